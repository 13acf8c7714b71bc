#pragma once
// Arguments of contrastive_lse_forward / _backward that every device shares: pos_offset (-1: no
// positives) and the optional sample ids (row_ids [M], col_ids [K], both or neither). With ids the
// pair (i, j) is excluded from both log-sum-exps, and gets dS = 0, when row_ids[i] == col_ids[j]
// and j is not row i's positive (docs/targets.md, targets "mask").
#include <ATen/ATen.h>

#include <optional>

#include "clipshard/launch_rules.h"

namespace clipshard {

// The column offset the kernels use: pos_offset itself, or K for -1 (no column j < K is then row
// i's positive pos_offset + i, and every kernel's "positive" test is false).
inline int64_t kernel_pos_offset(const char* op, int64_t pos_offset, int64_t M, int64_t K) {
  TORCH_CHECK(pos_offset == -1 || (pos_offset >= 0 && pos_offset + M <= K), op,
              ": pos_offset must satisfy 0 <= pos_offset and pos_offset + M <= K, or be -1 (no positives) (M = ", M,
              ", K = ", K, "), got ", pos_offset);
  return launch_rules::contrastive_kernel_pos_offset(pos_offset, K);
}

// Both ids contiguous int64, or both undefined when none were given.
struct SampleIds {
  at::Tensor rows, cols;
  bool given() const { return rows.defined(); }
};

inline SampleIds checked_ids(const char* op, const std::optional<at::Tensor>& row_ids,
                             const std::optional<at::Tensor>& col_ids, const at::Tensor& rows, const at::Tensor& cols) {
  TORCH_CHECK(row_ids.has_value() == col_ids.has_value(), op,
              ": row_ids and col_ids must be given together or not at all, got row_ids ",
              row_ids.has_value() ? "given" : "None", " and col_ids ", col_ids.has_value() ? "given" : "None");
  if (!row_ids.has_value()) return {};
  const auto check = [&](const char* name, const at::Tensor& ids, int64_t n) {
    TORCH_CHECK(ids.dim() == 1 && ids.size(0) == n && ids.scalar_type() == at::kLong && ids.device() == rows.device(),
                op, ": ", name, " must be a 1-D int64 tensor of length ", n, " on ", rows.device(), ", got ",
                ids.scalar_type(), " of shape ", ids.sizes(), " on ", ids.device());
    return ids.contiguous();
  };
  return {check("row_ids", *row_ids, rows.size(0)), check("col_ids", *col_ids, cols.size(0))};
}

}  // namespace clipshard
