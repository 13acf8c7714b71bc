#pragma once
// Argument checks of clipshard::siglip_forward, shared by the CPU and CUDA kernels (every error
// names the op, the argument, what was expected and what came), and the dtype of its saved gradients.
// row_ids [M] / col_ids [K]: int64, 1-D, on rows' device, both or neither; mask_same_ids needs them.
#include <ATen/ATen.h>

#include <cstdint>
#include <limits>
#include <optional>

namespace clipshard {

void check_siglip_inputs(const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, std::optional<int64_t> pos_offset,
                         const std::optional<at::Tensor>& row_ids, const std::optional<at::Tensor>& col_ids,
                         bool mask_same_ids, int64_t workspace_bytes);

// The kernels place row i's positive at column pos_offset + i. A block without positives (pos_offset
// None: every pair a negative) reaches them as this offset, so far below zero that pos_offset + i -
// begin is negative for every row i and chunk start begin (no overflow: both are below 2^62), and no
// column j >= 0 is ever a positive.
constexpr int64_t kNoPositives = std::numeric_limits<int64_t>::min() / 2;

inline int64_t kernel_pos_offset(std::optional<int64_t> pos_offset) { return pos_offset.value_or(kNoPositives); }

// The gradients of the loss *sum* for a unit upstream gradient, which the op returns for autograd
// to scale later, can exceed fp16's range (65504) where the gradient of the mean would not: for
// fp16 features they are kept in fp32 (cast to fp16 once scaled); other dtypes keep their own.
inline at::ScalarType siglip_saved_grad_dtype(at::ScalarType features) {
  return features == at::kHalf ? at::kFloat : features;
}

}  // namespace clipshard
