"""Ring mode of the sharded CLIP loss (docs/distributed.md): the text blocks travel around the ring of
ranks instead of being all-gathered, so a rank never holds more than a few M x D blocks.

Rank r keeps its image rows I_r. At step k = 0 .. N-1 it holds the text block T_q of rank
q = (r - k) mod N: it received it from rank r - 1 and passes it on to rank r + 1 while it calls the
fused op on the block S_rq = s * I_r @ T_q^T (+ b), so the next block is in flight during the
current block's work (two block buffers). Every similarity is computed once per pass.

Forward:
- the block's row LSEs are folded into I_r's row LSE (logaddexp, in step order);
- the block's partial column LSE over I_r (K_q floats) is folded into an accumulator that travels
  with T_q, one step behind it; after visiting every rank it is the full column LSE of q's columns,
  C_q[j] = logsumexp_r c_rq[j], and its last hop delivers it to q. O(NM) floats per rank in all.
- the positives S_ii come from the own block (step 0).
Backward (recomputation): the op's backward on each block with the FULL row LSE of I_r and the FULL
column LSE C_q, which travels with T_q together with its owner's upstream gradient g_C_q. Then each
block's dS_ij = g_row_i exp(S_ij - rowLSE_i) + g_C_j exp(S_ij - C_j) (+ g_pos on the diagonal of the
own block), which is exactly the gradient of the loss through the folds and the combine. The
gradient of I_r accumulates locally; that of T_q accumulates in a buffer that travels with the block
(fp32 for 16-bit features) and arrives at its owner after N hops.

Each rank's per-block work and its logit_scale / logit_bias gradient are those of exchange mode
(the same row block, cut into N column blocks), so ring mode gives exchange mode's results. The
point-to-point pass (blocks in flight, travelling accumulators) is clipshard/parallel/_ring_pass.py, shared
with SigLIP's ring mode.

Sample ids (docs/targets.md): the sample ids of a text block travel with it (and with its column LSE
in the backward). Targets "mask": every block call gets the ids; the foreign blocks have no
positives (pos_offset None), so that every same-id pair there leaves the LSEs, and are transposed
exactly when they would be without ids. Targets "multi": the LSEs are those without ids; the
positives (mean same-id logits of this rank's rows and of its columns over every rank's rows) are
the own pairs' logits from the LSE pass and the other same-id pairs' sums from a second pass
(_RingSameIdSums) that adds up each block's sums, the columns' sums travelling with their block like
the column LSEs. With all ids distinct both targets give the bits of the loss without ids. Hard
negatives are gathered (O(sum_r H_r D) per rank) and join the row LSEs outside the pass.
"""
import torch

from clipshard.parallel._ring_pass import Ring, Travelling, blocks
from clipshard.ops.contrastive_lse import contrastive_lse, contrastive_lse_backward
from clipshard.ops.inputs import accumulate_dtype
from clipshard.ops.same_id import mean_positive, other_same_id_logit_sums, other_same_id_logit_sums_backward
from clipshard.parallel.collectives import gather_negatives


def _transposed(image, block, own):
    """The op needs pos_offset + M <= K: a foreign block with fewer columns than I_r has rows is
    computed as S^T (rows T_q, columns I_r; the roles of the row and column LSEs swap)."""
    return not own and block.shape[0] < image.shape[0]


def _block_forward(image, block, scale, bias, own, algorithm, ids=None, block_ids=None):
    """(row LSE part [M], positives [M] (own block only, else None), column LSE part [K]). With ids
    (targets "mask") a foreign block has no positives (pos_offset None): its same-id pairs all
    leave the LSEs. It is transposed exactly when it would be without ids, so that with all ids
    distinct every block does the same floating-point operations as without ids."""
    pos_offset = 0 if own or ids is None else None
    mask = {} if ids is None else dict(targets="mask")
    if _transposed(image, block, own):
        col, _, row = contrastive_lse(block, image, scale, bias, pos_offset, True, row_ids=block_ids, col_ids=ids,
                                      algorithm=algorithm, **mask)
        return row, None, col
    row, pos, col = contrastive_lse(image, block, scale, bias, pos_offset, True, row_ids=ids, col_ids=block_ids,
                                    algorithm=algorithm, **mask)
    return row, (pos if own else None), col


