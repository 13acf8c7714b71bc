"""distill_lse with algorithm="torch": the chunked algorithm in PyTorch operations only
(docs/distillation.md).

For the student logits s_ij = scale * <rows_i, cols_j> and T teachers' logits
t^k_ij = teacher_scale[k] * <teacher_rows[k, i], teacher_cols[k, j]>, the op returns per row i
(over the K columns) and, when asked, per column j (over these M rows):

    row_lse, pos_logit, teacher_row_lse[k], row_cross[k] = sum_j softmax_j(t^k_i.)_j s_ij,
    col_lse, teacher_col_lse[k], col_cross[k] = sum_i softmax_i(t^k_.j)_i s_ij.

Forward, per chunk of Kc columns: the student's and each teacher's chunk of logits (one GEMM each);
the row statistics are merged into running ones: LSEs by logaddexp, and the cross term, a
softmax-weighted mean, by reweighting the running mean and the chunk's with exp(lse_old - lse_new)
and exp(lse_chunk - lse_new). The chunk holds all M rows, so its column statistics are exact.
Backward, per chunk: the logits are recomputed, then

    dS = g_row_lse e^(s - row_lse) + g_col_lse e^(s - col_lse) + g_pos [j == pos(i)]
         + sum_k (g_row_cross[k] P^k + g_col_cross[k] Q^k),
    dT^k = P^k (g_teacher_row_lse[k] + g_row_cross[k] (s - row_cross[k]))
         + Q^k (g_teacher_col_lse[k] + g_col_cross[k] (s - col_cross[k])),

with P^k = e^(t^k - teacher_row_lse[k]) (row softmax) and Q^k = e^(t^k - teacher_col_lse[k]) (column
softmax); the gradient GEMMs of clipshard/ops/_portable_chunks.py turn dS and dT^k into the feature
gradients. The teachers are processed one after the other, so the workspace does not grow with T:
forward 5 M x Kc buffers in the accumulation dtype, backward 9, all counted against the budget.
"""
import torch

from clipshard.ops._portable_chunks import Chunks, GradientGemms, fp16_prescale
from clipshard.ops.no_autocast import autocast_off
from clipshard.ops._workspace import chunk_columns

_FORWARD_BUFFERS = 5
_BACKWARD_BUFFERS = 9


class _TeacherChunks:
    """The teachers' Chunks, cut at the student's column chunks."""

    def __init__(self, teacher_rows, teacher_cols, budget):
        self.each = [Chunks(r, c, budget, acc_buffers=1, with_grad_gemms=False)
                     for r, c in zip(teacher_rows, teacher_cols)]

    def logits(self, k, begin, width, teacher_scale, acc, keep_dots):
        """(teacher k's logits, its dots or None) of the chunk, in the student's accumulation dtype."""
        dots = self.each[k].dots(begin, width).to(acc)
        if not keep_dots:
            return dots.mul_(teacher_scale[k]), None
        return dots * teacher_scale[k], dots


def _student_chunks(rows, cols, teacher_rows, buffers, budget):
    chunks = Chunks(rows, cols, budget, acc_buffers=buffers, with_grad_gemms=False)
    per_logit = buffers * torch.finfo(chunks.acc).bits // 8
    if rows.dtype != chunks.acc or teacher_rows.dtype != chunks.acc:
        per_logit += 2 * max(rows.element_size(), teacher_rows.element_size())  # 16-bit copies of dS, dT
    chunks.width = chunk_columns(chunks.m, chunks.k, per_logit, budget)
    return chunks


def _softmax_statistics(t, s, dim, in_place):
    """(logsumexp of t along dim, sum of softmax(t) * s along dim) with one exp pass: e = exp(t - max),
    then log(sum e) + max and (e . s) / sum e. in_place: t may be overwritten."""
    high = t.amax(dim=dim, keepdim=True)
    high = torch.where(torch.isfinite(high), high, torch.zeros_like(high))
    e = (t.sub_(high) if in_place else t - high).exp_()
    total = e.sum(dim=dim)
    return total.log() + high.squeeze(dim), torch.linalg.vecdot(e, s, dim=dim) / total


