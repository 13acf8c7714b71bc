// Helpers of the CPU tile kernels (contrastive_lse.cpp, distill_lse.cpp): the logits are produced
// one row-block x column-block tile at a time by BLAS into per-thread scratch, and the threads
// ("chunks") own contiguous ranges of row blocks.
#pragma once

#include <ATen/ATen.h>

#include <cmath>
#include <limits>
#include <tuple>
#include <utility>

namespace clipshard::cpu_tiles {

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

template <typename acc_t>
acc_t finite_or_zero(acc_t x) { return std::isfinite(x) ? x : acc_t(0); }

// The maximum of an online state that holds sum = sum exp(x - finite_or_zero(m)) for a row's or
// column's maximum m: its finite maximum, or -inf when m is not finite (reference 0).
template <typename acc_t>
acc_t state_max(acc_t m) { return std::isfinite(m) ? m : -std::numeric_limits<acc_t>::infinity(); }

// Contiguous [n x m] view of the start of a flat scratch buffer.
inline at::Tensor scratch_view(const at::Tensor& buffer, int64_t n, int64_t m) {
  return buffer.narrow(0, 0, n * m).view({n, m});
}

// Which row blocks chunk c of n_chunks owns: [first, last).
inline std::pair<int64_t, int64_t> chunk_blocks(int64_t c, int64_t n_chunks, int64_t n_blocks) {
  return {c * n_blocks / n_chunks, (c + 1) * n_blocks / n_chunks};
}

// tile = scale * a @ b^T (BLAS, single-threaded inside a parallel region).
inline void similarity_tile(at::Tensor& tile, const at::Tensor& a, const at::Tensor& b, double scale) {
  at::addmm_out(tile, tile, a, b.t(), /*beta=*/0, /*alpha=*/scale);
}

// A tile whose logits span less than this range is exponentiated once, against its maximum: every
// exp(S - max) is then a normal float (e^-80 > FLT_MIN ~ e^-87.3), so a single exponential per logit
// serves the row sums, the column sums and both softmaxes of the backward. Wider tiles (large scales,
// NaN, Inf) take the exact two-exponential path with per-row and per-column shifts.
constexpr double kOneExpRange = 80.0;

// True (and lo/hi set) when the tile's logits are finite and span less than kOneExpRange.
template <typename acc_t>
inline bool narrow_range(const at::Tensor& tile, acc_t& hi) {
  auto minmax = at::aminmax(tile);
  const acc_t lo = std::get<0>(minmax).template item<acc_t>();
  hi = std::get<1>(minmax).template item<acc_t>();
  return hi - lo < acc_t(kOneExpRange);  // false for NaN and Inf
}

inline at::ScalarType acc_type_of(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

}  // namespace clipshard::cpu_tiles
