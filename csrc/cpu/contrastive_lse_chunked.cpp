// The chunked contrastive_lse on the CPU (see contrastive_lse_chunked.h): per chunk, the row
// log-sum-exps are carried across chunks in OnlineLse states, the chunk's columns get their exact
// log-sum-exp over all M rows, and the backward forms dS with softmax_dlogit, all from
// clipshard/online_lse.h, the same maths the CUDA kernels run. With sample ids (kIds) an excluded
// pair (same id, not the positive) is folded in as -inf (OnlineLse::add(-inf) leaves a state as it
// is) and gets dS = 0; one id per row and per column is read outside the inner loops' arithmetic.
#include "contrastive_lse_chunked.h"

#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "../chunked/chunk_driver.h"
#include "clipshard/online_lse.h"

namespace clipshard {
namespace {

constexpr int64_t kRowGrain = 16;
constexpr int64_t kColumnBlock = 64;  // columns per task of the column pass

// Whether global pair (i, j) is excluded: same id, not row i's positive (always false without ids).
template <bool kIds>
bool excluded(const int64_t* row_ids, const int64_t* col_ids, int64_t pos_offset, int64_t i, int64_t j) {
  if constexpr (kIds) return row_ids[i] == col_ids[j] && j != pos_offset + i;
  return false;
}

template <typename acc_t, bool kIds>
void forward_impl(const at::Tensor& rows, const at::Tensor& cols, acc_t scale, int64_t pos_offset,
                  const int64_t* row_ids, const int64_t* col_ids, bool want_col, int64_t workspace_bytes,
                  acc_t* row_lse, acc_t* pos_logit, acc_t* col_lse) {
  const int64_t M = rows.size(0), K = cols.size(0);
  constexpr acc_t kMinusInf = -std::numeric_limits<acc_t>::infinity();
  const int64_t kc = chunked::chunk_columns(M, K, sizeof(acc_t), workspace_bytes);
  std::vector<OnlineLse<acc_t>> row_state(M, OnlineLse<acc_t>::empty());
  chunked::for_each_chunk(rows, cols, kc, [&](const chunked::Chunk& chunk) {
    const acc_t* dots = chunk.dots.data_ptr<acc_t>();
    const int64_t w = chunk.width, begin = chunk.begin;
    at::parallel_for(0, M, kRowGrain, [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const acc_t* d = dots + i * w;
        for (int64_t j = 0; j < w; ++j)
          row_state[i].add(excluded<kIds>(row_ids, col_ids, pos_offset, i, begin + j) ? kMinusInf : scale * d[j]);
        const int64_t pos = pos_offset + i - begin;
        if (pos >= 0 && pos < w) pos_logit[i] = scale * d[pos];
      }
    });
    if (!want_col) return;
    at::parallel_for(0, w, kColumnBlock, [&](int64_t j0, int64_t j1) {
      std::vector<OnlineLse<acc_t>> col_state(j1 - j0, OnlineLse<acc_t>::empty());
      for (int64_t i = 0; i < M; ++i) {
        const acc_t* d = dots + i * w;
        for (int64_t j = j0; j < j1; ++j)
          col_state[j - j0].add(excluded<kIds>(row_ids, col_ids, pos_offset, i, begin + j) ? kMinusInf : scale * d[j]);
      }
      for (int64_t j = j0; j < j1; ++j) col_lse[begin + j] = col_state[j - j0].value();
    });
  });
  for (int64_t i = 0; i < M; ++i) row_lse[i] = row_state[i].value();
}

template <bool kIds>
std::tuple<at::Tensor, at::Tensor, double, double> backward_impl(
    const at::Tensor& g_row, const at::Tensor& g_pos, const at::Tensor& g_col, const at::Tensor& rows,
    const at::Tensor& cols, double scale, int64_t pos_offset, const int64_t* row_ids, const int64_t* col_ids,
    const at::Tensor& row_lse, const at::Tensor& col_lse, int64_t workspace_bytes) {
  const int64_t M = rows.size(0), K = cols.size(0);
  // Per row: sum over the columns of dS * dot (for d scale) and of dS (for d bias), accumulated
  // chunk after chunk in column order, then summed over rows in order: deterministic.
  std::vector<double> scale_part(M, 0.0), bias_part(M, 0.0);
  at::Tensor grad_rows, grad_cols;
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "contrastive_lse_backward_chunked_cpu", [&] {
    using acc_t = scalar_t;
    const acc_t s = static_cast<acc_t>(scale);
    const acc_t *gr = g_row.data_ptr<acc_t>(), *gp = g_pos.data_ptr<acc_t>(), *r = row_lse.data_ptr<acc_t>();
    const acc_t* gc = g_col.defined() ? g_col.data_ptr<acc_t>() : nullptr;
    const acc_t* c = gc ? col_lse.data_ptr<acc_t>() : nullptr;
    const int64_t kc = chunked::chunk_columns(M, K, 2 * sizeof(acc_t), workspace_bytes);
    std::tie(grad_rows, grad_cols) = chunked::chunked_gradients(
        rows, cols, kc, rows.scalar_type(), at::Tensor(), [&](const chunked::Chunk& chunk, at::Tensor& dlogits) {
          const acc_t* dots = chunk.dots.data_ptr<acc_t>();
          acc_t* out = dlogits.data_ptr<acc_t>();
          const int64_t w = chunk.width, begin = chunk.begin;
          at::parallel_for(0, M, kRowGrain, [&](int64_t i0, int64_t i1) {
            for (int64_t i = i0; i < i1; ++i) {
              double sum_dot = 0.0, sum = 0.0;
              for (int64_t j = 0; j < w; ++j) {
                const acc_t dot = dots[i * w + j];
                const acc_t ds = excluded<kIds>(row_ids, col_ids, pos_offset, i, begin + j)
                                     ? acc_t(0)
                                     : softmax_dlogit(s * dot, gr[i], r[i], gc ? gc[begin + j] : acc_t(0),
                                                      c ? c[begin + j] : acc_t(0), gp[i], begin + j == pos_offset + i);
                out[i * w + j] = s * ds;
                sum_dot += double(ds) * double(dot);
                sum += ds;
              }
              scale_part[i] += sum_dot;
              bias_part[i] += sum;
            }
          });
        });
  });
  double grad_scale = 0.0, grad_bias = 0.0;
  for (int64_t i = 0; i < M; ++i) {
    grad_scale += scale_part[i];
    grad_bias += bias_part[i];
  }
  return {grad_rows, grad_cols, grad_scale, grad_bias};
}

}  // namespace

