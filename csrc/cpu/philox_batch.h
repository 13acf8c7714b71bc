#pragma once
// CPU only: the Philox words of kPhiloxBatchBlocks consecutive blocks at once, in the layout the
// rounding loop reads (word j of block first + b at index 4 * b + j). Two versions with identical
// output: a portable loop over philox_block that compilers vectorise, and an AVX-512 one written
// with intrinsics, about twice as fast because it forms the 32 x 32 -> 64-bit products of even and
// odd lanes in place instead of widening every lane (tests compare both with Random123's answers).
#include <cstdint>

#include "clipshard/philox.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define CLIPSHARD_PHILOX_AVX512 1
#endif

namespace clipshard {

constexpr int64_t kPhiloxBatchBlocks = 64;

__attribute__((always_inline)) inline void philox_batch_portable(uint64_t seed, uint64_t offset, uint64_t first,
                                                                  uint32_t* random) {
  for (int64_t b = 0; b < kPhiloxBatchBlocks; ++b) {
    const PhiloxWords words = philox_block(seed, offset, first + static_cast<uint64_t>(b));
    for (int j = 0; j < 4; ++j) random[4 * b + j] = words.w[j];
  }
}

#if CLIPSHARD_PHILOX_AVX512
// GCC 12's own intrinsic headers trip -Wuninitialized when inlined with -Wall; not our variables.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

// hi and lo halves of a * m for 16 lanes of 32 bits: even lanes from one _mm512_mul_epu32, odd
// lanes from another on the inputs shifted down by 32, recombined with lane blends.
__attribute__((target("avx512f"), always_inline)) inline void philox_mulhilo16(__m512i a, __m512i m, __m512i& hi,
                                                                               __m512i& lo) {
  const __m512i even = _mm512_mul_epu32(a, m);
  const __m512i odd = _mm512_mul_epu32(_mm512_srli_epi64(a, 32), m);
  hi = _mm512_mask_blend_epi32(0xAAAA, _mm512_srli_epi64(even, 32), odd);
  lo = _mm512_mask_blend_epi32(0xAAAA, even, _mm512_slli_epi64(odd, 32));
}

__attribute__((target("avx512f"), always_inline)) inline void philox_batch_avx512(uint64_t seed, uint64_t offset,
                                                                                  uint64_t first, uint32_t* random) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i m0 = _mm512_set1_epi32(static_cast<int>(kPhiloxM0));
  const __m512i m1 = _mm512_set1_epi32(static_cast<int>(kPhiloxM1));
  for (int64_t group = 0; group < kPhiloxBatchBlocks; group += 16) {
    const uint64_t block0 = first + static_cast<uint64_t>(group);
    const __m512i low0 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0)));
    __m512i c0 = _mm512_add_epi32(low0, lane);  // block index, low word: may wrap ...
    const __mmask16 carry = _mm512_cmplt_epu32_mask(c0, low0);  // ... then the high word gets +1
    __m512i c1 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(block0 >> 32)));
    c1 = _mm512_mask_add_epi32(c1, carry, c1, _mm512_set1_epi32(1));
    __m512i c2 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset)));
    __m512i c3 = _mm512_set1_epi32(static_cast<int>(static_cast<uint32_t>(offset >> 32)));
    uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
    for (int round = 0; round < 10; ++round) {  // the rounds of philox_block, 16 blocks at a time
      __m512i hi0, lo0, hi1, lo1;
      philox_mulhilo16(c0, m0, hi0, lo0);
      philox_mulhilo16(c2, m1, hi1, lo1);
      c0 = _mm512_xor_si512(_mm512_xor_si512(hi1, c1), _mm512_set1_epi32(static_cast<int>(k0)));
      c1 = lo1;
      c2 = _mm512_xor_si512(_mm512_xor_si512(hi0, c3), _mm512_set1_epi32(static_cast<int>(k1)));
      c3 = lo0;
      k0 += kPhiloxW0;
      k1 += kPhiloxW1;
    }
    alignas(64) uint32_t words[4][16];
    _mm512_store_si512(words[0], c0);
    _mm512_store_si512(words[1], c1);
    _mm512_store_si512(words[2], c2);
    _mm512_store_si512(words[3], c3);
    for (int b = 0; b < 16; ++b) {
      for (int j = 0; j < 4; ++j) random[4 * (group + b) + j] = words[j][b];
    }
  }
}
#pragma GCC diagnostic pop
#endif

}  // namespace clipshard
