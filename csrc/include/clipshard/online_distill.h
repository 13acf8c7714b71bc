// The maths of the distillation op that its kernels share (docs/distillation_cuda.md): the online
// softmax-weighted mean of the forward and the teacher's terms of the logit gradients dS and dT.
// Torch-free and HOST_DEVICE, beside the online log-sum-exp of online_lse.h whose conventions it
// follows (max = the largest finite value folded in, sums relative to ref(), +Inf/NaN travel
// through the sums).
#pragma once

#include "clipshard/online_lse.h"

namespace clipshard {

// For one teacher row (or column) t_1, t_2, ... with weights-to-be-averaged v_1, v_2, ... (the
// student's logits of the same pairs): lse() = logsumexp_j t_j and mean() = sum_j softmax(t)_j v_j,
// folded online like OnlineLse: sum = sum_j exp(t_j - ref), weighted = sum_j exp(t_j - ref) v_j,
// both rescaled together when the maximum moves. One exponential per value.
template <typename T>
struct OnlineSoftmaxMean {
  T max;
  T sum;
  T weighted;

  CLIPSHARD_HOST_DEVICE static OnlineSoftmaxMean empty() { return {-lse_infinity<T>(), T(0), T(0)}; }

  CLIPSHARD_HOST_DEVICE T ref() const { return max == -lse_infinity<T>() ? T(0) : max; }

  CLIPSHARD_HOST_DEVICE void add(T t, T v) {
    const bool new_max = t > max && t < lse_infinity<T>();  // false for NaN and +-Inf
    const T e = lse_exp(new_max ? max - t : t - ref());
    sum = new_max ? rescale(sum, e) + T(1) : sum + e;
    weighted = new_max ? rescale(weighted, e) + v : weighted + e * v;
    max = new_max ? t : max;
  }

  CLIPSHARD_HOST_DEVICE void merge(const OnlineSoftmaxMean& other) {
    if (other.sum == T(0) && other.max == -lse_infinity<T>()) return;
    if (sum == T(0) && max == -lse_infinity<T>()) {
      *this = other;
      return;
    }
    const T a = ref(), b = other.ref();
    const T m = a > b ? a : b;
    const T ea = lse_exp(a - m), eb = lse_exp(b - m);
    sum = rescale(sum, ea) + rescale(other.sum, eb);
    weighted = rescale(weighted, ea) + rescale(other.weighted, eb);
    max = max > other.max ? max : other.max;
    if (max != -lse_infinity<T>() && m != max) {  // see OnlineLse::merge
      const T e = lse_exp(m - max);
      sum = rescale(sum, e);
      weighted = rescale(weighted, e);
    }
  }

  CLIPSHARD_HOST_DEVICE T lse() const { return ref() + lse_log(sum); }
  CLIPSHARD_HOST_DEVICE T mean() const { return weighted / sum; }

 private:
  // An infinite sum stays infinite when rescaled (inf * 0 would be NaN).
  CLIPSHARD_HOST_DEVICE static T rescale(T s, T factor) {
    return (s == lse_infinity<T>() || s == -lse_infinity<T>()) ? s : s * factor;
  }
};

// One teacher's statistics of a row (or of a column) and their upstream gradients, as the
// backward reads them: P = exp(t - lse) is the teacher's softmax over the row (column), cross the
// P-weighted mean student logit.
template <typename T>
struct TeacherSide {
  T lse;
  T cross;
  T g_lse;    // upstream gradient of lse (the teacher_*_lse output)
  T g_cross;  // upstream gradient of cross (the *_cross output)
};

// The teacher's terms for one logit pair (student logit s, teacher logit t) from its row side r
// and column side c: adds to ds the student's gradient g_cross P (row and column), and returns dT,
// the gradient of the teacher logit: P (g_lse + g_cross (s - cross)) for each side. A side whose
// two gradients are zero costs no exponential; with want_dt false only ds is formed.
template <typename T>
CLIPSHARD_HOST_DEVICE T teacher_dlogits(T s, T t, const TeacherSide<T>& r, const TeacherSide<T>& c, bool want_dt,
                                        T& ds) {
  T dt = T(0);
  if (r.g_cross != T(0) || (want_dt && r.g_lse != T(0))) {
    const T p = lse_exp(t - r.lse);
    ds += r.g_cross * p;
    if (want_dt) dt += p * (r.g_lse + r.g_cross * (s - r.cross));
  }
  if (c.g_cross != T(0) || (want_dt && c.g_lse != T(0))) {
    const T q = lse_exp(t - c.lse);
    ds += c.g_cross * q;
    if (want_dt) dt += q * (c.g_lse + c.g_cross * (s - c.cross));
  }
  return dt;
}

}  // namespace clipshard
