// Host side of fp16_prescale.cuh (launched in fp16_prescale.cu on the current stream).
#pragma once

#include <ATen/ATen.h>

namespace clipshard {

// A 2-element fp32 device tensor: (pre-scale, its inverse) for fp16 logit gradients of a loss with
// scale `scale` (0-dim fp32) and upstream gradients g_row, g_pos (and g_col, which may be undefined).
at::Tensor fp16_gradient_prescale(const at::Tensor& scale, const at::Tensor& g_row, const at::Tensor& g_col,
                                  const at::Tensor& g_pos);

}  // namespace clipshard
