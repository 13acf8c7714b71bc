// CUDA registration of contrastive_lse_forward / contrastive_lse_backward (docs/fused_loss_cuda.md):
// input checks, scratch tensors and launches. The kernels live in contrastive_lse_kernels.cuh.
//
// Paths: the fp32-FMA kernels are the default for every dtype. tensor_cores=True selects the
// (unverified) mma.sync kernels for fp16/bf16 where they apply (see use_tensor_cores).
// allow_tf32 selects nothing: fp32 is always exact fp32 FMA.
// `deterministic` is accepted; the backward is always deterministic (no atomics).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <climits>
#include <tuple>
#include <type_traits>

#include "contrastive_lse_kernels.cuh"
#include "contrastive_lse_mma.cuh"

namespace clipshard {
namespace {

using at::Tensor;
namespace k = lse_cuda;

// Calls f(T{}) with the element type of a supported feature dtype.
template <typename F>
void dispatch_features(at::ScalarType dtype, F&& f) {
  switch (dtype) {
    case at::kFloat: return f(float{});
    case at::kHalf: return f(at::Half{});
    case at::kBFloat16: return f(at::BFloat16{});
    default: TORCH_INTERNAL_ASSERT(false, "unsupported dtype ", dtype);
  }
}

void check_scalar(const char* fn, const char* name, const Tensor& t, const Tensor& rows) {
  TORCH_CHECK(t.dim() == 0, fn, ": ", name, " must be a 0-dim tensor, got shape ", t.sizes());
  TORCH_CHECK(t.device() == rows.device(), fn, ": ", name, " must be on the device of rows (",
              rows.device(), "), got ", t.device());
  TORCH_CHECK(at::isFloatingType(t.scalar_type()), fn, ": ", name,
              " must be a floating-point tensor, got ", t.scalar_type());
}

void check_features(const char* fn, const Tensor& rows, const Tensor& cols, const Tensor& scale,
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
  TORCH_CHECK(rows.is_contiguous() && cols.is_contiguous(), fn,
              ": rows and cols must be contiguous (call .contiguous())");
  check_scalar(fn, "scale", scale, rows);
  if (bias.has_value()) check_scalar(fn, "bias", *bias, rows);
  const int64_t M = rows.size(0), K = cols.size(0);
  TORCH_CHECK(pos_offset >= 0 && pos_offset + M <= K, fn,
              ": pos_offset must satisfy 0 <= pos_offset and pos_offset + M <= K, got pos_offset=",
              pos_offset, ", M=", M, ", K=", K);
  TORCH_CHECK((std::max(M, K) + k::kTile - 1) / k::kTile <= INT_MAX, fn, ": too many rows (",
              std::max(M, K), ") for the launch grid");
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

// The tensor-core forward handles fp16/bf16 features with D % 8 == 0 and 16-byte aligned data on
// sm_80 or newer; anything else falls back to the FMA kernel.
bool use_tensor_cores(bool tensor_cores, const Tensor& rows, const Tensor& cols) {
  if (!tensor_cores || rows.scalar_type() == at::kFloat || rows.size(1) % 8 != 0) return false;
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

std::tuple<Tensor, Tensor, Tensor> contrastive_lse_forward_cuda(
    const Tensor& rows, const Tensor& cols, const Tensor& scale, const c10::optional<Tensor>& bias,
    int64_t pos_offset, bool want_col_lse, bool allow_tf32, bool tensor_cores) {
  constexpr const char* fn = "contrastive_lse_forward";
  check_features(fn, rows, cols, scale, bias, pos_offset);
  (void)allow_tf32;  // see the file comment
  c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t M = rows.size(0), K = cols.size(0), D = rows.size(1);
  const auto fopts = rows.options().dtype(at::kFloat);
  const Tensor scale_f = scale.to(at::kFloat);
  const Tensor bias_f = bias.has_value() ? bias->to(at::kFloat) : Tensor();
  Tensor row_lse = at::empty({M}, fopts), pos_logit = at::empty({M}, fopts);
  Tensor col_lse = at::empty({want_col_lse ? K : 0}, fopts);

  const bool mma = use_tensor_cores(tensor_cores, rows, cols);
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

std::tuple<Tensor, Tensor, Tensor, Tensor> contrastive_lse_backward_cuda(
    const Tensor& grad_row_lse, const Tensor& grad_pos_logit,
    const c10::optional<Tensor>& grad_col_lse, const Tensor& rows, const Tensor& cols,
    const Tensor& scale, const c10::optional<Tensor>& bias, int64_t pos_offset,
    const Tensor& row_lse, const c10::optional<Tensor>& col_lse, bool allow_tf32,
    bool tensor_cores, bool deterministic) {
  constexpr const char* fn = "contrastive_lse_backward";
  check_features(fn, rows, cols, scale, bias, pos_offset);
  (void)allow_tf32, (void)deterministic;  // see the file comment
  c10::cuda::CUDAGuard guard(rows.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const int64_t M = rows.size(0), K = cols.size(0), D = rows.size(1);
  const auto fopts = rows.options().dtype(at::kFloat);

  const Tensor g_row = float_vector(fn, "grad_row_lse", grad_row_lse, M, rows);
  const Tensor g_pos = float_vector(fn, "grad_pos_logit", grad_pos_logit, M, rows);
  const Tensor lse_row = float_vector(fn, "row_lse", row_lse, M, rows);
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
  const float* bias_p = bias_f.defined() ? bias_f.const_data_ptr<float>() : nullptr;
  const float* g_col_p = has_col ? g_col.const_data_ptr<float>() : nullptr;
  const float* lse_col_p = has_col ? lse_col.const_data_ptr<float>() : nullptr;

  // fp32 accumulators of the two gradients (O((M + K) D)), and per-CTA partial sums of the row
  // pass for grad_scale / grad_bias, reduced in a fixed order: no atomics anywhere.
  Tensor grad_rows_f = at::zeros({M, D}, fopts), grad_cols_f = at::zeros({K, D}, fopts);
  const int64_t row_blocks = num_blocks(M);
  Tensor partials = at::empty({2, row_blocks}, fopts), sums = at::empty({2}, fopts);
  const bool mma = use_tensor_cores(tensor_cores, rows, cols);

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
                                  partials[1].mutable_data_ptr<float>()};
    launch_backward(row_pass, mma, stream);
    k::BackwardParams<T> col_pass{cols_p, rows_p, K, M, D, scale_f.const_data_ptr<float>(), bias_p,
                                  lse_col_p, g_col_p, lse_row.const_data_ptr<float>(),
                                  g_row.const_data_ptr<float>(), g_pos.const_data_ptr<float>(),
                                  /*pos_grad_by_own=*/false, -pos_offset,
                                  grad_cols_f.mutable_data_ptr<float>(), nullptr, nullptr};
    launch_backward(col_pass, mma, stream);
  });
  k::sum_partials_kernel<<<1, k::kThreads, 0, stream>>>(partials[0].const_data_ptr<float>(),
                                                        partials[1].const_data_ptr<float>(),
                                                        row_blocks, sums.mutable_data_ptr<float>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  // Fresh tensors (copy=true): outputs must not alias each other.
  const Tensor grad_scale = sums[0].to(scale.scalar_type(), false, true);
  const Tensor grad_bias =
      sums[1].to(bias.has_value() ? bias->scalar_type() : scale.scalar_type(), false, true);
  return {grad_rows_f.to(rows.scalar_type()), grad_cols_f.to(cols.scalar_type()), grad_scale,
          grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) {
  m.impl("contrastive_lse_forward", &contrastive_lse_forward_cuda);
  m.impl("contrastive_lse_backward", &contrastive_lse_backward_cuda);
}

}  // namespace clipshard
