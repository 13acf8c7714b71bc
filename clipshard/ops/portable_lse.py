"""contrastive_lse with algorithm="torch": the chunked algorithm in PyTorch operations only
(docs/portable.md).

Same outputs as the compiled kernels (row LSE, positive logits, partial column LSE; fp32, fp64 for
fp64 inputs) and the same gradients. Forward, per chunk of Kc columns: one GEMM gives the chunk's
logits; torch.logsumexp over its columns is merged into the running row LSE (logaddexp), over its
rows gives the chunk's column LSE exactly (all M rows are there), and the positives are read off
the chunk's diagonal. Backward, per chunk: the chunk is recomputed and

    dS = g_row * exp(S - row_lse) + g_col * exp(S - col_lse) + g_pos * [j == pos(i)],

then grad_rows += dS @ cols_chunk, grad_cols[chunk] = dS^T @ rows (both times s, applied to the
M x D and Kc x D results), d scale += sum(dS * dots), d bias += sum(dS). Per-chunk temporaries (all
counted against workspace_bytes): forward two M x Kc buffers (the logits and logsumexp's exp),
backward three (the dots, dS and the column term, or the dS * dots product) plus dS rounded to 16
bits where the GEMMs take 16-bit factors.

Sample ids (row_ids, col_ids; targets "mask", docs/targets.md): per chunk an M x Kc boolean marks
the same-id pairs other than the own pair; the forward sets their logits to -inf before the
log-sum-exps, the backward sets their dS to 0. One byte per logit more, counted in the budget.
pos_offset None: no positives (pos_logit NaN, its gradient ignored). Without ids and with a
pos_offset the code path, and so every bit, is the one without these features.

A torch.autograd.Function rather than a registered op, so that torch.compile can trace into it and
fuse the per-chunk elementwise work; it has no host synchronisation.
"""
import torch

from clipshard.ops._portable_chunks import Chunks, GradientGemms, fp16_prescale
from clipshard.ops.no_autocast import autocast_off


def _forward(rows, cols, scale, bias, pos_offset, want_col_lse, budget, row_ids=None, col_ids=None):
    chunks = Chunks(rows, cols, budget, acc_buffers=2, with_grad_gemms=False, extra_bytes=_mask_bytes(row_ids))
    acc = chunks.acc
    s = scale.to(acc)
    row_lse = rows.new_full((chunks.m,), float("-inf"), dtype=acc)
    if pos_offset is None:
        pos_logit = rows.new_full((chunks.m,), float("nan"), dtype=acc)
    else:
        pos_logit = rows.new_empty((chunks.m,), dtype=acc)
    col_lse = rows.new_empty((chunks.k if want_col_lse else 0,), dtype=acc)
    for begin, width in chunks:
        logits = chunks.dots(begin, width).mul_(s)
        if row_ids is not None:  # "mask": the other same-id pairs leave every denominator
            logits.masked_fill_(chunks.other_same_ids(row_ids, col_ids, begin, width, pos_offset), float("-inf"))
        row_lse = torch.logaddexp(row_lse, torch.logsumexp(logits, dim=1))
        if want_col_lse:
            col_lse.narrow(0, begin, width).copy_(torch.logsumexp(logits, dim=0))
        if pos_offset is not None:
            first, last, diagonal = chunks.positives(logits, begin, pos_offset)
            pos_logit.narrow(0, first, last - first).copy_(diagonal)
            del diagonal
        del logits  # before the next chunk's GEMM allocates its result
    if bias is not None:  # a constant on every logit shifts every output by itself
        b = bias.to(acc)
        row_lse, pos_logit, col_lse = row_lse + b, pos_logit + b, col_lse + b
    return row_lse, pos_logit, col_lse


def _mask_bytes(row_ids):
    """Bytes per logit of the chunk's boolean same-id mask (none without ids)."""
    return 0 if row_ids is None else 1


