// Tiled fp32-FMA kernels of the fused contrastive log-sum-exp (docs/fused_loss_cuda.md). Torch-free:
// the kernels see plain pointers and sizes; csrc/cuda/contrastive_lse.cu is the only file that
// touches tensors.
//
// Every kernel works on an "own" matrix (n_own x dim, one CTA per kTile own rows) against an "other"
// matrix (n_other x dim, swept in tiles of kTile rows). The row pass uses own = rows, other = cols;
// the column pass swaps them, so that column quantities are the row quantities of S^T. Both passes
// compute every logit with the same code and summation order, so S^T is bitwise S.
#pragma once

#include <cmath>
#include <cstdint>

#include "clipshard/online_lse.h"

namespace clipshard {
namespace lse_cuda {

constexpr int kTile = 64;        // own rows per CTA = other rows per tile = features per output chunk
constexpr int kDepth = 32;       // features per shared-memory chunk of the logit tile
constexpr int kSide = 16;        // threads per side of the 16 x 16 thread grid
constexpr int kThreads = kSide * kSide;
constexpr int kPer = kTile / kSide;  // each thread owns kPer x kPer logits (strided by kSide)
constexpr int kPitch = kTile + 1;    // padded shared-memory row pitch (no bank conflicts)

// Shared-memory floats of one CTA: the two kDepth x kTile operand chunks of the logit tile; the
// backward reuses the same space for a kTile x kTile chunk of the other matrix.
constexpr int kOperandFloats = 2 * kDepth * kPitch;
static_assert(kOperandFloats >= kTile * kPitch, "value chunk must fit in the operand space");

template <typename T>
struct ForwardParams {
  const T* own;
  const T* other;
  int64_t n_own, n_other, dim;
  const float* scale;  // device scalar
  const float* bias;   // device scalar, or nullptr for no bias
  float* lse;          // n_own: logsumexp over the other side
  float* pos;          // n_own: logit of (i, i + pos_delta), or nullptr
  int64_t pos_delta;
};

template <typename T>
struct BackwardParams {
  const T* own;
  const T* other;
  int64_t n_own, n_other, dim;
  const float* scale;
  const float* bias;
  // dS[i, j] = own_grad[i] exp(S[i,j] - own_lse[i]) + other_grad[j] exp(S[i,j] - other_lse[j])
  //          + pos_grad[row index] [j == i + pos_delta]; a null *_grad drops that term.
  const float* own_lse;
  const float* own_grad;
  const float* other_lse;
  const float* other_grad;
  const float* pos_grad;  // indexed by the own index when pos_grad_by_own, else by the other index
  bool pos_grad_by_own;
  int64_t pos_delta;
  float* grad_own;       // n_own x dim fp32, zeroed; this kernel adds prescale * scale * dS @ other
  float* partial_scale;  // per CTA: sum of dS * (own . other), or nullptr
  float* partial_bias;   // per CTA: sum of dS, or nullptr
  // Tensor-core kernel only: a power of two applied to scale * dS before it is rounded to a 16-bit
  // mma operand (so that gradients near 1e-8 survive fp16), undone by the caller; nullptr for none.
  const float* prescale;
};

__device__ __forceinline__ float logit(float scale, float dot, float bias) {
  return fmaf(scale, dot, bias);
}

// tile[k][r] = src[row0 + r][k0 + k] as fp32 for r < kTile, k < kDepth; zero outside the matrix.
template <typename T>
__device__ __forceinline__ void load_operand_chunk(float (*tile)[kPitch], const T* src, int64_t n,
                                                   int64_t dim, int64_t row0, int64_t k0) {
  for (int idx = threadIdx.x; idx < kTile * kDepth; idx += kThreads) {
    const int r = idx / kDepth, k = idx % kDepth;
    const int64_t row = row0 + r, col = k0 + k;
    tile[k][r] = (row < n && col < dim) ? static_cast<float>(src[row * dim + col]) : 0.f;
  }
}

// acc[i][j] = own[own0 + ty + kSide i] . other[other0 + tx + kSide j], features summed in order
// (fp32 FMA). Starts and ends with the shared operand space free for reuse after a barrier.
template <typename T>
__device__ __forceinline__ void dot_tile(float (&acc)[kPer][kPer], float* smem, const T* own,
                                         const T* other, int64_t n_own, int64_t n_other,
                                         int64_t dim, int64_t own0, int64_t other0) {
  float(*own_s)[kPitch] = reinterpret_cast<float(*)[kPitch]>(smem);
  float(*other_s)[kPitch] = own_s + kDepth;
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
#pragma unroll
  for (int i = 0; i < kPer; ++i)
#pragma unroll
    for (int j = 0; j < kPer; ++j) acc[i][j] = 0.f;
  for (int64_t k0 = 0; k0 < dim; k0 += kDepth) {
    __syncthreads();  // the previous users of the operand space are done
    load_operand_chunk(own_s, own, n_own, dim, own0, k0);
    load_operand_chunk(other_s, other, n_other, dim, other0, k0);
    __syncthreads();
#pragma unroll 8
    for (int k = 0; k < kDepth; ++k) {
      float a[kPer], b[kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i) a[i] = own_s[k][ty + kSide * i];
#pragma unroll
      for (int j = 0; j < kPer; ++j) b[j] = other_s[k][tx + kSide * j];
#pragma unroll
      for (int i = 0; i < kPer; ++i)
#pragma unroll
        for (int j = 0; j < kPer; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
    }
  }
  __syncthreads();
}

// One CTA per kTile own rows: online logsumexp over all other rows, and the positive logit.
template <typename T>
__global__ void __launch_bounds__(kThreads) lse_forward_kernel(ForwardParams<T> p) {
  __shared__ float smem[kOperandFloats];
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t own0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const float scale = *p.scale, bias = p.bias ? *p.bias : 0.f;
  OnlineLse<float> lse[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) lse[i] = OnlineLse<float>::empty();

  for (int64_t other0 = 0; other0 < p.n_other; other0 += kTile) {
    float acc[kPer][kPer];
    dot_tile(acc, smem, p.own, p.other, p.n_own, p.n_other, p.dim, own0, other0);
#pragma unroll
    for (int i = 0; i < kPer; ++i) {
      const int64_t row = own0 + ty + kSide * i;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int64_t col = other0 + tx + kSide * j;
        if (col >= p.n_other) continue;
        const float x = logit(scale, acc[i][j], bias);
        if (p.pos != nullptr && row < p.n_own && col - row == p.pos_delta) p.pos[row] = x;
        lse[i].add(x);
      }
    }
  }
  // The kSide threads of a row are kSide consecutive lanes of one warp: merge them in a fixed tree.
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
#pragma unroll
    for (int lane_mask = kSide / 2; lane_mask > 0; lane_mask /= 2) {
      const float m2 = __shfl_xor_sync(0xffffffffu, lse[i].max, lane_mask, kSide);
      const float s2 = __shfl_xor_sync(0xffffffffu, lse[i].sum, lane_mask, kSide);
      lse[i].merge({m2, s2});
    }
    const int64_t row = own0 + ty + kSide * i;
    if (tx == 0 && row < p.n_own) p.lse[row] = lse[i].value();
  }
}

// Sum of v over the CTA (kBlockThreads threads) in a fixed order; the result is valid in thread 0.
template <int kBlockThreads>
__device__ __forceinline__ float block_sum(float v, float* scratch) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  if (threadIdx.x == 0)
    for (int w = 0; w < kBlockThreads / 32; ++w) total += scratch[w];
  return total;
}

