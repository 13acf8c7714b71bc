// CPU kernels of clipshard::distill_lse / distill_lse_backward (the contract in csrc/clipshard.cpp,
// the maths in docs/distillation_cuda.md).
//
// The structure of contrastive_lse.cpp: the student's logits S and each teacher's logits T^k are
// produced one row-block x column-block tile at a time by BLAS (at::addmm into per-thread scratch)
// and folded at once into running statistics; the backward recomputes the tiles. Threads
// ("chunks") own contiguous ranges of row blocks and keep their own partial column statistics
// (forward) or column-gradient accumulators (backward), merged in chunk order afterwards:
// deterministic for a given number of threads. Nothing of size M x K is ever allocated.
//
// Each tile's statistics come from vectorised ATen exponentials over the whole tile: with a
// narrow range of logits one exp(x - tile max) serves the rows and the columns (see
// cpu_tiles::narrow_range), else each row and each column is shifted by its own maximum.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <vector>

#include "clipshard/online_distill.h"
#include "cpu_tiles.h"
#include "../chunked/chunk_driver.h"
#include "../distill_args.h"

namespace clipshard {
namespace {

using namespace cpu_tiles;
using at::Tensor;

// Tile shape: a 128 x 512 fp32 tile is 256 KiB; the few per-thread tiles stay in L2.
constexpr int64_t kRowBlock = 128;
constexpr int64_t kColBlock = 512;

// The op's features in the accumulation dtype, contiguous, one matrix per teacher, and the scales.
struct Features {
  Tensor rows, cols;                              // M x D, K x D
  std::vector<Tensor> teacher_rows, teacher_cols;  // T of M x Dt, K x Dt
  double scale;
  std::vector<double> teacher_scale;
  int64_t M, K, T;
};

Features features_in(at::ScalarType acc, const Tensor& rows, const Tensor& cols, const Tensor& teacher_rows,
                     const Tensor& teacher_cols, const Tensor& scale, const Tensor& teacher_scale) {
  Features f;
  f.rows = rows.to(acc).contiguous();
  f.cols = cols.to(acc).contiguous();
  const Tensor tr = teacher_rows.to(acc).contiguous(), tc = teacher_cols.to(acc).contiguous();
  f.M = rows.size(0), f.K = cols.size(0), f.T = teacher_rows.size(0);
  f.scale = scale.item<double>();
  const Tensor ts = teacher_scale.to(at::kDouble).contiguous();
  for (int64_t k = 0; k < f.T; ++k) {
    f.teacher_rows.push_back(tr[k]);
    f.teacher_cols.push_back(tc[k]);
    f.teacher_scale.push_back(ts.data_ptr<double>()[k]);
  }
  return f;
}

// Per-thread scratch: tiles of logits and exponentials, per-row/column vectors.
template <typename acc_t>
struct Scratch {
  Tensor student, teacher, exps, weighted, dlogits, teacher_dlogits, sums, weighted_sums;
  std::vector<acc_t> shift, peak, g_lse, g_cross, cross;

