// The chunk driver shared by the chunked losses on CPU and CUDA (docs/fused_loss_cuda.md).
//
// The K columns are processed in chunks of kc. For each chunk one GEMM writes the chunk's raw
// similarities rows @ cols_chunk^T into a reused fp32 workspace (fp64 for fp64 inputs; on CUDA
// 16-bit inputs go through ATen's out_dtype GEMM, so the similarities are never rounded to 16
// bits); a loss-specific callback then reads the chunk. The gradient pass adds two GEMMs per
// chunk: grad_rows += dlogits @ cols_chunk (an fp32 accumulator, beta = 1) and
// grad_cols[chunk] = dlogits^T @ rows. Memory beyond inputs and outputs is O(M x kc + M x D), never
// O(M x K); everything runs on the current stream with no host synchronisation.
//
// Device-agnostic on purpose: the GEMMs are ATen calls, so the same driver runs on the CPU (where
// callers pass fp32/fp64 inputs) and on CUDA, and every CI run tests its chunk bookkeeping.
#pragma once

#include <ATen/ATen.h>

#include "../env_vars.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <utility>

namespace clipshard::chunked {

// Whether ATen's addmm.dtype_out takes an fp32 accumulator with `factors`-typed (16-bit) factors,
// out = the accumulator, on this device type: newer torch relaxed that dtype check (pytorch#167931),
// older torch refuses it, and the CPU has no such kernel at all. Decided by asking torch, not by its
// version number: the first call per (device type, dtype) tries it on 1 x 1 tensors of the device
// (no host synchronisation) and caches the answer. CLIPSHARD_ADDMM_FP32_ACCUMULATOR=0 (false, off,
// no) forces "refused"; 1 (true, on, yes) or unset asks torch (read at every call: a knob for tests
// and benchmarks of the fallback; other values raise, see env_vars.h).
inline bool addmm_accepts_fp32_accumulator(const at::Device& device, at::ScalarType factors) {
  if (env::flag("CLIPSHARD_ADDMM_FP32_ACCUMULATOR") == false) return false;
  static std::mutex mutex;
  static std::map<std::pair<c10::DeviceType, at::ScalarType>, bool> answers;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_pair(device.type(), factors);
  if (const auto known = answers.find(key); known != answers.end()) return known->second;
  bool accepted = true;
  try {
    at::Tensor acc = at::zeros({1, 1}, at::TensorOptions().device(device).dtype(at::kFloat));
    const at::Tensor factor = at::ones({1, 1}, at::TensorOptions().device(device).dtype(factors));
    at::addmm_out(acc, acc, factor, factor, at::kFloat);
  } catch (const c10::Error&) {
    accepted = false;
  }
  answers.emplace(key, accepted);
  return accepted;
}

// Chunk widths are multiples of this (or K itself when K is smaller).
constexpr int64_t kColumnQuantum = 128;

// Columns per chunk: the largest multiple of kColumnQuantum with M * kc * bytes_per_logit <=
// budget_bytes, but at least kColumnQuantum (a huge M may then exceed the budget) and at most K.
inline int64_t chunk_columns(int64_t M, int64_t K, int64_t bytes_per_logit, int64_t budget_bytes) {
  TORCH_CHECK(budget_bytes > 0, "workspace_bytes must be positive, got ", budget_bytes);
  TORCH_CHECK(M > 0 && K > 0 && bytes_per_logit > 0, "chunk_columns: need M, K, bytes_per_logit >= 1");
  const int64_t fit = budget_bytes / bytes_per_logit / M;
  return std::min(K, std::max(fit / kColumnQuantum * kColumnQuantum, kColumnQuantum));
}

// Rows of GradientAccumulator's buffer of the columns' gradient (rows x D in the accumulator's
// dtype), for M rows and chunks of at most width_max columns: M rounded down to a multiple of
// kColumnQuantum, at least kColumnQuantum and at most width_max. The chunk width answers to the
// M x kc logit budget alone, so a small M with a large K (exchange mode over many ranks) would make
// a whole-chunk kc x D buffer dwarf everything else; bounded by M, the buffer is never larger than
// the rows' accumulator grad_rows_ (M x D, same dtype) that the call holds anyway, except below
// M = kColumnQuantum, where one quantum (kColumnQuantum x D) keeps each column GEMM a useful size.
inline int64_t column_buffer_rows(int64_t M, int64_t width_max) {
  TORCH_CHECK(M > 0 && width_max > 0, "column_buffer_rows: need M, width_max >= 1, got ", M, ", ", width_max);
  return std::min(width_max, std::max(M / kColumnQuantum * kColumnQuantum, kColumnQuantum));
}

// Columns [begin, begin + width) of the similarity matrix.
struct Chunk {
  int64_t begin;
  int64_t width;
  at::Tensor dots;  // M x width, contiguous: rows @ cols[begin : begin + width]^T, no scale, no bias
};

// fp64 inputs keep fp64; everything else is accumulated in fp32.
inline at::ScalarType accumulate_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

// A contiguous n x m view of the start of a flat workspace.
inline at::Tensor workspace_view(const at::Tensor& flat, int64_t n, int64_t m) {
  return flat.narrow(0, 0, n * m).view({n, m});
}

// out = a @ b in out's dtype (fp32 out of 16-bit inputs on CUDA: ATen's mm.dtype_out).
inline void mm_into(at::Tensor& out, const at::Tensor& a, const at::Tensor& b) {
  if (a.scalar_type() == out.scalar_type()) {
    at::mm_out(out, a, b);
  } else {
    at::mm_out(out, a, b, out.scalar_type());
  }
}

// Calls visit(chunk) for every chunk, in column order.
template <class Visit>
void for_each_chunk(const at::Tensor& rows, const at::Tensor& cols, int64_t kc, Visit&& visit) {
  const int64_t M = rows.size(0), K = cols.size(0);
  const at::Tensor workspace = at::empty({M * std::min(kc, K)}, rows.options().dtype(accumulate_type(rows.scalar_type())));
  for (int64_t begin = 0; begin < K; begin += kc) {
    const int64_t width = std::min(kc, K - begin);
    Chunk chunk{begin, width, workspace_view(workspace, M, width)};
    mm_into(chunk.dots, rows, cols.narrow(0, begin, width).t());
    visit(static_cast<const Chunk&>(chunk));
  }
}

// The gradient GEMMs of the chunks, one chunk at a time: add(begin, dlogits) takes the gradient
// of the loss with respect to the chunk's logits (M x width, dtype grad_dtype, times a power-of-two
// prescale when the caller uses one) and accumulates grad_rows += dlogits @ cols_chunk and
// grad_cols[chunk] = dlogits^T @ rows; finish() multiplies both by `unscale` (a 0-dim fp32 tensor,
// 1 / prescale; undefined for none) and returns them in out_dtype (default: rows' dtype).
class GradientAccumulator {
 public:
  GradientAccumulator(const at::Tensor& rows, const at::Tensor& cols, int64_t kc, at::ScalarType grad_dtype,
                      const at::Tensor& unscale, std::optional<at::ScalarType> out_dtype = std::nullopt)
      : rows_(rows), cols_(cols), grad_dtype_(grad_dtype), unscale_(unscale) {
    const int64_t M = rows.size(0), K = cols.size(0), D = rows.size(1);
    acc_ = accumulate_type(rows.scalar_type());
    out_ = out_dtype.value_or(rows.scalar_type());
    const int64_t width_max = std::min(kc, K);
    grad_rows_ = at::zeros({M, D}, rows.options().dtype(acc_));
    grad_cols_ = at::empty({K, D}, rows.options().dtype(out_));
    // grad_cols chunks go straight into the output when no conversion or unscaling is needed; else
    // through an fp32 buffer of column_buffer_rows columns, a chunk's columns a block at a time
    // (16-bit outputs are then rounded once, from fp32).
    direct_ = !unscale.defined() && grad_dtype == acc_ && out_ == acc_;
    if (!direct_) {
      buffer_rows_ = column_buffer_rows(M, width_max);
      cols_buffer_ = at::empty({buffer_rows_ * D}, rows.options().dtype(acc_));
    }
    // 16-bit dlogits where torch's addmm.dtype_out refuses an fp32 accumulator with 16-bit factors:
    // the rows' gradient of a chunk goes through an fp32 M x D buffer and is then added (the extra
    // M x D traffic is a few % of the chunk's GEMMs).
    buffered_rows_ = grad_dtype != acc_ && !addmm_accepts_fp32_accumulator(rows.device(), grad_dtype);
    if (buffered_rows_) rows_buffer_ = at::empty({M, D}, rows.options().dtype(acc_));
  }

