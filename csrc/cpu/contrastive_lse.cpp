// CPU kernels of clipshard::contrastive_lse_forward / contrastive_lse_backward (docs/fused_loss.md).
//
// S = scale * rows @ cols^T (+ bias) is produced one row-block x column-block tile at a time by BLAS
// (at::addmm into a per-thread scratch tile) and immediately folded into running log-sum-exps; the
// backward recomputes the tiles. Nothing of size M x K is ever allocated. Work is split over row
// blocks: each thread ("chunk") owns a contiguous range of row blocks and keeps its own partial
// column state (column LSE in the forward, column gradient in the backward), merged in chunk order
// afterwards, so results are deterministic for a given number of threads.
//
// The bias is a constant added to every logit: it shifts every LSE and positive logit by the same
// amount and cancels in every softmax, so the tiles never see it.
//
// Sample ids (row_ids, col_ids): a tile's excluded pairs (same id, not the positive) become -inf
// after the tile's range is taken, so a narrow tile still takes the one-exponential path (exp(-inf
// - hi) = 0) and only rows / columns with at least one kept logit in the tile are merged; in the
// backward dS is computed as without ids and then overwritten with 0 at the excluded pairs (any
// Inf / NaN that an entirely excluded row or column produced there is discarded with it).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

#include "clipshard/online_lse.h"
#include "contrastive_lse_chunked.h"
#include "cpu_tiles.h"
#include "../block_args.h"
#include "../contrastive_ids.h"
#include "../chunked/algorithm.h"

namespace clipshard {
namespace {

using namespace cpu_tiles;

// Tile shape: a 128 x 512 fp32 tile is 256 KiB, so the tile and its exponentials stay in L2.
constexpr int64_t kRowBlock = 128;
constexpr int64_t kColBlock = 512;
// Upper bound on each thread's column-gradient accumulator in the backward (columns are processed in
// super-blocks of at most this many bytes of K x D accumulator per thread).
constexpr int64_t kColGradBytesPerThread = int64_t(8) << 20;

void check_vector(const char* op, const char* name, const at::Tensor& t, int64_t n, const at::Tensor& rows) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, op, ": ", name, " must have shape [", n, "], got ", t.sizes());
  TORCH_CHECK(t.device() == rows.device(), op, ": ", name, " must be on the same device as rows (",
              rows.device(), "), got ", t.device());
}

// Sample ids of one tile: row i0 + i has id rid[i], column j0 + j id cid[j], and row i's positive is
// the tile's column own0 + i (outside [0, bk) when not in this tile). Null rid: no ids.
struct TileIds {
  const int64_t* rid;
  const int64_t* cid;
  int64_t own0;
};

TileIds tile_ids(const int64_t* row_ids, const int64_t* col_ids, int64_t pos_offset, int64_t i0, int64_t j0) {
  if (row_ids == nullptr) return {nullptr, nullptr, 0};
  return {row_ids + i0, col_ids + j0, pos_offset + i0 - j0};
}

// Writes `value` at the tile's excluded pairs: same id, not the row's positive.
template <typename acc_t>
void set_excluded(acc_t* t, int64_t bm, int64_t bk, const TileIds& ids, acc_t value) {
  for (int64_t i = 0; i < bm; ++i) {
    const int64_t a = ids.rid[i], own = ids.own0 + i;
    acc_t* ti = t + i * bk;
    for (int64_t j = 0; j < bk; ++j)
      if (ids.cid[j] == a && j != own) ti[j] = value;
  }
}

// ---------------------------------------------------------------------------------------- forward

