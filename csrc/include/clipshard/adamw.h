#pragma once
// The per-element AdamW update and the storage conversions of the half-precision AdamW, shared by
// the CPU and CUDA kernels so that both produce the same bits.
//
// Update (torch.optim.AdamW, decoupled weight decay, evaluated in fp32 in this exact order):
//   p <- p * (1 - lr * wd)
//   m <- m + (1 - beta1) * (g - m)
//   v <- v * beta2 + ((1 - beta2) * g) * g
//   p <- p + (-lr / (1 - beta1^t) * m) / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// Every operation is a single IEEE-rounded fp32 operation: on CUDA through the explicit _rn
// intrinsics (never contracted into FMAs), on the host through plain operators or their vector
// equivalents, never contracted either (csrc/cpu/adamw.cpp is compiled with fp-contract=off; the
// x86-64 baseline has no FMA instruction anyway). sqrt and division are
// correctly rounded on both, so the CPU and CUDA results agree bit for bit.
//
// Storage: fp32 as is except that any NaN is stored as the canonical NaN 0x7FC00000
// (stochastic_rounding.h: the hardware decides a computed NaN's sign and payload); bf16 and fp16 rounded stochastically (stochastic_rounding.h) or to nearest
// even. An fp16 second moment is stored as v^(1/4) (see docs/optimizer.md for the measurement that
// chose it): v from 1e-16 to 1e8 becomes 1e-4 .. 1e2, well inside fp16's normal range.
#include <cmath>
#include <cstdint>

#include "clipshard/float_bits.h"
#include "clipshard/macros.h"
#include "clipshard/stochastic_rounding.h"

