// CUDA kernels of clipshard::stochastic_round and clipshard::stochastic_round_into: fp32 ->
// fp16/bf16 with Philox random bits (docs/stochastic_rounding.md). Same header maths as the CPU
// kernels, integer only, and the random word of an element depends on its index alone, so the
// results equal the CPU ones bit for bit whatever the launch grid.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>

#include "clipshard/philox.h"
#include "clipshard/stochastic_round_checks.h"
#include "clipshard/stochastic_rounding.h"

namespace clipshard {
namespace {

constexpr int kThreads = 256;

template <bool kBf16, bool kSaturate>
__device__ __forceinline__ uint16_t round_bits(uint32_t bits, uint32_t r) {
  return kBf16 ? sr_float_to_bfloat16_bits(bits, r, kSaturate) : sr_float_to_half_bits(bits, r, kSaturate);
}

// Rounds element i = 4 * block + j for j < count with the block's four Philox words.
template <bool kBf16, bool kSaturate>
__device__ __forceinline__ void round_block_scalar(const uint32_t* __restrict__ src, uint16_t* __restrict__ dst,
                                                   int64_t block, int count, uint64_t seed, uint64_t offset) {
  const PhiloxWords words = philox_block(seed, offset, static_cast<uint64_t>(block));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    if (j < count) dst[4 * block + j] = round_bits<kBf16, kSaturate>(src[4 * block + j], words.w[j]);
  }
}

// src and dst 16-byte aligned: each step of a thread reads 8 floats (two 16-byte loads) and writes
// 8 halves (one 16-byte store), using two Philox blocks. The last n % 8 elements go scalar.
template <bool kBf16, bool kSaturate>
__global__ void round_vectorized_kernel(const uint32_t* __restrict__ src, uint16_t* __restrict__ dst,
                                        int64_t n, uint64_t seed, uint64_t offset) {
  const int64_t groups = n / 8;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t g = first; g < groups; g += stride) {
    const uint4 lo = reinterpret_cast<const uint4*>(src)[2 * g];
    const uint4 hi = reinterpret_cast<const uint4*>(src)[2 * g + 1];
    const PhiloxWords a = philox_block(seed, offset, static_cast<uint64_t>(2 * g));
    const PhiloxWords b = philox_block(seed, offset, static_cast<uint64_t>(2 * g + 1));
    uint4 out;
    out.x = round_bits<kBf16, kSaturate>(lo.x, a.w[0]) | (uint32_t{round_bits<kBf16, kSaturate>(lo.y, a.w[1])} << 16);
    out.y = round_bits<kBf16, kSaturate>(lo.z, a.w[2]) | (uint32_t{round_bits<kBf16, kSaturate>(lo.w, a.w[3])} << 16);
    out.z = round_bits<kBf16, kSaturate>(hi.x, b.w[0]) | (uint32_t{round_bits<kBf16, kSaturate>(hi.y, b.w[1])} << 16);
    out.w = round_bits<kBf16, kSaturate>(hi.z, b.w[2]) | (uint32_t{round_bits<kBf16, kSaturate>(hi.w, b.w[3])} << 16);
    reinterpret_cast<uint4*>(dst)[g] = out;
  }
  // Tail: at most 7 elements, in blocks 2 * groups and 2 * groups + 1.
  const int64_t tail = n - 8 * groups;
  if (first < 2 && 4 * first < tail) {
    const int count = static_cast<int>(std::min<int64_t>(4, tail - 4 * first));
    round_block_scalar<kBf16, kSaturate>(src, dst, 2 * groups + first, count, seed, offset);
  }
}

// Any alignment: each step of a thread rounds one Philox block (4 elements) with scalar accesses.
template <bool kBf16, bool kSaturate>
__global__ void round_scalar_kernel(const uint32_t* __restrict__ src, uint16_t* __restrict__ dst, int64_t n,
                                    uint64_t seed, uint64_t offset) {
  const int64_t blocks = (n + 3) / 4;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; b < blocks; b += stride) {
    const int count = static_cast<int>(std::min<int64_t>(4, n - 4 * b));
    round_block_scalar<kBf16, kSaturate>(src, dst, b, count, seed, offset);
  }
}

template <bool kBf16, bool kSaturate>
void launch(const uint32_t* src, uint16_t* dst, int64_t n, uint64_t seed, uint64_t offset) {
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0;
  const int64_t work = aligned ? std::max<int64_t>(n / 8, 1) : (n + 3) / 4;  // per-thread steps
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t wanted = (work + kThreads - 1) / kThreads;
  const int grid = static_cast<int>(std::min<int64_t>(wanted, static_cast<int64_t>(sms) * 8));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  if (aligned) {
    round_vectorized_kernel<kBf16, kSaturate><<<grid, kThreads, 0, stream>>>(src, dst, n, seed, offset);
  } else {
    round_scalar_kernel<kBf16, kSaturate><<<grid, kThreads, 0, stream>>>(src, dst, n, seed, offset);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Rounds a contiguous fp32 tensor into a contiguous 16-bit tensor of the same size.
void round_into_contiguous(at::Tensor& dst, const at::Tensor& src, uint64_t seed, uint64_t offset,
                           bool saturate) {
  const int64_t n = src.numel();
  if (n == 0) return;
  const auto* in = static_cast<const uint32_t*>(src.const_data_ptr());
  auto* out = static_cast<uint16_t*>(dst.mutable_data_ptr());
  if (dst.scalar_type() == at::kBFloat16) {
    saturate ? launch<true, true>(in, out, n, seed, offset) : launch<true, false>(in, out, n, seed, offset);
  } else {
    saturate ? launch<false, true>(in, out, n, seed, offset) : launch<false, false>(in, out, n, seed, offset);
  }
}

at::Tensor stochastic_round_cuda(const at::Tensor& src, at::ScalarType dtype, int64_t seed, int64_t offset,
                                 bool saturate) {
  check_stochastic_round_args("stochastic_round", src, dtype);
  const c10::cuda::OptionalCUDAGuard guard(src.device());
  // Random words follow the row-major index, so a strided source is made contiguous first.
  const at::Tensor in = src.contiguous();
  at::Tensor out = at::empty(src.sizes(), src.options().dtype(dtype));
  round_into_contiguous(out, in, static_cast<uint64_t>(seed), static_cast<uint64_t>(offset), saturate);
  return out;
}

void stochastic_round_into_cuda(at::Tensor& dst, const at::Tensor& src, int64_t seed, int64_t offset,
                                bool saturate) {
  check_stochastic_round_into_args(dst, src);
  const c10::cuda::OptionalCUDAGuard guard(dst.device());
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

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) {
  m.impl("stochastic_round", &clipshard::stochastic_round_cuda);
  m.impl("stochastic_round_into", &clipshard::stochastic_round_into_cuda);
}
