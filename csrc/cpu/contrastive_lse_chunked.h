// The chunked algorithm of contrastive_lse on the CPU: the chunk driver of csrc/chunked with
// at::mm as the GEMM and parallel loops over each chunk. The CPU's default is the tiled kernel in
// contrastive_lse.cpp; this one exists so that the driver that the CUDA default runs on is tested
// by every CPU run too (algorithm="chunked").
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <tuple>

namespace clipshard {

// Inputs are checked by the caller; rows and cols in the accumulation dtype (fp32 or fp64),
// contiguous; pos_offset >= 0 (K: no positives); row_ids [M] / col_ids [K] contiguous, or both null
// (no ids). Outputs as contrastive_lse_forward, without the bias.
std::tuple<at::Tensor, at::Tensor, at::Tensor> contrastive_lse_forward_chunked_cpu(
    const at::Tensor& rows, const at::Tensor& cols, double scale, int64_t pos_offset, const int64_t* row_ids,
    const int64_t* col_ids, bool want_col_lse, int64_t workspace_bytes);

// Gradient inputs as contrastive_lse_backward, in the accumulation dtype; row_lse and col_lse without
// the bias; g_col and col_lse undefined when there is no column term. Returns (d rows, d cols, d scale,
// d bias) in the accumulation dtype; d bias is sum(dS).
std::tuple<at::Tensor, at::Tensor, double, double> contrastive_lse_backward_chunked_cpu(
    const at::Tensor& g_row, const at::Tensor& g_pos, const at::Tensor& g_col, const at::Tensor& rows,
    const at::Tensor& cols, double scale, int64_t pos_offset, const int64_t* row_ids, const int64_t* col_ids,
    const at::Tensor& row_lse, const at::Tensor& col_lse, int64_t workspace_bytes);

}  // namespace clipshard
