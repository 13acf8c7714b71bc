// The chunk driver shared by the chunked losses on CPU and CUDA (docs/fused_loss_cuda.md).
//
// The K columns are processed in chunks of kc. For each chunk one GEMM writes the chunk's raw
// similarities rows @ cols_chunk^T into a reused fp32 workspace (fp64 for fp64 inputs; on CUDA
// 16-bit inputs go through ATen's out_dtype GEMM, so the similarities are never rounded to 16
// bits); a loss-specific callback then reads the chunk. The gradient pass adds two GEMMs per
// chunk: grad_rows += dlogits @ cols_chunk (an fp32 accumulator, beta = 1) and
// grad_cols[chunk] = dlogits^T @ rows. Memory beyond inputs and outputs is O(M x kc), never
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

// For every chunk, fill_grad(chunk, dlogits) writes dlogits (M x width, dtype grad_dtype): the
// gradient of the loss with respect to chunk.dots (the logit scale applied), times a power-of-two
// prescale when the caller uses one. The driver accumulates grad_rows = sum_chunks dlogits @
// cols_chunk and grad_cols[chunk] = dlogits^T @ rows, multiplies both by `unscale` (a 0-dim fp32
// tensor, 1 / prescale; undefined for none) and returns them in out_dtype (default: rows' dtype).
template <class FillGrad>
std::pair<at::Tensor, at::Tensor> chunked_gradients(const at::Tensor& rows, const at::Tensor& cols, int64_t kc,
                                                    at::ScalarType grad_dtype, const at::Tensor& unscale,
                                                    FillGrad&& fill_grad,
                                                    std::optional<at::ScalarType> out_dtype = std::nullopt) {
  const int64_t M = rows.size(0), K = cols.size(0), D = rows.size(1);
  const auto acc = accumulate_type(rows.scalar_type());
  const auto out = out_dtype.value_or(rows.scalar_type());
  const int64_t width_max = std::min(kc, K);
  const at::Tensor grad_workspace = at::empty({M * width_max}, rows.options().dtype(grad_dtype));
  at::Tensor grad_rows = at::zeros({M, D}, rows.options().dtype(acc));
  at::Tensor grad_cols = at::empty({K, D}, rows.options().dtype(out));
  // grad_cols chunks go straight into the output when no conversion or unscaling is needed; else
  // through an fp32 chunk buffer (16-bit outputs are then rounded once, from fp32).
  const bool direct = !unscale.defined() && grad_dtype == acc && out == acc;
  const at::Tensor cols_buffer = direct ? at::Tensor() : at::empty({width_max * D}, rows.options().dtype(acc));
  // 16-bit dlogits where torch's addmm.dtype_out refuses an fp32 accumulator with 16-bit factors:
  // the rows' gradient of a chunk goes through an fp32 M x D buffer and is then added (the extra
  // M x D traffic is a few % of the chunk's GEMMs).
  const bool buffered_rows = grad_dtype != acc && !addmm_accepts_fp32_accumulator(rows.device(), grad_dtype);
  const at::Tensor rows_buffer = buffered_rows ? at::empty({M, D}, rows.options().dtype(acc)) : at::Tensor();
  for_each_chunk(rows, cols, kc, [&](const Chunk& chunk) {
    at::Tensor dlogits = workspace_view(grad_workspace, M, chunk.width);
    fill_grad(chunk, dlogits);
    const at::Tensor cols_chunk = cols.narrow(0, chunk.begin, chunk.width);
    if (grad_dtype == acc) {
      grad_rows.addmm_(dlogits, cols_chunk);  // beta = 1: accumulate in place
    } else if (!buffered_rows) {
      at::addmm_out(grad_rows, grad_rows, dlogits, cols_chunk, acc);  // fp32 accumulator, beta = 1
    } else {
      at::Tensor chunk_rows = rows_buffer;
      mm_into(chunk_rows, dlogits, cols_chunk);
      grad_rows.add_(chunk_rows);
    }
    at::Tensor cols_out = grad_cols.narrow(0, chunk.begin, chunk.width);
    if (direct) {
      at::mm_out(cols_out, dlogits.t(), rows);
      return;
    }
    at::Tensor buffer = workspace_view(cols_buffer, chunk.width, D);
    mm_into(buffer, dlogits.t(), rows);
    if (unscale.defined()) buffer.mul_(unscale);
    cols_out.copy_(buffer);
  });
  if (unscale.defined()) grad_rows.mul_(unscale);
  return {grad_rows.to(out), grad_cols};
}

}  // namespace clipshard::chunked
