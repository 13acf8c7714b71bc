// CUDA registration of contrastive_lse_forward / contrastive_lse_backward (docs/fused_loss_cuda.md):
// input checks and the choice of algorithm.
//
// algorithm="chunked" (the default that the Python layer picks on CUDA): cuBLAS GEMMs over column
// chunks plus fused elementwise kernels, contrastive_lse_chunked.cu; any strides.
// algorithm="fused": the hand-written tile kernels of contrastive_lse_kernels.cuh, never leaving a
// tile: the tensor-core (mma.sync) kernels for fp16/bf16 features with D % 8 == 0 on sm_80+ (see
// use_tensor_cores), the fp32-FMA kernels otherwise; inputs are made contiguous first.
// Every path is deterministic (no float atomics). Sample ids (row_ids / col_ids) are taken by the
// chunked path only; pos_offset -1 (no positives) by both, as K: no column is then a positive.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <limits>
#include <tuple>
#include <type_traits>

#include "../chunked/algorithm.h"
#include "../contrastive_ids.h"
#include "contrastive_lse_chunked.h"
#include "contrastive_lse_kernels.cuh"
#include "contrastive_lse_mma.cuh"
#include "dispatch_features.h"
#include "fp16_prescale.h"

namespace clipshard {
namespace {

using at::Tensor;
namespace k = lse_cuda;

void check_scalar(const char* fn, const char* name, const Tensor& t, const Tensor& rows) {
  TORCH_CHECK(t.dim() == 0, fn, ": ", name, " must be a 0-dim tensor, got shape ", t.sizes());
  TORCH_CHECK(t.device() == rows.device(), fn, ": ", name, " must be on the device of rows (",
              rows.device(), "), got ", t.device());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), fn, ": ", name,
              " must be a floating-point tensor, got ", t.scalar_type());
}

// Returns the kernels' pos_offset (K for -1: no positives).
int64_t check_features(const char* fn, const Tensor& rows, const Tensor& cols, const Tensor& scale,
                       const c10::optional<Tensor>& bias, int64_t pos_offset) {
  TORCH_CHECK(rows.is_cuda(), fn, ": rows must be on a CUDA device, got ", rows.device());
  TORCH_CHECK(cols.device() == rows.device(), fn,
              ": rows and cols must be on the same device, got ", rows.device(), " and ",
              cols.device());
  TORCH_CHECK(rows.dim() == 2 && cols.dim() == 2, fn,
              ": rows and cols must be 2-D (M x D and K x D), got shapes ", rows.sizes(), " and ",
              cols.sizes());
  TORCH_CHECK(rows.size(1) == cols.size(1), fn,
              ": rows and cols must have the same feature size D, got ", rows.size(1), " and ",
              cols.size(1));
  TORCH_CHECK(rows.numel() > 0 && cols.numel() > 0, fn,
              ": rows and cols must be non-empty, got shapes ", rows.sizes(), " and ", cols.sizes());
  TORCH_CHECK(rows.scalar_type() == cols.scalar_type(), fn,
              ": rows and cols must have the same dtype, got ", rows.scalar_type(), " and ",
              cols.scalar_type());
  const auto dtype = rows.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, fn,
              ": the CUDA kernels take float32, float16 or bfloat16 features, got ", dtype,
              dtype == at::kDouble ? " (float64 is supported by the CPU kernel only)" : "");
  check_scalar(fn, "scale", scale, rows);
  if (bias.has_value()) check_scalar(fn, "bias", *bias, rows);
  const int64_t M = rows.size(0), K = cols.size(0);
  const int64_t pos = kernel_pos_offset(fn, pos_offset, M, K);
  TORCH_CHECK((std::max(M, K) + k::kTile - 1) / k::kTile <= INT_MAX, fn, ": too many rows (",
              std::max(M, K), ") for the launch grid");
  return pos;
}

// The fused tile kernels have no sample-id masking.
void refuse_ids_in_fused(const char* fn, const SampleIds& ids) {
  TORCH_CHECK(!ids.given(), fn, ": row_ids/col_ids are not supported by the fused CUDA kernels; use "
              "algorithm=\"chunked\" (the CUDA default) or \"torch\"");
}

