// The maths of the softmax (contrastive) loss that every kernel shares: the online log-sum-exp
// state, its merge, and the logit gradient dS. Torch-free and HOST_DEVICE, so the CPU kernels, the
// chunked CUDA path and the fused CUDA tile kernels compute it with the same code
// (docs/fused_loss.md, docs/fused_loss_cuda.md).
//
// A log-sum-exp is kept as (max, sum): `max` is the largest *finite* value folded in (-inf while
// none), `sum` the sum of exp(x - ref) with ref = max, or 0 while max is -inf. Then
// lse = ref + log(sum). +Inf and NaN values travel through `sum` (as Inf / NaN), so they
// propagate to the result as they do in torch's logsumexp, and no inf - inf is ever formed.
#pragma once

#include <cmath>

#include "clipshard/macros.h"

namespace clipshard {

// exp for the loss maths: the hardware exponential (ex2.approx) on the device, std::exp on the
// host. Its relative error grows with |x| (about |x| * 9e-8), but the terms with a large |x| are
// the ones below e^-20 that barely move a sum or a gradient.
template <typename T>
CLIPSHARD_HOST_DEVICE T lse_exp(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return __expf(x);
  else return ::exp(x);
#else
  return std::exp(x);
#endif
}

template <typename T>
CLIPSHARD_HOST_DEVICE T lse_log(T x) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(T) == 4) return __logf(x);
  else return ::log(x);
#else
  return std::log(x);
#endif
}

template <typename T>
CLIPSHARD_HOST_DEVICE T lse_infinity() {
  return T(INFINITY);
}

template <typename T>
struct OnlineLse {
  T max;
  T sum;

  CLIPSHARD_HOST_DEVICE static OnlineLse empty() { return {-lse_infinity<T>(), T(0)}; }

  CLIPSHARD_HOST_DEVICE T ref() const { return max == -lse_infinity<T>() ? T(0) : max; }

  // Folds in one value with one exponential.
  CLIPSHARD_HOST_DEVICE void add(T x) {
    const bool new_max = x > max && x < lse_infinity<T>();  // false for NaN and +-Inf
    const T e = lse_exp(new_max ? max - x : x - ref());
    // An infinite sum stays infinite when rescaled (inf * 0 would be NaN).
    sum = new_max ? (sum == lse_infinity<T>() ? sum : sum * e) + T(1) : sum + e;
    max = new_max ? x : max;
  }

  // Folds in another state (the result does not depend on which side is empty).
  CLIPSHARD_HOST_DEVICE void merge(const OnlineLse& other) {
    if (other.sum == T(0) && other.max == -lse_infinity<T>()) return;
    if (sum == T(0) && max == -lse_infinity<T>()) {
      *this = other;
      return;
    }
    const T a = ref(), b = other.ref();
    const T m = a > b ? a : b;
    sum = rescale(sum, a - m) + rescale(other.sum, b - m);
    max = max > other.max ? max : other.max;
    // The reference may have moved from 0 (a state of only Inf/NaN values) to a finite maximum:
    // both are fine, since such a sum is Inf or NaN whatever its reference.
    if (max != -lse_infinity<T>() && m != max) sum = rescale(sum, m - max);
  }

  CLIPSHARD_HOST_DEVICE T value() const { return ref() + lse_log(sum); }

 private:
  CLIPSHARD_HOST_DEVICE static T rescale(T s, T shift) {
    return s == lse_infinity<T>() ? s : s * lse_exp(shift);
  }
};

// d loss / d S[i, j] of the contrastive loss: the row-softmax term weighted by the row's upstream
// gradient, the column-softmax term weighted by the column's, and the positive logit's upstream
// gradient on the positive pair. A zero weight drops its term (so an absent column term needs no
// log-sum-exp). S, row_lse and col_lse either all include the logit bias or all exclude it.
template <typename T>
CLIPSHARD_HOST_DEVICE T softmax_dlogit(T s, T g_row, T row_lse, T g_col, T col_lse, T g_pos, bool positive) {
  T d = T(0);
  if (g_row != T(0)) d += g_row * lse_exp(s - row_lse);
  if (g_col != T(0)) d += g_col * lse_exp(s - col_lse);
  return positive ? d + g_pos : d;
}

}  // namespace clipshard
