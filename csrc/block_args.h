#pragma once
// Argument checks shared by the CPU kernels of the fused block ops (contrastive_lse, siglip_forward)
// and siglip_forward's CUDA kernel: a rows x cols block of features, a scale, an optional bias and
// the column of row 0's positive. Every error names the op, the argument, what was expected and
// what came.
#include <ATen/ATen.h>

#include <optional>

namespace clipshard {

// rows M x D and cols K x D: same device and dtype (float32, float16, bfloat16 or float64), M, K,
// D >= 1; scale and bias 0-dim floating tensors on rows' device; 0 <= pos_offset, pos_offset + M <= K
// (no pos_offset: a block without positives, which only siglip_forward accepts).
void check_block_inputs(const char* op, const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias, std::optional<int64_t> pos_offset);

}  // namespace clipshard