template <typename acc_t>
void forward_impl(const at::Tensor& A, const at::Tensor& B, acc_t scale, int64_t pos_offset, const int64_t* row_ids,
                  const int64_t* col_ids, bool want_col, acc_t* row_lse, acc_t* pos_logit, acc_t* col_lse) {
  const int64_t M = A.size(0), K = B.size(0);
  const int64_t n_blocks = ceil_div(M, kRowBlock);
  const int64_t n_chunks = std::min<int64_t>(at::get_num_threads(), n_blocks);
  const auto opts = A.options();
  using Lse = OnlineLse<acc_t>;
  // Partial column LSE of each chunk, one state per column.
  std::vector<Lse> col_state(want_col ? n_chunks * K : 0, Lse::empty());

  const at::ThreadLocalState caller_state;  // worker threads do not inherit it (profiler, dispatch)
  at::parallel_for(0, n_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    at::Tensor tile_buf = at::empty({kRowBlock * kColBlock}, opts);
    at::Tensor exp_buf = at::empty({kRowBlock * kColBlock}, opts);
    at::Tensor row_vec = at::empty({kRowBlock}, opts), col_vec = at::empty({kColBlock}, opts);
    std::vector<Lse> r_state(kRowBlock);
    std::vector<acc_t> shift(std::max(kRowBlock, kColBlock)), peak(std::max(kRowBlock, kColBlock));
    for (int64_t c = c_begin; c < c_end; ++c) {
      Lse* c_state = want_col ? col_state.data() + c * K : nullptr;
      const auto [blk_begin, blk_end] = chunk_blocks(c, n_chunks, n_blocks);
      for (int64_t blk = blk_begin; blk < blk_end; ++blk) {
        const int64_t i0 = blk * kRowBlock, bm = std::min(kRowBlock, M - i0);
        const at::Tensor a = A.narrow(0, i0, bm);
        std::fill(r_state.begin(), r_state.end(), Lse::empty());
        for (int64_t j0 = 0; j0 < K; j0 += kColBlock) {
          const int64_t bk = std::min(kColBlock, K - j0);
          at::Tensor tile = scratch_view(tile_buf, bm, bk);
          similarity_tile(tile, a, B.narrow(0, j0, bk), scale);
          acc_t* t = tile.data_ptr<acc_t>();
          for (int64_t i = 0; i < bm; ++i) {  // positives inside this tile
            const int64_t j = pos_offset + i0 + i - j0;
            if (j >= 0 && j < bk) pos_logit[i0 + i] = t[i * bk + j];
          }
          at::Tensor rows_out = row_vec.narrow(0, 0, bm), cols_out = col_vec.narrow(0, 0, bk);
          acc_t hi;
          const bool narrow = narrow_range(tile, hi);  // over every logit of the tile, excluded or not
          const TileIds ids = tile_ids(row_ids, col_ids, pos_offset, i0, j0);
          if (ids.rid) set_excluded(t, bm, bk, ids, -std::numeric_limits<acc_t>::infinity());
          if (narrow) {
            // One exponential per logit, shared by row and column sums. A kept logit's exp(S - hi)
            // is a normal float, so a zero sum means a row / column excluded in this whole tile:
            // it is not merged (a state {hi, 0} would move the reference to an unrelated hi).
            tile.sub_(hi).exp_();
            at::sum_out(rows_out, tile, 1);
            const acc_t* rs = rows_out.data_ptr<acc_t>();
            for (int64_t i = 0; i < bm; ++i)
              if (!ids.rid || rs[i] > 0) r_state[i].merge({hi, rs[i]});
            if (want_col) {
              at::sum_out(cols_out, tile, 0);
              const acc_t* cs = cols_out.data_ptr<acc_t>();
              for (int64_t j = 0; j < bk; ++j)
                if (!ids.rid || cs[j] > 0) c_state[j0 + j].merge({hi, cs[j]});
            }
            continue;
          }
          // (An entirely excluded row / column has maximum -inf: reference 0, sum 0, an empty state.)
          // Wide range: shift each column by its own maximum, then each row by its own maximum.
          if (want_col) {
            at::amax_out(cols_out, tile, 0);
            const acc_t* cm = cols_out.data_ptr<acc_t>();
            for (int64_t j = 0; j < bk; ++j) shift[j] = finite_or_zero(cm[j]), peak[j] = state_max(cm[j]);
            at::Tensor e = scratch_view(exp_buf, bm, bk);
            at::sub_out(e, tile, at::from_blob(shift.data(), {1, bk}, opts)).exp_();
            at::sum_out(cols_out, e, 0);
            const acc_t* cs = cols_out.data_ptr<acc_t>();
            for (int64_t j = 0; j < bk; ++j) c_state[j0 + j].merge({peak[j], cs[j]});
          }
          at::amax_out(rows_out, tile, 1);
          const acc_t* rm = rows_out.data_ptr<acc_t>();
          for (int64_t i = 0; i < bm; ++i) shift[i] = finite_or_zero(rm[i]), peak[i] = state_max(rm[i]);
          tile.sub_(at::from_blob(shift.data(), {bm, 1}, opts)).exp_();
          at::sum_out(rows_out, tile, 1);
          const acc_t* rs = rows_out.data_ptr<acc_t>();
          for (int64_t i = 0; i < bm; ++i) r_state[i].merge({peak[i], rs[i]});
        }
        for (int64_t i = 0; i < bm; ++i) row_lse[i0 + i] = r_state[i].value();
      }
    }
  });

  if (want_col) {  // merge the chunks' partial column LSEs in chunk order
    at::parallel_for(0, K, 1024, [&](int64_t j_begin, int64_t j_end) {
      for (int64_t j = j_begin; j < j_end; ++j) {
        Lse state = col_state[j];
        for (int64_t c = 1; c < n_chunks; ++c) state.merge(col_state[c * K + j]);
        col_lse[j] = state.value();
      }
    });
  }
}