def _merge_rows(lse, cross, chunk_lse, chunk_cross):
    """Running (LSE, softmax-weighted mean) merged with a chunk's: the means are reweighted by
    their share of the merged normaliser."""
    merged = torch.logaddexp(lse, chunk_lse)
    return merged, torch.exp(lse - merged) * cross + torch.exp(chunk_lse - merged) * chunk_cross


def _forward(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns, budget):
    chunks = _student_chunks(rows, cols, teacher_rows, _FORWARD_BUFFERS, budget)
    teachers = _TeacherChunks(teacher_rows, teacher_cols, budget)
    acc = chunks.acc
    s_scale, t_scale = scale.to(acc), teacher_scale.to(acc)
    n_teachers, m, k = teacher_rows.shape[0], chunks.m, chunks.k
    row_lse = rows.new_full((m,), float("-inf"), dtype=acc)
    pos_logit = rows.new_empty((m,), dtype=acc)
    teacher_row_lse = rows.new_full((n_teachers, m), float("-inf"), dtype=acc)
    row_cross = rows.new_zeros((n_teachers, m), dtype=acc)
    k_out = k if want_columns else 0
    col_lse = rows.new_empty((k_out,), dtype=acc)
    teacher_col_lse = rows.new_empty((n_teachers, k_out), dtype=acc)
    col_cross = rows.new_empty((n_teachers, k_out), dtype=acc)
    for begin, width in chunks:
        s = chunks.dots(begin, width).mul_(s_scale)
        row_lse = torch.logaddexp(row_lse, torch.logsumexp(s, dim=1))
        first, last, diagonal = chunks.positives(s, begin, pos_offset)
        pos_logit.narrow(0, first, last - first).copy_(diagonal)
        del diagonal
        if want_columns:
            col_lse.narrow(0, begin, width).copy_(torch.logsumexp(s, dim=0))
        for t_index in range(n_teachers):
            t, _ = teachers.logits(t_index, begin, width, t_scale, acc, keep_dots=False)
            if want_columns:
                t_col, cross = _softmax_statistics(t, s, dim=0, in_place=False)
                teacher_col_lse[t_index].narrow(0, begin, width).copy_(t_col)
                col_cross[t_index].narrow(0, begin, width).copy_(cross)
            t_row, cross = _softmax_statistics(t, s, dim=1, in_place=True)
            teacher_row_lse[t_index], row_cross[t_index] = _merge_rows(
                teacher_row_lse[t_index], row_cross[t_index], t_row, cross)
            del t
        del s  # before the next chunk's GEMM allocates its result
    return row_lse, pos_logit, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross


def _prescale_or_none(chunks, bound):
    return fp16_prescale(bound) if chunks.grad_dtype == torch.float16 else None


def _max_abs(tensors, like):
    """sum of max |g| over the given (non-None, non-empty) tensors: a bound of a sum of terms."""
    total = torch.zeros((), dtype=like.dtype, device=like.device)
    for g in tensors:
        if g is not None and g.numel():
            total = total + g.abs().max().to(like.dtype)
    return total


def _max_of_sums(tensors, like):
    """max over positions of the sum of |g| over the given (non-None, non-empty) tensors, a T x n one
    contributing sum_k |g_k| at each of its n positions: the largest weight the terms give one row's
    (or one column's) logits, softmaxes being <= 1."""
    total = None
    for g in tensors:
        if g is not None and g.numel():
            g = g.abs().to(like.dtype)
            g = g.sum(0) if g.dim() == 2 else g
            total = g if total is None else total + g
    return torch.zeros((), dtype=like.dtype, device=like.device) if total is None else total.max()


