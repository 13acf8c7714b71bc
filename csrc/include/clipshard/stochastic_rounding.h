#pragma once
// Bit-exact stochastic rounding of fp32 to fp16 / bf16, shared by the CPU and CUDA kernels.
// Integer arithmetic only, so every compiler and device gives the same bits.
//
// The rule: write |x| on the target grid; the target drops k low magnitude bits whose value is d.
// Round the magnitude away from zero exactly when (r mod 2^k) < d, r being the element's 32-bit
// random word; when k > 32 compare r with the top 32 bits of d instead (d >> (k - 32)). Then
// P(round up) = d / 2^k, the dropped fraction, so E[SR(x)] = x. A carry out of the mantissa moves to
// the next binade and, past the largest finite value, to Inf (or to the largest finite value when
// `saturate`). NaN stays NaN, +-Inf stays +-Inf (or saturates), +-0 keeps its sign.
#include <cstdint>

#include "clipshard/macros.h"

namespace clipshard {

// True when a k-bit dropped value d (0 <= d < 2^k) rounds up for random word r.
CLIPSHARD_HOST_DEVICE bool sr_round_up(uint32_t r, uint64_t d, uint32_t k) {
  if (k <= 32) {
    const uint64_t mask = (k == 32) ? 0xffffffffull : ((1ull << k) - 1ull);
    return (static_cast<uint64_t>(r) & mask) < d;
  }
  const uint32_t shift = k - 32;
  const uint64_t top = shift >= 64 ? 0ull : (d >> shift);
  return static_cast<uint64_t>(r) < top;
}

// fp32 bits -> fp16 bits.
CLIPSHARD_HOST_DEVICE uint16_t sr_float_to_half_bits(uint32_t bits, uint32_t r, bool saturate) {
  const uint32_t sign16 = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7fffffffu;
  const uint32_t kHalfInf = 0x7c00u, kHalfMax = 0x7bffu;
  if (mag > 0x7f800000u) {  // NaN: quiet NaN, keep sign and the top payload bits
    return static_cast<uint16_t>(sign16 | kHalfInf | 0x0200u | ((mag >> 13) & 0x03ffu));
  }
  if (mag >= 0x47800000u) {  // |x| >= 65536 (the grid point past 65504), or Inf
    return static_cast<uint16_t>(sign16 | (saturate ? kHalfMax : kHalfInf));
  }
  uint32_t out;
  if (mag >= 0x38800000u) {  // |x| >= 2^-14: fp16 normal range, drop 13 bits
    out = (mag - 0x38000000u) >> 13;  // rebias exponent 127 -> 15, keep top 10 mantissa bits
    out += sr_round_up(r, mag & 0x1fffu, 13) ? 1u : 0u;  // may carry into the exponent / Inf
  } else {  // fp16 subnormal range: grid spacing 2^-24
    const uint32_t exp32 = mag >> 23;
    // value = sig * 2^(exp32 - 150), with the implicit bit for fp32 normals; fp32 subnormals
    // (exp32 == 0) have value = mant * 2^-149.
    const uint32_t sig = exp32 ? ((mag & 0x7fffffu) | 0x800000u) : (mag & 0x7fffffu);
    const uint32_t k = exp32 ? (126u - exp32) : 125u;  // dropped bits: value / 2^-24 = sig >> k
    const uint32_t kept = k >= 32 ? 0u : (sig >> k);
    const uint64_t dropped = k >= 32 ? sig : (sig & ((1u << k) - 1u));
    out = kept + (sr_round_up(r, dropped, k) ? 1u : 0u);  // 1024 is the smallest normal: exact
  }
  if (saturate && out > kHalfMax) out = kHalfMax;
  return static_cast<uint16_t>(sign16 | out);
}

// fp32 bits -> bf16 bits: bf16 is the top half of fp32, so k = 16 everywhere (subnormals too).
CLIPSHARD_HOST_DEVICE uint16_t sr_float_to_bfloat16_bits(uint32_t bits, uint32_t r, bool saturate) {
  const uint32_t sign16 = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7fffffffu;
  const uint32_t kBf16Inf = 0x7f80u, kBf16Max = 0x7f7fu;
  if (mag > 0x7f800000u) {  // NaN: quiet, keep sign and top payload bits (never becomes Inf)
    return static_cast<uint16_t>(sign16 | kBf16Inf | 0x0040u | ((mag >> 16) & 0x007fu));
  }
  if (mag == 0x7f800000u) {
    return static_cast<uint16_t>(sign16 | (saturate ? kBf16Max : kBf16Inf));
  }
  uint32_t out = mag >> 16;
  out += sr_round_up(r, mag & 0xffffu, 16) ? 1u : 0u;
  if (saturate && out > kBf16Max) out = kBf16Max;
  return static_cast<uint16_t>(sign16 | out);
}

}  // namespace clipshard
