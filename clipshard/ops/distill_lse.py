"""The fused distillation statistics op: argument checks, fake (shape) kernels, autograd, and the
typed wrapper (docs/distillation.md).

`distill_lse(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale)` computes, for the
student logits S = scale * rows @ cols^T and each teacher's T^k = teacher_scale[k] *
teacher_rows[k] @ teacher_cols[k]^T, the row statistics (student LSE, positive logits, teacher LSE,
teacher-softmax-weighted student logit) and, when asked, the same column statistics over these
rows, without materialising S or any T^k.

Two algorithms: "compiled" (the extension's CPU kernel and CUDA chunked kernel, when this build
has them) and "torch" (clipshard/ops/portable_distill.py, on every device). "auto" picks
"compiled" where the dispatcher has a kernel for the device that takes the student's and the
teachers' dtypes (on CUDA: no fp64 on either side), else "torch" (clipshard/ops/_algorithm.py).
"""
import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops import first_use
from clipshard.ops.inputs import SUPPORTED_DTYPES, accumulate_dtype, check_block_features, check_flags, \
    check_logit_scalar
from clipshard.ops._workspace import workspace_bytes as _workspace_bytes
from clipshard.ops.no_autocast import autocast_off
from clipshard.ops.portable_distill import distill_lse_backward_torch, distill_lse_torch

ALGORITHMS = ("auto", "compiled", "torch")
OUTPUTS = ("row_lse", "pos_logit", "teacher_row_lse", "row_cross", "col_lse", "teacher_col_lse", "col_cross")


def _output_shapes(m, k, n_teachers, want_columns):
    k_out = k if want_columns else 0
    return ((m,), (m,), (n_teachers, m), (n_teachers, m), (k_out,), (n_teachers, k_out), (n_teachers, k_out))


@torch.library.register_fake("clipshard::distill_lse")
def _forward_fake(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns,
                  workspace_bytes):
    acc = accumulate_dtype(rows.dtype)
    shapes = _output_shapes(rows.shape[0], cols.shape[0], teacher_rows.shape[0], want_columns)
    return tuple(rows.new_empty(shape, dtype=acc) for shape in shapes)


@torch.library.register_fake("clipshard::distill_lse_backward")
def _backward_fake(g_row, g_pos, g_trow, g_rcross, g_col, g_tcol, g_ccross, rows, cols, teacher_rows,
                   teacher_cols, scale, teacher_scale, pos_offset, row_lse, teacher_row_lse, row_cross, col_lse,
                   teacher_col_lse, col_cross, teacher_grad, workspace_bytes):
    teacher = (teacher_rows.new_empty(teacher_rows.shape), teacher_cols.new_empty(teacher_cols.shape),
               teacher_scale.new_empty(teacher_scale.shape)) if teacher_grad else (
               teacher_rows.new_empty(0), teacher_cols.new_empty(0), teacher_scale.new_empty(0))
    return (rows.new_empty(rows.shape), cols.new_empty(cols.shape), teacher[0], teacher[1],
            scale.new_empty(()), teacher[2])


def _setup_context(ctx, inputs, output):
    rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns, workspace = inputs
    row_lse, _, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross = output
    ctx.save_for_backward(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, row_lse, teacher_row_lse,
                          row_cross, col_lse, teacher_col_lse, col_cross)
    ctx.pos_offset, ctx.want_columns, ctx.workspace = pos_offset, want_columns, workspace
    # an output left out of the loss hands back None, not zeros: the kernels skip its terms (and
    # without a teacher term, the teachers' GEMMs)
    ctx.set_materialize_grads(False)


@autocast_off
def _backward(ctx, *grads):
    saved = ctx.saved_tensors
    if not ctx.want_columns:
        grads = grads[:4] + (None, None, None)
    if all(g is None for g in grads):
        return (None,) * 9
    needs = ctx.needs_input_grad
    teacher_grad = any(needs[2:4]) or needs[5]
    result = torch.ops.clipshard.distill_lse_backward(*grads, *saved[:6], ctx.pos_offset, *saved[6:],
                                                      teacher_grad, ctx.workspace)
    return tuple(g if need else None for g, need in zip(result, needs[:6])) + (None, None, None)


torch.library.register_autograd("clipshard::distill_lse", _backward, setup_context=_setup_context)


def _check_teachers(fn, rows, cols, teacher_rows, teacher_cols):
    for name, t, expect in (("teacher_rows", teacher_rows, "T x M x Dt"), ("teacher_cols", teacher_cols, "T x K x Dt")):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{fn}: {name} must be 3-D ({expect}), got shape {tuple(t.shape)}")
        if t.device != rows.device:
            raise ValueError(f"{fn}: {name} must be on the students' device ({rows.device}), got {t.device}")
    if teacher_rows.dtype != teacher_cols.dtype:
        raise TypeError(f"{fn}: teacher_rows and teacher_cols must have the same dtype, got {teacher_rows.dtype} "
                        f"and {teacher_cols.dtype}")
    if teacher_rows.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: teacher_rows must be float32, float16, bfloat16 or float64, got {teacher_rows.dtype}")
    (n_teachers, m, dt), (n_cols_teachers, k, dt_cols) = teacher_rows.shape, teacher_cols.shape
    expected = f"(T, {rows.shape[0]}, Dt) and (T, {cols.shape[0]}, Dt) with T, Dt >= 1"
    if (n_teachers != n_cols_teachers or m != rows.shape[0] or k != cols.shape[0] or dt != dt_cols
            or n_teachers == 0 or dt == 0):
        raise ValueError(f"{fn}: teacher_rows and teacher_cols must have shapes {expected}, got "
                         f"{tuple(teacher_rows.shape)} and {tuple(teacher_cols.shape)}")