def _backward(grads, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, stats, budget,
              needs):
    """Gradients (rows, cols, teacher_rows, teacher_cols, scale, teacher_scale), None where not in
    `needs`, for the upstream gradients `grads` (the forward's seven outputs' order; None: that
    output took no part in the loss) and the statistics `stats` (row_lse, teacher_row_lse,
    row_cross, col_lse, teacher_col_lse, col_cross; the column ones unused when their gradients
    are None)."""
    g_row, g_pos, g_trow, g_rcross, g_col, g_tcol, g_ccross = grads
    row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross = stats
    want_rows, want_cols, want_trows, want_tcols, want_scale, want_tscale = needs
    want_teacher = want_trows or want_tcols or want_tscale
    chunks = _student_chunks(rows, cols, teacher_rows, _BACKWARD_BUFFERS, budget)
    teachers = _TeacherChunks(teacher_rows, teacher_cols, budget)
    acc, n_teachers = chunks.acc, teacher_rows.shape[0]
    device = rows.device
    s_scale, t_scale = scale.to(acc), teacher_scale.to(acc)
    zero = torch.zeros((), dtype=acc, device=device)
    # fp16 gradient GEMMs: dS_ij is bounded by row i's weights (|g_row| + sum_k |g_row_cross^k|), plus the
    # positive's and column j's (softmaxes <= 1): the bound of the CUDA path (distill_lse.cu)
    ds_bound = _max_of_sums((g_row, g_rcross), zero) + _max_abs((g_pos,), zero) + _max_of_sums((g_col, g_ccross), zero)
    prescale = _prescale_or_none(chunks, ds_bound)
    student_gemms = GradientGemms(chunks, s_scale, rows.dtype, prescale, want_rows, want_cols)
    teacher_gemms = []
    if want_trows or want_tcols:
        # |s - cross| <= 2 max|s| <= 2 |scale| max||rows_i|| max||cols_j|| (Cauchy-Schwarz)
        norm = lambda x: torch.linalg.vector_norm(x, dim=1, dtype=acc).max()  # noqa: E731
        s_bound = 2 * s_scale.abs() * norm(rows) * norm(cols)
        t_bound = _max_abs((g_trow, g_tcol), zero) + _max_abs((g_rcross, g_ccross), zero) * s_bound
        for t_index, t_chunks in enumerate(teachers.each):
            teacher_gemms.append(GradientGemms(t_chunks, t_scale[t_index], teacher_rows.dtype,
                                               _prescale_or_none(t_chunks, t_bound), want_trows, want_tcols))
    grad_scale = zero.clone()
    grad_tscale = torch.zeros((n_teachers,), dtype=acc, device=device)
    row_shift = -row_lse.unsqueeze(1)
    for begin, width in chunks:
        dots = chunks.dots(begin, width)
        # the student's logits themselves only enter the teachers' gradients
        s = dots * s_scale if want_teacher else None
        # exp(s - lse) straight from the dots: one pass each
        ds = (torch.addcmul(row_shift, dots, s_scale).exp_().mul_(g_row.unsqueeze(1)) if g_row is not None
              else torch.zeros_like(dots))
        if g_col is not None:
            col_shift = -col_lse.narrow(0, begin, width)
            ds.add_(torch.addcmul(col_shift, dots, s_scale).exp_().mul_(g_col.narrow(0, begin, width)))
        if g_pos is not None:
            first, last, diagonal = chunks.positives(ds, begin, pos_offset)
            diagonal.add_(g_pos.narrow(0, first, last - first))
            del diagonal
        for t_index in range(n_teachers):
            if g_rcross is None and g_ccross is None and not want_teacher:
                break
            t, t_dots = teachers.logits(t_index, begin, width, t_scale, acc, keep_dots=want_tscale)
            dt = torch.zeros_like(t) if want_teacher else None
            if g_rcross is not None or g_trow is not None:
                p = (t - teacher_row_lse[t_index].unsqueeze(1)).exp_()
                _add_softmax_terms(ds, dt, p, s, _row(g_rcross, t_index), _row(g_trow, t_index),
                                   row_cross[t_index].unsqueeze(1), rows_axis=True)
                del p
            if g_ccross is not None or g_tcol is not None:
                j = slice(begin, begin + width)
                q = (t - teacher_col_lse[t_index, j]).exp_()
                _add_softmax_terms(ds, dt, q, s, _row(g_ccross, t_index, j), _row(g_tcol, t_index, j),
                                   col_cross[t_index, j], rows_axis=False)
                del q
            del t
            if want_teacher:
                if want_tscale:
                    grad_tscale[t_index] += (dt * t_dots).sum()
                if teacher_gemms:
                    teacher_gemms[t_index].add(dt.to(teachers.each[t_index].acc), begin, width)
            del dt, t_dots
        if want_scale:
            grad_scale += (ds * dots).sum()
        del dots, s
        if want_rows or want_cols:
            student_gemms.add(ds, begin, width)
        del ds  # before the next chunk's GEMM allocates its result
    grad_rows, grad_cols = student_gemms.results()
    teacher_results = [g.results() for g in teacher_gemms]
    grad_trows = torch.stack([r for r, _ in teacher_results]) if want_trows else None
    grad_tcols = torch.stack([c for _, c in teacher_results]) if want_tcols else None
    return (grad_rows, grad_cols, grad_trows, grad_tcols, grad_scale.to(scale.dtype) if want_scale else None,
            grad_tscale.to(teacher_scale.dtype) if want_tscale else None)


