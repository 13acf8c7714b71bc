"""Ring mode of the distillation loss (docs/distillation.md): exchange mode's partials with the
student's and the teachers' text blocks passed around the ring instead of gathered, as ClipLoss's
ring mode does (clipshard/parallel/ring.py, whose notation this follows).

Forward: at each step the op runs on the row block I_r (and the teachers' I'_r) against the text
block of rank q; the row statistics fold locally (LSEs by logaddexp, the teacher-weighted means by
their shares of the merged normaliser), the column statistics of q's columns fold into an
accumulator that travels with the block and reaches q complete. Backward: the op's backward on
each block with the FULL statistics and their gradients (the column ones travel with the block),
which is the exact gradient through the folds; the text blocks' gradients travel back to their
owners.
"""
import torch

from clipshard.ops.distill_lse import distill_lse, distill_lse_backward
from clipshard.parallel._ring_pass import Ring, Travelling, blocks


def _merge(lse_a, cross_a, lse_b, cross_b):
    lse = torch.logaddexp(lse_a, lse_b)
    return lse, torch.exp(lse_a - lse) * cross_a + torch.exp(lse_b - lse) * cross_b


def _fold_columns(acc, part):
    """Column statistics packed K x (1 + 2T): student LSE, T teacher LSEs, T cross terms."""
    if acc is None:
        return part
    n = (part.shape[1] - 1) // 2
    teacher_lse, cross = _merge(acc[:, 1:1 + n], acc[:, 1 + n:], part[:, 1:1 + n], part[:, 1 + n:])
    return torch.cat([torch.logaddexp(acc[:, :1], part[:, :1]), teacher_lse, cross], dim=1)


def _teacher_block(packed, n_teachers, k):
    """T x K x Dt teacher features from their travelling form, (T Dt) x K."""
    return packed.reshape(n_teachers, -1, k).transpose(1, 2)


def _transposed(image, block, own):
    """The op needs pos_offset + M <= K: a foreign block with fewer columns than I_r has rows is
    computed as its transpose (the row and column statistics swap)."""
    return not own and block.shape[0] < image.shape[0]


