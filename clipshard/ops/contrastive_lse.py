"""The fused contrastive log-sum-exp op: fake (shape) kernels, autograd, and the typed wrapper.

`contrastive_lse(rows, cols, scale)` computes, for S = scale * rows @ cols^T (+ bias), the row
log-sum-exps, the positive logits S[i, pos_offset + i] and the column log-sum-exps over these rows,
without ever materialising S (docs/fused_loss.md).

Three algorithms: "fused" tile kernels that never leave a tile (the CPU default; on CUDA the
hand-written FMA / mma.sync kernels), "chunked": per chunk of Kc columns a cuBLAS GEMM into a
bounded fp32 workspace, then one fused elementwise kernel (the CUDA default; docs/fused_loss_cuda.md),
and "torch": the chunked algorithm in PyTorch operations only, for every device without a compiled
kernel (clipshard/ops/portable_lse.py, docs/portable.md).

Sample ids and hard negatives (docs/targets.md): targets "mask" drops the same-id pairs other than
the own pair from both LSEs (inside the op), "multi" keeps every pair in the LSEs and returns the
mean logit of the own pair and each row's other same-id columns as its positive
(clipshard/ops/same_id.py), and extra
columns join the row LSEs through a second op call merged with logaddexp.
"""
import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops import first_use
from clipshard.ops.inputs import (accumulate_dtype, check_block_features, check_extra_cols, check_flags,
                                  check_logit_scalar, check_targets)
from clipshard.ops._workspace import workspace_bytes as _workspace_bytes
from clipshard.ops.no_autocast import autocast_off
from clipshard.ops.portable_lse import contrastive_lse_backward_torch, contrastive_lse_torch
from clipshard.ops.same_id import mean_positive, other_same_id_logit_sums

ALGORITHMS = ("auto", "fused", "chunked", "torch")

@torch.library.register_fake("clipshard::contrastive_lse_forward")
def _forward_fake(rows, cols, scale, bias, pos_offset, row_ids, col_ids, want_col_lse, algorithm, workspace_bytes):
    torch._check(rows.dim() == 2 and cols.dim() == 2, lambda: "contrastive_lse_forward: rows and cols must be 2-D")
    torch._check(rows.shape[1] == cols.shape[1],
                 lambda: "contrastive_lse_forward: rows and cols must have the same feature size D")
    acc = accumulate_dtype(rows.dtype)
    m, k = rows.shape[0], cols.shape[0]
    return (rows.new_empty(m, dtype=acc), rows.new_empty(m, dtype=acc),
            rows.new_empty(k if want_col_lse else 0, dtype=acc))


@torch.library.register_fake("clipshard::contrastive_lse_backward")
def _backward_fake(grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, pos_offset, row_ids, col_ids,
                   row_lse, col_lse, algorithm, workspace_bytes):
    grad_bias = bias.new_empty(()) if bias is not None else scale.new_empty(())
    return rows.new_empty(rows.shape), cols.new_empty(cols.shape), scale.new_empty(()), grad_bias


def _setup_context(ctx, inputs, output):
    rows, cols, scale, bias, pos_offset, row_ids, col_ids, want_col_lse, algorithm, workspace_bytes = inputs
    row_lse, _, col_lse = output
    ctx.save_for_backward(rows, cols, scale, bias, row_ids, col_ids, row_lse, col_lse if want_col_lse else None)
    ctx.pos_offset = pos_offset
    ctx.want_col_lse = want_col_lse
    ctx.set_materialize_grads(False)  # an unused col_lse hands back None, not zeros: its term is skipped
    ctx.algorithm = algorithm
    ctx.workspace_bytes = workspace_bytes