  void add(int64_t begin, const at::Tensor& dlogits) {
    const int64_t width = dlogits.size(1);
    const at::Tensor cols_chunk = cols_.narrow(0, begin, width);
    if (grad_dtype_ == acc_) {
      grad_rows_.addmm_(dlogits, cols_chunk);  // beta = 1: accumulate in place
    } else if (!buffered_rows_) {
      at::addmm_out(grad_rows_, grad_rows_, dlogits, cols_chunk, acc_);  // fp32 accumulator, beta = 1
    } else {
      at::Tensor chunk_rows = rows_buffer_;
      mm_into(chunk_rows, dlogits, cols_chunk);
      grad_rows_.add_(chunk_rows);
    }
    at::Tensor cols_out = grad_cols_.narrow(0, begin, width);
    if (direct_) {
      at::mm_out(cols_out, dlogits.t(), rows_);
      return;
    }
    // Each column's gradient is still one GEMM dot over the M rows; only the GEMM's column range
    // is cut into blocks of at most buffer_rows_.
    for (int64_t first = 0; first < width; first += buffer_rows_) {
      const int64_t n = std::min(buffer_rows_, width - first);
      at::Tensor buffer = workspace_view(cols_buffer_, n, rows_.size(1));
      mm_into(buffer, dlogits.narrow(1, first, n).t(), rows_);
      if (unscale_.defined()) buffer.mul_(unscale_);
      cols_out.narrow(0, first, n).copy_(buffer);
    }
  }

