// Tensor-core kernels of the fused contrastive log-sum-exp for fp16/bf16 features
// (docs/fused_loss_cuda.md): mma.sync.m16n8k16 with fp32 accumulators, operands staged through
// shared memory and read with ldmatrix, online log-sum-exp on the accumulator fragments; the
// backward feeds dS (rounded to the input dtype) from registers as the A operand of dS @ other.
// Used by algorithm="fused" for D % 8 == 0 and 16-byte aligned features on sm_80+.
// UNVERIFIED: compiled for sm_80/sm_90, never run on a GPU.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#ifndef CLIPSHARD_LSE_HOST_EMULATION
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "contrastive_lse_kernels.cuh"

namespace clipshard {
namespace lse_cuda {

constexpr int kMmaWarps = 4;
constexpr int kMmaThreads = 32 * kMmaWarps;
constexpr int kMmaRows = 16 * kMmaWarps;  // own rows per CTA: 16 per warp
constexpr int kMmaCols = 64;              // other rows per tile
constexpr int kMmaDepth = 32;             // features per shared-memory chunk
constexpr int kMmaPitch = kMmaDepth + 8;  // 80-byte rows: the 8 rows of an ldmatrix hit distinct banks
constexpr int kMmaFrags = kMmaCols / 8;   // m16n8 accumulator fragments per warp and tile
constexpr int kMmaValuePitch = kMmaCols + 8;  // 144-byte rows of the backward's value chunk
static_assert(kMmaRows == kTile, "both backward kernels share the partial-sum layout");

template <typename T>
struct IsBf16 : std::false_type {};
template <>
struct IsBf16<c10::BFloat16> : std::true_type {};

// The four warp-level primitives below are replaced by host versions in
// tests/cuda_emulation/emulate_mma.h, which runs these kernels on the CPU for testing.
#ifndef CLIPSHARD_LSE_HOST_EMULATION
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_ptr) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// As ldmatrix_x4, each 8 x 8 matrix transposed on the way (row-major K x N in shared memory ->
// column-major B fragments).
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_ptr) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
}

// Two floats rounded to the 16-bit type, `lo` in the low half (the lower column of a fragment).
template <bool kBf16>
__device__ __forceinline__ uint32_t pack_pair(float lo, float hi) {
  uint32_t bits;
  if constexpr (kBf16) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&bits, &v, sizeof(bits));
  }
  return bits;
}

// c += a (16 x 16, row-major fragments) * b (16 x 8, column-major fragments), fp32 accumulation.
template <bool kBf16>
__device__ __forceinline__ void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  if constexpr (kBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#else
  __trap();  // the launcher selects this kernel only on sm_80+
#endif
}
#endif  // CLIPSHARD_LSE_HOST_EMULATION

// tile[r * kMmaPitch + k] = src[row0 + r][k0 + k] for r < R, k < kMmaDepth, zeros outside the
// matrix; 16-byte copies (dim % 8 == 0 and 16-byte aligned src, so a vector is all in or all out).
template <int R, typename T>
__device__ __forceinline__ void load_mma_chunk(T* tile, const T* src, int64_t n, int64_t dim,
                                               int64_t row0, int64_t k0) {
  constexpr int kVectors = kMmaDepth / 8;
  for (int idx = threadIdx.x; idx < R * kVectors; idx += kMmaThreads) {
    const int r = idx / kVectors, v = idx % kVectors;
    const int64_t row = row0 + r, col = k0 + v * 8;
    uint4 value = make_uint4(0u, 0u, 0u, 0u);
    if (row < n && col < dim) value = *reinterpret_cast<const uint4*>(src + row * dim + col);
    *reinterpret_cast<uint4*>(tile + r * kMmaPitch + v * 8) = value;
  }
}

// acc[f][2h + e] = own[own0 + 16 warp + group + 8h] . other[other0 + 8f + 2 quad + e] for this
// lane (group = lane / 4, quad = lane % 4), fp32 accumulation on tensor cores. Starts with a
// barrier before it overwrites the operand tiles.
template <typename T>
__device__ __forceinline__ void mma_dot_tile(float (&acc)[kMmaFrags][4], T* own_s, T* other_s,
                                             const T* own, const T* other, int64_t n_own,
                                             int64_t n_other, int64_t dim, int64_t own0,
                                             int64_t other0) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // ldmatrix row addresses: A = 16 own rows x 16 features; B = 16 other rows x 16 features,
  // giving (b0, b1) of fragment f from lanes 0-15 and of fragment f + 1 from lanes 16-31.
  const T* a_base = own_s + (warp * 16 + lane % 16) * kMmaPitch + (lane / 16) * 8;
  const T* b_base = other_s + ((lane & 7) + ((lane >> 4) << 3)) * kMmaPitch + ((lane >> 3) & 1) * 8;
