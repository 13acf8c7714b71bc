// Argument checks shared by the fused block ops (see block_args.h).
#include "block_args.h"

namespace clipshard {
namespace {

constexpr const char* kDtypeList = "float32, float16, bfloat16 or float64";

bool supported_dtype(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || t == at::kDouble;
}

void check_scalar_tensor(const char* op, const char* name, const at::Tensor& t, const at::Tensor& rows) {
  TORCH_CHECK(t.dim() == 0, op, ": ", name, " must be a 0-dim tensor, got shape ", t.sizes());
  TORCH_CHECK(t.is_floating_point(), op, ": ", name, " must be a floating-point tensor, got ",
              t.scalar_type());
  TORCH_CHECK(t.device() == rows.device(), op, ": ", name, " must be on the same device as rows (",
              rows.device(), "), got ", t.device());
}

}  // namespace

void check_block_inputs(const char* op, const at::Tensor& rows, const at::Tensor& cols, const at::Tensor& scale,
                        const std::optional<at::Tensor>& bias, std::optional<int64_t> pos_offset) {
  TORCH_CHECK(rows.dim() == 2, op, ": rows must be 2-D (M x D), got shape ", rows.sizes());
  TORCH_CHECK(cols.dim() == 2, op, ": cols must be 2-D (K x D), got shape ", cols.sizes());
  TORCH_CHECK(rows.device() == cols.device(), op, ": rows and cols must be on the same device, got ",
              rows.device(), " and ", cols.device());
  TORCH_CHECK(rows.scalar_type() == cols.scalar_type(), op, ": rows and cols must have the same dtype, got ",
              rows.scalar_type(), " and ", cols.scalar_type());
  TORCH_CHECK(supported_dtype(rows.scalar_type()), op, ": rows must be ", kDtypeList, ", got ",
              rows.scalar_type());
  TORCH_CHECK(rows.size(1) == cols.size(1), op, ": rows and cols must have the same feature size D, got ",
              rows.size(1), " and ", cols.size(1));
  TORCH_CHECK(rows.size(0) >= 1 && cols.size(0) >= 1 && rows.size(1) >= 1, op,
              ": empty inputs are not supported (need M, K, D >= 1), got rows ", rows.sizes(), " and cols ",
              cols.sizes());
  check_scalar_tensor(op, "scale", scale, rows);
  if (bias.has_value()) check_scalar_tensor(op, "bias", *bias, rows);
  if (!pos_offset.has_value()) return;
  const int64_t M = rows.size(0), K = cols.size(0);
  TORCH_CHECK(*pos_offset >= 0 && *pos_offset + M <= K, op,
              ": pos_offset must satisfy 0 <= pos_offset and pos_offset + M <= K (M = ", M, ", K = ", K,
              "), got ", *pos_offset);
}

}  // namespace clipshard
