#pragma once
// Argument checks of clipshard::siglip_forward, shared by the CPU and CUDA kernels: every error
// names the op, the argument, what was expected and what came.
#include <ATen/ATen.h>

#include <optional>

namespace clipshard {

void check_siglip_inputs(const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, int64_t pos_offset, int64_t workspace_bytes);

}  // namespace clipshard
