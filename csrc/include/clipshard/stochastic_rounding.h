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
//
// Every NaN becomes the one canonical NaN of its format, the positive quiet NaN with an empty
// payload (Python's float('nan'), torch.nan, ARM's default NaN): fp32 0x7FC00000, fp16 0x7E00,
// bf16 0x7FC0. Sign and payload of a NaN depend on the hardware that produced it (x86 arithmetic
// gives 0xFFC00000, NVIDIA GPUs 0x7FFFFFFF), so keeping them would make CPU and CUDA results differ.
#include <cstdint>

#include "clipshard/macros.h"

namespace clipshard {

constexpr uint32_t kCanonicalNaNFloatBits = 0x7fc00000u;
constexpr uint16_t kCanonicalNaNHalfBits = 0x7e00u;
constexpr uint16_t kCanonicalNaNBFloat16Bits = 0x7fc0u;

// True for the fp32 bits of any NaN (either sign, any payload).
CLIPSHARD_HOST_DEVICE bool is_nan_bits(uint32_t bits) { return (bits & 0x7fffffffu) > 0x7f800000u; }

// fp32 bits with any NaN replaced by the canonical one (a select: CPU loops over it vectorise).
CLIPSHARD_HOST_DEVICE uint32_t canonical_nan_float_bits(uint32_t bits) {
  return is_nan_bits(bits) ? kCanonicalNaNFloatBits : bits;
}

// True when a k-bit dropped value d (0 <= d < 2^k, and d < 2^24 in every use) rounds up for
// random word r: (r mod 2^k) < d for k < 32, else r < d >> (k - 32), the top 32 bits of d (0 once
// k >= 56). One 32-bit compare, every shift count below 32, no branches: CPU loops vectorise.
CLIPSHARD_HOST_DEVICE bool sr_round_up(uint32_t r, uint32_t d, uint32_t k) {
  const uint32_t mask = k < 32u ? (1u << (k < 32u ? k : 0u)) - 1u : 0xffffffffu;
  const uint32_t shift = k <= 32u ? 0u : (k - 32u < 31u ? k - 32u : 31u);
  return (r & mask) < (d >> shift);
}

// fp32 bits -> fp16 bits. Written as selects rather than early returns so that CPU loops over it
// vectorise; every candidate below is cheap and free of undefined behaviour.
CLIPSHARD_HOST_DEVICE uint16_t sr_float_to_half_bits(uint32_t bits, uint32_t r, bool saturate) {
  const uint32_t sign16 = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7fffffffu;
  const uint32_t kHalfInf = 0x7c00u, kHalfMax = 0x7bffu;
  // fp16 normal range, |x| >= 2^-14: rebias the exponent 127 -> 15, keep the top 10 mantissa bits,
  // drop 13. A carry moves to the next binade, past 65504 to Inf.
  const uint32_t normal = ((mag - 0x38000000u) >> 13) + (sr_round_up(r, mag & 0x1fffu, 13) ? 1u : 0u);
  // fp16 subnormal range, grid spacing 2^-24: |x| = sig * 2^(exp32 - 150) with the implicit bit for
  // fp32 normals, mant * 2^-149 for fp32 subnormals (exp32 == 0); so |x| / 2^-24 = sig / 2^k with
  // k = 126 - exp32 (125) dropped bits, k >= 14. A carry out of 1023 gives 1024, the smallest normal.
  const uint32_t exp32 = mag >> 23;
  const uint32_t sig = (mag & 0x7fffffu) | (exp32 ? 0x800000u : 0u);
  const uint32_t scale_exp = exp32 ? (exp32 < 112u ? exp32 : 112u) : 1u;  // fp32 subnormals: as 1
  const uint32_t k = 126u - scale_exp;  // (k = 14 on lanes in the normal range, unused there)
  const uint32_t shift = k < 31u ? k : 31u;  // sig < 2^24, so shifting by 31 instead of k >= 31 is exact
  const uint32_t kept = sig >> shift;
  const uint32_t dropped = sig & ((1u << shift) - 1u);
  const uint32_t subnormal = kept + (sr_round_up(r, dropped, k) ? 1u : 0u);

  uint32_t out = mag >= 0x38800000u ? normal : subnormal;
  out = (saturate && out > kHalfMax) ? kHalfMax : out;
  // |x| >= 65536 (the grid point after 65504) or Inf: Inf, or the largest finite when saturating.
  out = mag >= 0x47800000u ? (saturate ? kHalfMax : kHalfInf) : out;
  const uint32_t signed_out = sign16 | out;
  return static_cast<uint16_t>(is_nan_bits(bits) ? kCanonicalNaNHalfBits : signed_out);
}

// fp32 bits -> bf16 bits: bf16 is the top half of fp32, so k = 16 everywhere (subnormals too).
CLIPSHARD_HOST_DEVICE uint16_t sr_float_to_bfloat16_bits(uint32_t bits, uint32_t r, bool saturate) {
  const uint32_t sign16 = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7fffffffu;
  const uint32_t kBf16Inf = 0x7f80u, kBf16Max = 0x7f7fu;
  uint32_t out = (mag >> 16) + (sr_round_up(r, mag & 0xffffu, 16) ? 1u : 0u);  // carry: next binade / Inf
  out = (saturate && out > kBf16Max) ? kBf16Max : out;
  out = mag == 0x7f800000u ? (saturate ? kBf16Max : kBf16Inf) : out;
  const uint32_t signed_out = sign16 | out;  // (a NaN never becomes Inf: it is replaced here)
  return static_cast<uint16_t>(is_nan_bits(bits) ? kCanonicalNaNBFloat16Bits : signed_out);
}

}  // namespace clipshard
