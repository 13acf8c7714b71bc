// Argument checks of the distillation op (see distill_args.h).
#include "distill_args.h"

#include <vector>

namespace clipshard {
namespace {

bool feature_dtype(at::ScalarType t, bool allow_double) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16 || (allow_double && t == at::kDouble);
}

void check_on_device(const char* op, const char* name, const at::Tensor& t, const at::Tensor& rows) {
  TORCH_CHECK(t.device() == rows.device(), op, ": ", name, " must be on the same device as rows (", rows.device(),
              "), got ", t.device());
}

// A gradient: undefined for None and for an empty tensor (the gradient of an empty output), else
// checked against `shape` and converted.
at::Tensor gradient(const char* op, const char* name, const std::optional<at::Tensor>& g, at::IntArrayRef shape,
                    const at::Tensor& rows, at::ScalarType acc) {
  if (!g.has_value() || !g->defined() || g->numel() == 0) return at::Tensor();
  check_distill_vector(op, name, *g, shape, rows);
  return g->to(acc).contiguous();
}

}  // namespace

void check_distill_inputs(const char* op, const at::Tensor& rows, const at::Tensor& cols,
                          const at::Tensor& teacher_rows, const at::Tensor& teacher_cols, const at::Tensor& scale,
                          const at::Tensor& teacher_scale, int64_t pos_offset, bool allow_double) {
  const char* dtypes = allow_double ? "float32, float16, bfloat16 or float64" : "float32, float16 or bfloat16";
  TORCH_CHECK(rows.dim() == 2, op, ": rows must be 2-D (M x D), got shape ", rows.sizes());
  TORCH_CHECK(cols.dim() == 2, op, ": cols must be 2-D (K x D), got shape ", cols.sizes());
  TORCH_CHECK(teacher_rows.dim() == 3, op, ": teacher_rows must be 3-D (T x M x Dt), got shape ",
              teacher_rows.sizes());
  TORCH_CHECK(teacher_cols.dim() == 3, op, ": teacher_cols must be 3-D (T x K x Dt), got shape ",
              teacher_cols.sizes());
  check_on_device(op, "cols", cols, rows);
  check_on_device(op, "teacher_rows", teacher_rows, rows);
  check_on_device(op, "teacher_cols", teacher_cols, rows);
  check_on_device(op, "scale", scale, rows);
  check_on_device(op, "teacher_scale", teacher_scale, rows);
  TORCH_CHECK(feature_dtype(rows.scalar_type(), allow_double), op, ": rows must be ", dtypes, " on ",
              rows.device().type(), ", got ", rows.scalar_type());
  TORCH_CHECK(rows.scalar_type() == cols.scalar_type(), op, ": rows and cols must have the same dtype, got ",
              rows.scalar_type(), " and ", cols.scalar_type());
  TORCH_CHECK(feature_dtype(teacher_rows.scalar_type(), allow_double), op, ": teacher_rows must be ", dtypes, " on ",
              rows.device().type(), ", got ", teacher_rows.scalar_type());
  TORCH_CHECK(teacher_rows.scalar_type() == teacher_cols.scalar_type(), op,
              ": teacher_rows and teacher_cols must have the same dtype, got ", teacher_rows.scalar_type(), " and ",
              teacher_cols.scalar_type());
  const int64_t M = rows.size(0), K = cols.size(0), D = rows.size(1);
  TORCH_CHECK(cols.size(1) == D, op, ": rows and cols must have the same feature size D, got ", D, " and ",
              cols.size(1));
  TORCH_CHECK(M >= 1 && K >= 1 && D >= 1, op, ": empty inputs are not supported (need M, K, D >= 1), got rows ",
              rows.sizes(), " and cols ", cols.sizes());
  const int64_t T = teacher_rows.size(0), Dt = teacher_rows.size(2);
  TORCH_CHECK(T >= 1 && Dt >= 1, op, ": teacher_rows must hold T >= 1 teachers of feature size Dt >= 1, got shape ",
              teacher_rows.sizes());
  TORCH_CHECK(teacher_rows.size(1) == M, op, ": teacher_rows must have shape [T, M, Dt] with M = ", M,
              " (rows' M), got ", teacher_rows.sizes());
  TORCH_CHECK(teacher_cols.size(0) == T && teacher_cols.size(1) == K && teacher_cols.size(2) == Dt, op,
              ": teacher_cols must have shape [", T, ", ", K, ", ", Dt, "] (T and Dt of teacher_rows, K of cols), got ",
              teacher_cols.sizes());
  TORCH_CHECK(scale.numel() == 1 && scale.dim() <= 1, op, ": scale must be a 0-dim or 1-element tensor, got shape ",
              scale.sizes());
  TORCH_CHECK(scale.is_floating_point(), op, ": scale must be a floating-point tensor, got ", scale.scalar_type());
  TORCH_CHECK(teacher_scale.dim() == 1 && teacher_scale.size(0) == T, op, ": teacher_scale must have shape [", T,
              "] (one scale per teacher), got ", teacher_scale.sizes());
  TORCH_CHECK(teacher_scale.is_floating_point(), op, ": teacher_scale must be a floating-point tensor, got ",
              teacher_scale.scalar_type());
  TORCH_CHECK(pos_offset >= 0 && pos_offset + M <= K, op,
              ": pos_offset must satisfy 0 <= pos_offset and pos_offset + M <= K (M = ", M, ", K = ", K, "), got ",
              pos_offset);
}

