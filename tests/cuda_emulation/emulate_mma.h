// Host versions of the warp-level primitives of csrc/cuda/contrastive_lse_mma.cuh (ldmatrix,
// ldmatrix.trans, mma.sync.m16n8k16 with fp32 accumulators, packing of two floats to 16 bits),
// written from the fragment layouts of the PTX ISA ("Matrix Fragments for mma.m16n8k16 with
// floating point type", "ldmatrix"), independently of the kernels' own address arithmetic.
// Include emulate_cuda.h first; define CLIPSHARD_LSE_HOST_EMULATION before the kernel header.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#include "emulate_cuda.h"

namespace clipshard {
namespace lse_cuda {

template <bool kBf16>
inline float half_bits_to_float(uint16_t bits) {
  if constexpr (kBf16) return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
  else return static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

template <bool kBf16>
inline uint32_t pack_pair(float lo, float hi) {
  uint16_t l, h;
  if constexpr (kBf16) l = c10::BFloat16(lo).x, h = c10::BFloat16(hi).x;
  else l = c10::Half(lo).x, h = c10::Half(hi).x;
  return static_cast<uint32_t>(l) | (static_cast<uint32_t>(h) << 16);
}

// ldmatrix.x4: lanes 8i..8i+7 give the row addresses of matrix i (8 rows of 8 16-bit values);
// lane l receives, in register i, row l / 4, values 2 (l % 4) and 2 (l % 4) + 1 of matrix i, or,
// transposed, value l / 4 of rows 2 (l % 4) and 2 (l % 4) + 1.
inline void emulated_ldmatrix(uint32_t (&r)[4], const void* smem_ptr, bool trans) {
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, base = t - lane;
  g_block->pointers[t] = smem_ptr;
  __syncthreads();
  for (int i = 0; i < 4; ++i) {
    uint16_t v[2];
    for (int e = 0; e < 2; ++e) {
      const int row = trans ? 2 * (lane % 4) + e : lane / 4;
      const int col = trans ? lane / 4 : 2 * (lane % 4) + e;
      const auto* row_ptr = static_cast<const uint16_t*>(g_block->pointers[base + 8 * i + row]);
      v[e] = row_ptr[col];
    }
    r[i] = static_cast<uint32_t>(v[0]) | (static_cast<uint32_t>(v[1]) << 16);
  }
  __syncthreads();
}

inline void ldmatrix_x4(uint32_t (&r)[4], const void* p) { emulated_ldmatrix(r, p, false); }
inline void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) { emulated_ldmatrix(r, p, true); }

// D = A B + C for the warp: A 16 x 16 (a0..a3: rows g / g + 8, columns 2q.. / 2q + 8..),
// B 16 x 8 (b0: rows 2q, 2q + 1, b1: rows 2q + 8, 2q + 9; column g), C/D 16 x 8 (c0, c1: row g,
// c2, c3: row g + 8; columns 2q, 2q + 1), where g = lane / 4 and q = lane % 4.
template <bool kBf16>
inline void mma_m16n8k16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const int t = static_cast<int>(threadIdx.x), lane = t % 32, base = t - lane;
  const uint32_t mine[6] = {a[0], a[1], a[2], a[3], b0, b1};
  std::memcpy(g_block->words[t], mine, sizeof(mine));
  __syncthreads();
  float A[16][16], B[16][8];
  for (int l = 0; l < 32; ++l) {
    const int g = l / 4, q = l % 4;
    const uint32_t* w = g_block->words[base + l];
    for (int e = 0; e < 2; ++e) {
      auto half = [&](uint32_t word) { return half_bits_to_float<kBf16>(static_cast<uint16_t>(word >> (16 * e))); };
      A[g][2 * q + e] = half(w[0]);
      A[g + 8][2 * q + e] = half(w[1]);
      A[g][2 * q + 8 + e] = half(w[2]);
      A[g + 8][2 * q + 8 + e] = half(w[3]);
      B[2 * q + e][g] = half(w[4]);
      B[2 * q + 8 + e][g] = half(w[5]);
    }
  }
  __syncthreads();
  const int g = lane / 4, q = lane % 4;
  for (int i = 0; i < 4; ++i) {
    const int row = g + 8 * (i / 2), col = 2 * q + i % 2;
    float sum = 0.f;
    for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
    c[i] += sum;
  }
}

}  // namespace lse_cuda
}  // namespace clipshard
