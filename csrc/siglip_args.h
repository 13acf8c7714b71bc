#pragma once
// Argument checks of clipshard::siglip_forward, shared by the CPU and CUDA kernels (every error
// names the op, the argument, what was expected and what came), and the dtype of its saved gradients.
#include <ATen/ATen.h>

#include <optional>

namespace clipshard {

void check_siglip_inputs(const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, int64_t pos_offset, int64_t workspace_bytes);

// The gradients of the loss *sum* for a unit upstream gradient, which the op returns for autograd
// to scale later, can exceed fp16's range (65504) where the gradient of the mean would not: for
// fp16 features they are kept in fp32 (cast to fp16 once scaled); other dtypes keep their own.
inline at::ScalarType siglip_saved_grad_dtype(at::ScalarType features) {
  return features == at::kHalf ? at::kFloat : features;
}

}  // namespace clipshard