// One CTA per kTile own rows: recompute each logit tile, form dS, and add scale * dS @ other to
// the CTA's own rows of grad_own (no other CTA writes them: deterministic without atomics).
template <typename T>
__global__ void __launch_bounds__(kThreads) lse_backward_kernel(BackwardParams<T> p) {
  __shared__ float smem[kOperandFloats];
  __shared__ float ds_s[kTile][kPitch];
  __shared__ float scratch[kThreads / 32];
  float(*value_s)[kPitch] = reinterpret_cast<float(*)[kPitch]>(smem);
  const int tx = threadIdx.x % kSide, ty = threadIdx.x / kSide;
  const int64_t own0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const float scale = *p.scale, bias = p.bias ? *p.bias : 0.f;

  float own_lse[kPer], own_grad[kPer];
#pragma unroll
  for (int i = 0; i < kPer; ++i) {
    const int64_t row = own0 + ty + kSide * i;
    const bool valid = row < p.n_own && p.own_grad != nullptr;
    own_grad[i] = valid ? p.own_grad[row] : 0.f;
    own_lse[i] = valid ? p.own_lse[row] : 0.f;
  }
  float sum_scale = 0.f, sum_bias = 0.f;

  for (int64_t other0 = 0; other0 < p.n_other; other0 += kTile) {
    float acc[kPer][kPer];
    dot_tile(acc, smem, p.own, p.other, p.n_own, p.n_other, p.dim, own0, other0);
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int64_t col = other0 + tx + kSide * j;
      const bool col_valid = col < p.n_other;
      const float other_grad = (col_valid && p.other_grad != nullptr) ? p.other_grad[col] : 0.f;
      const float other_lse = (col_valid && p.other_grad != nullptr) ? p.other_lse[col] : 0.f;
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int64_t row = own0 + ty + kSide * i;
        float d = 0.f;
        if (col_valid && row < p.n_own) {
          const bool positive = col - row == p.pos_delta;
          d = softmax_dlogit(logit(scale, acc[i][j], bias), own_grad[i], own_lse[i], other_grad, other_lse,
                             positive ? p.pos_grad[p.pos_grad_by_own ? row : col] : 0.f, positive);
          sum_scale = fmaf(d, acc[i][j], sum_scale);
          sum_bias += d;
        }
        ds_s[ty + kSide * i][tx + kSide * j] = scale * d;
      }
    }
    // grad_own[own0 + r, :] += sum_n ds_s[r][n] * other[other0 + n, :], kTile features at a time.
    for (int64_t d0 = 0; d0 < p.dim; d0 += kTile) {
      __syncthreads();  // ds_s is written; the previous value chunk is consumed
      for (int idx = threadIdx.x; idx < kTile * kTile; idx += kThreads) {
        const int n = idx / kTile, c = idx % kTile;
        const int64_t row = other0 + n, col = d0 + c;
        value_s[n][c] = (row < p.n_other && col < p.dim)
                            ? static_cast<float>(p.other[row * p.dim + col]) : 0.f;
      }
      __syncthreads();
      float out[kPer][kPer];
#pragma unroll
      for (int i = 0; i < kPer; ++i)
#pragma unroll
        for (int q = 0; q < kPer; ++q) out[i][q] = 0.f;
#pragma unroll 8
      for (int n = 0; n < kTile; ++n) {
        float a[kPer], b[kPer];
#pragma unroll
        for (int i = 0; i < kPer; ++i) a[i] = ds_s[ty + kSide * i][n];
#pragma unroll
        for (int q = 0; q < kPer; ++q) b[q] = value_s[n][tx + kSide * q];
#pragma unroll
        for (int i = 0; i < kPer; ++i)
#pragma unroll
          for (int q = 0; q < kPer; ++q) out[i][q] = fmaf(a[i], b[q], out[i][q]);
      }
#pragma unroll
      for (int i = 0; i < kPer; ++i) {
        const int64_t row = own0 + ty + kSide * i;
#pragma unroll
        for (int q = 0; q < kPer; ++q) {
          const int64_t col = d0 + tx + kSide * q;
          if (row < p.n_own && col < p.dim) p.grad_own[row * p.dim + col] += out[i][q];
        }
      }
    }
  }
  if (p.partial_scale != nullptr) {
    const float total_scale = block_sum<kThreads>(sum_scale, scratch);
    const float total_bias = block_sum<kThreads>(sum_bias, scratch);
    if (threadIdx.x == 0) {
      p.partial_scale[blockIdx.x] = total_scale;
      p.partial_bias[blockIdx.x] = total_bias;
    }
  }
}

// out[0] = sum(partial_scale), out[1] = sum(partial_bias), in a fixed order (one CTA).
__global__ void __launch_bounds__(kThreads)
    sum_partials_kernel(const float* partial_scale, const float* partial_bias, int64_t n, float* out) {
  __shared__ float scratch[kThreads / 32];
  float a = 0.f, b = 0.f;
  for (int64_t k = threadIdx.x; k < n; k += kThreads) a += partial_scale[k], b += partial_bias[k];
  const float total_scale = block_sum<kThreads>(a, scratch);
  const float total_bias = block_sum<kThreads>(b, scratch);
  if (threadIdx.x == 0) out[0] = total_scale, out[1] = total_bias;
}

}  // namespace lse_cuda
}  // namespace clipshard
