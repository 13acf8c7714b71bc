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
    """open_clip's local_loss=False loss, sum_r P_r / (2NM), the same value on every rank.

    open_clip computes the whole NM x NM loss on every rank, so rank r's gradients are
        features:  G * dL/d(I_r, T_r) with G = sum_q g_q   (gather_with_grad=True)
                   g_r * dL/d(I_r, T_r)                    (gather_with_grad=False: the 1/N scale
                                                            after DDP's averaging, kept on purpose)
        logit_scale, logit_bias:  g_r * dL/ds, g_r * dL/db.
    Here each rank computes only P_r, in the ordinary autograd graph between two Functions: the
    backward of _SumOfPartials hands P_r the *unit* gradient 1/(2NM) (the gathers' reduce-scatter
    and the column-LSE all-reduce complete dL/d(own features)) and records g_r (and G); the backward
    of _OpenClipWeights, which autograd runs after it, scales the features' unit gradients by G (or
    g_r) and all-reduces dP_r/ds, dP_r/db into dL/ds, dL/db times g_r. No graph is kept outside
    autograd's, so retain_graph and a second backward behave as autograd's own.
    """
    upstream = _Upstream()
    image, text, scale, bias = _OpenClipWeights.apply(upstream, layout, image, text, scale, bias)
    partial = _PARTIALS[mode](image, text, scale, bias, layout, algorithm=algorithm)
    return _SumOfPartials.apply(partial, upstream, layout, gather_with_grad)


class _Upstream:
    """What _SumOfPartials.backward learns for _OpenClipWeights.backward: this rank's upstream
    gradient g_r and the weight of the feature gradients (G or g_r), fp64 0-dim tensors."""
    own = None
    feature_weight = None


class _SumOfPartials(torch.autograd.Function):
    """L = sum_r P_r / (2NM) (one all-reduce); backward: the unit gradient to P_r, g_r (and G) to
    the _Upstream shared with _OpenClipWeights."""

    @staticmethod
    def forward(ctx, partial, upstream, layout, gather_with_grad):
        ctx.upstream, ctx.layout, ctx.gather_with_grad = upstream, layout, gather_with_grad
        # Nothing here needs it, but a freed saved tensor makes a second backward without
        # retain_graph raise torch's own error here, on every rank, before any collective.
        ctx.save_for_backward(partial)
        return cdist.all_reduce_sum(partial, ctx.layout) / (2 * layout.total)

    @staticmethod
    def backward(ctx, grad):
        partial, = ctx.saved_tensors
        own = grad.detach().double()
        ctx.upstream.own = own
        ctx.upstream.feature_weight = cdist.all_reduce_sum(own, ctx.layout) if ctx.gather_with_grad else own
        return partial.new_tensor(1.0 / (2 * ctx.layout.total)), None, None, None


class _OpenClipWeights(torch.autograd.Function):
    """The identity on (image, text, scale, bias); backward: open_clip's weights (global_loss) on the
    unit gradients that reach them."""

    @staticmethod
    def forward(ctx, upstream, layout, image, text, scale, bias):
        ctx.upstream, ctx.layout = upstream, layout
        return tuple(None if t is None else t.view_as(t) for t in (image, text, scale, bias))

    @staticmethod
    def backward(ctx, g_image, g_text, g_scale, g_bias):
        upstream = ctx.upstream
        out = [None, None]
        for g in (g_image, g_text):
            if g is None:
                out.append(None)
            else:
                acc = torch.promote_types(g.dtype, torch.float32)
                out.append((g.to(acc) * upstream.feature_weight.to(acc)).to(g.dtype))
        if ctx.needs_input_grad[4] or ctx.needs_input_grad[5]:  # the same on every rank (the losses' shard_layout)
            zero = upstream.own.new_zeros(())
            units = torch.stack([zero if g is None else g.double().reshape(()) for g in (g_scale, g_bias)])
            sums = cdist.all_reduce_sum(units, ctx.layout)
            for k, g in enumerate((g_scale, g_bias)):
                out.append(None if g is None else (upstream.own * sums[k]).to(g.dtype).reshape(g.shape))
        else:
            out += [None, None]
        return tuple(out)