namespace clipshard {

enum class Storage : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

CLIPSHARD_HOST_DEVICE float fmul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
CLIPSHARD_HOST_DEVICE float fadd(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
CLIPSHARD_HOST_DEVICE float fsub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
CLIPSHARD_HOST_DEVICE float fdiv(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
CLIPSHARD_HOST_DEVICE float fsqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}


// Scalars of one AdamW call (one param group); the per-tensor bias corrections come separately.
struct AdamWHyper {
  float decay;             // 1 - lr * weight_decay
  float one_minus_beta1;   // 1 - beta1
  float beta2;
  float one_minus_beta2;   // 1 - beta2
  float eps;
  bool maximize;
};

// neg_step_size = -lr / (1 - beta1^t); bc2_sqrt = sqrt(1 - beta2^t) (both computed in double on the
// host, then rounded to fp32). Returns nothing; updates p, m, v in place.
CLIPSHARD_HOST_DEVICE void adamw_update(float& p, float g, float& m, float& v, const AdamWHyper& h,
                                        float neg_step_size, float bc2_sqrt) {
  if (h.maximize) g = -g;
  p = fmul(p, h.decay);
  m = fadd(m, fmul(h.one_minus_beta1, fsub(g, m)));
  v = fadd(fmul(v, h.beta2), fmul(fmul(h.one_minus_beta2, g), g));
  const float denom = fadd(fdiv(fsqrt(v), bc2_sqrt), h.eps);
  p = fadd(p, fdiv(fmul(neg_step_size, m), denom));
}

// fp16 second moments are stored as q = v^(1/4); v = (q * q) * (q * q).
CLIPSHARD_HOST_DEVICE float decode_fourth_root(float q) {
  const float s = fmul(q, q);
  return fmul(s, s);
}
CLIPSHARD_HOST_DEVICE float encode_fourth_root(float v) { return fsqrt(fsqrt(v)); }

// Exact fp16 bits -> fp32. Selects rather than early returns, so that CPU loops over it vectorise.
CLIPSHARD_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
  const uint32_t inf_nan = 0x7f800000u | (mantissa << 13);
  const uint32_t normal = ((exponent + 112u) << 23) | (mantissa << 13);
  // zero or subnormal: mantissa * 2^-24, exact in fp32
  const float mantissa_f = static_cast<float>(static_cast<int32_t>(mantissa));
  const uint32_t subnormal = float_to_bits(fmul(mantissa_f, 5.9604644775390625e-8f));
  return bits_to_float(sign | (exponent == 0x1fu ? inf_nan : (exponent != 0 ? normal : subnormal)));
}
CLIPSHARD_HOST_DEVICE float bfloat16_bits_to_float(uint16_t b) {
  return bits_to_float(static_cast<uint32_t>(b) << 16);
}

// Round-to-nearest-even fp32 -> fp16 / bf16 bits, integer-only (any NaN gives the canonical NaN, as
// in the SR rule).
CLIPSHARD_HOST_DEVICE uint16_t rn_float_to_half_bits(uint32_t bits) {
  const uint32_t sign16 = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return kCanonicalNaNHalfBits;
  if (mag >= 0x477ff000u) return static_cast<uint16_t>(sign16 | 0x7c00u);  // >= 65520 -> Inf
  uint32_t kept, dropped, half;
  if (mag >= 0x38800000u) {  // fp16 normal: drop 13 bits
    kept = (mag - 0x38000000u) >> 13;
    dropped = mag & 0x1fffu;
    half = 0x1000u;
  } else {  // fp16 subnormal grid (spacing 2^-24): value / 2^-24 = sig >> k
    const uint32_t exp32 = mag >> 23;
    if (exp32 < 102u) return static_cast<uint16_t>(sign16);  // |x| < 2^-25: rounds to zero
    const uint32_t sig = (mag & 0x7fffffu) | 0x800000u;
    const uint32_t k = 126u - exp32;  // 14 .. 24
    kept = sig >> k;
    dropped = sig & ((1u << k) - 1u);
    half = 1u << (k - 1u);
  }
  kept += (dropped > half || (dropped == half && (kept & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign16 | kept);
}
CLIPSHARD_HOST_DEVICE uint16_t rn_float_to_bfloat16_bits(uint32_t bits) {
  const uint32_t sign16 = (bits >> 16) & 0x8000u;
  const uint32_t mag = bits & 0x7fffffffu;
  if (mag > 0x7f800000u) return kCanonicalNaNBFloat16Bits;
  uint32_t kept = mag >> 16;
  const uint32_t dropped = mag & 0xffffu;
  kept += (dropped > 0x8000u || (dropped == 0x8000u && (kept & 1u))) ? 1u : 0u;
  return static_cast<uint16_t>(sign16 | kept);
}

// A stored 16-bit value from fp32 x: stochastic with random word r, or to nearest even.
template <Storage S>
CLIPSHARD_HOST_DEVICE uint16_t round_to_storage(float x, uint32_t r, bool stochastic) {
  const uint32_t bits = float_to_bits(x);
  if (S == Storage::kHalf) {
    return stochastic ? sr_float_to_half_bits(bits, r, /*saturate=*/false) : rn_float_to_half_bits(bits);
  }
  return stochastic ? sr_float_to_bfloat16_bits(bits, r, /*saturate=*/false) : rn_float_to_bfloat16_bits(bits);
}

// A stored fp32 value: x, or the canonical NaN when x is a NaN.
CLIPSHARD_HOST_DEVICE float canonical_float(float x) {
  return bits_to_float(canonical_nan_float_bits(float_to_bits(x)));
}

template <Storage S>
CLIPSHARD_HOST_DEVICE float storage_to_float(uint16_t bits) {
  return S == Storage::kHalf ? half_bits_to_float(bits) : bfloat16_bits_to_float(bits);
}

// Random streams. One call draws (seed, offset); the stored 16-bit tensor of role `role` (0 = param,
// 1 = exp_avg, 2 = exp_avg_sq) of tensor number `tensor` (given per tensor by the caller: the
// parameter's position in the optimizer, whatever the sharding) uses stream 3 * tensor + role, and
// its element with global index i (the element's index in the full, unsharded parameter: the
// shard's index base + its local index) uses word i % 4 of
// Philox(key = seed, counter = (stream * 2^40 + i / 4, offset)). A shard therefore draws exactly
// the words the unsharded tensor would, and distinct streams use disjoint Philox counters:
// independent bits. Limits: 2^42 elements per full tensor, 2^24 streams per call.
constexpr int kStreamShift = 40;
constexpr int64_t kMaxStreams = int64_t(1) << 24;
CLIPSHARD_HOST_DEVICE uint64_t stream_block(uint64_t stream, uint64_t element) {
  return (stream << kStreamShift) + (element >> 2);
}

}  // namespace clipshard
