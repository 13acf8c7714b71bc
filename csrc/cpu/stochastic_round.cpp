// CPU kernels of clipshard::stochastic_round and clipshard::stochastic_round_into: fp32 -> fp16/bf16
// with Philox random bits (docs/stochastic_rounding.md). The bit rule and the random stream come
// from the shared headers, so these kernels and the CUDA ones give identical bits.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/Parallel.h>
#include <ATen/core/PhiloxRNGEngine.h>
#include <torch/library.h>

#include <algorithm>

#include "clipshard/philox.h"
#include "clipshard/stochastic_rounding.h"
#include "clipshard/stochastic_round_checks.h"
#include "philox_simd.h"

namespace clipshard {
namespace {

// Philox blocks (4 elements each) per parallel task: 64 KiB of fp32 input.
constexpr int64_t kBlocksPerTask = 4096;
// Philox blocks whose words are generated together before the rounding loop reads them (1 KiB).
constexpr int64_t kBatchBlocks = 64;

template <bool kBf16, bool kSaturate>
__attribute__((always_inline)) inline uint16_t round_bits(uint32_t bits, uint32_t r) {
  return kBf16 ? sr_float_to_bfloat16_bits(bits, r, kSaturate) : sr_float_to_half_bits(bits, r, kSaturate);
}

// Rounds the elements of Philox blocks [begin, end) of a contiguous tensor; element i uses word
// i % 4 of philox_block(seed, offset, i / 4). The words of a batch of blocks are generated first
// (`words`, one of philox_simd.h's generators) and consumed by a second loop, simple enough for
// the compiler to vectorise. Inlined into each instruction-set version below.
template <bool kBf16, bool kSaturate, typename Words>
__attribute__((always_inline)) inline void round_blocks(const uint32_t* src, uint16_t* dst, int64_t begin,
                                                        int64_t end, uint64_t seed, uint64_t offset, Words words) {
  uint32_t random[4 * kBatchBlocks];
  for (int64_t first = begin; first < end; first += kBatchBlocks) {
    const int64_t blocks = std::min(kBatchBlocks, end - first);
    words(seed, offset, static_cast<uint64_t>(first), blocks, random);
    const int64_t n = 4 * blocks;
    const uint32_t* in = src + 4 * first;
    uint16_t* out = dst + 4 * first;
    for (int64_t i = 0; i < n; ++i) out[i] = round_bits<kBf16, kSaturate>(in[i], random[i]);
  }
}

#define CLIPSHARD_ROUND_BLOCKS_SWITCH(WORDS)                                         \
  if (bf16) {                                                                        \
    saturate ? round_blocks<true, true>(src, dst, begin, end, seed, offset, WORDS)   \
             : round_blocks<true, false>(src, dst, begin, end, seed, offset, WORDS); \
  } else {                                                                           \
    saturate ? round_blocks<false, true>(src, dst, begin, end, seed, offset, WORDS)  \
             : round_blocks<false, false>(src, dst, begin, end, seed, offset, WORDS); \
  }

// One copy of the rounding loop per instruction set, each with the matching Philox generator: the
// rule's variable shifts vectorise well only from AVX2 on.
void round_blocks_baseline(const uint32_t* src, uint16_t* dst, int64_t begin, int64_t end, uint64_t seed,
                           uint64_t offset, bool bf16, bool saturate) {
  CLIPSHARD_ROUND_BLOCKS_SWITCH(philox_words_scalar)
}

#if defined(CLIPSHARD_PHILOX_SIMD)
__attribute__((target("avx2"))) void round_blocks_avx2(const uint32_t* src, uint16_t* dst, int64_t begin,
                                                       int64_t end, uint64_t seed, uint64_t offset, bool bf16,
                                                       bool saturate) {
  CLIPSHARD_ROUND_BLOCKS_SWITCH(philox_words_avx2)
}

__attribute__((target("avx512f"))) void round_blocks_avx512(const uint32_t* src, uint16_t* dst, int64_t begin,
                                                            int64_t end, uint64_t seed, uint64_t offset, bool bf16,
                                                            bool saturate) {
  CLIPSHARD_ROUND_BLOCKS_SWITCH(philox_words_avx512)
}
#endif
#undef CLIPSHARD_ROUND_BLOCKS_SWITCH

// The widest version this CPU runs (CLIPSHARD_CPU_ISA narrows the choice, see philox_simd.h).
void round_blocks_dispatch(const uint32_t* src, uint16_t* dst, int64_t begin, int64_t end, uint64_t seed,
                           uint64_t offset, bool bf16, bool saturate) {
#if defined(CLIPSHARD_PHILOX_SIMD)
  const SimdIsa isa = simd_isa();
  if (isa == SimdIsa::kAvx512) return round_blocks_avx512(src, dst, begin, end, seed, offset, bf16, saturate);
  if (isa == SimdIsa::kAvx2) return round_blocks_avx2(src, dst, begin, end, seed, offset, bf16, saturate);
#endif
  round_blocks_baseline(src, dst, begin, end, seed, offset, bf16, saturate);
}

// Rounds a contiguous fp32 tensor into a contiguous 16-bit tensor of the same size.
void round_into_contiguous(at::Tensor& dst, const at::Tensor& src, uint64_t seed, uint64_t offset,
                           bool saturate) {
  const auto* in = static_cast<const uint32_t*>(src.const_data_ptr());
  auto* out = static_cast<uint16_t*>(dst.mutable_data_ptr());
  const int64_t n = src.numel();
  const bool bf16 = dst.scalar_type() == at::kBFloat16;
  const int64_t full_blocks = n / 4;
  at::parallel_for(0, full_blocks, kBlocksPerTask, [&](int64_t begin, int64_t end) {
    round_blocks_dispatch(in, out, begin, end, seed, offset, bf16, saturate);
  });
  if (n % 4 != 0) {  // the last, partial block
    const PhiloxWords words = philox_block(seed, offset, static_cast<uint64_t>(full_blocks));
    for (int64_t i = 4 * full_blocks; i < n; ++i) {
      out[i] = bf16 ? sr_float_to_bfloat16_bits(in[i], words.w[i % 4], saturate)
                    : sr_float_to_half_bits(in[i], words.w[i % 4], saturate);
    }
  }
}

at::Tensor stochastic_round_cpu(const at::Tensor& src, at::ScalarType dtype, int64_t seed,
                                int64_t offset, bool saturate) {
  check_stochastic_round_args("stochastic_round", src, dtype);
  // The random word of an element depends on its row-major index only, so a strided source is
  // first made contiguous (one extra copy) and the result is always contiguous.
  const at::Tensor in = src.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  round_into_contiguous(out, in, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), saturate);
  return out;
}

void stochastic_round_into_cpu(at::Tensor& dst, const at::Tensor& src, int64_t seed, int64_t offset,
                               bool saturate) {
  check_stochastic_round_into_args(dst, src);
  const at::Tensor in = src.contiguous();
  if (dst.is_contiguous()) {
    round_into_contiguous(dst, in, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), saturate);
    return;
  }
  // A strided destination: round into a contiguous buffer, then copy into dst's own storage.
  at::Tensor buffer = at::empty(dst.sizes(), dst.options().memory_format(at::MemoryFormat::Contiguous));
  round_into_contiguous(buffer, in, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), saturate);
  dst.copy_(buffer);
}

