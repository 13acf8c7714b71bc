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
#include "philox_batch.h"

namespace clipshard {
namespace {

// Philox blocks (4 elements each) per parallel task: 64 KiB of fp32 input.
constexpr int64_t kBlocksPerTask = 4096;

template <bool kBf16, bool kSaturate>
__attribute__((always_inline)) inline uint16_t round_bits(uint32_t bits, uint32_t r) {
  return kBf16 ? sr_float_to_bfloat16_bits(bits, r, kSaturate) : sr_float_to_half_bits(bits, r, kSaturate);
}

// Rounds the elements of Philox blocks [begin, end) of a contiguous tensor; element i uses word
// i % 4 of philox_block(seed, offset, i / 4). The words of a batch of blocks are generated first
// (`batch`, one of philox_batch.h's generators) and consumed by a second loop, simple enough for
// the compiler to vectorise. Inlined into each instruction-set version below.
template <bool kBf16, bool kSaturate, typename Batch>
__attribute__((always_inline)) inline void round_blocks(const uint32_t* src, uint16_t* dst, int64_t begin,
                                                        int64_t end, uint64_t seed, uint64_t offset, Batch batch) {
  uint32_t random[4 * kPhiloxBatchBlocks];
  for (int64_t first = begin; first < end; first += kPhiloxBatchBlocks) {
    batch(seed, offset, static_cast<uint64_t>(first), random);
    const int64_t n = 4 * std::min(kPhiloxBatchBlocks, end - first);
    const uint32_t* in = src + 4 * first;
    uint16_t* out = dst + 4 * first;
    for (int64_t i = 0; i < n; ++i) out[i] = round_bits<kBf16, kSaturate>(in[i], random[i]);
  }
}

#define CLIPSHARD_ROUND_BLOCKS_SWITCH(BATCH)                                         \
  if (bf16) {                                                                        \
    saturate ? round_blocks<true, true>(src, dst, begin, end, seed, offset, BATCH)   \
             : round_blocks<true, false>(src, dst, begin, end, seed, offset, BATCH); \
  } else {                                                                           \
    saturate ? round_blocks<false, true>(src, dst, begin, end, seed, offset, BATCH)  \
             : round_blocks<false, false>(src, dst, begin, end, seed, offset, BATCH); \
  }

// Compiled for AVX2 and for baseline x86-64, picked at load time: the Philox multiplies and the
// rule's variable shifts vectorise well only from AVX2 on.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("avx2", "default")))
#endif
void round_blocks_portable(const uint32_t* src, uint16_t* dst, int64_t begin, int64_t end, uint64_t seed,
                           uint64_t offset, bool bf16, bool saturate) {
  const auto batch = [](uint64_t s, uint64_t o, uint64_t f, uint32_t* r) { philox_batch_portable(s, o, f, r); };
  CLIPSHARD_ROUND_BLOCKS_SWITCH(batch)
}

#if CLIPSHARD_PHILOX_AVX512
// One call per batch of 64 blocks: an out-of-line AVX-512 function, so that callers need not be.
__attribute__((target("avx512f"), noinline)) void philox_words_avx512(uint64_t seed, uint64_t offset,
                                                                      uint64_t first, uint32_t* random) {
  philox_batch_avx512(seed, offset, first, random);
}

__attribute__((target("avx512f"))) void round_blocks_avx512(const uint32_t* src, uint16_t* dst, int64_t begin,
                                                            int64_t end, uint64_t seed, uint64_t offset, bool bf16,
                                                            bool saturate) {
  const auto batch = [](uint64_t s, uint64_t o, uint64_t f, uint32_t* r) { philox_words_avx512(s, o, f, r); };
  CLIPSHARD_ROUND_BLOCKS_SWITCH(batch)
}
#endif
#undef CLIPSHARD_ROUND_BLOCKS_SWITCH

bool use_avx512() {
#if CLIPSHARD_PHILOX_AVX512
  static const bool available = __builtin_cpu_supports("avx512f");
  return available;
#else
  return false;
#endif
}

void round_blocks_dispatch(const uint32_t* src, uint16_t* dst, int64_t begin, int64_t end, uint64_t seed,
                           uint64_t offset, bool bf16, bool saturate) {
#if CLIPSHARD_PHILOX_AVX512
  if (use_avx512()) return round_blocks_avx512(src, dst, begin, end, seed, offset, bf16, saturate);
#endif
  round_blocks_portable(src, dst, begin, end, seed, offset, bf16, saturate);
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

at::Tensor philox_words(int64_t seed, int64_t offset, int64_t n, int64_t first_block, c10::string_view source) {
  TORCH_CHECK(n >= 0, "clipshard::philox_words: n must be >= 0, got ", n);
  TORCH_CHECK(source == "kernel" || source == "header" || source == "aten",
              "clipshard::philox_words: source must be 'kernel', 'header' or 'aten', got '", source, "'");
  at::Tensor out = at::empty({n}, at::TensorOptions().dtype(at::kInt));
  auto* words = static_cast<uint32_t*>(out.mutable_data_ptr());
  const auto key = static_cast<uint64_t>(seed), high = static_cast<uint64_t>(offset);
  const auto first = static_cast<uint64_t>(first_block);
  uint32_t random[4 * kPhiloxBatchBlocks];
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t block = first + static_cast<uint64_t>(i / 4);
    if (source == "aten") {
      at::Philox4_32 engine(key, /*subsequence=*/high, /*offset=*/block);
      for (int64_t j = 0; j < i % 4; ++j) engine();
      words[i] = engine();
    } else if (source == "header") {
      words[i] = philox_block(key, high, block).w[i % 4];
    } else {  // the batch generator the CPU rounding kernel uses on this machine
      const int64_t in_batch = i % (4 * kPhiloxBatchBlocks);
      if (in_batch == 0) {
#if CLIPSHARD_PHILOX_AVX512
        if (use_avx512()) {
          philox_words_avx512(key, high, block, random);
        } else
#endif
        {
          philox_batch_portable(key, high, block, random);
        }
      }
      words[i] = random[in_batch];
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
TORCH_LIBRARY_IMPL(clipshard, CompositeExplicitAutograd, m) {
  m.impl("philox_words", &clipshard::philox_words);
}