def _backward(g_row, g_pos, g_col, rows, cols, scale, bias, pos_offset, row_lse, col_lse, budget, needs,
              row_ids=None, col_ids=None):
    """Gradients of rows, cols, scale, bias (None where not in `needs`) for the upstream gradients
    g_row, g_pos, g_col (None: that output took no part in the loss)."""
    want_rows, want_cols, want_scale, want_bias = needs
    want_features = want_rows or want_cols
    if pos_offset is None:  # no positives: pos_logit is a constant NaN
        g_pos = None
    chunks = Chunks(rows, cols, budget, acc_buffers=3, with_grad_gemms=want_features,
                    extra_bytes=_mask_bytes(row_ids))
    acc = chunks.acc
    s = scale.to(acc)
    prescale = None
    if chunks.grad_dtype == torch.float16:  # every |dS| <= max|g_row| + max|g_col| + max|g_pos|
        bound = sum((g.abs().max() for g in (g_row, g_col, g_pos) if g is not None and g.numel()),
                    torch.zeros((), dtype=acc, device=rows.device))
        prescale = fp16_prescale(bound)
    gemms = GradientGemms(chunks, s, rows.dtype, prescale, want_rows, want_cols)
    grad_scale = torch.zeros((), dtype=acc, device=rows.device)
    grad_bias = torch.zeros((), dtype=acc, device=rows.device)
    # exp(S - lse) = exp(s * dots + (b - lse)): one pass from the dots to each exponent
    b = torch.zeros((), dtype=acc, device=rows.device) if bias is None else bias.to(acc)
    row_shift = (b - row_lse).unsqueeze(1) if g_row is not None else None
    col_shift = b - col_lse if g_col is not None else None
    for begin, width in chunks:
        dots = chunks.dots(begin, width)
        ds = None
        if g_row is not None:
            ds = torch.addcmul(row_shift, dots, s).exp_().mul_(g_row.unsqueeze(1))
        if g_col is not None:
            col_term = torch.addcmul(col_shift.narrow(0, begin, width), dots, s).exp_()
            col_term.mul_(g_col.narrow(0, begin, width))
            ds = col_term if ds is None else ds.add_(col_term)
            del col_term
        if ds is None:
            ds = torch.zeros_like(dots)
        if row_ids is not None:  # excluded pairs have no logit (their exp may be inf - inf there: NaN)
            ds.masked_fill_(chunks.other_same_ids(row_ids, col_ids, begin, width, pos_offset), 0.0)
        if g_pos is not None:
            first, last, diagonal = chunks.positives(ds, begin, pos_offset)
            diagonal.add_(g_pos.narrow(0, first, last - first))
            del diagonal
        if want_scale:
            grad_scale += (ds * dots).sum()
        del dots
        if want_bias:
            grad_bias += ds.sum()
        if want_features:
            gemms.add(ds, begin, width)
        del ds  # before the next chunk's GEMM allocates its result
    grad_rows, grad_cols = gemms.results()
    return (grad_rows, grad_cols, grad_scale.to(scale.dtype) if want_scale else None,
            grad_bias.to(bias.dtype) if want_bias else None)


class _ContrastiveLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, cols, scale, bias, pos_offset, want_col_lse, budget, row_ids, col_ids):
        row_lse, pos_logit, col_lse = _forward(rows, cols, scale, bias, pos_offset, want_col_lse, budget, row_ids,
                                               col_ids)
        ctx.save_for_backward(rows, cols, scale, bias, row_lse, col_lse, row_ids, col_ids)
        ctx.pos_offset, ctx.want_col_lse, ctx.budget = pos_offset, want_col_lse, budget
        ctx.set_materialize_grads(False)  # an output left out of the loss hands back None: its term is skipped
        return row_lse, pos_logit, col_lse

    @staticmethod
    @autocast_off  # also when the backward runs inside the autocast block
    def backward(ctx, g_row, g_pos, g_col):
        rows, cols, scale, bias, row_lse, col_lse, row_ids, col_ids = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        if not ctx.want_col_lse:
            g_col = None
        if g_row is None and g_pos is None and g_col is None:
            return (None,) * 9
        grads = _backward(g_row, g_pos, g_col, rows, cols, scale, bias, ctx.pos_offset, row_lse, col_lse,
                          ctx.budget, needs, row_ids, col_ids)
        return (*grads, None, None, None, None, None)


def contrastive_lse_torch(rows, cols, scale, bias, pos_offset, want_col_lse, budget, row_ids=None, col_ids=None):
    """contrastive_lse's outputs by the torch path; the arguments were checked by the caller
    (pos_offset None: no positives; row_ids / col_ids: targets "mask")."""
    return _ContrastiveLse.apply(rows, cols, scale, bias, pos_offset, want_col_lse, budget, row_ids, col_ids)


def contrastive_lse_backward_torch(g_row, g_pos, g_col, rows, cols, scale, bias, pos_offset, row_lse, col_lse,
                                   budget, row_ids=None, col_ids=None):
    """The op's backward contract (every gradient, d bias a zero without bias) by the torch path."""
    grads = _backward(g_row, g_pos, g_col, rows, cols, scale, bias, pos_offset, row_lse, col_lse, budget,
                      (True, True, True, bias is not None), row_ids, col_ids)
    return grads[:3] + (grads[3] if bias is not None else torch.zeros_like(grads[2]),)
