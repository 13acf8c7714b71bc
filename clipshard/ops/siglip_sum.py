"""The fused SigLIP op: fake (shape) kernel, autograd, and the typed wrapper `siglip_sum`.

`siglip_sum(rows, cols, scale, bias, pos_offset)` returns

    sum_{i < M, j < K} softplus(-z_ij * l_ij),   l_ij = scale * rows_i . cols_j + bias,
    z_ij = +1 if j == pos_offset + i else -1   (pos_offset None: -1 for every pair, a block without positives),

without ever materialising the M x K logits (docs/siglip.md). The loss has no normaliser, so the
op computes the gradients of that sum in the same chunked pass as the loss when a gradient will be
needed (three GEMMs per column chunk instead of the four a recomputing backward would need); the
autograd backward only multiplies them by the upstream gradient.

Algorithms: "chunked" (the compiled op above, CPU and CUDA) and "torch" (the same algorithm in
PyTorch operations only, for every device without a compiled kernel: clipshard/ops/portable_siglip.py,
docs/portable.md); "auto" picks as clipshard.ops._algorithm says.

Sample ids (docs/targets.md): with row_ids / col_ids the same-id pairs are positives too (targets
"multi", z = +1) or have no term ("mask"); extra columns (hard negatives) are negatives of every row,
summed in by a second op call without positives.
"""
import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops import _workspace, first_use
from clipshard.ops.inputs import (accumulate_dtype, check_block_features, check_bool, check_extra_cols,
                                  check_logit_scalar, check_targets)
from clipshard.ops.no_autocast import autocast_off
from clipshard.ops.portable_siglip import siglip_block_torch, siglip_sum_torch

ALGORITHMS = ("auto", "chunked", "torch")

@torch.library.register_fake("clipshard::siglip_forward")
def _forward_fake(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids, with_grad, workspace_bytes):
    torch._check(rows.dim() == 2 and cols.dim() == 2, lambda: "siglip_forward: rows and cols must be 2-D")
    torch._check(rows.shape[1] == cols.shape[1],
                 lambda: "siglip_forward: rows and cols must have the same feature size D")
    loss_sum = rows.new_empty((), dtype=accumulate_dtype(rows.dtype))
    if not with_grad:
        return (loss_sum, rows.new_empty(0), cols.new_empty(0), scale.new_empty(0), scale.new_empty(0))
    grad_bias = bias.new_empty(()) if bias is not None else scale.new_empty(0)
    return (loss_sum, rows.new_empty(rows.shape, dtype=_saved_grad_dtype(rows.dtype)),
            cols.new_empty(cols.shape, dtype=_saved_grad_dtype(cols.dtype)), scale.new_empty(()), grad_bias)


def _saved_grad_dtype(dtype):
    """fp16 features keep the gradients of the sum in fp32 (they may exceed 65504 before the mean's
    1/M); every other dtype keeps its own (siglip_saved_grad_dtype in csrc/siglip_args.h)."""
    return torch.float32 if dtype == torch.float16 else dtype


def _setup_context(ctx, inputs, output):
    rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids, with_grad, workspace_bytes = inputs
    _, grad_rows, grad_cols, grad_scale, grad_bias = output
    ctx.mark_non_differentiable(grad_rows, grad_cols, grad_scale, grad_bias)
    ctx.set_materialize_grads(False)  # else autograd allocates zero "gradients" for the four above
    ctx.with_grad = with_grad
    ctx.has_bias = bias is not None
    ctx.feature_dtypes = (rows.dtype, cols.dtype)
    ctx.save_for_backward(grad_rows, grad_cols, grad_scale, grad_bias)


def _backward(ctx, grad_loss, *unused):
    if not ctx.with_grad:
        raise RuntimeError("siglip_forward: the op ran with with_grad=False, so it kept no gradients; call it "
                           "with with_grad=True when a backward will follow (siglip_sum does this)")
    grad_rows, grad_cols, grad_scale, grad_bias = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 10
    # The saved gradients are those of the sum for a unit upstream gradient; 16-bit ones are scaled
    # in fp32 and rounded once, to the input's dtype.
    def scaled(grad, dtype=None):
        return (grad.to(grad_loss.dtype) * grad_loss).to(dtype or grad.dtype)

    rows_dtype, cols_dtype = ctx.feature_dtypes
    return (scaled(grad_rows, rows_dtype), scaled(grad_cols, cols_dtype), scaled(grad_scale),
            scaled(grad_bias) if ctx.has_bias else None) + (None,) * 6


torch.library.register_autograd("clipshard::siglip_forward", _backward, setup_context=_setup_context)


def _sum(rows, cols, scale, bias, pos_offset, with_grad, row_ids, col_ids, mask_same_ids, algorithm, budget):
    if algorithm == "torch":
        return siglip_sum_torch(rows, cols, scale, bias, pos_offset, with_grad, budget, _saved_grad_dtype(rows.dtype),
                                row_ids, col_ids, mask_same_ids)
    return torch.ops.clipshard.siglip_forward(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids,
                                              with_grad, budget)[0]


