#pragma once
// Philox4x32-10 words for many consecutive blocks at once, in element order (words[4 * b + l] is
// word l of block first_block + b): the stream of clipshard/philox.h, computed 16 blocks at a time
// with AVX-512 or 8 with AVX2 where the CPU has them (integer operations only, so every path gives
// the same words; the scalar philox_block serves the rest and other architectures).
//
// Vector form: lane j of c0..c3 holds the counter words of block first + j. The 32x32 -> 64-bit
// products come from the even/odd-lane multiply (mul_epu32) and are split into low and high words
// with shifts and blends; after 10 rounds a 4 x N transpose puts the words in element order.
#include <algorithm>
#include <cstdint>

#include "../env_vars.h"
#include "clipshard/philox.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#include <immintrin.h>
#define CLIPSHARD_PHILOX_SIMD 1
#endif

namespace clipshard {

inline void philox_words_scalar(uint64_t seed, uint64_t offset, uint64_t first_block, int64_t blocks,
                                uint32_t* words) {
  for (int64_t b = 0; b < blocks; ++b) {
    const PhiloxWords w = philox_block(seed, offset, first_block + static_cast<uint64_t>(b));
    for (int l = 0; l < 4; ++l) words[4 * b + l] = w.w[l];
  }
}

#if defined(CLIPSHARD_PHILOX_SIMD)
// GCC 12 warns about the deliberately undefined lanes inside its own AVX-512 intrinsics at -O3.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// hi/lo 32-bit halves of a * m in every 32-bit lane.
__attribute__((target("avx512f"))) inline void philox_mul16(__m512i a, __m512i m, __m512i& hi, __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m);                       // products of lanes 0, 2, ...
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);  // products of lanes 1, 3, ...
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
}

__attribute__((target("avx512f"))) inline void philox_words_avx512(uint64_t seed, uint64_t offset,
                                                                   uint64_t first_block, int64_t blocks,
                                                                   uint32_t* words) {
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t b = 0;
  for (; b + 16 <= blocks; b += 16) {
    const uint64_t block = first_block + static_cast<uint64_t>(b);
    if (static_cast<uint32_t>(block) > 0xFFFFFFF0u) {  // the low counter word wraps inside the group
      philox_words_scalar(seed, offset, block, 16, words + 4 * b);
      continue;
    }
    __m512i c0 = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block))), lane);
    __m512i c1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block >> 32)));
    __m512i c2 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
    __m512i c3 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      __m512i hi0, lo0, hi1, lo1;
      philox_mul16(c0, m0, hi0, lo0);
      philox_mul16(c2, m1, hi1, lo1);
      c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    // Transpose: u_j's 128-bit lane q holds the 4 words of block 4q + j.
    const __m512i t0 = _mm512_unpacklo_epi32(c0, c1), t1 = _mm512_unpackhi_epi32(c0, c1);
    const __m512i t2 = _mm512_unpacklo_epi32(c2, c3), t3 = _mm512_unpackhi_epi32(c2, c3);
    const __m512i u0 = _mm512_unpacklo_epi64(t0, t2), u1 = _mm512_unpackhi_epi64(t0, t2);
    const __m512i u2 = _mm512_unpacklo_epi64(t1, t3), u3 = _mm512_unpackhi_epi64(t1, t3);
    const __m512i v0 = _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i v1 = _mm512_shuffle_i32x4(u2, u3, _MM_SHUFFLE(1, 0, 1, 0));
    const __m512i v2 = _mm512_shuffle_i32x4(u0, u1, _MM_SHUFFLE(3, 2, 3, 2));
    const __m512i v3 = _mm512_shuffle_i32x4(u2, u3, _MM_SHUFFLE(3, 2, 3, 2));
    uint32_t* out = words + 4 * b;
    _mm512_storeu_si512(out, _mm512_shuffle_i32x4(v0, v1, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(out + 16, _mm512_shuffle_i32x4(v0, v1, _MM_SHUFFLE(3, 1, 3, 1)));
    _mm512_storeu_si512(out + 32, _mm512_shuffle_i32x4(v2, v3, _MM_SHUFFLE(2, 0, 2, 0)));
    _mm512_storeu_si512(out + 48, _mm512_shuffle_i32x4(v2, v3, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  philox_words_scalar(seed, offset, first_block + static_cast<uint64_t>(b), blocks - b, words + 4 * b);
}

__attribute__((target("avx2"))) inline void philox_mul8(__m256i a, __m256i m, __m256i& hi, __m256i& lo) {
  const __m256i even = _mm256_mul_epu32(a, m);
  const __m256i odd = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), m);
  lo = _mm256_blend_epi32(even, _mm256_slli_epi64(odd, 32), 0xAA);
  hi = _mm256_blend_epi32(_mm256_srli_epi64(even, 32), odd, 0xAA);
}

__attribute__((target("avx2"))) inline void philox_words_avx2(uint64_t seed, uint64_t offset,
                                                              uint64_t first_block, int64_t blocks,
                                                              uint32_t* words) {
  const __m256i m0 = _mm256_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m256i m1 = _mm256_set1_epi32(static_cast<int>(kPhiloxM1));
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  int64_t b = 0;
  for (; b + 8 <= blocks; b += 8) {
    const uint64_t block = first_block + static_cast<uint64_t>(b);
    if (static_cast<uint32_t>(block) > 0xFFFFFFF8u) {  // the low counter word wraps inside the group
      philox_words_scalar(seed, offset, block, 8, words + 4 * b);
      continue;
    }
    __m256i c0 = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block))), lane);
    __m256i c1 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(block >> 32)));
    __m256i c2 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
    __m256i c3 = _mm256_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {
      __m256i hi0, lo0, hi1, lo1;
      philox_mul8(c0, m0, hi0, lo0);
      philox_mul8(c2, m1, hi1, lo1);
      c0 = _mm256_xor_si256(_mm256_xor_si256(hi1, c1), _mm256_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm256_xor_si256(_mm256_xor_si256(hi0, c3), _mm256_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    // Transpose: u_j's 128-bit lane q holds the 4 words of block 4q + j.
    const __m256i t0 = _mm256_unpacklo_epi32(c0, c1), t1 = _mm256_unpackhi_epi32(c0, c1);
    const __m256i t2 = _mm256_unpacklo_epi32(c2, c3), t3 = _mm256_unpackhi_epi32(c2, c3);
    const __m256i u0 = _mm256_unpacklo_epi64(t0, t2), u1 = _mm256_unpackhi_epi64(t0, t2);
    const __m256i u2 = _mm256_unpacklo_epi64(t1, t3), u3 = _mm256_unpackhi_epi64(t1, t3);
    auto* out = reinterpret_cast<__m256i*>(words + 4 * b);
    _mm256_storeu_si256(out, _mm256_permute2x128_si256(u0, u1, 0x20));
    _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(u2, u3, 0x20));
    _mm256_storeu_si256(out + 2, _mm256_permute2x128_si256(u0, u1, 0x31));
    _mm256_storeu_si256(out + 3, _mm256_permute2x128_si256(u2, u3, 0x31));
  }
  philox_words_scalar(seed, offset, first_block + static_cast<uint64_t>(b), blocks - b, words + 4 * b);
}