#pragma unroll
  for (int f = 0; f < kMmaFrags; ++f)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[f][e] = 0.f;
  for (int64_t k0 = 0; k0 < dim; k0 += kMmaDepth) {
    __syncthreads();  // every warp is done with the previous chunk
    load_mma_chunk<kMmaRows>(own_s, own, n_own, dim, own0, k0);
    load_mma_chunk<kMmaCols>(other_s, other, n_other, dim, other0, k0);
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kMmaDepth; kk += 16) {
      uint32_t a[4];
      ldmatrix_x4(a, a_base + kk);
#pragma unroll
      for (int f = 0; f < kMmaFrags; f += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, b_base + f * 8 * kMmaPitch + kk);
        mma_m16n8k16<IsBf16<T>::value>(acc[f], a, b[0], b[1]);
        mma_m16n8k16<IsBf16<T>::value>(acc[f + 1], a, b[2], b[3]);
      }
    }
  }
}

// One CTA (4 warps) per 64 own rows, warp w owning rows 16w..16w+15: online logsumexp over all
// other rows, and the positive logit. Same contract as lse_forward_kernel.
template <typename T>
__global__ void __launch_bounds__(kMmaThreads) lse_forward_mma_kernel(ForwardParams<T> p) {
  __shared__ __align__(16) T own_s[kMmaRows * kMmaPitch];
  __shared__ __align__(16) T other_s[kMmaCols * kMmaPitch];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;  // fragment row and column pair of this lane
  const int64_t own0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const float scale = *p.scale, bias = p.bias ? *p.bias : 0.f;
  // This lane's rows: accumulator elements 0,1 belong to row `group`, 2,3 to row `group + 8`.
  const int64_t my_row[2] = {own0 + warp * 16 + group, own0 + warp * 16 + group + 8};
  OnlineLse<float> lse[2] = {OnlineLse<float>::empty(), OnlineLse<float>::empty()};

  for (int64_t other0 = 0; other0 < p.n_other; other0 += kMmaCols) {
    float acc[kMmaFrags][4];
    mma_dot_tile(acc, own_s, other_s, p.own, p.other, p.n_own, p.n_other, p.dim, own0, other0);
    // acc[f][2h + e] is the dot product of row my_row[h] with other row other0 + 8f + 2 quad + e.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
#pragma unroll
      for (int f = 0; f < kMmaFrags; ++f)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = other0 + 8 * f + 2 * quad + e;
          if (col >= p.n_other) continue;
          const float v = logit(scale, acc[f][2 * h + e], bias);
          if (p.pos != nullptr && my_row[h] < p.n_own && col - my_row[h] == p.pos_delta)
            p.pos[my_row[h]] = v;
          lse[h].add(v);
        }
    }
  }
  // The 4 lanes of a fragment row differ in the two low lane bits: merge in a fixed tree.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int lane_mask = 1; lane_mask < 4; lane_mask *= 2) {
      const float m2 = __shfl_xor_sync(0xffffffffu, lse[h].max, lane_mask);
      const float s2 = __shfl_xor_sync(0xffffffffu, lse[h].sum, lane_mask);
      lse[h].merge({m2, s2});
    }
    if (quad == 0 && my_row[h] < p.n_own) p.lse[my_row[h]] = lse[h].value();
  }
}