def _check_teacher_scale(fn, teacher_scale, n_teachers, rows):
    if not isinstance(teacher_scale, torch.Tensor) or not teacher_scale.is_floating_point():
        got = teacher_scale.dtype if isinstance(teacher_scale, torch.Tensor) else type(teacher_scale).__name__
        raise TypeError(f"{fn}: teacher_scale must be a floating-point tensor of T = {n_teachers} elements, got {got}")
    if teacher_scale.numel() != n_teachers:
        raise ValueError(f"{fn}: teacher_scale must have T = {n_teachers} elements (one per teacher), got shape "
                         f"{tuple(teacher_scale.shape)}")
    if teacher_scale.device != rows.device:
        raise ValueError(f"{fn}: teacher_scale must be on the students' device ({rows.device}), got "
                         f"{teacher_scale.device}")
    return teacher_scale.reshape(n_teachers)


@autocast_off
def distill_lse(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset=0, want_columns=True, *,
                algorithm="auto", workspace_bytes=None):
    """The student's and the teachers' log-sum-exps and cross terms of one block, never forming a
    logit matrix.

    Args:
        rows, cols: student features M x D and K x D (fp32, fp16, bf16 or fp64; one dtype).
        teacher_rows, teacher_cols: T teachers' features, T x M x Dt and T x K x Dt (one dtype, which
            may differ from the student's; Dt may differ from D).
        scale: the student's logit scale, already exponentiated (a float or a one-element tensor).
        teacher_scale: the teachers' logit scales, a tensor of T elements.
        pos_offset: row i's positive is column pos_offset + i (0 <= pos_offset, pos_offset + M <= K).
        want_columns: also return the column statistics over these M rows.
        algorithm: "auto", "compiled" or "torch" (module docstring).
        workspace_bytes: the chunked algorithms' workspace budget (default 256 MiB on CUDA, 32 MiB
            elsewhere).

    Returns the seven tensors named in OUTPUTS, fp32 (fp64 for fp64 students): row_lse [M],
    pos_logit [M], teacher_row_lse [T, M], row_cross [T, M] (sum_j softmax(T^k_i)_j S_ij), col_lse
    [K], teacher_col_lse [T, K], col_cross [T, K] (the last three empty, K = 0, without
    want_columns). Gradients flow to every input.
    """
    fn = "distill_lse"
    check_block_features(fn, rows, cols, pos_offset)
    _check_teachers(fn, rows, cols, teacher_rows, teacher_cols)
    check_flags(fn, want_columns=want_columns)
    acc = accumulate_dtype(rows.dtype)
    scale = check_logit_scalar(fn, "scale", scale, rows).to(acc)
    teacher_scale = _check_teacher_scale(fn, teacher_scale, teacher_rows.shape[0], rows).to(acc)
    teacher_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (teacher_rows, teacher_cols, teacher_scale))
    path = (first_use.rows_of(teacher_rows), want_columns, teacher_grad)  # the kernel variant (first-use check)
    algorithm = first_use.resolve(fn, algorithm, rows.device, ALGORITHMS, rows.dtype, teacher_rows.dtype,
                                  paths=(path,))
    budget = _workspace_bytes(fn, rows.device, workspace_bytes)
    if algorithm == "torch":
        return distill_lse_torch(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset,
                                 want_columns, budget)
    return torch.ops.clipshard.distill_lse(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset,
                                           want_columns, budget)


@autocast_off
def distill_lse_backward(grads, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, stats,
                         teacher_grad, *, algorithm="auto", workspace_bytes=None):
    """The backward of distill_lse for statistics computed elsewhere (ring mode hands it the full
    statistics of one block of a larger matrix). grads: the seven outputs' upstream gradients (None:
    zero); stats: (row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross); scale
    0-dim and teacher_scale (T,) in the accumulation dtype. Returns (d rows, d cols, d teacher_rows,
    d teacher_cols, d scale, d teacher_scale), the teachers' empty without teacher_grad."""
    want_columns = stats[3] is not None and stats[3].shape[0] != 0  # col_lse: empty without the columns
    path = (first_use.rows_of(teacher_rows), want_columns, teacher_grad)  # the kernel variant (first-use check)
    algorithm = first_use.resolve("distill_lse", algorithm, rows.device, ALGORITHMS, rows.dtype, teacher_rows.dtype,
                                  paths=(path,))
    budget = _workspace_bytes("distill_lse", rows.device, workspace_bytes)
    if algorithm == "torch":
        return distill_lse_backward_torch(grads, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale,
                                          pos_offset, stats, teacher_grad, budget)
    return torch.ops.clipshard.distill_lse_backward(*grads, rows, cols, teacher_rows, teacher_cols, scale,
                                                    teacher_scale, pos_offset, *stats, teacher_grad, budget)