#pragma GCC diagnostic pop
#endif  // CLIPSHARD_PHILOX_SIMD

enum class SimdIsa { kBaseline, kAvx2, kAvx512 };

// The widest instruction set of this CPU, or a narrower one named by the environment variable
// CLIPSHARD_CPU_ISA (avx512, avx2, baseline; read once; other values raise), so that tests can run every code path.
inline SimdIsa simd_isa() {
#if defined(CLIPSHARD_PHILOX_SIMD)
  static const SimdIsa isa = [] {
    __builtin_cpu_init();
    SimdIsa best = __builtin_cpu_supports("avx512f") ? SimdIsa::kAvx512
                   : __builtin_cpu_supports("avx2") ? SimdIsa::kAvx2
                                                    : SimdIsa::kBaseline;
    const auto wanted = env::choice("CLIPSHARD_CPU_ISA", {"avx512", "avx2", "baseline"});
    if (wanted == 1) best = std::min(best, SimdIsa::kAvx2);
    if (wanted == 2) best = SimdIsa::kBaseline;
    return best;
  }();
  return isa;
#else
  return SimdIsa::kBaseline;
#endif
}

// Words of `blocks` consecutive blocks from first_block on, with the widest instruction set
// available.
inline void philox_words(uint64_t seed, uint64_t offset, uint64_t first_block, int64_t blocks,
                         uint32_t* words) {
#if defined(CLIPSHARD_PHILOX_SIMD)
  const SimdIsa isa = simd_isa();
  if (isa == SimdIsa::kAvx512) return philox_words_avx512(seed, offset, first_block, blocks, words);
  if (isa == SimdIsa::kAvx2) return philox_words_avx2(seed, offset, first_block, blocks, words);
#endif
  philox_words_scalar(seed, offset, first_block, blocks, words);
}

}  // namespace clipshard