const int64_t* ids_ptr(const at::Tensor& ids) { return ids.defined() ? ids.const_data_ptr<int64_t>() : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor> contrastive_lse_forward_cpu(
    const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
    int64_t pos_offset, const std::optional<at::Tensor>& row_ids, const std::optional<at::Tensor>& col_ids,
    bool want_col_lse, c10::string_view algorithm, int64_t workspace_bytes) {
  const char* op = "contrastive_lse_forward";
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal tensor maths is not differentiated
  check_block_inputs(op, rows, cols, scale, bias, std::nullopt);
  const int64_t pos = kernel_pos_offset(op, pos_offset, rows.size(0), cols.size(0));
  const SampleIds ids = checked_ids(op, row_ids, col_ids, rows, cols);
  const bool chunked = parse_algorithm(op, algorithm) == Algorithm::kChunked;
  const auto acc = acc_type_of(rows.scalar_type());
  const at::Tensor A = rows.to(acc).contiguous(), B = cols.to(acc).contiguous();
  const int64_t M = A.size(0), K = B.size(0);
  at::Tensor row_lse, pos_logit, col_lse;
  if (chunked) {
    std::tie(row_lse, pos_logit, col_lse) = contrastive_lse_forward_chunked_cpu(
        A, B, scale.item<double>(), pos, ids_ptr(ids.rows), ids_ptr(ids.cols), want_col_lse, workspace_bytes);
  } else {
    row_lse = at::empty({M}, A.options()), pos_logit = at::empty({M}, A.options());
    col_lse = at::empty({want_col_lse ? K : 0}, A.options());
    AT_DISPATCH_FLOATING_TYPES(acc, "contrastive_lse_forward_cpu", [&] {
      forward_impl<scalar_t>(A, B, scale.item<scalar_t>(), pos, ids_ptr(ids.rows), ids_ptr(ids.cols), want_col_lse,
                             row_lse.data_ptr<scalar_t>(), pos_logit.data_ptr<scalar_t>(),
                             want_col_lse ? col_lse.data_ptr<scalar_t>() : nullptr);
    });
  }
  if (pos_offset == -1) pos_logit.fill_(std::numeric_limits<double>::quiet_NaN());  // no positives
  if (bias.has_value()) {  // a constant logit shift moves every LSE and positive by the same amount
    const at::Tensor b = bias->to(acc);
    row_lse.add_(b);
    pos_logit.add_(b);
    if (want_col_lse) col_lse.add_(b);
  }
  return {row_lse, pos_logit, col_lse};
}

// --------------------------------------------------------------------------------------- backward

// Inputs of the backward, all contiguous in the accumulation type; g_col/c_lse are null when the
// column LSE has no gradient.
template <typename acc_t>
struct BackwardArgs {
  const acc_t* g_row;
  const acc_t* g_pos;
  const acc_t* g_col;
  const acc_t* r_lse;
  const acc_t* c_lse;
};

// Overwrites the similarity tile (rows i0.., columns j0..) with
// dS = g_row[i] exp(S - r_lse[i]) + g_col[j] exp(S - c_lse[j]) + g_pos[i] [j == pos(i)],
// softmax_dlogit of clipshard/online_lse.h, here rewritten over whole tiles (vectorised ATen
// exponentials; one exponential per logit where the tile's range allows) for speed.
template <typename acc_t>
void tile_grad(at::Tensor& tile, at::Tensor& exp_buf, std::vector<acc_t>& a, std::vector<acc_t>& b,
               const BackwardArgs<acc_t>& p, int64_t i0, int64_t j0, int64_t pos_offset, const TileIds& ids) {
  const int64_t bm = tile.size(0), bk = tile.size(1);
  const auto opts = tile.options();
  acc_t* t = tile.data_ptr<acc_t>();
  acc_t hi;
  if (narrow_range(tile, hi)) {
    // exp(S - r) = exp(S - hi) * exp(hi - r), and hi - r <= hi - lo < 80 because r, c are at least
    // the row/column maxima, so both factors are finite: one exponential per logit.
    for (int64_t i = 0; i < bm; ++i) a[i] = p.g_row[i0 + i] * std::exp(hi - p.r_lse[i0 + i]);
    for (int64_t j = 0; j < bk; ++j) b[j] = p.g_col ? p.g_col[j0 + j] * std::exp(hi - p.c_lse[j0 + j]) : acc_t(0);
    tile.sub_(hi).exp_();
    for (int64_t i = 0; i < bm; ++i) {
      acc_t* ti = t + i * bk;
      const acc_t ai = a[i];
      const acc_t* bj = b.data();
#pragma omp simd
      for (int64_t j = 0; j < bk; ++j) ti[j] *= ai + bj[j];
    }
  } else {
    at::Tensor e = scratch_view(exp_buf, bm, bk);
    at::sub_out(e, tile, at::from_blob(const_cast<acc_t*>(p.r_lse + i0), {bm, 1}, opts)).exp_();
    const acc_t* ep = e.data_ptr<acc_t>();
    if (p.g_col) {
      tile.sub_(at::from_blob(const_cast<acc_t*>(p.c_lse + j0), {1, bk}, opts)).exp_();
      for (int64_t i = 0; i < bm; ++i) {
        acc_t* ti = t + i * bk;
        const acc_t* ei = ep + i * bk;
        const acc_t gi = p.g_row[i0 + i];
        const acc_t* gc = p.g_col + j0;
#pragma omp simd
        for (int64_t j = 0; j < bk; ++j) ti[j] = gi * ei[j] + gc[j] * ti[j];
      }
    } else {
      for (int64_t i = 0; i < bm; ++i) {
        acc_t* ti = t + i * bk;
        const acc_t* ei = ep + i * bk;
        const acc_t gi = p.g_row[i0 + i];
#pragma omp simd
        for (int64_t j = 0; j < bk; ++j) ti[j] = gi * ei[j];
      }
    }
  }
  if (ids.rid) set_excluded(t, bm, bk, ids, acc_t(0));
  for (int64_t i = 0; i < bm; ++i) {
    const int64_t j = pos_offset + i0 + i - j0;
    if (j >= 0 && j < bk) t[i * bk + j] += p.g_pos[i0 + i];
  }
}

// Accumulates G = dS @ B (M x D, unscaled) and Gc = dS^T @ A (K x D, unscaled); returns sum(dS) when
// want_bias (else 0).
template <typename acc_t>
double backward_impl(const at::Tensor& A, const at::Tensor& B, acc_t scale, int64_t pos_offset, const int64_t* row_ids,
                     const int64_t* col_ids, const BackwardArgs<acc_t>& p, bool want_bias, at::Tensor& G,
                     at::Tensor& Gc) {
  const int64_t M = A.size(0), K = B.size(0), D = A.size(1);
  const int64_t n_blocks = ceil_div(M, kRowBlock);
  const int64_t n_chunks = std::min<int64_t>(at::get_num_threads(), n_blocks);
  const auto opts = A.options();
  // Columns are processed in super-blocks so that each chunk's column-gradient accumulator stays
  // within kColGradBytesPerThread (it is O(K x D) per thread otherwise).
  const int64_t super_cols = std::min(
      K, std::max<int64_t>(kColBlock, kColGradBytesPerThread / (D * int64_t(sizeof(acc_t))) / kColBlock * kColBlock));
  // Chunk 0 accumulates straight into Gc; the others into their own partial buffers.
  at::Tensor partial = at::empty({n_chunks - 1, super_cols, D}, opts);
  const at::ThreadLocalState caller_state;  // worker threads do not inherit it (profiler, dispatch)
  std::vector<double> bias_sum(n_chunks, 0.0);

  for (int64_t J0 = 0; J0 < K; J0 += super_cols) {
    const int64_t width = std::min(super_cols, K - J0);
    at::parallel_for(0, n_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
      at::ThreadLocalStateGuard state_guard(caller_state);
      at::Tensor tile_buf = at::empty({kRowBlock * kColBlock}, opts);
      at::Tensor exp_buf = at::empty({kRowBlock * kColBlock}, opts);
      std::vector<acc_t> a(kRowBlock), b(kColBlock);
      for (int64_t c = c_begin; c < c_end; ++c) {
        at::Tensor gc = c == 0 ? Gc.narrow(0, J0, width) : partial[c - 1].narrow(0, 0, width);
        gc.zero_();
        const auto [blk_begin, blk_end] = chunk_blocks(c, n_chunks, n_blocks);
        for (int64_t blk = blk_begin; blk < blk_end; ++blk) {
          const int64_t i0 = blk * kRowBlock, bm = std::min(kRowBlock, M - i0);
          const at::Tensor a_blk = A.narrow(0, i0, bm);
          at::Tensor g_blk = G.narrow(0, i0, bm);
          for (int64_t j0 = J0; j0 < J0 + width; j0 += kColBlock) {
            const int64_t bk = std::min(kColBlock, J0 + width - j0);
            const at::Tensor b_blk = B.narrow(0, j0, bk);
            at::Tensor tile = scratch_view(tile_buf, bm, bk);
            similarity_tile(tile, a_blk, b_blk, scale);
            tile_grad(tile, exp_buf, a, b, p, i0, j0, pos_offset, tile_ids(row_ids, col_ids, pos_offset, i0, j0));
            if (want_bias) bias_sum[c] += tile.sum().template item<double>();
            g_blk.addmm_(tile, b_blk);
            gc.narrow(0, j0 - J0, bk).addmm_(tile.t(), a_blk);
          }
        }
      }
    });
    at::Tensor out = Gc.narrow(0, J0, width);  // chunk order: deterministic for a given thread count
    for (int64_t c = 1; c < n_chunks; ++c) out.add_(partial[c - 1].narrow(0, 0, width));
  }
  double total = 0.0;
  for (double s : bias_sum) total += s;
  return total;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> contrastive_lse_backward_cpu(
    const at::Tensor& grad_row_lse, const at::Tensor& grad_pos_logit, const std::optional<at::Tensor>& grad_col_lse,
    const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
    int64_t pos_offset, const std::optional<at::Tensor>& row_ids, const std::optional<at::Tensor>& col_ids,
    const at::Tensor& row_lse, const std::optional<at::Tensor>& col_lse, c10::string_view algorithm,
    int64_t workspace_bytes) {
  const char* op = "contrastive_lse_backward";
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_block_inputs(op, rows, cols, scale, bias, std::nullopt);
  const int64_t pos = kernel_pos_offset(op, pos_offset, rows.size(0), cols.size(0));
  const SampleIds ids = checked_ids(op, row_ids, col_ids, rows, cols);
  const bool chunked = parse_algorithm(op, algorithm) == Algorithm::kChunked;
  const int64_t M = rows.size(0), K = cols.size(0);
  check_vector(op, "grad_row_lse", grad_row_lse, M, rows);
  check_vector(op, "grad_pos_logit", grad_pos_logit, M, rows);
  check_vector(op, "row_lse", row_lse, M, rows);
  const bool with_col = grad_col_lse.has_value();
  if (with_col) {
    TORCH_CHECK(col_lse.has_value(), op, ": grad_col_lse was given but col_lse is None");
    check_vector(op, "grad_col_lse", *grad_col_lse, K, rows);
    check_vector(op, "col_lse", *col_lse, K, rows);
  }
  const auto acc = acc_type_of(rows.scalar_type());
  const at::Tensor A = rows.to(acc).contiguous(), B = cols.to(acc).contiguous();
  const at::Tensor g_row = grad_row_lse.to(acc).contiguous(), g_pos = grad_pos_logit.to(acc).contiguous();
  const at::Tensor r_lse = row_lse.to(acc).contiguous();
  at::Tensor g_col, c_lse;
  if (with_col) {
    g_col = grad_col_lse->to(acc).contiguous();
    c_lse = col_lse->to(acc).contiguous();
  }
  // The bias moved every LSE by b; the tiles are computed without it, so take it back out.
  const at::Tensor b_acc = bias.has_value() ? bias->to(acc) : at::Tensor();
  const at::Tensor r_unbiased = bias.has_value() ? r_lse - b_acc : r_lse;
  const at::Tensor c_unbiased = with_col && bias.has_value() ? c_lse - b_acc : c_lse;

  if (chunked) {
    auto [grad_rows, grad_cols, grad_scale, grad_bias] = contrastive_lse_backward_chunked_cpu(
        g_row, g_pos, g_col, A, B, scale.item<double>(), pos, ids_ptr(ids.rows), ids_ptr(ids.cols), r_unbiased,
        c_unbiased, workspace_bytes);
    return {grad_rows.to(rows.scalar_type()), grad_cols.to(cols.scalar_type()),
            at::scalar_tensor(grad_scale, scale.options()),
            at::scalar_tensor(bias.has_value() ? grad_bias : 0.0, bias.has_value() ? bias->options() : scale.options())};
  }
  // For fp32 inputs the gradients are accumulated straight into the outputs.
  at::Tensor G = at::zeros({M, A.size(1)}, A.options()), Gc = at::empty({K, A.size(1)}, A.options());
  at::Tensor grad_scale, grad_bias;
  AT_DISPATCH_FLOATING_TYPES(acc, "contrastive_lse_backward_cpu", [&] {
    BackwardArgs<scalar_t> p{g_row.data_ptr<scalar_t>(), g_pos.data_ptr<scalar_t>(),
                             with_col ? g_col.data_ptr<scalar_t>() : nullptr, r_unbiased.data_ptr<scalar_t>(),
                             with_col ? c_unbiased.data_ptr<scalar_t>() : nullptr};
    const scalar_t s = scale.item<scalar_t>();
    const double bias_grad = backward_impl<scalar_t>(A, B, s, pos, ids_ptr(ids.rows), ids_ptr(ids.cols), p,
                                                     bias.has_value(), G, Gc);
    // d scale = sum(dS * rows @ cols^T) = sum(rows * (dS @ cols)), from the unscaled G.
    grad_scale = at::dot(A.view(-1), G.view(-1)).to(scale.scalar_type());
    grad_bias = bias.has_value() ? at::scalar_tensor(bias_grad, bias->options())
                                 : at::zeros({}, scale.options());
    G.mul_(s);
    Gc.mul_(s);
  });
  return {G.to(rows.scalar_type()), Gc.to(cols.scalar_type()), grad_scale, grad_bias};
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CPU, m) {
  m.impl("contrastive_lse_forward", &clipshard::contrastive_lse_forward_cpu);
  m.impl("contrastive_lse_backward", &clipshard::contrastive_lse_backward_cpu);
}