class _RingDistill(torch.autograd.Function):
    """(row LSE, positives, row cross terms T x M, column LSE of this rank's columns, their cross
    terms T x M), all complete over the global batch."""

    @staticmethod
    def forward(ctx, image, text, teacher_image, teacher_text, scale, teacher_scale, layout, algorithm):
        ring = Ring(layout)
        n_teachers, m = teacher_image.shape[:2]
        image = image.contiguous()
        travelling_teacher = teacher_text.transpose(1, 2).reshape(-1, m).contiguous()
        column = Travelling(ring, _fold_columns)
        for step, block, packed in blocks(ring, text, travelling_teacher):
            teacher_block = _teacher_block(packed, n_teachers, block.shape[0])
            own = step == 0
            if _transposed(image, block, own):
                col, _, t_col, x_col, row, t_row, x_row = distill_lse(
                    block, image, teacher_block, teacher_image, scale, teacher_scale, 0, True, algorithm=algorithm)
            else:
                row, pos, t_row, x_row, col, t_col, x_col = distill_lse(
                    image, block, teacher_image, teacher_block, scale, teacher_scale, 0, True, algorithm=algorithm)
            if own:
                row_lse, own_pos, teacher_row_lse, row_cross = row, pos, t_row, x_row
            else:
                row_lse = torch.logaddexp(row_lse, row)
                teacher_row_lse, row_cross = _merge(teacher_row_lse, row_cross, t_row, x_row)
            column.fold(step, torch.cat([col.unsqueeze(1), t_col.t(), x_col.t()], dim=1))
        columns = column.result()
        col_lse, teacher_col_lse, col_cross = (columns[:, 0], columns[:, 1:1 + n_teachers].t(),
                                               columns[:, 1 + n_teachers:].t())
        ctx.save_for_backward(image, text, teacher_image, teacher_text, scale, teacher_scale, row_lse,
                              teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross)
        ctx.layout, ctx.algorithm = layout, algorithm
        return row_lse, own_pos, row_cross, col_lse, col_cross.contiguous()

    @staticmethod
    def backward(ctx, g_row, g_pos, g_row_cross, g_col, g_col_cross):
        (image, text, teacher_image, teacher_text, scale, teacher_scale, row_lse, teacher_row_lse, row_cross,
         col_lse, teacher_col_lse, col_cross) = ctx.saved_tensors
        ring = Ring(ctx.layout)
        n_teachers, m = teacher_image.shape[:2]
        acc = row_lse.dtype
        zeros = lambda like: torch.zeros_like(like)  # noqa: E731
        g_row, g_pos, g_col = (zeros(row_lse) if g is None else g for g in (g_row, g_pos, g_col))
        g_row_cross = zeros(row_cross) if g_row_cross is None else g_row_cross
        g_col_cross = zeros(col_cross) if g_col_cross is None else g_col_cross
        needs = ctx.needs_input_grad
        teacher_grad = needs[2] or needs[3] or needs[5]
        # what travels with a text block: its teachers' features, then its full column statistics
        # and their gradients (rows: col LSE, T teacher LSEs, T cross terms, d col LSE, T d cross)
        companion = torch.cat([teacher_text.transpose(1, 2).reshape(-1, m).to(acc), col_lse.unsqueeze(0),
                               teacher_col_lse, col_cross, g_col.unsqueeze(0), g_col_cross])
        n_features = companion.shape[0] - (2 + 3 * n_teachers)
        grad_dtype = torch.promote_types(text.dtype, torch.float32)
        d_image = torch.zeros(image.shape, dtype=grad_dtype, device=image.device)
        d_teacher_image = torch.zeros(teacher_image.shape, dtype=acc, device=image.device)
        d_scale = torch.zeros((), dtype=torch.float64, device=image.device)
        d_teacher_scale = torch.zeros(n_teachers, dtype=torch.float64, device=image.device)
        # the text block's gradient and its teachers', K x (D + T Dt), travelling back to the owner
        d_text = Travelling(ring, lambda total, part: part if total is None else total.add_(part))
        for step, block, packed in blocks(ring, text, companion):
            k = block.shape[0]
            d_text.arrive()  # the accumulator of this block is in; the one sent on is freed
            teacher_block = _teacher_block(packed[:n_features], n_teachers, k).to(teacher_text.dtype)
            stats = packed[n_features:]
            c_lse, c_teacher_lse = stats[0], stats[1:1 + n_teachers]
            c_cross, c_g = stats[1 + n_teachers:1 + 2 * n_teachers], stats[1 + 2 * n_teachers]
            c_g_cross = stats[2 + 2 * n_teachers:]
            own = step == 0
            # upstream gradients in the op's output order: (LSE, positives, teacher LSEs, cross terms)
            # of the rows, then (LSE, teacher LSEs, cross terms) of the columns
            row_grads = (g_row, g_pos if own else None, None, g_row_cross)
            row_stats = (row_lse, teacher_row_lse, row_cross)
            col_grads, col_stats = (c_g, None, c_g_cross), (c_lse, c_teacher_lse, c_cross)
            if _transposed(image, block, own):
                d_b, d_i, d_tb, d_ti, d_s, d_ts = distill_lse_backward(
                    (c_g, None, None, c_g_cross, g_row, None, g_row_cross), block, image, teacher_block,
                    teacher_image, scale, teacher_scale, 0, col_stats + row_stats, teacher_grad,
                    algorithm=ctx.algorithm)
            else:
                d_i, d_b, d_ti, d_tb, d_s, d_ts = distill_lse_backward(
                    row_grads + col_grads, image, block, teacher_image, teacher_block, scale, teacher_scale, 0,
                    row_stats + col_stats, teacher_grad, algorithm=ctx.algorithm)
            d_image += d_i
            d_scale += d_s.double()
            parts = [d_b.to(grad_dtype)]
            if teacher_grad:
                d_teacher_image += d_ti
                d_teacher_scale += d_ts.double()
                parts.append(d_tb.transpose(0, 1).reshape(k, -1).to(grad_dtype))
            del d_i, d_b, d_ti, d_tb  # freed before the next accumulator's buffer is allocated
            d_text.fold(step, torch.cat(parts, dim=1))
            del parts, block, packed, teacher_block, stats  # not alive when the next block's buffer is allocated
        total = d_text.result()
        d_teacher_text = (total[:, text.shape[1]:].reshape(m, n_teachers, -1).transpose(0, 1)
                          if teacher_grad else None)
        grads = (d_image.to(image.dtype), total[:, :text.shape[1]].to(text.dtype),
                 d_teacher_image.to(teacher_image.dtype),
                 None if d_teacher_text is None else d_teacher_text.to(teacher_text.dtype),
                 d_scale.to(scale.dtype).reshape(scale.shape), d_teacher_scale.to(teacher_scale.dtype))
        return tuple(g if need else None for g, need in zip(grads, needs[:6])) + (None, None)


def partial_terms(row_lse, row_pos, row_cross, col_lse, col_pos, col_cross):
    """(P, D) of rows and columns whose statistics are given (distill_exchange.py's notation); the
    cross terms are T x n and their mean over the teachers is the cross term of the teachers' mean
    softmax."""
    contrastive = (row_lse - row_pos).sum() + (col_lse - col_pos).sum()
    distill = (row_lse - row_cross.mean(0)).sum() + (col_lse - col_cross.mean(0)).sum()
    return torch.stack([contrastive, distill])


def weighted_rows(rows, weights):
    """Teacher rows times the per-feature weights of a mean of teachers' logits (None: none)."""
    return rows if weights is None else rows * weights.to(rows.dtype)


def ring_partials(image, text, scale, teacher, layout, algorithm="auto"):
    """exchange_partials (clipshard/parallel/distill_exchange.py) in ring mode: the same values and
    gradients, without gathering the text features."""
    teacher_image, teacher_text, teacher_scale, weights = teacher
    row_lse, pos, row_cross, col_lse, col_cross = _RingDistill.apply(
        image, text, weighted_rows(teacher_image, weights), teacher_text, scale, teacher_scale, layout, algorithm)
    # S_jj of this rank's column j = offset + i is the positive logit of local row i
    return partial_terms(row_lse, pos, row_cross, col_lse, pos, col_cross)
