// CPU kernel of clipshard::siglip_forward (docs/siglip.md).
//
// The chunk driver (csrc/chunked/chunk_driver.h) produces the raw similarities of one column chunk
// at a time with BLAS; this file folds each chunk into the loss with a parallel loop over its rows,
// calling the per-logit maths of clipshard/siglip_math.h. With with_grad the same loop writes the
// chunk's logit gradients s * dl, which the driver turns into the row and column gradients with two
// more GEMMs: three GEMMs for loss and gradients, one without.
//
// Labels by sample id: each row's same-id columns of a chunk come from a table sorted once per
// call (SameIds); the row's plain negatives between them run the same vectorised loop as without
// ids, and the few special columns (the positive, the same-id pairs: +1 or no term) one at a time.
//
// Determinism: every row's partial sums (loss, sum dl * dot, sum dl) are added into that row's own
// double accumulator in chunk order, and the rows are summed in order at the end, so the result
// does not depend on how the rows are split between threads. Within a row and chunk the fp32
// partial sums are vectorised (a fixed order for a given instruction set).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "../chunked/chunk_driver.h"
#include "../siglip_args.h"
#include "clipshard/siglip_math.h"
#include "philox_simd.h"  // simd_isa(): the instruction set chosen at run time

namespace clipshard {
namespace {

// Rows per parallel task: with chunks of ~1000 columns, tens of thousands of logits per task.
constexpr int64_t kRowGrain = 16;

// Labels by sample id: the columns sorted by (col_id, column) once per call, so that row i's
// same-id columns are one range order[first[i] .. last[i]) (found once per row, by binary search),
// ascending, and those of a chunk a sub-range of it. No ids: order is null.
struct SameIds {
  const int64_t* order = nullptr;
  const int64_t* first = nullptr;
  const int64_t* last = nullptr;
  bool mask = false;  // mask_same_ids: a same-id pair other than the positive has no term
};

// What the row loop reads and writes for one chunk. dlogits is null in the loss-only pass.
template <typename T>
struct ChunkRows {
  const T* dots;  // M x width raw similarities
  T* dlogits;     // M x width: s * d loss / d logit, or null
  int64_t width, begin, pos_offset;  // kernel_pos_offset: kNoPositives for a block without positives
  T scale, bias;
  double* loss;        // per-row accumulators (M each)
  double* grad_scale;  // sum of dl * dot
  double* grad_bias;   // sum of dl
  SameIds ids;
};

// Negative columns [from, to) of one row: partial sums added to the row's accumulators.
template <typename T, bool kGrad>
inline void negatives(const ChunkRows<T>& c, const T* dots, T* dlogits, int64_t from, int64_t to, double& loss,
                      double& grad_scale, double& grad_bias) {
  const T s = c.scale, b = c.bias;
  T sum_loss = 0, sum_scale = 0, sum_bias = 0;
  if constexpr (kGrad) {
#pragma omp simd reduction(+ : sum_loss, sum_scale, sum_bias)
    for (int64_t j = from; j < to; ++j) {
      T value, dl;
      siglip_term(s * dots[j] + b, T(-1), value, dl);
      dlogits[j] = s * dl;
      sum_loss += value;
      sum_scale += dl * dots[j];
      sum_bias += dl;
    }
  } else {
#pragma omp simd reduction(+ : sum_loss)
    for (int64_t j = from; j < to; ++j) sum_loss += siglip_softplus(s * dots[j] + b, T(-1));
  }
  loss += sum_loss;
  grad_scale += sum_scale;
  grad_bias += sum_bias;
}

// The z = +1 term of column p of one row.
template <typename T, bool kGrad>
inline void plus_one(const ChunkRows<T>& c, const T* dots, T* dlogits, int64_t p, double& loss, double& grad_scale,
                     double& grad_bias) {
  T value, dl;
  siglip_term(c.scale * dots[p] + c.bias, T(1), value, dl);
  if constexpr (kGrad) dlogits[p] = c.scale * dl;
  loss += value;
  grad_scale += dl * dots[p];
  grad_bias += dl;
}

// Calls f(column) for row i's columns in this chunk that are not plain negatives: the positive p
// (if in the chunk) and the same-id columns, ascending, each once.
template <typename T, typename F>
inline void for_each_special(const ChunkRows<T>& c, int64_t i, int64_t p, F&& f) {
  const int64_t* same = std::lower_bound(c.ids.order + c.ids.first[i], c.ids.order + c.ids.last[i], c.begin);
  const int64_t* end = std::lower_bound(same, c.ids.order + c.ids.last[i], c.begin + c.width);
  bool positive_left = p >= 0 && p < c.width;
  for (; same != end; ++same) {
    const int64_t j = *same - c.begin;
    if (positive_left && p <= j) {
      positive_left = false;
      if (p < j) f(p);
    }
    f(j);
  }
  if (positive_left) f(p);
}

// One row of a chunk with labels by id: the negatives between the special columns first, in
// column order, then the special terms (with ids that match only at the positive: the same
// operations in the same order as the path without ids, so the same bits).
template <typename T, bool kGrad>
inline void row_with_ids(const ChunkRows<T>& c, int64_t i, int64_t p, const T* dots, T* dlogits, double& loss,
                         double& grad_scale, double& grad_bias) {
  int64_t from = 0;
  for_each_special(c, i, p, [&](int64_t j) {
    negatives<T, kGrad>(c, dots, dlogits, from, j, loss, grad_scale, grad_bias);
    from = j + 1;
  });
  negatives<T, kGrad>(c, dots, dlogits, from, c.width, loss, grad_scale, grad_bias);
  for_each_special(c, i, p, [&](int64_t j) {
    if (j == p || !c.ids.mask) {
      plus_one<T, kGrad>(c, dots, dlogits, j, loss, grad_scale, grad_bias);
    } else if constexpr (kGrad) {
      dlogits[j] = T(0);  // a dropped pair: no term
    }
  });
}

// Rows [i_begin, i_end) of one chunk.
template <typename T, bool kGrad>
inline void chunk_rows(const ChunkRows<T>& c, int64_t i_begin, int64_t i_end) {
  for (int64_t i = i_begin; i < i_end; ++i) {
    const T* dots = c.dots + i * c.width;
    T* dlogits = kGrad ? c.dlogits + i * c.width : nullptr;
    double loss = 0, grad_scale = 0, grad_bias = 0;
    const int64_t p = c.pos_offset + i - c.begin;  // the positive's column within the chunk
    if (c.ids.order != nullptr) {
      row_with_ids<T, kGrad>(c, i, p, dots, dlogits, loss, grad_scale, grad_bias);
    } else if (p < 0 || p >= c.width) {
      negatives<T, kGrad>(c, dots, dlogits, 0, c.width, loss, grad_scale, grad_bias);
    } else {
      negatives<T, kGrad>(c, dots, dlogits, 0, p, loss, grad_scale, grad_bias);
      negatives<T, kGrad>(c, dots, dlogits, p + 1, c.width, loss, grad_scale, grad_bias);
      plus_one<T, kGrad>(c, dots, dlogits, p, loss, grad_scale, grad_bias);
    }
    c.loss[i] += loss;
    if constexpr (kGrad) {
      c.grad_scale[i] += grad_scale;
      c.grad_bias[i] += grad_bias;
    }
  }
}

// One body per instruction set (the maths inlined into each by `flatten`); fp64 runs the baseline.
#define CLIPSHARD_SIGLIP_ROWS(NAME, ATTRIBUTES)                                        \
  template <typename T, bool kGrad>                                                      \
  ATTRIBUTES void NAME(const ChunkRows<T>& c, int64_t i_begin, int64_t i_end) {          \
    chunk_rows<T, kGrad>(c, i_begin, i_end);                                             \
  }
CLIPSHARD_SIGLIP_ROWS(chunk_rows_baseline, __attribute__((flatten)))
#if defined(CLIPSHARD_PHILOX_SIMD)
CLIPSHARD_SIGLIP_ROWS(chunk_rows_avx2, __attribute__((target("avx2,fma"), flatten)))
CLIPSHARD_SIGLIP_ROWS(chunk_rows_avx512, __attribute__((target("avx512f"), flatten)))
#endif
#undef CLIPSHARD_SIGLIP_ROWS

template <typename T, bool kGrad>
void chunk_rows_dispatch(const ChunkRows<T>& c, int64_t i_begin, int64_t i_end) {
#if defined(CLIPSHARD_PHILOX_SIMD)
  if constexpr (std::is_same_v<T, float>) {
    switch (simd_isa()) {
      case SimdIsa::kAvx512: return chunk_rows_avx512<T, kGrad>(c, i_begin, i_end);
      case SimdIsa::kAvx2: return chunk_rows_avx2<T, kGrad>(c, i_begin, i_end);
      case SimdIsa::kBaseline: break;
    }
  }
#endif
  chunk_rows_baseline<T, kGrad>(c, i_begin, i_end);
}

template <typename T, bool kGrad>
void fold_chunk(ChunkRows<T> c, const chunked::Chunk& chunk, T* dlogits) {
  c.dots = chunk.dots.data_ptr<T>();
  c.dlogits = dlogits;
  c.width = chunk.width;
  c.begin = chunk.begin;
  const int64_t M = chunk.dots.size(0);
  at::parallel_for(0, M, kRowGrain, [&](int64_t i_begin, int64_t i_end) {
    chunk_rows_dispatch<T, kGrad>(c, i_begin, i_end);
  });
}

// The SameIds tables of (row_ids, col_ids): order (K), first and last (M each).
struct IdTables {
  std::vector<int64_t> order, first, last;