  explicit Scratch(const at::TensorOptions& opts)
      : shift(kColBlock), peak(kColBlock), g_lse(kColBlock), g_cross(kColBlock), cross(kColBlock) {
    for (Tensor* t : {&student, &teacher, &exps, &weighted, &dlogits, &teacher_dlogits})
      *t = at::empty({kRowBlock * kColBlock}, opts);
    sums = at::empty({kColBlock}, opts);
    weighted_sums = at::empty({kColBlock}, opts);
  }
};

// ---------------------------------------------------------------------------------------- forward

// Merges into states[0, n) the sums of e along `dim` (and of ew = e * values when defined), taken
// relative to peak[i] (one peak for all when peak_all is not null).
template <typename acc_t>
void merge_sums(const Tensor& e, const Tensor& ew, int64_t dim, const acc_t* peak, const acc_t* peak_all,
                OnlineSoftmaxMean<acc_t>* states, Scratch<acc_t>& w) {
  const int64_t n = e.size(1 - dim);
  Tensor sums = w.sums.narrow(0, 0, n), weighted = w.weighted_sums.narrow(0, 0, n);
  at::sum_out(sums, e, dim);
  if (ew.defined()) at::sum_out(weighted, ew, dim);
  const acc_t* s = sums.data_ptr<acc_t>();
  const acc_t* ws = ew.defined() ? weighted.data_ptr<acc_t>() : nullptr;
  for (int64_t i = 0; i < n; ++i) states[i].merge({peak_all ? *peak_all : peak[i], s[i], ws ? ws[i] : acc_t(0)});
}

// Folds the tile of logits x (bm x bk) into the states of its rows (rows[i]) and, when cols is
// not null, of its columns (cols[j]): the log-sum-exp of x and, when values is defined (the
// student's tile under a teacher's), the x-softmax-weighted sum of values.
template <typename acc_t>
void fold_tile(const Tensor& x, const Tensor& values, OnlineSoftmaxMean<acc_t>* rows,
               OnlineSoftmaxMean<acc_t>* cols, Scratch<acc_t>& w) {
  const int64_t bm = x.size(0), bk = x.size(1);
  const auto opts = x.options();
  Tensor e = scratch_view(w.exps, bm, bk);
  Tensor ew = values.defined() ? scratch_view(w.weighted, bm, bk) : Tensor();
  acc_t hi;
  if (narrow_range(x, hi)) {  // one exponential per logit for the rows and the columns
    e.copy_(x).sub_(hi).exp_();
    if (ew.defined()) at::mul_out(ew, e, values);
    merge_sums(e, ew, 1, static_cast<const acc_t*>(nullptr), &hi, rows, w);
    if (cols) merge_sums(e, ew, 0, static_cast<const acc_t*>(nullptr), &hi, cols, w);
    return;
  }
  // Wide range: each column by its own maximum, then each row by its own maximum.
  for (const int64_t dim : {int64_t(0), int64_t(1)}) {
    if (dim == 0 && !cols) continue;
    const int64_t n = dim == 0 ? bk : bm;
    Tensor maxima = w.sums.narrow(0, 0, n);
    at::amax_out(maxima, x, dim);
    const acc_t* m = maxima.data_ptr<acc_t>();
    for (int64_t i = 0; i < n; ++i) w.shift[i] = finite_or_zero(m[i]), w.peak[i] = state_max(m[i]);
    const std::vector<int64_t> shape = dim == 0 ? std::vector<int64_t>{1, bk} : std::vector<int64_t>{bm, 1};
    at::sub_out(e, x, at::from_blob(w.shift.data(), shape, opts)).exp_();
    if (ew.defined()) at::mul_out(ew, e, values);
    merge_sums(e, ew, dim, w.peak.data(), static_cast<const acc_t*>(nullptr), dim == 0 ? cols : rows, w);
  }
}

// Outputs of the forward, as pointers into the fp32/fp64 output tensors (column ones null when
// not wanted).
template <typename acc_t>
struct ForwardOut {
  acc_t *row_lse, *pos_logit, *teacher_row_lse, *row_cross;
  acc_t *col_lse, *teacher_col_lse, *col_cross;
};

template <typename acc_t>
void forward_impl(const Features& f, int64_t pos_offset, bool want_cols, const ForwardOut<acc_t>& out) {
  using Stat = OnlineSoftmaxMean<acc_t>;
  const int64_t M = f.M, K = f.K, T = f.T, S = 1 + T;  // S: statistics per row/column (student, teachers)
  const int64_t n_blocks = ceil_div(M, kRowBlock);
  const int64_t n_chunks = std::min<int64_t>(at::get_num_threads(), n_blocks);
  const auto opts = f.rows.options();
  // Partial column statistics of each chunk: [chunk][student, teacher 0, ...][column].
  std::vector<Stat> col_state(want_cols ? n_chunks * S * K : 0, Stat::empty());

  const at::ThreadLocalState caller_state;  // worker threads do not inherit it (profiler, dispatch)
  at::parallel_for(0, n_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
    at::ThreadLocalStateGuard state_guard(caller_state);
    Scratch<acc_t> w(opts);
    std::vector<Stat> row_state(S * kRowBlock);  // [student, teacher 0, ...][row of the block]
    for (int64_t c = c_begin; c < c_end; ++c) {
      const auto [blk_begin, blk_end] = chunk_blocks(c, n_chunks, n_blocks);
      for (int64_t blk = blk_begin; blk < blk_end; ++blk) {
        const int64_t i0 = blk * kRowBlock, bm = std::min(kRowBlock, M - i0);
        std::fill(row_state.begin(), row_state.end(), Stat::empty());
        for (int64_t j0 = 0; j0 < K; j0 += kColBlock) {
          const int64_t bk = std::min(kColBlock, K - j0);
          auto col_states = [&](int64_t which) { return want_cols ? &col_state[(c * S + which) * K + j0] : nullptr; };
          Tensor s = scratch_view(w.student, bm, bk);
          similarity_tile(s, f.rows.narrow(0, i0, bm), f.cols.narrow(0, j0, bk), f.scale);
          const acc_t* sp = s.data_ptr<acc_t>();
          for (int64_t i = 0; i < bm; ++i) {  // positives inside this tile
            const int64_t j = pos_offset + i0 + i - j0;
            if (j >= 0 && j < bk) out.pos_logit[i0 + i] = sp[i * bk + j];
          }
          fold_tile(s, Tensor(), row_state.data(), col_states(0), w);
          for (int64_t k = 0; k < T; ++k) {
            Tensor t = scratch_view(w.teacher, bm, bk);
            similarity_tile(t, f.teacher_rows[k].narrow(0, i0, bm), f.teacher_cols[k].narrow(0, j0, bk),
                            f.teacher_scale[k]);
            fold_tile(t, s, row_state.data() + (1 + k) * kRowBlock, col_states(1 + k), w);
          }
        }
        for (int64_t i = 0; i < bm; ++i) {
          out.row_lse[i0 + i] = row_state[i].lse();
          for (int64_t k = 0; k < T; ++k) {
            const Stat& st = row_state[(1 + k) * kRowBlock + i];
            out.teacher_row_lse[k * M + i0 + i] = st.lse();
            out.row_cross[k * M + i0 + i] = st.mean();
          }
        }
      }
    }
  });

