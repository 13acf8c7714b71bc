"""The CLIP loss over ranks, in the two modes of docs/distributed.md, with open_clip's gradients.

Notation: this rank holds M local pairs (I_r, T_r) starting at global row `offset`; the global batch
has NM pairs; S = s * I @ T^T (+ b). A rank's *partial* P_r is

    P_r = sum_{i in r} (rowLSE_i(S) - S_ii) + sum_{j in r} (colLSE_j(S) - S_jj),

so that open_clip's per-rank loss (local_loss=True) is P_r / (2M) and its full-batch loss
(local_loss=False, the same value on every rank) is sum_r P_r / (2NM).

- exchange: one fused pass over the row block I_r vs T (gathered); the column LSEs of this rank's
  columns come from combining every rank's partial column LSE (NM floats).
- local: two fused passes, I_r vs T and T_r vs I (both gathered), row LSEs only.
- ring: exchange's maths with the text blocks passed around the ring instead of gathered
  (clipshard/parallel/ring.py).
"""
import functools

import torch

from clipshard.parallel import collectives as cdist
from clipshard.ops.contrastive_lse import contrastive_lse
from clipshard.parallel.ring import ring_partial


def exchange_partial(image, text, scale, bias, layout, algorithm="auto"):
    cols = cdist.gather_rows(text, layout)
    row_lse, pos, col_part = contrastive_lse(image, cols, scale, bias, layout.offset, True, algorithm=algorithm)
    col_lse = cdist.combine_column_lse(col_part, layout).narrow(0, layout.offset, layout.local_size)
    # S_jj of this rank's column j = offset + i is the positive logit of local row i.
    return (row_lse - pos).sum() + (col_lse - pos).sum()


def local_partial(image, text, scale, bias, layout, gather_with_grad=True, algorithm="auto"):
    all_text = cdist.gather_rows(text, layout, with_grad=gather_with_grad)
    all_image = cdist.gather_rows(image, layout, with_grad=gather_with_grad)
    image_lse, image_pos, _ = contrastive_lse(image, all_text, scale, bias, layout.offset, False, algorithm=algorithm)
    text_lse, text_pos, _ = contrastive_lse(text, all_image, scale, bias, layout.offset, False, algorithm=algorithm)
    return (image_lse - image_pos).sum() + (text_lse - text_pos).sum()


_PARTIALS = {"exchange": exchange_partial, "local": local_partial, "ring": ring_partial}


def rank_loss(image, text, scale, bias, layout, mode, gather_with_grad, algorithm="auto"):
    """open_clip's local_loss=True loss of this rank, P_r / (2M), with plain autograd.

    gather_with_grad=True: the gathers' backward reduce-scatters, so this rank's features receive
    the gradient of sum_q g_q * L_q (g_q: rank q's upstream gradient), as in open_clip.
    gather_with_grad=False (local mode only): gathered features are constants, as in open_clip.
    """
    if mode == "local":
        partial = local_partial(image, text, scale, bias, layout, gather_with_grad, algorithm)
    else:
        partial = _PARTIALS[mode](image, text, scale, bias, layout, algorithm)
    return partial / (2 * layout.local_size)


def global_loss(image, text, scale, bias, layout, mode, gather_with_grad, algorithm="auto"):
    """open_clip's local_loss=False loss, sum_r P_r / (2NM), the same value on every rank."""
    partial_fn = functools.partial(_PARTIALS[mode], algorithm=algorithm)
    return _GlobalLoss.apply(partial_fn, layout, gather_with_grad, image, text, scale, bias)


class _GlobalLoss(torch.autograd.Function):
    """Full-batch loss L with open_clip's gradients for local_loss=False.

    open_clip computes the whole NM x NM loss on every rank, so rank r's gradients are
        features:  G * dL/d(I_r, T_r) with G = sum_q g_q   (gather_with_grad=True)
                   g_r * dL/d(I_r, T_r)                    (gather_with_grad=False: the 1/N scale
                                                            after DDP's averaging, kept on purpose)
        logit_scale, logit_bias:  g_r * dL/ds, g_r * dL/db.
    Here each rank computes only P_r. The backward first takes the *unit* gradient of L (every rank
    weighs its P_r by 1/(2NM); the gathers' reduce-scatter and the column-LSE all-reduce complete
    dL/d(own features)), all-reduces [g_r, dP_r/ds, dP_r/db] (three numbers) to get G, dL/ds and
    dL/db, then scales. The graph of P_r is built in forward and differentiated in backward.
    """

    @staticmethod
    def forward(ctx, partial_fn, layout, gather_with_grad, image, text, scale, bias):
        leaves = [None if t is None else t.detach().requires_grad_(t.requires_grad)
                  for t in (image, text, scale, bias)]
        with torch.enable_grad():
            partial = partial_fn(*leaves, layout)
        ctx.graph = (partial, leaves)
        ctx.layout, ctx.gather_with_grad = layout, gather_with_grad
        return cdist.all_reduce_sum(partial, layout) / (2 * layout.total)

    @staticmethod
    def backward(ctx, grad):
        partial, leaves = ctx.graph
        ctx.graph = None
        layout = ctx.layout
        wanted = [k for k, t in enumerate(leaves) if t is not None and t.requires_grad]
        unit = torch.autograd.grad(partial, [leaves[k] for k in wanted],
                                   partial.new_tensor(1.0 / (2 * layout.total)))
        unit = dict(zip(wanted, unit))
        zero = grad.new_zeros((), dtype=torch.float64)
        sums = cdist.all_reduce_sum(torch.stack([
            grad.double(), unit[2].double().reshape(()) if 2 in unit else zero,
            unit[3].double().reshape(()) if 3 in unit else zero]), layout)
        feature_weight = sums[0] if ctx.gather_with_grad else grad.double()
        out = [None, None, None]
        for k, leaf in enumerate(leaves):
            if k not in unit:
                out.append(None)
            elif k < 2:
                acc = torch.promote_types(leaf.dtype, torch.float32)
                out.append((unit[k].to(acc) * feature_weight.to(acc)).to(leaf.dtype))
            else:
                out.append((grad.double() * sums[k - 1]).to(leaf.dtype).reshape(leaf.shape))
        return tuple(out)