def _row(g, t_index, columns=None):
    """Teacher t_index's row of an upstream gradient (T x n), or None."""
    if g is None:
        return None
    g = g[t_index]
    return g if columns is None else g[columns]


def _add_softmax_terms(ds, dt, soft, s, g_cross, g_lse, cross, rows_axis):
    """ds += g_cross soft; dt += soft (g_lse + g_cross (s - cross)) for one teacher's row (P) or
    column (Q) softmax `soft`; the per-row gradients broadcast over columns when rows_axis."""
    shape = (lambda g: g.unsqueeze(1)) if rows_axis else (lambda g: g)
    if g_cross is not None:
        ds.addcmul_(soft, shape(g_cross))
    if dt is None:
        return
    weight = torch.zeros_like(s) if g_cross is None else (s - cross).mul_(shape(g_cross))
    if g_lse is not None:
        weight.add_(shape(g_lse))
    dt.addcmul_(soft, weight)


class _DistillLse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns, budget):
        outputs = _forward(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns,
                           budget)
        row_lse, _, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross = outputs
        ctx.save_for_backward(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, row_lse, teacher_row_lse,
                              row_cross, col_lse, teacher_col_lse, col_cross)
        ctx.pos_offset, ctx.want_columns, ctx.budget = pos_offset, want_columns, budget
        ctx.set_materialize_grads(False)  # an output left out of the loss hands back None: its term is skipped
        return outputs

    @staticmethod
    @autocast_off  # also when the backward runs inside the autocast block
    def backward(ctx, *grads):
        saved = ctx.saved_tensors
        inputs, stats = saved[:6], saved[6:]
        if not ctx.want_columns:
            grads = grads[:4] + (None, None, None)
        if all(g is None for g in grads):
            return (None,) * 9
        result = _backward(grads, *inputs, ctx.pos_offset, stats, ctx.budget, ctx.needs_input_grad[:6])
        return (*result, None, None, None)


def distill_lse_torch(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns, budget):
    """distill_lse's seven outputs by the torch path; the arguments were checked by the caller."""
    return _DistillLse.apply(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns,
                             budget)


def distill_lse_backward_torch(grads, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset,
                               stats, teacher_grad, budget):
    """The op's backward contract by the torch path: the six gradients, the teachers' empty
    tensors when not teacher_grad."""
    needs = (True, True, teacher_grad, teacher_grad, True, teacher_grad)
    result = list(_backward(grads, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, stats,
                            budget, needs))
    if not teacher_grad:
        result[2], result[3] = teacher_rows.new_empty(0), teacher_cols.new_empty(0)
        result[5] = teacher_scale.new_empty(0)
    return tuple(result)
