// The CUDA kernels of clipshard::stochastic_round (stochastic_round.cu launches them), torch-free
// so that tests/cuda_emulation/emulate_stochastic_round.cpp can run them as host code. An
// element's random word depends on its index alone: word i % 4 of Philox block i / 4.
#pragma once

#include <algorithm>
#include <cstdint>

#include "clipshard/philox.h"
#include "clipshard/stochastic_rounding.h"

namespace clipshard {
namespace stochastic_round_kernels {

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

}  // namespace stochastic_round_kernels
}  // namespace clipshard
