// The power-of-two pre-scale of fp16 logit gradients (docs/fused_loss_cuda.md). A realistic
// upstream gradient (0.5 / M) times a softmax probability (~1 / K) times the logit scale is ~1e-8,
// below fp16's smallest subnormal (6e-8): rounded as it is, almost every negative pair's gradient
// would become 0. Every logit gradient is bounded by G = |scale| (max|g_row| + max|g_col| +
// max|g_pos|) (each softmax term is at most 1), so multiplying them by 2^floor(log2(2^14 / G))
// keeps them below 2^15 < 65504 while lifting the small ones into fp16's normal range; the fp32
// results of the gradient products are multiplied back exactly. One small kernel computes it on
// the device: no host synchronisation. Torch-free.
#pragma once

#include <cmath>
#include <cstdint>

#include "clipshard/macros.h"

namespace clipshard {
namespace fp16_prescale {

constexpr int kThreads = 256;

// 2^floor(log2(2^14 / bound)) clamped to 2^[-60, 60]; 1 when the bound is 0, Inf or NaN.
CLIPSHARD_HOST_DEVICE float prescale_for_bound(float bound) {
  if (!(bound > 0.f) || !(bound < INFINITY)) return 1.f;
  float e = floorf(log2f(16384.f / bound));
  e = e < -60.f ? -60.f : (e > 60.f ? 60.f : e);
  return ldexpf(1.f, static_cast<int>(e));
}

__device__ __forceinline__ float cta_max(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  __syncthreads();
  if (threadIdx.x % 32 == 0) scratch[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kThreads / 32; ++w) total = fmaxf(total, scratch[w]);
  return total;
}

__device__ __forceinline__ float abs_max(const float* v, int64_t n) {
  float m = 0.f;
  for (int64_t i = threadIdx.x; i < n; i += kThreads) m = fmaxf(m, fabsf(v[i]));
  return m;
}

// One CTA of kThreads: out[0] = the pre-scale, out[1] = its inverse. g_col may be nullptr.
__global__ void __launch_bounds__(kThreads)
    prescale_kernel(const float* scale, const float* g_row, int64_t M, const float* g_pos, const float* g_col,
                    int64_t K, float* out) {
  __shared__ float scratch[kThreads / 32];
  const float row = cta_max(abs_max(g_row, M), scratch);
  const float pos = cta_max(abs_max(g_pos, M), scratch);
  const float col = cta_max(g_col != nullptr ? abs_max(g_col, K) : 0.f, scratch);
  if (threadIdx.x == 0) {
    const float prescale = prescale_for_bound(fabsf(*scale) * (row + pos + col));
    out[0] = prescale;
    out[1] = 1.f / prescale;
  }
}

}  // namespace fp16_prescale
}  // namespace clipshard