// One CTA (4 warps) per 64 own rows: recompute each 64 x 64 logit tile on tensor cores, form dS
// in fp32 registers, and add prescale * scale * dS @ other to the CTA's own rows of grad_own, 64
// features at a time, with prescale * scale * dS rounded to T as the A operand. Same contract as lse_backward_kernel;
// deterministic (fixed order, no atomics).
template <typename T>
__global__ void __launch_bounds__(kMmaThreads) lse_backward_mma_kernel(BackwardParams<T> p) {
  __shared__ __align__(16) T own_s[kMmaRows * kMmaPitch];
  __shared__ __align__(16) T other_s[kMmaCols * kMmaPitch];
  __shared__ __align__(16) T value_s[kMmaCols * kMmaValuePitch];
  __shared__ float scratch[kMmaThreads / 32];
  constexpr bool kBf16 = IsBf16<T>::value;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = lane / 4, quad = lane % 4;
  const int64_t own0 = static_cast<int64_t>(blockIdx.x) * kMmaRows;
  const float scale = *p.scale, bias = p.bias ? *p.bias : 0.f;
  const int64_t my_row[2] = {own0 + warp * 16 + group, own0 + warp * 16 + group + 8};
  // dS is rounded to T for the mma: pre-scaled by a power of two so that fp16 keeps gradients
  // far below its smallest subnormal (6e-8); the caller multiplies grad_own back.
  const float scale_out = scale * (p.prescale ? *p.prescale : 1.f);
  float own_lse[2], own_grad[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool valid = my_row[h] < p.n_own && p.own_grad != nullptr;
    own_grad[h] = valid ? p.own_grad[my_row[h]] : 0.f;
    own_lse[h] = valid ? p.own_lse[my_row[h]] : 0.f;
  }
  // B fragments of value_s (other rows x features, feature-contiguous) through ldmatrix.trans:
  // lanes 0-15 address rows 0-15 of features 0-7, lanes 16-31 rows 0-15 of features 8-15.
  const T* v_base = value_s + (lane & 15) * kMmaValuePitch + (lane >> 4) * 8;
  float sum_scale = 0.f, sum_bias = 0.f;

  for (int64_t other0 = 0; other0 < p.n_other; other0 += kMmaCols) {
    float acc[kMmaFrags][4];
    mma_dot_tile(acc, own_s, other_s, p.own, p.other, p.n_own, p.n_other, p.dim, own0, other0);
    // dS in place of the dot products, then packed as A fragments: k-chunk c (other rows 16c..)
    // is accumulator fragments 2c (k 0-7) and 2c + 1 (k 8-15), rows group / group + 8.
#pragma unroll
    for (int f = 0; f < kMmaFrags; ++f)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t col = other0 + 8 * f + 2 * quad + e;
        const bool col_valid = col < p.n_other;
        const float other_grad = (col_valid && p.other_grad != nullptr) ? p.other_grad[col] : 0.f;
        const float other_lse = (col_valid && p.other_grad != nullptr) ? p.other_lse[col] : 0.f;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float d = 0.f;
          if (col_valid && my_row[h] < p.n_own) {
            const bool positive = col - my_row[h] == p.pos_delta;
            d = softmax_dlogit(logit(scale, acc[f][2 * h + e], bias), own_grad[h], own_lse[h], other_grad,
                               other_lse, positive ? p.pos_grad[p.pos_grad_by_own ? my_row[h] : col] : 0.f,
                               positive);
            sum_scale = fmaf(d, acc[f][2 * h + e], sum_scale);
            sum_bias += d;
          }
          acc[f][2 * h + e] = scale_out * d;
        }
      }
    uint32_t ds[kMmaCols / 16][4];
#pragma unroll
    for (int c = 0; c < kMmaCols / 16; ++c) {
      ds[c][0] = pack_pair<kBf16>(acc[2 * c][0], acc[2 * c][1]);
      ds[c][1] = pack_pair<kBf16>(acc[2 * c][2], acc[2 * c][3]);
      ds[c][2] = pack_pair<kBf16>(acc[2 * c + 1][0], acc[2 * c + 1][1]);
      ds[c][3] = pack_pair<kBf16>(acc[2 * c + 1][2], acc[2 * c + 1][3]);
    }
    for (int64_t d0 = 0; d0 < p.dim; d0 += kMmaCols) {
      __syncthreads();  // every warp is done with the previous value chunk
      constexpr int kVectors = kMmaCols / 8;
      for (int idx = threadIdx.x; idx < kMmaCols * kVectors; idx += kMmaThreads) {
        const int n = idx / kVectors, v = idx % kVectors;
        const int64_t row = other0 + n, col = d0 + v * 8;
        uint4 value = make_uint4(0u, 0u, 0u, 0u);
        if (row < p.n_other && col < p.dim)
          value = *reinterpret_cast<const uint4*>(p.other + row * p.dim + col);
        *reinterpret_cast<uint4*>(value_s + n * kMmaValuePitch + v * 8) = value;
      }
      __syncthreads();
      float out[kMmaFrags][4];
#pragma unroll
      for (int f = 0; f < kMmaFrags; ++f)
#pragma unroll
        for (int e = 0; e < 4; ++e) out[f][e] = 0.f;
#pragma unroll
      for (int c = 0; c < kMmaCols / 16; ++c)
#pragma unroll
        for (int f = 0; f < kMmaFrags; f += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_base + 16 * c * kMmaValuePitch + 8 * f);
          mma_m16n8k16<kBf16>(out[f], ds[c], b[0], b[1]);
          mma_m16n8k16<kBf16>(out[f + 1], ds[c], b[2], b[3]);
        }
      // out[f][2h + e] belongs to row my_row[h], feature d0 + 8f + 2 quad + e.
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        if (my_row[h] >= p.n_own) continue;
        float* grad_row = p.grad_own + my_row[h] * p.dim;
#pragma unroll
        for (int f = 0; f < kMmaFrags; ++f)
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int64_t col = d0 + 8 * f + 2 * quad + e;
            if (col < p.dim) grad_row[col] += out[f][2 * h + e];
          }
      }
    }
  }
  if (p.partial_scale != nullptr) {
    const float total_scale = block_sum<kMmaThreads>(sum_scale, scratch);
    const float total_bias = block_sum<kMmaThreads>(sum_bias, scratch);
    if (threadIdx.x == 0) {
      p.partial_scale[blockIdx.x] = total_scale;
      p.partial_bias[blockIdx.x] = total_bias;
    }
  }
}

}  // namespace lse_cuda
}  // namespace clipshard
