#pragma once
// Argument checks of clipshard::distill_lse / distill_lse_backward, shared by the CPU and CUDA
// registrations. Every error names the op, the argument, what was expected and what came.
#include <ATen/ATen.h>

#include <optional>

namespace clipshard {

// The features and scales of the op: rows (M x D) and cols (K x D) of one dtype, teacher_rows
// (T x M x Dt) and teacher_cols (T x K x Dt) of one dtype (float32, float16, bfloat16, or float64
// where allow_double), all on rows' device; scale a one-element floating tensor, teacher_scale a
// floating (T,) tensor, both on that device; 0 <= pos_offset, pos_offset + M <= K.
void check_distill_inputs(const char* op, const at::Tensor& rows, const at::Tensor& cols,
                          const at::Tensor& teacher_rows, const at::Tensor& teacher_cols, const at::Tensor& scale,
                          const at::Tensor& teacher_scale, int64_t pos_offset, bool allow_double);

// A statistic or upstream gradient of the backward: a floating tensor of shape `shape` on rows'
// device. `given_by` names the gradient that makes a column statistic necessary, for the message.
void check_distill_vector(const char* op, const char* name, const at::Tensor& t, at::IntArrayRef shape,
                          const at::Tensor& rows, const char* given_by = nullptr);

// The backward's inputs, in the accumulation dtype `acc` on rows' device, contiguous: each
// upstream gradient (undefined when None or empty: zero) and the statistics the given gradients
// need (undefined when none needs them). Checks every given tensor's shape, dtype and device.
struct DistillBackwardInputs {
  at::Tensor g_row_lse, g_pos, g_teacher_row_lse, g_row_cross;        // (M), (M), (T, M), (T, M)
  at::Tensor g_col_lse, g_teacher_col_lse, g_col_cross;               // (K), (T, K), (T, K)
  at::Tensor row_lse, teacher_row_lse, row_cross;                     // (M), (T, M), (T, M)
  at::Tensor col_lse, teacher_col_lse, col_cross;                     // (K), (T, K), (T, K)
  bool teacher_grad;

  // Whether any teacher statistic enters dS or dT: else the teacher logits are never formed.
  bool needs_teacher() const {
    return g_row_cross.defined() || g_col_cross.defined() ||
           (teacher_grad && (g_teacher_row_lse.defined() || g_teacher_col_lse.defined()));
  }
};

DistillBackwardInputs distill_backward_inputs(
    const char* op, const std::optional<at::Tensor>& grad_row_lse, const std::optional<at::Tensor>& grad_pos_logit,
    const std::optional<at::Tensor>& grad_teacher_row_lse, const std::optional<at::Tensor>& grad_row_cross,
    const std::optional<at::Tensor>& grad_col_lse, const std::optional<at::Tensor>& grad_teacher_col_lse,
    const std::optional<at::Tensor>& grad_col_cross, const at::Tensor& rows, const at::Tensor& cols,
    const at::Tensor& teacher_rows, const at::Tensor& row_lse, const at::Tensor& teacher_row_lse,
    const at::Tensor& row_cross, const at::Tensor& col_lse, const at::Tensor& teacher_col_lse,
    const at::Tensor& col_cross, bool teacher_grad, at::ScalarType acc);

}  // namespace clipshard