def _block_backward(image, block, scale, bias, row_lse, col_lse, g_row, g_pos, g_col, own, algorithm, ids=None,
                    block_ids=None):
    """(d image, d block, d scale, d bias) of one block given the full LSEs and their gradients."""
    pos_offset = 0 if own or ids is None else None
    if _transposed(image, block, own):
        no_pos = g_col.new_zeros(block.shape[0])
        d_block, d_image, d_scale, d_bias = contrastive_lse_backward(
            g_col, no_pos, g_row, block, image, scale, bias, pos_offset, col_lse, row_lse, row_ids=block_ids,
            col_ids=ids, algorithm=algorithm)
        return d_image, d_block, d_scale, d_bias
    if not own:
        g_pos = g_row.new_zeros(image.shape[0])
    return contrastive_lse_backward(g_row, g_pos, g_col, image, block, scale, bias, pos_offset, row_lse, col_lse,
                                    row_ids=ids, col_ids=block_ids, algorithm=algorithm)


class _RingLSE(torch.autograd.Function):
    """(row LSE of I_r over all columns, positives of I_r, full column LSE of this rank's columns)."""

    @staticmethod
    def forward(ctx, image, text, scale, bias, layout, algorithm, ids=None):
        ring = Ring(layout)
        image = image.contiguous()
        # the partial column LSEs of a block, folded (logaddexp) by every rank it visits
        column = Travelling(ring, lambda acc, part: part if acc is None else torch.logaddexp(acc, part))
        for step, block, block_ids in blocks(ring, text, ids):
            row, own_pos, col = _block_forward(image, block, scale, bias, step == 0, algorithm, ids, block_ids)
            if step == 0:
                row_lse, pos = row, own_pos
            else:
                row_lse = torch.logaddexp(row_lse, row)
            column.fold(step, col)
            del block  # freed before the generator allocates the next block's buffer
        col_lse = column.result()  # the full column LSE of this rank's own columns
        ctx.save_for_backward(image, text, scale, bias, row_lse, col_lse, ids)
        ctx.layout, ctx.algorithm = layout, algorithm
        return row_lse, pos, col_lse

    @staticmethod
    def backward(ctx, g_row, g_pos, g_col):
        image, text, scale, bias, row_lse, col_lse, ids = ctx.saved_tensors
        ring = Ring(ctx.layout)
        g_row = torch.zeros_like(row_lse) if g_row is None else g_row.contiguous()
        g_pos = torch.zeros_like(row_lse) if g_pos is None else g_pos.contiguous()
        g_col = torch.zeros_like(col_lse) if g_col is None else g_col.contiguous()
        grad_dtype = torch.promote_types(text.dtype, torch.float32)  # fp32 accumulation for 16-bit
        d_image = torch.zeros(image.shape, dtype=grad_dtype, device=image.device)
        d_scale = torch.zeros((), dtype=torch.float64, device=image.device)
        d_bias = torch.zeros((), dtype=torch.float64, device=image.device)
        d_text = Travelling(ring, lambda acc, part: part.to(grad_dtype) if acc is None else acc.add_(part))
        # what travels ahead with a text block: its full column LSE and its owner's gradient of it
        # (and its sample ids)
        column_and_ids = torch.stack([col_lse, g_col]) if ids is None else (torch.stack([col_lse, g_col]), ids)
        for step, block, companion in blocks(ring, text, column_and_ids):
            column, block_ids = (companion, None) if ids is None else companion
            d_text.arrive()  # the accumulator of this block is in; the one sent on is freed
            di, dt, ds, db = _block_backward(image, block, scale, bias, row_lse, column[0], g_row, g_pos,
                                             column[1], step == 0, ctx.algorithm, ids, block_ids)
            d_image += di
            d_scale += ds.double()
            d_bias += db.double()
            del di  # freed before the next accumulator's buffer is allocated
            d_text.fold(step, dt)
            del dt, block  # not alive during the next block's work (nor when its buffer is allocated)
        grads = (d_image.to(image.dtype), d_text.result().to(text.dtype),
                 d_scale.to(scale.dtype).reshape(scale.shape),
                 None if bias is None else d_bias.to(bias.dtype).reshape(bias.shape))
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:4])) + (None, None, None)


def _other_sums(image, block, scale, bias, ids, block_ids, step):
    """The block's sums over its other same-id pairs (the own block's diagonal left out)."""
    return other_same_id_logit_sums(image, block, scale, bias, ids, block_ids, 0 if step == 0 else None)