  if (!want_cols) return;
  at::parallel_for(0, K, 1024, [&](int64_t j_begin, int64_t j_end) {  // merge the chunks in chunk order
    for (int64_t j = j_begin; j < j_end; ++j) {
      for (int64_t which = 0; which < S; ++which) {
        Stat st = col_state[which * K + j];
        for (int64_t c = 1; c < n_chunks; ++c) st.merge(col_state[(c * S + which) * K + j]);
        if (which == 0) {
          out.col_lse[j] = st.lse();
        } else {
          out.teacher_col_lse[(which - 1) * K + j] = st.lse();
          out.col_cross[(which - 1) * K + j] = st.mean();
        }
      }
    }
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> distill_lse_cpu(
    const Tensor& rows, const Tensor& cols, const Tensor& teacher_rows, const Tensor& teacher_cols,
    const Tensor& scale, const Tensor& teacher_scale, int64_t pos_offset, bool want_columns,
    int64_t workspace_bytes) {
  const char* op = "distill_lse";
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal tensor maths is not differentiated
  check_distill_inputs(op, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset,
                       /*allow_double=*/true);
  TORCH_CHECK(workspace_bytes > 0, op, ": workspace_bytes must be positive, got ", workspace_bytes);
  const auto acc = acc_type_of(rows.scalar_type());
  const Features f = features_in(acc, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale);
  const auto opts = f.rows.options();
  const int64_t Kc = want_columns ? f.K : 0;
  Tensor row_lse = at::empty({f.M}, opts), pos_logit = at::empty({f.M}, opts);
  Tensor teacher_row_lse = at::empty({f.T, f.M}, opts), row_cross = at::empty({f.T, f.M}, opts);
  Tensor col_lse = at::empty({Kc}, opts), teacher_col_lse = at::empty({f.T, Kc}, opts);
  Tensor col_cross = at::empty({f.T, Kc}, opts);
  AT_DISPATCH_FLOATING_TYPES(acc, "distill_lse_cpu", [&] {
    auto ptr = [&](Tensor& t) { return want_columns ? t.data_ptr<scalar_t>() : nullptr; };
    const ForwardOut<scalar_t> out{row_lse.data_ptr<scalar_t>(), pos_logit.data_ptr<scalar_t>(),
                                   teacher_row_lse.data_ptr<scalar_t>(), row_cross.data_ptr<scalar_t>(),
                                   ptr(col_lse), ptr(teacher_col_lse), ptr(col_cross)};
    forward_impl<scalar_t>(f, pos_offset, want_columns, out);
  });
  return {row_lse, pos_logit, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross};
}

// --------------------------------------------------------------------------------------- backward

// The backward's inputs as pointers (null for an absent gradient or an unneeded statistic):
// row vectors [M] or [T][M], column vectors [K] or [T][K].
template <typename acc_t>
struct BackwardData {
  const acc_t *g_row_lse, *g_pos, *row_lse, *g_col_lse, *col_lse;
  const acc_t *g_teacher_row_lse, *g_row_cross, *teacher_row_lse, *row_cross;
  const acc_t *g_teacher_col_lse, *g_col_cross, *teacher_col_lse, *col_cross;
  bool teacher_grad;
};

template <typename acc_t>
const acc_t* ptr_or_null(const Tensor& t) {
  return t.defined() ? t.data_ptr<acc_t>() : nullptr;
}

// dst[i] = src[offset + i] for i < n, or 0 when src is null.
template <typename acc_t>
void fill_coefficients(std::vector<acc_t>& dst, const acc_t* src, int64_t offset, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = src ? src[offset + i] : acc_t(0);
}

// One softmax's terms of a tile (bm x bk): e holds the softmax (exp(x - lse) by row when by_row,
// by column otherwise) and the scratch vectors g_lse, g_cross, cross the coefficients of each row
// (column). Adds g_cross e to ds and, when dt is not null, e (g_lse + g_cross (s - cross)) to dt:
// teacher_dlogits of clipshard/online_distill.h over a whole tile (the student's own softmaxes
// pass their upstream gradient as g_cross and no dt).
template <typename acc_t, bool by_row>
void add_softmax_terms(acc_t* ds, acc_t* dt, const acc_t* e, const acc_t* s, int64_t bm, int64_t bk,
                       const Scratch<acc_t>& w) {
  const acc_t *gl = w.g_lse.data(), *gc = w.g_cross.data(), *cr = w.cross.data();
  for (int64_t i = 0; i < bm; ++i) {
    acc_t* dsi = ds + i * bk;
    const acc_t* ei = e + i * bk;
    if constexpr (by_row) {
      const acc_t a = gl[i], b = gc[i], m = cr[i];
#pragma omp simd
      for (int64_t j = 0; j < bk; ++j) dsi[j] += b * ei[j];
      if (dt == nullptr) continue;
      acc_t* dti = dt + i * bk;
      const acc_t* si = s + i * bk;
#pragma omp simd
      for (int64_t j = 0; j < bk; ++j) dti[j] += ei[j] * (a + b * (si[j] - m));
    } else {
#pragma omp simd
      for (int64_t j = 0; j < bk; ++j) dsi[j] += gc[j] * ei[j];
      if (dt == nullptr) continue;
      acc_t* dti = dt + i * bk;
      const acc_t* si = s + i * bk;
#pragma omp simd
      for (int64_t j = 0; j < bk; ++j) dti[j] += ei[j] * (gl[j] + gc[j] * (si[j] - cr[j]));
    }
  }
}

// e = exp(x - lse) with lse per row (by_row) or per column, from lse[offset...].
template <typename acc_t>
void softmax_tile(Tensor& e, const Tensor& x, const acc_t* lse, int64_t offset, bool by_row) {
  const int64_t bm = x.size(0), bk = x.size(1);
  const std::vector<int64_t> shape = by_row ? std::vector<int64_t>{bm, 1} : std::vector<int64_t>{1, bk};
  at::sub_out(e, x, at::from_blob(const_cast<acc_t*>(lse + offset), shape, x.options())).exp_();
}

// Gradient accumulators: unscaled (scale applied at the end), fp32/fp64.
struct Accumulators {
  Tensor rows, cols;                              // dS @ cols (M x D), dS^T @ rows (K x D)
  std::vector<Tensor> teacher_rows, teacher_cols;  // per teacher, when teacher_grad
};

// The gradients of one tile (rows i0.., columns j0..): dS into w.dlogits, each teacher's dT
// (teacher_grad) straight into its GEMMs; accumulates into acc (rows) and col_acc (this chunk's
// column accumulators, whose row 0 is column col_base).
template <typename acc_t>
void tile_gradients(const Features& f, const BackwardData<acc_t>& p, int64_t pos_offset, bool needs_teacher,
                    int64_t i0, int64_t bm, int64_t j0, int64_t bk, Accumulators& acc, Accumulators& col_acc,
                    int64_t col_base, Scratch<acc_t>& w) {
  const Tensor a = f.rows.narrow(0, i0, bm), b = f.cols.narrow(0, j0, bk);
  Tensor s = scratch_view(w.student, bm, bk), e = scratch_view(w.exps, bm, bk);
  Tensor ds = scratch_view(w.dlogits, bm, bk);
  similarity_tile(s, a, b, f.scale);
  ds.zero_();
  acc_t* dsp = ds.data_ptr<acc_t>();
  const acc_t *sp = s.data_ptr<acc_t>(), *ep = e.data_ptr<acc_t>();
  std::fill(w.g_lse.begin(), w.g_lse.end(), acc_t(0));
  std::fill(w.cross.begin(), w.cross.end(), acc_t(0));
  if (p.g_row_lse) {  // the student's row softmax
    softmax_tile(e, s, p.row_lse, i0, /*by_row=*/true);
    fill_coefficients(w.g_cross, p.g_row_lse, i0, bm);
    add_softmax_terms<acc_t, true>(dsp, nullptr, ep, sp, bm, bk, w);
  }
  if (p.g_col_lse) {  // its column softmax
    softmax_tile(e, s, p.col_lse, j0, /*by_row=*/false);
    fill_coefficients(w.g_cross, p.g_col_lse, j0, bk);
    add_softmax_terms<acc_t, false>(dsp, nullptr, ep, sp, bm, bk, w);
  }
  if (p.g_pos) {
    for (int64_t i = 0; i < bm; ++i) {
      const int64_t j = pos_offset + i0 + i - j0;
      if (j >= 0 && j < bk) dsp[i * bk + j] += p.g_pos[i0 + i];
    }
  }
  for (int64_t k = 0; k < f.T && needs_teacher; ++k) {
    const int64_t M = f.M, K = f.K;
    auto at_k = [](const acc_t* v, int64_t k, int64_t n) { return v ? v + k * n : nullptr; };
    const acc_t *g_trl = at_k(p.g_teacher_row_lse, k, M), *g_rc = at_k(p.g_row_cross, k, M);
    const acc_t *g_tcl = at_k(p.g_teacher_col_lse, k, K), *g_cc = at_k(p.g_col_cross, k, K);
    const bool tg = p.teacher_grad;
    const Tensor ta = f.teacher_rows[k].narrow(0, i0, bm), tb = f.teacher_cols[k].narrow(0, j0, bk);
    Tensor t = scratch_view(w.teacher, bm, bk), dt = scratch_view(w.teacher_dlogits, bm, bk);
    similarity_tile(t, ta, tb, f.teacher_scale[k]);
    acc_t* dtp = tg ? dt.zero_().data_ptr<acc_t>() : nullptr;
    if (g_rc || (tg && g_trl)) {  // the teacher's row softmax P
      softmax_tile(e, t, p.teacher_row_lse + k * M, i0, /*by_row=*/true);
      fill_coefficients(w.g_lse, g_trl, i0, bm);
      fill_coefficients(w.g_cross, g_rc, i0, bm);
      fill_coefficients(w.cross, tg && g_rc ? p.row_cross + k * M : nullptr, i0, bm);
      add_softmax_terms<acc_t, true>(dsp, dtp, ep, sp, bm, bk, w);
    }
    if (g_cc || (tg && g_tcl)) {  // its column softmax Q
      softmax_tile(e, t, p.teacher_col_lse + k * K, j0, /*by_row=*/false);
      fill_coefficients(w.g_lse, g_tcl, j0, bk);
      fill_coefficients(w.g_cross, g_cc, j0, bk);
      fill_coefficients(w.cross, tg && g_cc ? p.col_cross + k * K : nullptr, j0, bk);
      add_softmax_terms<acc_t, false>(dsp, dtp, ep, sp, bm, bk, w);
    }
    if (tg) {
      acc.teacher_rows[k].narrow(0, i0, bm).addmm_(dt, tb);
      col_acc.teacher_cols[k].narrow(0, j0 - col_base, bk).addmm_(dt.t(), ta);
    }
  }
  acc.rows.narrow(0, i0, bm).addmm_(ds, b);
  col_acc.cols.narrow(0, j0 - col_base, bk).addmm_(ds.t(), a);
}

template <typename acc_t>
void backward_impl(const Features& f, const BackwardData<acc_t>& p, int64_t pos_offset, bool needs_teacher,
                   int64_t workspace_bytes, Accumulators& acc) {
  const int64_t M = f.M, K = f.K, D = f.rows.size(1);
  const int64_t Dt = f.teacher_rows[0].size(1);
  const int64_t n_blocks = ceil_div(M, kRowBlock);
  const int64_t n_chunks = std::min<int64_t>(at::get_num_threads(), n_blocks);
  const auto opts = f.rows.options();
  // Columns go in chunks whose column-gradient accumulators, one set per thread but the first
  // (which writes into the outputs), fit workspace_bytes: the chunk driver's rule, with a "row"
  // of accumulators per column of width D (+ T x Dt).
  const int64_t width = D + (p.teacher_grad ? f.T * Dt : 0);
  const int64_t kc = chunked::chunk_columns(std::max<int64_t>(n_chunks - 1, 1) * width, K, sizeof(acc_t),
                                            workspace_bytes);
  std::vector<Accumulators> partial(n_chunks - 1);
  for (auto& part : partial) {
    part.cols = at::empty({kc, D}, opts);
    for (int64_t k = 0; k < f.T && p.teacher_grad; ++k) part.teacher_cols.push_back(at::empty({kc, Dt}, opts));
  }
  const at::ThreadLocalState caller_state;
  for (int64_t J0 = 0; J0 < K; J0 += kc) {
    const int64_t chunk_width = std::min(kc, K - J0);
    at::parallel_for(0, n_chunks, 1, [&](int64_t c_begin, int64_t c_end) {
      at::ThreadLocalStateGuard state_guard(caller_state);
      Scratch<acc_t> w(opts);
      for (int64_t c = c_begin; c < c_end; ++c) {
        // Chunk 0 accumulates straight into the outputs' columns [J0, J0 + chunk_width).
        Accumulators own;
        Accumulators& col_acc = c == 0 ? acc : own;
        const int64_t col_base = c == 0 ? 0 : J0;
        if (c > 0) {
          own.cols = partial[c - 1].cols.narrow(0, 0, chunk_width);
          for (const Tensor& t : partial[c - 1].teacher_cols) own.teacher_cols.push_back(t.narrow(0, 0, chunk_width));
        }
        col_acc.cols.narrow(0, J0 - col_base, chunk_width).zero_();
        for (const Tensor& t : col_acc.teacher_cols) t.narrow(0, J0 - col_base, chunk_width).zero_();
        const auto [blk_begin, blk_end] = chunk_blocks(c, n_chunks, n_blocks);
        for (int64_t blk = blk_begin; blk < blk_end; ++blk) {
          const int64_t i0 = blk * kRowBlock, bm = std::min(kRowBlock, M - i0);
          for (int64_t j0 = J0; j0 < J0 + chunk_width; j0 += kColBlock) {
            const int64_t bk = std::min(kColBlock, J0 + chunk_width - j0);
            tile_gradients(f, p, pos_offset, needs_teacher, i0, bm, j0, bk, acc, col_acc, col_base, w);
          }
        }
      }
    });
    for (int64_t c = 1; c < n_chunks; ++c) {  // chunk order: deterministic for a given thread count
      acc.cols.narrow(0, J0, chunk_width).add_(partial[c - 1].cols.narrow(0, 0, chunk_width));
      for (size_t k = 0; k < partial[c - 1].teacher_cols.size(); ++k)
        acc.teacher_cols[k].narrow(0, J0, chunk_width).add_(partial[c - 1].teacher_cols[k].narrow(0, 0, chunk_width));
    }
  }
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> distill_lse_backward_cpu(
    const std::optional<Tensor>& grad_row_lse, const std::optional<Tensor>& grad_pos_logit,
    const std::optional<Tensor>& grad_teacher_row_lse, const std::optional<Tensor>& grad_row_cross,
    const std::optional<Tensor>& grad_col_lse, const std::optional<Tensor>& grad_teacher_col_lse,
    const std::optional<Tensor>& grad_col_cross, const Tensor& rows, const Tensor& cols, const Tensor& teacher_rows,
    const Tensor& teacher_cols, const Tensor& scale, const Tensor& teacher_scale, int64_t pos_offset,
    const Tensor& row_lse, const Tensor& teacher_row_lse, const Tensor& row_cross, const Tensor& col_lse,
    const Tensor& teacher_col_lse, const Tensor& col_cross, bool teacher_grad, int64_t workspace_bytes) {
  const char* op = "distill_lse_backward";
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_distill_inputs(op, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset,
                       /*allow_double=*/true);
  TORCH_CHECK(workspace_bytes > 0, op, ": workspace_bytes must be positive, got ", workspace_bytes);
  const auto acc_type = acc_type_of(rows.scalar_type());
  const DistillBackwardInputs in = distill_backward_inputs(
      op, grad_row_lse, grad_pos_logit, grad_teacher_row_lse, grad_row_cross, grad_col_lse, grad_teacher_col_lse,
      grad_col_cross, rows, cols, teacher_rows, row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse,
      col_cross, teacher_grad, acc_type);
  const Features f = features_in(acc_type, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale);
  const auto opts = f.rows.options();
  const int64_t D = f.rows.size(1), Dt = teacher_rows.size(2);
  Accumulators acc;
  acc.rows = at::zeros({f.M, D}, opts);
  acc.cols = at::empty({f.K, D}, opts);
  for (int64_t k = 0; k < f.T && teacher_grad; ++k) {
    acc.teacher_rows.push_back(at::zeros({f.M, Dt}, opts));
    acc.teacher_cols.push_back(at::empty({f.K, Dt}, opts));
  }
  AT_DISPATCH_FLOATING_TYPES(acc_type, "distill_lse_backward_cpu", [&] {
    using acc_t = scalar_t;
    const BackwardData<acc_t> p{
        ptr_or_null<acc_t>(in.g_row_lse),         ptr_or_null<acc_t>(in.g_pos),
        ptr_or_null<acc_t>(in.row_lse),           ptr_or_null<acc_t>(in.g_col_lse),
        ptr_or_null<acc_t>(in.col_lse),           ptr_or_null<acc_t>(in.g_teacher_row_lse),
        ptr_or_null<acc_t>(in.g_row_cross),       ptr_or_null<acc_t>(in.teacher_row_lse),
        ptr_or_null<acc_t>(in.row_cross),         ptr_or_null<acc_t>(in.g_teacher_col_lse),
        ptr_or_null<acc_t>(in.g_col_cross),       ptr_or_null<acc_t>(in.teacher_col_lse),
        ptr_or_null<acc_t>(in.col_cross),         teacher_grad};
    backward_impl<acc_t>(f, p, pos_offset, in.needs_teacher(), workspace_bytes, acc);
  });
  // d scale = sum_ij dS_ij rows_i . cols_j = sum(rows * (dS @ cols)), from the unscaled accumulator;
  // likewise per teacher. Then the accumulators get their scales.
  const Tensor grad_scale = at::dot(f.rows.view(-1), acc.rows.view(-1)).to(scale.scalar_type()).reshape(scale.sizes());
  acc.rows.mul_(f.scale);
  acc.cols.mul_(f.scale);
  if (!teacher_grad) {
    const Tensor none = at::empty({0}, teacher_rows.options());
    return {acc.rows.to(rows.scalar_type()), acc.cols.to(cols.scalar_type()), none, none.clone(), grad_scale,
            at::empty({0}, teacher_scale.options())};
  }
  Tensor grad_teacher_scale = at::empty({f.T}, teacher_scale.options());
  for (int64_t k = 0; k < f.T; ++k) {
    grad_teacher_scale[k].copy_(at::dot(f.teacher_rows[k].reshape(-1), acc.teacher_rows[k].view(-1)));
    acc.teacher_rows[k].mul_(f.teacher_scale[k]);
    acc.teacher_cols[k].mul_(f.teacher_scale[k]);
  }
  const auto tdtype = teacher_rows.scalar_type();
  return {acc.rows.to(rows.scalar_type()), acc.cols.to(cols.scalar_type()), at::stack(acc.teacher_rows).to(tdtype),
          at::stack(acc.teacher_cols).to(tdtype), grad_scale, grad_teacher_scale};
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CPU, m) {
  m.impl("distill_lse", &clipshard::distill_lse_cpu);
  m.impl("distill_lse_backward", &clipshard::distill_lse_backward_cpu);
}