  std::pair<at::Tensor, at::Tensor> finish() {
    if (unscale_.defined()) grad_rows_.mul_(unscale_);
    return {grad_rows_.to(out_), grad_cols_};
  }

 private:
  at::Tensor rows_, cols_;
  at::ScalarType grad_dtype_, acc_, out_;
  at::Tensor unscale_, grad_rows_, grad_cols_, cols_buffer_, rows_buffer_;
  int64_t buffer_rows_ = 0;  // columns per block of the buffered column gradient (0 when direct_)
  bool direct_, buffered_rows_;
};

// For every chunk, fill_grad(chunk, dlogits) writes dlogits (M x width, dtype grad_dtype) as
// GradientAccumulator::add takes them; returns its finish().
template <class FillGrad>
std::pair<at::Tensor, at::Tensor> chunked_gradients(const at::Tensor& rows, const at::Tensor& cols, int64_t kc,
                                                    at::ScalarType grad_dtype, const at::Tensor& unscale,
                                                    FillGrad&& fill_grad,
                                                    std::optional<at::ScalarType> out_dtype = std::nullopt) {
  const at::Tensor grad_workspace = at::empty({rows.size(0) * std::min(kc, cols.size(0))}, rows.options().dtype(grad_dtype));
  GradientAccumulator gradients(rows, cols, kc, grad_dtype, unscale, out_dtype);
  for_each_chunk(rows, cols, kc, [&](const Chunk& chunk) {
    at::Tensor dlogits = workspace_view(grad_workspace, rows.size(0), chunk.width);
    fill_grad(chunk, dlogits);
    gradients.add(chunk.begin, dlogits);
  });
  return gradients.finish();
}

}  // namespace clipshard::chunked
