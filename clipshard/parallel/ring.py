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
"""
import torch

from clipshard.parallel._ring_pass import Ring, Travelling, blocks
from clipshard.ops.contrastive_lse import contrastive_lse, contrastive_lse_backward


def _transposed(image, block, own):
    """The op needs pos_offset + M <= K: a foreign block with fewer columns than I_r has rows is
    computed as S^T (rows T_q, columns I_r; the roles of the row and column LSEs swap)."""
    return not own and block.shape[0] < image.shape[0]


def _block_forward(image, block, scale, bias, own, algorithm):
    """(row LSE part [M], positives [M] (own block only, else None), column LSE part [K])."""
    if _transposed(image, block, own):
        col, _, row = contrastive_lse(block, image, scale, bias, 0, True, algorithm=algorithm)
        return row, None, col
    row, pos, col = contrastive_lse(image, block, scale, bias, 0, True, algorithm=algorithm)
    return row, (pos if own else None), col


def _block_backward(image, block, scale, bias, row_lse, col_lse, g_row, g_pos, g_col, own, algorithm):
    """(d image, d block, d scale, d bias) of one block given the full LSEs and their gradients."""
    if _transposed(image, block, own):
        no_pos = g_col.new_zeros(block.shape[0])
        d_block, d_image, d_scale, d_bias = contrastive_lse_backward(
            g_col, no_pos, g_row, block, image, scale, bias, 0, col_lse, row_lse, algorithm=algorithm)
        return d_image, d_block, d_scale, d_bias
    if not own:
        g_pos = g_row.new_zeros(image.shape[0])
    return contrastive_lse_backward(g_row, g_pos, g_col, image, block, scale, bias, 0, row_lse, col_lse,
                                    algorithm=algorithm)


class _RingLSE(torch.autograd.Function):
    """(row LSE of I_r over all columns, positives of I_r, full column LSE of this rank's columns)."""

    @staticmethod
    def forward(ctx, image, text, scale, bias, layout, algorithm):
        ring = Ring(layout)
        image = image.contiguous()
        # the partial column LSEs of a block, folded (logaddexp) by every rank it visits
        column = Travelling(ring, lambda acc, part: part if acc is None else torch.logaddexp(acc, part))
        for step, block, _ in blocks(ring, text):
            row, own_pos, col = _block_forward(image, block, scale, bias, step == 0, algorithm)
            if step == 0:
                row_lse, pos = row, own_pos
            else:
                row_lse = torch.logaddexp(row_lse, row)
            column.fold(step, col)
        col_lse = column.result()  # the full column LSE of this rank's own columns
        ctx.save_for_backward(image, text, scale, bias, row_lse, col_lse)
        ctx.layout, ctx.algorithm = layout, algorithm
        return row_lse, pos, col_lse

    @staticmethod
    def backward(ctx, g_row, g_pos, g_col):
        image, text, scale, bias, row_lse, col_lse = ctx.saved_tensors
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
        for step, block, column in blocks(ring, text, torch.stack([col_lse, g_col])):
            di, dt, ds, db = _block_backward(image, block, scale, bias, row_lse, column[0], g_row, g_pos,
                                             column[1], step == 0, ctx.algorithm)
            d_image += di
            d_scale += ds.double()
            d_bias += db.double()
            d_text.fold(step, dt)
            del di, dt  # not alive during the next block's work
        grads = (d_image.to(image.dtype), d_text.result().to(text.dtype),
                 d_scale.to(scale.dtype).reshape(scale.shape),
                 None if bias is None else d_bias.to(bias.dtype).reshape(bias.shape))
        return tuple(g if need else None for g, need in zip(grads, ctx.needs_input_grad[:4])) + (None, None)


def ring_partial(image, text, scale, bias, layout, algorithm="auto"):
    """This rank's partial P_r (exchange.py's notation) in ring mode: exchange_partial's value and
    gradients, without gathering the text features."""
    row_lse, pos, col_lse = _RingLSE.apply(image, text, scale, bias, layout, algorithm)
    # S_jj of this rank's column j = offset + i is the positive logit of local row i.
    return (row_lse - pos).sum() + (col_lse - pos).sum()