std::tuple<at::Tensor, at::Tensor, at::Tensor> contrastive_lse_forward_chunked_cpu(
    const at::Tensor& rows, const at::Tensor& cols, double scale, int64_t pos_offset, const int64_t* row_ids,
    const int64_t* col_ids, bool want_col_lse, int64_t workspace_bytes) {
  const int64_t M = rows.size(0), K = cols.size(0);
  at::Tensor row_lse = at::empty({M}, rows.options()), pos_logit = at::empty({M}, rows.options());
  at::Tensor col_lse = at::empty({want_col_lse ? K : 0}, rows.options());
  AT_DISPATCH_FLOATING_TYPES(rows.scalar_type(), "contrastive_lse_forward_chunked_cpu", [&] {
    const auto run = row_ids ? &forward_impl<scalar_t, true> : &forward_impl<scalar_t, false>;
    run(rows, cols, static_cast<scalar_t>(scale), pos_offset, row_ids, col_ids, want_col_lse, workspace_bytes,
        row_lse.data_ptr<scalar_t>(), pos_logit.data_ptr<scalar_t>(),
        want_col_lse ? col_lse.data_ptr<scalar_t>() : nullptr);
  });
  return {row_lse, pos_logit, col_lse};
}

std::tuple<at::Tensor, at::Tensor, double, double> contrastive_lse_backward_chunked_cpu(
    const at::Tensor& g_row, const at::Tensor& g_pos, const at::Tensor& g_col, const at::Tensor& rows,
    const at::Tensor& cols, double scale, int64_t pos_offset, const int64_t* row_ids, const int64_t* col_ids,
    const at::Tensor& row_lse, const at::Tensor& col_lse, int64_t workspace_bytes) {
  const auto run = row_ids ? &backward_impl<true> : &backward_impl<false>;
  return run(g_row, g_pos, g_col, rows, cols, scale, pos_offset, row_ids, col_ids, row_lse, col_lse, workspace_bytes);
}

}  // namespace clipshard
