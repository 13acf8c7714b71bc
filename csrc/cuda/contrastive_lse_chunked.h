// The chunked contrastive_lse on CUDA, the default there (docs/fused_loss_cuda.md): per chunk of
// columns a cuBLAS GEMM (through ATen) into a bounded fp32 workspace, then the fused elementwise
// kernels of contrastive_lse_chunked_kernels.cuh. Inputs are checked by the caller.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace clipshard {

// scale: 0-dim fp32 on the device; pos_offset >= 0 (K: no positives); row_ids [M] / col_ids [K]
// contiguous int64 on the device, or both undefined (no ids). Returns (row_lse, pos_logit,
// col_lse), fp32, without the bias.
std::tuple<at::Tensor, at::Tensor, at::Tensor> contrastive_lse_forward_chunked_cuda(
    const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale, int64_t pos_offset,
    const at::Tensor& row_ids, const at::Tensor& col_ids, bool want_col_lse, int64_t workspace_bytes);

// g_row, g_pos, row_lse: fp32 [M]; g_col, col_lse: fp32 [K], or undefined for no column term; LSEs
// without the bias. Returns (d rows, d cols) in the features' dtype and (d scale, sum of dS) as
// 0-dim fp32 tensors.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> contrastive_lse_backward_chunked_cuda(
    const at::Tensor& g_row, const at::Tensor& g_pos, const at::Tensor& g_col, const at::Tensor& rows,
    const at::Tensor& cols, const at::Tensor& scale, int64_t pos_offset, const at::Tensor& row_ids,
    const at::Tensor& col_ids, const at::Tensor& row_lse, const at::Tensor& col_lse, int64_t workspace_bytes);

}  // namespace clipshard
