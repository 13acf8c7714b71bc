// Tensor-core forward kernel of the fused contrastive log-sum-exp for fp16/bf16 features
// (docs/fused_loss_cuda.md): mma.sync.m16n8k16 with fp32 accumulators, operands staged through
// shared memory and read with ldmatrix, online log-sum-exp on the accumulator fragments.
// Selected only by tensor_cores=True, for D % 8 == 0 and 16-byte aligned features on sm_80+.
// UNVERIFIED: compiled for sm_80/sm_90, never run on a GPU.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
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

template <typename T>
struct IsBf16 : std::false_type {};
template <>
struct IsBf16<c10::BFloat16> : std::true_type {};

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_ptr) {
  const uint32_t addr = static_cast<uint32_t>(__cvta_generic_to_shared(smem_ptr));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr)
               : "memory");
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
  // ldmatrix row addresses: A = 16 own rows x 16 features; B = 16 other rows x 16 features,
  // giving (b0, b1) of fragment f from lanes 0-15 and of fragment f + 1 from lanes 16-31.
  const T* a_base = own_s + (warp * 16 + lane % 16) * kMmaPitch + (lane / 16) * 8;
  const T* b_base = other_s + ((lane & 7) + ((lane >> 4) << 3)) * kMmaPitch + ((lane >> 3) & 1) * 8;
  float m[2] = {-INFINITY, -INFINITY}, s[2] = {0.f, 0.f};

  for (int64_t other0 = 0; other0 < p.n_other; other0 += kMmaCols) {
    float acc[kMmaFrags][4];
#pragma unroll
    for (int f = 0; f < kMmaFrags; ++f)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[f][e] = 0.f;
    for (int64_t k0 = 0; k0 < p.dim; k0 += kMmaDepth) {
      __syncthreads();  // every warp is done with the previous chunk
      load_mma_chunk<kMmaRows>(own_s, p.own, p.n_own, p.dim, own0, k0);
      load_mma_chunk<kMmaCols>(other_s, p.other, p.n_other, p.dim, other0, k0);
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
    // acc[f][2h + e] is the dot product of row my_row[h] with other row other0 + 8f + 2 quad + e.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float x[2 * kMmaFrags];
#pragma unroll
      for (int f = 0; f < kMmaFrags; ++f)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int64_t col = other0 + 8 * f + 2 * quad + e;
          const float v = col < p.n_other ? logit(scale, acc[f][2 * h + e], bias) : -INFINITY;
          x[2 * f + e] = v;
          if (p.pos != nullptr && my_row[h] < p.n_own && col - my_row[h] == p.pos_delta)
            p.pos[my_row[h]] = v;
        }
      online_lse_add(m[h], s[h], x);
    }
  }
  // The 4 lanes of a fragment row differ in the two low lane bits: merge in a fixed tree.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int lane_mask = 1; lane_mask < 4; lane_mask *= 2) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m[h], lane_mask);
      const float s2 = __shfl_xor_sync(0xffffffffu, s[h], lane_mask);
      online_lse_merge(m[h], s[h], m2, s2);
    }
    if (quad == 0 && my_row[h] < p.n_own) p.lse[my_row[h]] = m[h] + logf(s[h]);
  }
}

}  // namespace lse_cuda
}  // namespace clipshard
