// CUDA registration of clipshard::siglip_forward (docs/siglip.md): input checks, accumulators, the
// gradient prescale and the launches of siglip_kernels.cuh between the chunk driver's GEMMs.
//
// Per column chunk: one GEMM (fp32 similarities, also for 16-bit features) and one elementwise
// kernel; with with_grad the kernel also writes the logit gradients in the features' dtype and the
// driver adds two GEMMs. With sample ids the elementwise kernel is siglip_ids_chunk_kernel (up to
// kIdRows rows per CTA by launch_rules.h, labels by id; siglip_launch.h launches either); without
// them, the kernel of the op before ids, unchanged. fp16
// logit gradients use the softmax loss's power-of-two prescale (fp16_prescale.cuh) with the bound
// |scale| (|dl| <= 1), so that gradients near 1e-8 stay fp16 numbers; the driver multiplies the
// row and column gradients back in fp32. The prescale is computed on the device: no host
// synchronisation anywhere.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <climits>
#include <optional>
#include <tuple>

#include "../chunked/chunk_driver.h"
#include "../siglip_args.h"
#include "dispatch_features.h"
#include "fp16_prescale.h"
#include "siglip_launch.h"

namespace clipshard {
namespace {

using at::Tensor;
namespace k = siglip_cuda;

// (prescale, 1 / prescale) on the device for fp16 logit gradients |scale * dl| <= |scale|: the
// softmax loss's rule with the bound |scale| * 1 (one "row gradient" of 1, no other terms).
Tensor fp16_prescale(const Tensor& scale) {
  const Tensor one = at::ones({1}, scale.options()), zero = at::zeros({1}, scale.options());
  return fp16_gradient_prescale(scale, one, Tensor(), zero);
}

// The sample ids (contiguous, on the device), or none.
struct Ids {
  Tensor rows, cols;
  bool mask_same_ids;
};

template <typename DL, bool kGrad>
void launch(const chunked::Chunk& chunk, DL* dlogits, int64_t pos_offset, const Tensor& scale,
            const std::optional<Tensor>& bias, const Tensor& prescale, const Ids& ids, Tensor& accumulators) {
  const int64_t M = chunk.dots.size(0);
  k::ChunkParams<DL> p{chunk.dots.data_ptr<float>(), dlogits, M, chunk.width, chunk.begin, pos_offset,
                       scale.data_ptr<float>(), bias.has_value() ? bias->data_ptr<float>() : nullptr,
                       prescale.defined() ? prescale.data_ptr<float>() : nullptr,
                       accumulators[0].data_ptr<double>(), accumulators[1].data_ptr<double>(),
                       accumulators[2].data_ptr<double>()};
  // Rows per CTA with ids: launch_rules.h's rule, which the first-use check queries too.
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const k::ChunkIds chunk_ids{ids.rows.defined() ? ids.rows.data_ptr<int64_t>() : nullptr,
                              ids.rows.defined() ? ids.cols.data_ptr<int64_t>() : nullptr, ids.mask_same_ids,
                              launch_rules::siglip_ids_rows_per_cta(M, sms, k::kIdRows)};
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  k::launch_chunk<DL, kGrad>(p, chunk_ids, [stream](auto kernel, dim3 grid, const auto& params) {
    kernel<<<grid, k::kThreads, 0, stream>>>(params);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> siglip_forward_cuda(
    const Tensor& rows_in, const Tensor& cols_in, const Tensor& scale_in, const std::optional<Tensor>& bias_in,
    std::optional<int64_t> pos_offset_in, const std::optional<Tensor>& row_ids,
    const std::optional<Tensor>& col_ids, bool mask_same_ids, bool with_grad, int64_t workspace_bytes) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  check_siglip_inputs(rows_in, cols_in, scale_in, bias_in, pos_offset_in, row_ids, col_ids, mask_same_ids,
                      workspace_bytes);
  const int64_t pos_offset = kernel_pos_offset(pos_offset_in);  // kNoPositives: no positives
  TORCH_CHECK(rows_in.is_cuda(), "siglip_forward: rows must be on a CUDA device, got ", rows_in.device());
  TORCH_CHECK(rows_in.scalar_type() != at::kDouble,
              "siglip_forward: the CUDA kernel takes float32, float16 or bfloat16 features, got Double "
              "(float64 is supported by the CPU kernel only)");
  TORCH_CHECK(rows_in.size(0) <= INT_MAX, "siglip_forward: too many rows (", rows_in.size(0), ") for the launch grid");
  const c10::cuda::CUDAGuard guard(rows_in.device());
  const Tensor rows = rows_in.contiguous(), cols = cols_in.contiguous();
  const Tensor scale = scale_in.to(at::kFloat).contiguous();
  const std::optional<Tensor> bias =
      bias_in.has_value() ? std::optional<Tensor>(bias_in->to(at::kFloat).contiguous()) : std::nullopt;
  const Ids ids = row_ids.has_value() ? Ids{row_ids->contiguous(), col_ids->contiguous(), mask_same_ids} : Ids{};
  const int64_t M = rows.size(0), K = cols.size(0);
  const auto grad_dtype = rows.scalar_type();
  const int64_t logit_bytes = 4 + (with_grad ? int64_t(c10::elementSize(grad_dtype)) : 0);
  const int64_t kc = chunked::chunk_columns(M, K, logit_bytes, workspace_bytes);
  // Per row: loss, sum dl * dot, sum dl, each added to by one CTA per chunk, in chunk order.
  Tensor accumulators = at::zeros({3, M}, rows.options().dtype(at::kDouble));

  Tensor grad_rows = at::empty({0}, rows.options()), grad_cols = at::empty({0}, cols.options());
  if (!with_grad) {
    chunked::for_each_chunk(rows, cols, kc, [&](const chunked::Chunk& chunk) {
      launch<float, false>(chunk, nullptr, pos_offset, scale, bias, Tensor(), ids, accumulators);
    });
  } else {
    const Tensor scales = grad_dtype == at::kHalf ? fp16_prescale(scale) : Tensor();
    const Tensor prescale = scales.defined() ? scales[0] : Tensor();
    const Tensor unscale = scales.defined() ? scales[1] : Tensor();
    dispatch_features(grad_dtype, [&](auto dl_type) {
      using DL = decltype(dl_type);
      auto grads = chunked::chunked_gradients(
          rows, cols, kc, grad_dtype, unscale,
          [&](const chunked::Chunk& chunk, Tensor& dlogits) {
            launch<DL, true>(chunk, dlogits.data_ptr<DL>(), pos_offset, scale, bias, prescale, ids,
                             accumulators);
          },
          siglip_saved_grad_dtype(grad_dtype));
      grad_rows = grads.first;
      grad_cols = grads.second;
    });
  }
  const Tensor totals = accumulators.sum(1);  // deterministic: a fixed-size reduction
  // Separate copies (copy=true): outputs must not share storage.
  const Tensor loss_sum = totals[0].to(at::kFloat, false, true);
  if (!with_grad) {
    return {loss_sum, grad_rows, grad_cols, at::empty({0}, scale_in.options()), at::empty({0}, scale_in.options())};
  }
  const Tensor grad_scale = totals[1].to(scale_in.scalar_type(), false, true);
  const Tensor grad_bias = bias_in.has_value() ? totals[2].to(bias_in->scalar_type(), false, true)
                                               : at::empty({0}, scale_in.options());
  return {loss_sum, grad_rows, grad_cols, grad_scale, grad_bias};
}

}  // namespace
}  // namespace clipshard

TORCH_LIBRARY_IMPL(clipshard, CUDA, m) { m.impl("siglip_forward", &clipshard::siglip_forward_cuda); }