void check_distill_vector(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                          const at::Tensor& rows, const char* given_by) {
  TORCH_CHECK(t.sizes() == shape, op, ": ", name, " must have shape ", shape,
              given_by ? " (it is needed because " : "", given_by ? given_by : "", given_by ? " is given)" : "",
              ", got ", t.sizes());
  TORCH_CHECK(t.is_floating_point(), op, ": ", name, " must be a floating-point tensor, got ", t.scalar_type());
  check_on_device(op, name, t, rows);
}

DistillBackwardInputs distill_backward_inputs(
    const char* op, const std::optional<at::Tensor>& grad_row_lse, const std::optional<at::Tensor>& grad_pos_logit,
    const std::optional<at::Tensor>& grad_teacher_row_lse, const std::optional<at::Tensor>& grad_row_cross,
    const std::optional<at::Tensor>& grad_col_lse, const std::optional<at::Tensor>& grad_teacher_col_lse,
    const std::optional<at::Tensor>& grad_col_cross, const at::Tensor& rows, const at::Tensor& cols,
    const at::Tensor& teacher_rows, const at::Tensor& row_lse, const at::Tensor& teacher_row_lse,
    const at::Tensor& row_cross, const at::Tensor& col_lse, const at::Tensor& teacher_col_lse,
    const at::Tensor& col_cross, bool teacher_grad, at::ScalarType acc) {
  const int64_t M = rows.size(0), K = cols.size(0), T = teacher_rows.size(0);
  const std::vector<int64_t> m{M}, k{K}, tm{T, M}, tk{T, K};
  DistillBackwardInputs in;
  in.teacher_grad = teacher_grad;
  in.g_row_lse = gradient(op, "grad_row_lse", grad_row_lse, m, rows, acc);
  in.g_pos = gradient(op, "grad_pos_logit", grad_pos_logit, m, rows, acc);
  in.g_teacher_row_lse = gradient(op, "grad_teacher_row_lse", grad_teacher_row_lse, tm, rows, acc);
  in.g_row_cross = gradient(op, "grad_row_cross", grad_row_cross, tm, rows, acc);
  in.g_col_lse = gradient(op, "grad_col_lse", grad_col_lse, k, rows, acc);
  in.g_teacher_col_lse = gradient(op, "grad_teacher_col_lse", grad_teacher_col_lse, tk, rows, acc);
  in.g_col_cross = gradient(op, "grad_col_cross", grad_col_cross, tk, rows, acc);
  if (!teacher_grad) {  // these reach only dT, which is not formed
    in.g_teacher_row_lse = at::Tensor();
    in.g_teacher_col_lse = at::Tensor();
  }
  // Each statistic that a given gradient needs, checked and converted.
  auto stat = [&](const char* name, const at::Tensor& t, const std::vector<int64_t>& shape, const char* given_by) {
    check_distill_vector(op, name, t, shape, rows, given_by);
    return t.to(acc).contiguous();
  };
  if (in.g_row_lse.defined()) in.row_lse = stat("row_lse", row_lse, m, "grad_row_lse");
  if (in.g_row_cross.defined() || in.g_teacher_row_lse.defined()) {
    const char* by = in.g_row_cross.defined() ? "grad_row_cross" : "grad_teacher_row_lse";
    in.teacher_row_lse = stat("teacher_row_lse", teacher_row_lse, tm, by);
    if (teacher_grad && in.g_row_cross.defined()) in.row_cross = stat("row_cross", row_cross, tm, "grad_row_cross");
  }
  if (in.g_col_lse.defined()) in.col_lse = stat("col_lse", col_lse, k, "grad_col_lse");
  if (in.g_col_cross.defined() || in.g_teacher_col_lse.defined()) {
    const char* by = in.g_col_cross.defined() ? "grad_col_cross" : "grad_teacher_col_lse";
    in.teacher_col_lse = stat("teacher_col_lse", teacher_col_lse, tk, by);
    if (teacher_grad && in.g_col_cross.defined()) in.col_cross = stat("col_cross", col_cross, tk, "grad_col_cross");
  }
  return in;
}

}  // namespace clipshard