class _RingSameIdSums(torch.autograd.Function):
    """Targets "multi": (sum of S_ij over the columns j of every rank with id a_i, for this rank's
    rows i, the own pair left out; their count; sum over the rows of every rank with id c_j, for
    this rank's columns j, likewise; their count), from one pass of other_same_id_logit_sums per
    block. The counts carry no gradient. Backward: a second pass, each block's gradients by
    other_same_id_logit_sums_backward (no autograd inside the backward, which dynamo would not trace)."""

    @staticmethod
    def forward(ctx, image, text, scale, bias, ids, layout):
        ring = Ring(layout)
        image = image.contiguous()
        column = Travelling(ring, lambda acc, part: part if acc is None else acc.add_(part))
        for step, block, block_ids in blocks(ring, text, ids):
            rs, rc, cs, cc = _other_sums(image, block, scale, bias, ids, block_ids, step)
            row_sum, row_count = (rs, rc) if step == 0 else (row_sum + rs, row_count + rc)
            column.fold(step, torch.stack([cs, cc], dim=1))  # K x 2: Travelling keeps the first dimension
        col_sum, col_count = column.result().unbind(1)
        ctx.save_for_backward(image, text, scale, bias, ids)
        ctx.layout = layout
        ctx.mark_non_differentiable(row_count, col_count)
        return row_sum, row_count, col_sum, col_count

    @staticmethod
    def backward(ctx, g_row_sum, _, g_col_sum, __):
        image, text, scale, bias, ids = ctx.saved_tensors
        ring = Ring(ctx.layout)
        acc = accumulate_dtype(image.dtype)  # fp32 accumulation for 16-bit features
        g_row_sum = image.new_zeros(image.shape[0], dtype=acc) if g_row_sum is None else g_row_sum.to(acc)
        g_col_sum = image.new_zeros(text.shape[0], dtype=acc) if g_col_sum is None else g_col_sum.to(acc)
        d_image = torch.zeros(image.shape, dtype=acc, device=image.device)
        d_scale = torch.zeros((), dtype=torch.float64, device=image.device)
        d_bias = torch.zeros((), dtype=torch.float64, device=image.device)
        d_text = Travelling(ring, lambda total, part: part.to(acc) if total is None else total.add_(part))
        for step, block, (block_ids, g_block) in blocks(ring, text, (ids, g_col_sum.contiguous())):
            di, dt, ds, db = other_same_id_logit_sums_backward(image, block, scale, bias, ids, block_ids,
                                                               0 if step == 0 else None, g_row_sum, g_block)
            d_image += di
            d_scale += ds.double()
            if bias is not None:
                d_bias += db.double()
            d_text.fold(step, dt)
        out = (d_image.to(image.dtype), d_text.result().to(text.dtype), d_scale.to(scale.dtype).reshape(scale.shape),
               None if bias is None else d_bias.to(bias.dtype).reshape(bias.shape))
        return tuple(g if need else None for g, need in zip(out, ctx.needs_input_grad[:4])) + (None, None)


def ring_partial(image, text, scale, bias, layout, algorithm="auto", pairs=None):
    """This rank's partial P_r (exchange.py's notation) in ring mode: exchange_partial's value and
    gradients, without gathering the text features. pairs: exchange.PairTargets (None: today's loss)."""
    if pairs is None or pairs.plain:
        row_lse, pos, col_lse = _RingLSE.apply(image, text, scale, bias, layout, algorithm, None)
        # S_jj of this rank's column j = offset + i is the positive logit of local row i.
        return (row_lse - pos).sum() + (col_lse - pos).sum()
    ids = pairs.sample_ids
    row_lse, pos, col_lse = _RingLSE.apply(image, text, scale, bias, layout, algorithm,
                                           ids if pairs.targets == "mask" else None)
    negatives = gather_negatives(pairs.hard_negatives, layout)  # every image row sees every rank's
    if negatives is not None:
        extra = contrastive_lse(image, negatives, scale, bias, None, False, algorithm=algorithm)[0]
        row_lse = torch.logaddexp(row_lse, extra)
    if pairs.targets == "multi":
        row_sum, row_count, col_sum, col_count = _RingSameIdSums.apply(image, text, scale, bias, ids, layout)
        # the own pairs' logits from the LSE pass, the other same-id pairs' from the second pass: with
        # all ids distinct the bits of the loss without ids
        row_pos, col_pos = mean_positive(pos, row_sum, row_count), mean_positive(pos, col_sum, col_count)
    else:  # the own pairs (S_jj of this rank's column j = offset + i is local row i's)
        row_pos = col_pos = pos
    partial = (row_lse - row_pos).sum()
    if not pairs.both:
        return partial
    return partial + (col_lse - col_pos).sum()