at::Tensor philox_words_op(int64_t seed, int64_t offset, int64_t n, int64_t first_block, c10::string_view source) {
  TORCH_CHECK(n >= 0, "clipshard_testing::philox_words: n must be >= 0, got ", n);
  TORCH_CHECK(source == "kernel" || source == "header" || source == "aten",
              "clipshard_testing::philox_words: source must be 'kernel', 'header' or 'aten', got '", source, "'");
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kInt));
  auto* words = static_cast<uint32_t*>(out.mutable_data_ptr());
  const auto key = static_cast<uint64_t>(seed), high = static_cast<uint64_t>(offset);
  const auto first = static_cast<uint64_t>(first_block);
  if (source == "kernel") {  // philox_simd.h's generator on this CPU, in the rounding kernel's batches
    uint32_t random[4 * kBatchBlocks];
    for (int64_t i = 0; i < n; i += 4 * kBatchBlocks) {
      const int64_t count = std::min(4 * kBatchBlocks, n - i);
      philox_words(key, high, first + static_cast<uint64_t>(i / 4), (count + 3) / 4, random);
      std::copy(random, random + count, words + i);
    }
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t block = first + static_cast<uint64_t>(i / 4);
    if (source == "aten") {
      at::Philox4_32 engine(key, /*subsequence=*/high, /*offset=*/block);
      for (int64_t j = 0; j < i % 4; ++j) engine();
      words[i] = engine();
    } else {
      words[i] = philox_block(key, high, block).w[i % 4];
    }
  }
  return out;
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CPU, m) {
  m.impl("stochastic_round", &clipshard::stochastic_round_cpu);
  m.impl("stochastic_round_into", &clipshard::stochastic_round_into_cpu);
}

// No tensor arguments, so no backend to dispatch on: one kernel for every key.
TORCH_LIBRARY_IMPL(clipshard_testing, CompositeExplicitAutograd, m) {
  m.impl("philox_words", &clipshard::philox_words_op);
}
