#pragma once
// The per-logit maths of the SigLIP loss (docs/siglip.md), shared by the CPU and CUDA kernels.
//
// For a logit l with label z (+1 for the positive pair, -1 otherwise) and t = -z * l:
//   loss term  softplus(t) = max(t, 0) + log1p(exp(-|t|))        (= -logsigmoid(z * l))
//   gradient   d/dl        = -z * sigmoid(t),  sigmoid(t) = (t >= 0 ? 1 : e) / (1 + e), e = exp(-|t|)
// One exponential serves both, and e <= 1 keeps every step finite for any finite logit (scales up to
// 100 and |bias| up to 20 give |l| ~ 120). NaN logits give NaN for both; t = +Inf gives (Inf, -z),
// t = -Inf gives (0, 0).
//
// The fp32 versions are written as straight-line selects and polynomials (no library calls, no
// branches), so that a CPU loop over them vectorises; the fp64 versions call the C library and serve
// gradcheck and the fp64 kernels.
#include <cmath>
#include <cstdint>

#include "clipshard/float_bits.h"
#include "clipshard/macros.h"

namespace clipshard {

// exp(-a) for a >= 0 (NaN allowed: the result is then meaningless and the caller overrides it).
// a = n ln2 + r with |r| <= ln2/2 (Cody-Waite split of ln2) and exp(-a) = 2^-n * exp(-r), exp(-r)
// by its degree-7 Taylor polynomial (truncation error < 6e-9 relative); a few ulp overall. a is
// clamped to 104, past which exp(-a) rounds to 0; 2^-n is applied as two normal factors, so results
// down in the subnormal range are rounded once. n = round(a / ln2) comes from adding 1.5 * 2^23,
// which leaves the integer in the low mantissa bits (float arithmetic only: GCC does not vectorise
// the loop when a float -> int conversion follows the clamp).
CLIPSHARD_HOST_DEVICE float siglip_exp_neg(float a) {
  constexpr float kRound = 12582912.0f;  // 1.5 * 2^23
  a = a < 104.0f ? a : 104.0f;           // NaN -> 104 as well
  const float shifted = a * 1.44269504089f + kRound;
  const float nf = shifted - kRound;
  const int32_t n = static_cast<int32_t>(float_to_bits(shifted) - float_to_bits(kRound));  // 0 <= n <= 150
  const float x = nf * 0.693145751953125f - a + nf * 1.42860682030941723e-06f;  // -r: ln2 = hi + lo
  float p = 1.0f / 5040.0f;
  p = p * x + 1.0f / 720.0f;
  p = p * x + 1.0f / 120.0f;
  p = p * x + 1.0f / 24.0f;
  p = p * x + 1.0f / 6.0f;
  p = p * x + 0.5f;
  p = p * x + 1.0f;
  p = p * x + 1.0f;
  const int32_t n_half = n >> 1;
  return p * bits_to_float(static_cast<uint32_t>(127 - n_half) << 23) *
         bits_to_float(static_cast<uint32_t>(127 - (n - n_half)) << 23);
}

// log1p(e) for 0 <= e <= 1: log(1 + e) = 2 atanh(s), s = e / (2 + e) <= 1/3, by the atanh series
// 2 s (1 + s^2/3 + s^4/5 + ... + s^14/15); the first omitted term is below 2e-9 relative. No
// cancellation, and e multiplies last, so tiny (even subnormal) e keep their relative precision.
CLIPSHARD_HOST_DEVICE float siglip_log1p_unit(float e) {
  const float w = 2.0f / (2.0f + e);  // 2 s = e * w
  const float s = 0.5f * e * w;
  const float s2 = s * s;
  float p = 1.0f / 15.0f;
  p = p * s2 + 1.0f / 13.0f;
  p = p * s2 + 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return e * (w * p);
}

// softplus(-z * l) and its derivative with respect to l, for z = +1 (positive) or -1.
CLIPSHARD_HOST_DEVICE void siglip_term(float l, float z, float& loss, float& dl) {
  const float t = -z * l;
  const float a = t < 0.0f ? -t : t;
  const float e = siglip_exp_neg(a);
  const float value = (t > 0.0f ? t : 0.0f) + siglip_log1p_unit(e);
  const float sigmoid = (t >= 0.0f ? 1.0f : e) / (1.0f + e);
  const bool nan = t != t;
  loss = nan ? t : value;
  dl = nan ? t : -z * sigmoid;
}

CLIPSHARD_HOST_DEVICE void siglip_term(double l, double z, double& loss, double& dl) {
  const double t = -z * l;
  const double e = ::exp(-::fabs(t));
  const double value = (t > 0.0 ? t : 0.0) + ::log1p(e);
  const double sigmoid = (t >= 0.0 ? 1.0 : e) / (1.0 + e);
  const bool nan = t != t;
  loss = nan ? t : value;
  dl = nan ? t : -z * sigmoid;
}

// The loss term alone (no gradient wanted).
CLIPSHARD_HOST_DEVICE float siglip_softplus(float l, float z) {
  const float t = -z * l;
  const float a = t < 0.0f ? -t : t;
  const float value = (t > 0.0f ? t : 0.0f) + siglip_log1p_unit(siglip_exp_neg(a));
  return t != t ? t : value;
}

CLIPSHARD_HOST_DEVICE double siglip_softplus(double l, double z) {
  const double t = -z * l;
  const double value = (t > 0.0 ? t : 0.0) + ::log1p(::exp(-::fabs(t)));
  return t != t ? t : value;
}

}  // namespace clipshard