// A float32 contiguous copy of a per-row vector of length n (upstream gradients, saved LSEs).
Tensor float_vector(const char* fn, const char* name, const Tensor& t, int64_t n,
                    const Tensor& rows) {
  TORCH_CHECK(t.dim() == 1 && t.size(0) == n, fn, ": ", name, " must have shape [", n,
              "], got ", t.sizes());
  TORCH_CHECK(t.device() == rows.device(), fn, ": ", name, " must be on the device of rows (",
              rows.device(), "), got ", t.device());
  return t.to(at::kFloat).contiguous();
}

unsigned int num_blocks(int64_t n) { return static_cast<unsigned int>((n + k::kTile - 1) / k::kTile); }

template <typename T>
void launch_forward(const k::ForwardParams<T>& p, cudaStream_t stream) {
  k::lse_forward_kernel<T><<<num_blocks(p.n_own), k::kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The tensor-core kernels handle fp16/bf16 features with D % 8 == 0 and 16-byte aligned data on
// sm_80 or newer; anything else takes the FMA kernels.
bool use_tensor_cores(const Tensor& rows, const Tensor& cols) {
  if (rows.scalar_type() == at::kFloat || rows.size(1) % 8 != 0) return false;
  const bool aligned = reinterpret_cast<uintptr_t>(rows.const_data_ptr()) % 16 == 0 &&
                       reinterpret_cast<uintptr_t>(cols.const_data_ptr()) % 16 == 0;
  return aligned && at::cuda::getCurrentDeviceProperties()->major >= 8;
}

template <typename T>
void launch_forward_mma(const k::ForwardParams<T>& p, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned int>((p.n_own + k::kMmaRows - 1) / k::kMmaRows);
  k::lse_forward_mma_kernel<T><<<blocks, k::kMmaThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_backward(const k::BackwardParams<T>& p, bool mma, cudaStream_t stream) {
  if constexpr (!std::is_same_v<T, float>) {
    if (mma) {  // kMmaRows == kTile: the same grid and partial-sum layout
      k::lse_backward_mma_kernel<T><<<num_blocks(p.n_own), k::kMmaThreads, 0, stream>>>(p);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
      return;
    }
  }
  k::lse_backward_kernel<T><<<num_blocks(p.n_own), k::kThreads, 0, stream>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The fused tile kernels' forward (rows, cols contiguous; scale_f, bias_f fp32 on the device).
std::tuple<Tensor, Tensor, Tensor> fused_forward(const Tensor& rows, const Tensor& cols, const Tensor& scale_f,
                                                 const Tensor& bias_f, int64_t pos_offset, bool want_col_lse,
                                                 cudaStream_t stream) {
  const int64_t M = rows.size(0), K = cols.size(0), D = rows.size(1);
  const auto fopts = rows.options().dtype(at::kFloat);
  Tensor row_lse = at::empty({M}, fopts), pos_logit = at::empty({M}, fopts);
  Tensor col_lse = at::empty({want_col_lse ? K : 0}, fopts);

  const bool mma = use_tensor_cores(rows, cols);
  dispatch_features(rows.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* rows_p = rows.const_data_ptr<T>();
    const T* cols_p = cols.const_data_ptr<T>();
    const float* bias_p = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
    const float* scale_p = scale_f.const_data_ptr<float>();
    const k::ForwardParams<T> row_pass{rows_p, cols_p, M, K, D, scale_p, bias_p,
                                       row_lse.mutable_data_ptr<float>(),
                                       pos_logit.mutable_data_ptr<float>(), pos_offset};
    // Column LSE = row LSE of S^T: the same kernel with the roles swapped.
    const k::ForwardParams<T> col_pass{cols_p, rows_p, K, M, D, scale_p, bias_p,
                                       col_lse.mutable_data_ptr<float>(), nullptr, 0};
    if constexpr (!std::is_same_v<T, float>) {
      if (mma) {
        launch_forward_mma(row_pass, stream);
        if (want_col_lse) launch_forward_mma(col_pass, stream);
        return;
      }
    }
    launch_forward(row_pass, stream);
    if (want_col_lse) launch_forward(col_pass, stream);
  });
  return {row_lse, pos_logit, col_lse};
}

std::tuple<Tensor, Tensor, Tensor> contrastive_lse_forward_cuda(
    const Tensor& rows, const Tensor& cols, const Tensor& scale, const c10::optional<Tensor>& bias,
    int64_t pos_offset, const c10::optional<Tensor>& row_ids, const c10::optional<Tensor>& col_ids,
    bool want_col_lse, c10::string_view algorithm, int64_t workspace_bytes) {
  constexpr const char* fn = "contrastive_lse_forward";
  const int64_t pos = check_features(fn, rows, cols, scale, bias, pos_offset);
  const SampleIds ids = checked_ids(fn, row_ids, col_ids, rows, cols);
  const bool chunked = parse_algorithm(fn, algorithm) == Algorithm::kChunked;
  if (!chunked) refuse_ids_in_fused(fn, ids);
  c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const Tensor scale_f = scale.to(at::kFloat);
  const Tensor bias_f = bias.has_value() ? bias->to(at::kFloat) : Tensor();
  Tensor row_lse, pos_logit, col_lse;
  if (chunked) {  // the bias moves every output by the same amount
    std::tie(row_lse, pos_logit, col_lse) =
        contrastive_lse_forward_chunked_cuda(rows, cols, scale_f, pos, ids.rows, ids.cols, want_col_lse, workspace_bytes);
    if (bias_f.defined()) {
      row_lse.add_(bias_f);
      pos_logit.add_(bias_f);
      if (want_col_lse) col_lse.add_(bias_f);
    }
  } else {
    std::tie(row_lse, pos_logit, col_lse) =
        fused_forward(rows.contiguous(), cols.contiguous(), scale_f, bias_f, pos, want_col_lse, stream);
  }
  if (pos_offset == -1) pos_logit.fill_(std::numeric_limits<float>::quiet_NaN());  // no positives
  return {row_lse, pos_logit, col_lse};
}

// The fused tile kernels' backward: (d rows, d cols) in the features' dtype and the (d scale,
// sum of dS) partial sums. rows, cols contiguous; the vectors fp32; biased LSEs with bias_f.
std::tuple<Tensor, Tensor, Tensor> fused_backward(const Tensor& rows, const Tensor& cols, const Tensor& scale_f,
                                                  const Tensor& bias_f, int64_t pos_offset, const Tensor& g_row,
                                                  const Tensor& g_pos, const Tensor& lse_row, const Tensor& g_col,
                                                  const Tensor& lse_col, cudaStream_t stream) {
  const int64_t M = rows.size(0), K = cols.size(0), D = rows.size(1);
  const auto fopts = rows.options().dtype(at::kFloat);
  const float* bias_p = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  const float* g_col_p = g_col.defined() ? g_col.const_data_ptr<float>() : nullptr;
  const float* lse_col_p = g_col.defined() ? lse_col.const_data_ptr<float>() : nullptr;
  // fp32 accumulators of the two gradients (O((M + K) D)), and per-CTA partial sums of the row
  // pass for grad_scale / grad_bias, reduced in a fixed order: no atomics anywhere.
  Tensor grad_rows_f = at::zeros({M, D}, fopts), grad_cols_f = at::zeros({K, D}, fopts);
  const int64_t row_blocks = num_blocks(M);
  Tensor partials = at::empty({2, row_blocks}, fopts), sums = at::empty({2}, fopts);
  const bool mma = use_tensor_cores(rows, cols);
  // fp16 dS operands of the tensor-core kernels are pre-scaled (fp16_prescale.h).
  const Tensor prescale = mma && rows.scalar_type() == at::kHalf
                              ? fp16_gradient_prescale(scale_f, g_row, g_col, g_pos) : Tensor();
  const float* prescale_p = prescale.defined() ? prescale.const_data_ptr<float>() : nullptr;

  dispatch_features(rows.scalar_type(), [&](auto tag) {
    using T = decltype(tag);
    const T* rows_p = rows.const_data_ptr<T>();
    const T* cols_p = cols.const_data_ptr<T>();
    k::BackwardParams<T> row_pass{rows_p, cols_p, M, K, D, scale_f.const_data_ptr<float>(), bias_p,
                                  lse_row.const_data_ptr<float>(), g_row.const_data_ptr<float>(),
                                  lse_col_p, g_col_p, g_pos.const_data_ptr<float>(),
                                  /*pos_grad_by_own=*/true, pos_offset,
                                  grad_rows_f.mutable_data_ptr<float>(),
                                  partials[0].mutable_data_ptr<float>(),
                                  partials[1].mutable_data_ptr<float>(), prescale_p};
    launch_backward(row_pass, mma, stream);
    k::BackwardParams<T> col_pass{cols_p, rows_p, K, M, D, scale_f.const_data_ptr<float>(), bias_p,
                                  lse_col_p, g_col_p, lse_row.const_data_ptr<float>(),
                                  g_row.const_data_ptr<float>(), g_pos.const_data_ptr<float>(),
                                  /*pos_grad_by_own=*/false, -pos_offset,
                                  grad_cols_f.mutable_data_ptr<float>(), nullptr, nullptr, prescale_p};
    launch_backward(col_pass, mma, stream);
  });
  k::sum_partials_kernel<<<1, k::kThreads, 0, stream>>>(partials[0].const_data_ptr<float>(),
                                                        partials[1].const_data_ptr<float>(),
                                                        row_blocks, sums.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  if (prescale.defined()) {
    grad_rows_f.mul_(prescale[1]);
    grad_cols_f.mul_(prescale[1]);
  }
  return {grad_rows_f.to(rows.scalar_type()), grad_cols_f.to(cols.scalar_type()), sums};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> contrastive_lse_backward_cuda(
    const Tensor& grad_row_lse, const Tensor& grad_pos_logit,
    const c10::optional<Tensor>& grad_col_lse, const Tensor& rows, const Tensor& cols,
    const Tensor& scale, const c10::optional<Tensor>& bias, int64_t pos_offset,
    const c10::optional<Tensor>& row_ids, const c10::optional<Tensor>& col_ids, const Tensor& row_lse,
    const c10::optional<Tensor>& col_lse, c10::string_view algorithm, int64_t workspace_bytes) {
  constexpr const char* fn = "contrastive_lse_backward";
  const int64_t pos = check_features(fn, rows, cols, scale, bias, pos_offset);
  const SampleIds ids = checked_ids(fn, row_ids, col_ids, rows, cols);
  const bool chunked = parse_algorithm(fn, algorithm) == Algorithm::kChunked;
  if (!chunked) refuse_ids_in_fused(fn, ids);
  c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t M = rows.size(0), K = cols.size(0);

  const Tensor g_row = float_vector(fn, "grad_row_lse", grad_row_lse, M, rows);
  const Tensor g_pos = float_vector(fn, "grad_pos_logit", grad_pos_logit, M, rows);
  Tensor lse_row = float_vector(fn, "row_lse", row_lse, M, rows);
  // An empty grad_col_lse (the gradient of an empty col_lse output) means "no column term".
  const bool has_col = grad_col_lse.has_value() && grad_col_lse->numel() > 0;
  Tensor g_col, lse_col;
  if (has_col) {
    TORCH_CHECK(col_lse.has_value() && col_lse->numel() == K, fn,
                ": grad_col_lse is given, so col_lse must be a tensor of shape [", K, "]");
    g_col = float_vector(fn, "grad_col_lse", *grad_col_lse, K, rows);
    lse_col = float_vector(fn, "col_lse", *col_lse, K, rows);
  }
  const Tensor scale_f = scale.to(at::kFloat);
  const Tensor bias_f = bias.has_value() ? bias->to(at::kFloat) : Tensor();

  Tensor grad_rows, grad_cols, grad_scale, grad_bias;
  if (chunked) {  // the chunks are computed without the bias: take it out of the LSEs
    if (bias_f.defined()) {
      lse_row = lse_row - bias_f;
      if (has_col) lse_col = lse_col - bias_f;
    }
    std::tie(grad_rows, grad_cols, grad_scale, grad_bias) = contrastive_lse_backward_chunked_cuda(
        g_row, g_pos, g_col, rows, cols, scale_f, pos, ids.rows, ids.cols, lse_row, lse_col, workspace_bytes);
  } else {
    Tensor sums;
    std::tie(grad_rows, grad_cols, sums) = fused_backward(rows.contiguous(), cols.contiguous(), scale_f, bias_f,
                                                          pos, g_row, g_pos, lse_row, g_col, lse_col, stream);
    grad_scale = sums[0];
    grad_bias = sums[1];
  }
  // Fresh tensors (copy=true): outputs must not alias each other.
  return {grad_rows, grad_cols, grad_scale.to(scale.scalar_type(), false, true),
          grad_bias.to(bias.has_value() ? bias->scalar_type() : scale.scalar_type(), false, true)};
}

}  // namespace

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) {
  m.impl("contrastive_lse_forward", &contrastive_lse_forward_cuda);
  m.impl("contrastive_lse_backward", &contrastive_lse_backward_cuda);
}

}  // namespace clipshard
