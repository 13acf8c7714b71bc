// The double-precision reference of the contrastive log-sum-exp that both emulation harnesses
// compare the kernels with: outputs, gradients, and for each gradient entry the sum of its terms'
// magnitudes (the scale of its rounding error).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

struct LseReference {
  std::vector<double> S, dot, row_lse, col_lse;          // S and dot are M x K
  std::vector<double> grad_rows, grad_cols;              // M x D, K x D
  std::vector<double> bound_rows, bound_cols;            // sums of |terms| of each gradient entry
  double grad_scale = 0, grad_bias = 0, sum_bound = 0;   // sum_bound: sum |dS| (1 + |dot|)
};

// rows M x D and cols K x D as the kernels read them (rounded to their dtype, then widened);
// g_col may be empty (no column term); row i's positive is column i + pos (pos -1: none). With
// sample ids (row_ids [M], col_ids [K]; empty: none) the pairs of equal ids other than the positive
// are left out of both LSEs and have no gradient (an LSE over no pairs is -inf).
inline LseReference lse_reference(const std::vector<float>& rows, const std::vector<float>& cols, int64_t M,
                                  int64_t K, int64_t D, double scale, double bias, const std::vector<float>& g_row,
                                  const std::vector<float>& g_col, const std::vector<float>& g_pos, int64_t pos,
                                  const std::vector<int64_t>& row_ids = {}, const std::vector<int64_t>& col_ids = {}) {
  auto positive = [&](int64_t i, int64_t j) { return pos >= 0 && j == i + pos; };
  auto excluded = [&](int64_t i, int64_t j) { return !row_ids.empty() && row_ids[i] == col_ids[j] && !positive(i, j); };
  LseReference r;
  r.S.resize(M * K), r.dot.resize(M * K), r.row_lse.resize(M), r.col_lse.resize(K);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < K; ++j) {
      double d = 0;
      for (int64_t f = 0; f < D; ++f) d += double(rows[i * D + f]) * cols[j * D + f];
      r.dot[i * K + j] = d;
      r.S[i * K + j] = scale * d + bias;
    }
  auto lse = [](const std::vector<double>& x) {  // NaN in, NaN out; -inf for no values
    if (x.empty()) return -double(INFINITY);
    double m = -INFINITY, s = 0;
    for (double v : x) m = std::isnan(v) ? v : std::max(m, v);
    for (double v : x) s += std::exp(v - m);
    return m + std::log(s);
  };
  for (int64_t i = 0; i < M; ++i) {
    std::vector<double> x;
    for (int64_t j = 0; j < K; ++j)
      if (!excluded(i, j)) x.push_back(r.S[i * K + j]);
    r.row_lse[i] = lse(x);
  }
  for (int64_t j = 0; j < K; ++j) {
    std::vector<double> x;
    for (int64_t i = 0; i < M; ++i)
      if (!excluded(i, j)) x.push_back(r.S[i * K + j]);
    r.col_lse[j] = lse(x);
  }
  r.grad_rows.assign(M * D, 0.0), r.grad_cols.assign(K * D, 0.0);
  r.bound_rows.assign(M * D, 0.0), r.bound_cols.assign(K * D, 0.0);
  for (int64_t i = 0; i < M; ++i)
    for (int64_t j = 0; j < K; ++j) {
      if (excluded(i, j)) continue;
      const double s = r.S[i * K + j];
      double d = g_row[i] * std::exp(s - r.row_lse[i]);
      if (!g_col.empty()) d += g_col[j] * std::exp(s - r.col_lse[j]);
      if (positive(i, j)) d += g_pos[i];
      for (int64_t f = 0; f < D; ++f) {
        const double to_row = scale * d * cols[j * D + f], to_col = scale * d * rows[i * D + f];
        r.grad_rows[i * D + f] += to_row;
        r.grad_cols[j * D + f] += to_col;
        r.bound_rows[i * D + f] += std::fabs(to_row);
        r.bound_cols[j * D + f] += std::fabs(to_col);
      }
      r.grad_scale += d * r.dot[i * K + j];
      r.grad_bias += d;
      r.sum_bound += std::fabs(d) * (1 + std::fabs(r.dot[i * K + j]));
    }
  return r;
}
