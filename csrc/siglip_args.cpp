// Argument checks of clipshard::siglip_forward (see siglip_args.h).
#include "siglip_args.h"

#include "block_args.h"

namespace clipshard {

void check_siglip_inputs(const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale,
                         const std::optional<at::Tensor>& bias, std::optional<int64_t> pos_offset,
                         int64_t workspace_bytes) {
  check_block_inputs("siglip_forward", rows, cols, scale, bias, pos_offset);
  TORCH_CHECK(workspace_bytes >= 1, "siglip_forward: workspace_bytes must be at least 1, got ", workspace_bytes);
}

}  // namespace clipshard