@autocast_off
def siglip_sum(rows, cols, scale, bias=None, pos_offset=0, *, row_ids=None, col_ids=None, targets=None,
               extra_cols=None, algorithm="auto", workspace_bytes=None):
    """Fused sum of the SigLIP loss terms of an M x K block, never materialising the logits.

    Args:
        rows: M x D features (fp32, fp16, bf16 or fp64), e.g. this rank's image features.
        cols: K x D features, same dtype and device, e.g. all ranks' text features.
        scale: logit scale, already exponentiated (a Python float or a 0-dim tensor; differentiable).
        bias: optional logit bias (float or 0-dim tensor; differentiable).
        pos_offset: row i's positive is column pos_offset + i (0 <= pos_offset, pos_offset + M <= K);
            None: no positives, every pair is a negative (a block of texts from another rank).
        row_ids, col_ids: optional sample ids of the rows (M) and the columns (K), 1-D int64 on the
            rows' device, both or neither.
        targets: with ids, "multi" (the default: every same-id pair is a positive, z = +1) or "mask"
            (same-id pairs other than the own pair have no term); None without ids.
        extra_cols: optional H x D extra columns (hard negatives; H >= 0, same dtype, device and D as
            cols): z = -1 for every row, never masked.
        algorithm: "auto" (default: the compiled "chunked" op on the CPU, and on CUDA when the
            extension has its CUDA kernels; "torch" on every other device, with a warning the first
            time; CLIPSHARD_ALGORITHM=torch makes "auto" pick "torch" everywhere), "chunked" or
            "torch" (the same algorithm in PyTorch operations, on any device; docs/portable.md).
        workspace_bytes: budget of the chunk workspace (default: clipshard.ops._workspace's per device).

    Returns:
        0-dim fp32 tensor (fp64 for fp64 inputs): sum_ij softplus(-z_ij * l_ij) over the block's pairs
        with a term (and the extra columns'). Differentiable with respect to rows, cols, extra_cols,
        scale and bias.
    """
    fn = "siglip_sum"
    check_block_features(fn, rows, cols, pos_offset, none_allowed=True)
    targets = check_targets(fn, targets, rows, cols, row_ids, col_ids, default="multi")
    check_extra_cols(fn, extra_cols, cols)
    scale = check_logit_scalar(fn, "scale", scale, rows)
    if bias is not None:
        bias = check_logit_scalar(fn, "bias", bias, rows)
    scalars = (scale,) + ((bias,) if bias is not None else ())
    with_grad = lambda *features: torch.is_grad_enabled() and any(t.requires_grad for t in features + scalars)  # noqa: E731
    has_extra_cols = extra_cols is not None and extra_cols.shape[0] > 0
    # the kernel variants the call runs (first-use check): its block, and the extra columns' block
    ids = None if row_ids is None else targets
    paths = ((first_use.rows_of(rows), ids, pos_offset is not None, with_grad(rows, cols)),)
    paths += ((first_use.rows_of(rows), None, False, with_grad(rows, extra_cols)),) if has_extra_cols else ()
    algorithm = first_use.resolve(fn, algorithm, rows.device, ALGORITHMS, rows.dtype, paths=paths)
    budget = _workspace.workspace_bytes(fn, rows.device, workspace_bytes)
    loss = _sum(rows, cols, scale, bias, pos_offset, with_grad(rows, cols), row_ids, col_ids, targets == "mask",
                algorithm, budget)
    if has_extra_cols:
        loss = loss + _sum(rows, extra_cols, scale, bias, None, with_grad(rows, extra_cols), None, None, False,
                           algorithm, budget)
    return loss


@autocast_off
def siglip_block(rows, cols, scale, bias, pos_offset, with_grad, *, row_ids=None, col_ids=None, mask_same_ids=False,
                 algorithm="auto", workspace_bytes=None):
    """siglip_forward's outputs without autograd, for a caller that weighs the gradients itself (the
    SigLIP ring, clipshard/parallel/siglip_ring.py): (loss_sum, grad_rows, grad_cols, grad_scale, grad_bias),
    the gradients of the sum for a unit upstream gradient in siglip_forward's dtypes (unused ones
    empty or None). Arguments as siglip_sum's, scale and bias already 0-dim tensors, checked by the
    caller; pos_offset None for a block without positives; row_ids / col_ids (both or neither): the
    same-id pairs other than the own pair are positives, or have no term with mask_same_ids."""
    check_bool("siglip_block", "mask_same_ids", mask_same_ids)
    if row_ids is not None or col_ids is not None:
        check_targets("siglip_block", "mask" if mask_same_ids else "multi", rows, cols, row_ids, col_ids)
    ids = None if row_ids is None else "mask" if mask_same_ids else "multi"
    path = (first_use.rows_of(rows), ids, pos_offset is not None, with_grad)
    algorithm = first_use.resolve("siglip_sum", algorithm, rows.device, ALGORITHMS, rows.dtype, paths=(path,))
    budget = _workspace.workspace_bytes("siglip_sum", rows.device, workspace_bytes)
    with torch.no_grad():
        if algorithm == "torch":
            return siglip_block_torch(rows, cols, scale, bias, pos_offset, with_grad, budget,
                                      _saved_grad_dtype(rows.dtype), row_ids, col_ids, mask_same_ids)
        return torch.ops.clipshard.siglip_forward(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids,
                                                  with_grad, budget)