@autocast_off
def _backward(ctx, grad_row_lse, grad_pos_logit, grad_col_lse):
    rows, cols, scale, bias, row_ids, col_ids, row_lse, col_lse = ctx.saved_tensors
    # Outputs that did not take part in the loss may hand back None (or zeros, which are harmless).
    if grad_row_lse is None:
        grad_row_lse = torch.zeros_like(row_lse)
    if grad_pos_logit is None:
        grad_pos_logit = torch.zeros_like(row_lse)
    if not ctx.want_col_lse:
        grad_col_lse = None
    grad_rows, grad_cols, grad_scale, grad_bias = torch.ops.clipshard.contrastive_lse_backward(
        grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, ctx.pos_offset, row_ids, col_ids,
        row_lse, col_lse, ctx.algorithm, ctx.workspace_bytes)
    return (grad_rows, grad_cols, grad_scale, grad_bias if bias is not None else None,
            None, None, None, None, None, None)


torch.library.register_autograd("clipshard::contrastive_lse_forward", _backward, setup_context=_setup_context)


def _schema_pos_offset(pos_offset):
    """The schema's pos_offset: -1 for None (no positives)."""
    return -1 if pos_offset is None else pos_offset


def _block(rows, cols, scale, bias, pos_offset, want_col_lse, row_ids, col_ids, algorithm, budget):
    """The op's three outputs for checked arguments (row_ids / col_ids: the "mask" exclusion)."""
    if algorithm == "torch":
        return contrastive_lse_torch(rows, cols, scale, bias, pos_offset, want_col_lse, budget, row_ids, col_ids)
    return torch.ops.clipshard.contrastive_lse_forward(rows, cols, scale, bias, _schema_pos_offset(pos_offset),
                                                       row_ids, col_ids, want_col_lse, algorithm, budget)


@autocast_off
def contrastive_lse(rows, cols, scale, bias=None, pos_offset=0, want_col_lse=True, *, row_ids=None, col_ids=None,
                    targets=None, extra_cols=None, algorithm="auto", workspace_bytes=None):
    """Fused S = scale * rows @ cols^T (+ bias) reduced to log-sum-exps, never materialising S.

    Args:
        rows: M x D features (fp32, fp16, bf16 or fp64).
        cols: K x D features, same dtype and device.
        scale: logit scale, already exponentiated (a Python float or a one-element tensor;
            differentiable, its gradient has the tensor's shape).
        bias: optional logit bias added to every logit (float or one-element tensor; differentiable).
        pos_offset: row i's positive is column pos_offset + i (0 <= pos_offset, pos_offset + M <= K);
            None: no positives in this block (pos_logit is NaN, except for targets "multi").
        want_col_lse: also return the column log-sum-exps over these M rows.
        row_ids, col_ids: optional sample ids of the rows (M) and the columns (K), 1-D int64 on the
            rows' device, both or neither; they need `targets`.
        targets: None (without ids), "mask" (the same-id pairs other than the own pair leave both
            the row and the column LSEs, as if their logit were -inf; pos_logit is the own pair's)
            or "multi" (the LSEs over every pair, as without ids; pos_logit[i] is the mean logit of
            the own pair and the other columns with row i's id, NaN when pos_offset is None and
            there is none).
        extra_cols: optional H x D extra columns (hard negatives; H >= 0, same dtype, device and D as
            cols): they join the row LSEs only, never masked, never positives, no column LSE.
        algorithm: "auto" (default: "fused" on the CPU, "chunked" on CUDA when the extension has
            its CUDA kernels, "torch" on every other device, with a warning the first time; the
            environment variable CLIPSHARD_ALGORITHM=torch makes "auto" pick "torch" everywhere),
            "fused" (tile kernels; on CUDA the hand-written FMA kernels, with tensor cores for
            fp16/bf16 when D % 8 == 0), "chunked" (cuBLAS GEMMs over column chunks, fused
            elementwise kernels; on fp32 CUDA inputs TF32 follows
            torch.backends.cuda.matmul.allow_tf32) or "torch" (the chunked algorithm in PyTorch
            operations, on any device; docs/portable.md). The CUDA "fused" kernels refuse
            targets "mask" (use "chunked", CUDA's default, or "torch").
        workspace_bytes: memory budget of the chunked algorithms' workspace (default 256 MiB on
            CUDA, 32 MiB elsewhere); its chunks are the widest multiple of 128 columns that fits.

    Returns:
        (row_lse [M], pos_logit [M], col_lse [K], or an empty tensor when not wanted), fp32 — fp64
        for fp64 inputs — whatever the input dtype. Gradients flow to rows, cols, extra_cols, scale
        and bias. Every path is deterministic (no float atomics, fixed reduction order).
    """
    fn = "contrastive_lse"
    check_block_features(fn, rows, cols, pos_offset, none_allowed=True)
    check_flags(fn, want_col_lse=want_col_lse)
    targets = check_targets(fn, targets, rows, cols, row_ids, col_ids)
    check_extra_cols(fn, extra_cols, cols)
    scale = check_logit_scalar(fn, "scale", scale, rows)
    if bias is not None:
        bias = check_logit_scalar(fn, "bias", bias, rows)
    has_extra_cols = extra_cols is not None and extra_cols.shape[0] > 0
    # the kernel variants the call runs (first-use check): its block, and the extra columns' block
    paths = ((first_use.rows_of(rows), targets == "mask", pos_offset is not None, want_col_lse),)
    paths += ((first_use.rows_of(rows), False, False, False),) if has_extra_cols else ()
    algorithm = first_use.resolve(fn, algorithm, rows.device, ALGORITHMS, rows.dtype, paths=paths)
    budget = _workspace_bytes(fn, rows.device, workspace_bytes)
    mask_ids = (row_ids, col_ids) if targets == "mask" else (None, None)
    row_lse, pos_logit, col_lse = _block(rows, cols, scale, bias, pos_offset, want_col_lse, *mask_ids, algorithm,
                                         budget)
    if targets == "multi":
        # the own pair's logit from the op, the other same-id pairs' from their group sums: with all
        # ids distinct the bits of the call without ids
        row_sum, row_count, _, _ = other_same_id_logit_sums(rows, cols, scale, bias, row_ids, col_ids, pos_offset,
                                                            want_cols=False)
        pos_logit = mean_positive(None if pos_offset is None else pos_logit, row_sum, row_count)
    if has_extra_cols:
        extra_lse = _block(rows, extra_cols, scale, bias, None, False, None, None, algorithm, budget)[0]
        row_lse = torch.logaddexp(row_lse, extra_lse)
    return row_lse, pos_logit, col_lse


