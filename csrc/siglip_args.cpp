// Argument checks of clipshard::siglip_forward (see siglip_args.h).
#include "siglip_args.h"

#include "block_args.h"

namespace clipshard {
namespace {

void check_ids(const char* name, const at::Tensor& ids, int64_t length, const at::Tensor& rows) {
  TORCH_CHECK(ids.dim() == 1 && ids.scalar_type() == at::kLong && ids.size(0) == length &&
                  ids.device() == rows.device(),
              "siglip_forward: ", name, " must be a 1-D int64 tensor of length ", length, " on ", rows.device(),
              ", got ", ids.scalar_type(), " of shape ", ids.sizes(), " on ", ids.device());
}

}  // namespace

void check_siglip_inputs(const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, std::optional<int64_t> pos_offset,
                         const std::optional<at::Tensor>& row_ids, const std::optional<at::Tensor>& col_ids,
                         bool mask_same_ids, int64_t workspace_bytes) {
  check_block_inputs("siglip_forward", rows, cols, scale, bias, pos_offset);
  TORCH_CHECK(workspace_bytes >= 1, "siglip_forward: workspace_bytes must be at least 1, got ", workspace_bytes);
  TORCH_CHECK(row_ids.has_value() == col_ids.has_value(),
              "siglip_forward: row_ids and col_ids must be given both or neither, got row_ids ",
              row_ids.has_value() ? "given" : "None", " and col_ids ", col_ids.has_value() ? "given" : "None");
  TORCH_CHECK(!mask_same_ids || row_ids.has_value(),
              "siglip_forward: mask_same_ids=True needs row_ids and col_ids (it drops the same-id pairs), got None");
  if (!row_ids.has_value()) return;
  check_ids("row_ids", *row_ids, rows.size(0), rows);
  check_ids("col_ids", *col_ids, cols.size(0), rows);
}

}  // namespace clipshard