  IdTables(const at::Tensor& row_ids_in, const at::Tensor& col_ids_in) {
    const at::Tensor row_ids = row_ids_in.contiguous(), col_ids = col_ids_in.contiguous();
    const int64_t* rid = row_ids.data_ptr<int64_t>();
    const int64_t* cid = col_ids.data_ptr<int64_t>();
    const int64_t M = row_ids.size(0), K = col_ids.size(0);
    order.resize(K);
    std::iota(order.begin(), order.end(), int64_t(0));
    std::stable_sort(order.begin(), order.end(), [cid](int64_t a, int64_t b) { return cid[a] < cid[b]; });
    std::vector<int64_t> sorted(K);
    for (int64_t k = 0; k < K; ++k) sorted[k] = cid[order[k]];
    first.resize(M);
    last.resize(M);
    for (int64_t i = 0; i < M; ++i) {
      const auto range = std::equal_range(sorted.begin(), sorted.end(), rid[i]);
      first[i] = range.first - sorted.begin();
      last[i] = range.second - sorted.begin();
    }
  }

  SameIds view(bool mask) const { return {order.data(), first.data(), last.data(), mask}; }
};

double sum_in_order(const std::vector<double>& v) {
  double total = 0;
  for (double x : v) total += x;
  return total;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> siglip_forward_cpu(
    const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale, const std::optional<at::Tensor>& bias,
    std::optional<int64_t> pos_offset, const std::optional<at::Tensor>& row_ids,
    const std::optional<at::Tensor>& col_ids, bool mask_same_ids, bool with_grad, int64_t workspace_bytes) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;  // internal tensor maths is not differentiated
  check_siglip_inputs(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids, workspace_bytes);
  const std::optional<IdTables> id_tables =
      row_ids.has_value() ? std::optional<IdTables>(std::in_place, *row_ids, *col_ids) : std::nullopt;
  const SameIds ids = id_tables.has_value() ? id_tables->view(mask_same_ids) : SameIds{};
  // The CPU has no 16-bit-in / fp32-out GEMM: the driver gets fp32 (fp64) copies.
  const auto acc = chunked::accumulate_type(rows.scalar_type());
  const at::Tensor A = rows.to(acc).contiguous(), B = cols.to(acc).contiguous();
  const int64_t M = A.size(0), K = B.size(0);
  std::vector<double> loss(M, 0.0), grad_scale(with_grad ? M : 0, 0.0), grad_bias(with_grad ? M : 0, 0.0);
  at::Tensor grad_rows = at::empty({0}, rows.options()), grad_cols = at::empty({0}, cols.options());
  AT_DISPATCH_FLOATING_TYPES(acc, "siglip_forward_cpu", [&] {
    ChunkRows<scalar_t> c{nullptr, nullptr, 0, 0, kernel_pos_offset(pos_offset), scale.item<scalar_t>(),
                          bias.has_value() ? bias->item<scalar_t>() : scalar_t(0), loss.data(),
                          grad_scale.data(), grad_bias.data(), ids};
    const int64_t logit_bytes = int64_t(sizeof(scalar_t)) * (with_grad ? 2 : 1);  // dots (+ dlogits)
    const int64_t kc = chunked::chunk_columns(M, K, logit_bytes, workspace_bytes);
    if (!with_grad) {
      chunked::for_each_chunk(A, B, kc, [&](const chunked::Chunk& chunk) {
        fold_chunk<scalar_t, false>(c, chunk, nullptr);
      });
      return;
    }
    auto grads = chunked::chunked_gradients(A, B, kc, acc, at::Tensor(), [&](const chunked::Chunk& chunk,
                                                                             at::Tensor& dlogits) {
      fold_chunk<scalar_t, true>(c, chunk, dlogits.data_ptr<scalar_t>());
    });
    grad_rows = grads.first.to(siglip_saved_grad_dtype(rows.scalar_type()));
    grad_cols = grads.second.to(siglip_saved_grad_dtype(cols.scalar_type()));
  });
  const at::Tensor loss_sum = at::scalar_tensor(sum_in_order(loss), A.options());
  if (!with_grad) {
    return {loss_sum, grad_rows, grad_cols, at::empty({0}, scale.options()), at::empty({0}, scale.options())};
  }
  const at::Tensor g_scale = at::scalar_tensor(sum_in_order(grad_scale), scale.options());
  const at::Tensor g_bias = bias.has_value() ? at::scalar_tensor(sum_in_order(grad_bias), bias->options())
                                             : at::empty({0}, scale.options());
  return {loss_sum, grad_rows, grad_cols, g_scale, g_bias};
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CPU, m) { m.impl("siglip_forward", &clipshard::siglip_forward_cpu); }