@autocast_off
def contrastive_lse_backward(grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, pos_offset,
                             row_lse, col_lse, *, row_ids=None, col_ids=None, algorithm="auto", workspace_bytes=None):
    """The backward of contrastive_lse for log-sum-exps computed elsewhere: ring mode hands it the
    full row and column LSEs of one block of a larger matrix. Arguments as the op's backward
    (scale and bias 0-dim tensors, grad_col_lse and col_lse None together); pos_offset None: no
    positives (grad_pos_logit is ignored); row_ids / col_ids (both or neither): targets "mask", the
    same-id pairs other than the own pair have no logit. Returns (d rows, d cols, d scale, d bias),
    d bias a zero when bias is None."""
    fn = "contrastive_lse_backward"
    if row_ids is not None or col_ids is not None:
        check_targets(fn, "mask", rows, cols, row_ids, col_ids)
    path = (first_use.rows_of(rows), row_ids is not None, pos_offset is not None, grad_col_lse is not None)
    algorithm = first_use.resolve("contrastive_lse", algorithm, rows.device, ALGORITHMS, rows.dtype, paths=(path,))
    budget = _workspace_bytes("contrastive_lse", rows.device, workspace_bytes)
    if algorithm == "torch":
        return contrastive_lse_backward_torch(grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias,
                                              pos_offset, row_lse, col_lse, budget, row_ids, col_ids)
    return torch.ops.clipshard.contrastive_lse_backward(
        grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, _schema_pos_offset(pos_offset), row_ids,
        col_ids, row_lse, col_lse, algorithm, budget)
