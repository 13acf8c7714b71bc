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

With the optional inputs beyond the diagonal (`PairTargets`, docs/targets.md) the same structure holds:
sample ids travel with the features (gathered like them), targets "mask" leave the same-id pairs
out of the LSEs, "multi" replaces S_ii by the mean logit of the same-id pairs (exchange: the column
sums over every rank's rows are all-reduced, NM floats and NM counts), hard negatives are gathered
like the texts and join the rows' LSEs only, and direction "image_to_text" keeps the row terms only
(P_r's first sum; the loss divides by M or NM instead of 2M or 2NM).
"""
import torch

from dataclasses import dataclass

from clipshard.parallel import collectives as cdist
from clipshard.ops.contrastive_lse import contrastive_lse
from clipshard.ops.same_id import mean_positive, other_same_id_logit_sums
from clipshard.parallel.ring import ring_partial


@dataclass(frozen=True)
class PairTargets:
    """The options beyond the diagonal as the modes use them (validated across ranks by the losses):
    sample_ids [M] int64 or None, targets None / "mask" / "multi" (None exactly when sample_ids
    is None), hard_negatives H_r x D or None, direction "both" or "image_to_text"."""

    sample_ids: object = None
    targets: str = None
    hard_negatives: object = None
    direction: str = "both"

    @property
    def plain(self):
        """None of them: the modes run today's code, bit for bit."""
        return self.sample_ids is None and self.hard_negatives is None and self.direction == "both"

    @property
    def both(self):
        return self.direction == "both"

    @property
    def terms(self):
        """Terms per pair in P_r: 2 (rows and columns) or 1 (rows only)."""
        return 2 if self.both else 1


PLAIN = PairTargets()


def gather_ids(ids, layout):
    return None if ids is None else cdist.gather_rows(ids, layout, with_grad=False)


def _column_mean_positives(own, col_sum, col_count, layout):
    """targets "multi": for this rank's columns j, the mean of S_jj (own: the own pairs' logits) and
    of S_ij over the other rows i with id c_j of every rank, from each rank's sums over its own rows
    (own pairs left out) for all NM columns, all-reduced (with grad)."""
    col_sum = cdist.all_reduce_sum_with_grad(col_sum, layout).narrow(0, layout.offset, layout.local_size)
    col_count = cdist.all_reduce_sum(col_count, layout).narrow(0, layout.offset, layout.local_size)
    return mean_positive(own, col_sum, col_count)


def exchange_partial(image, text, scale, bias, layout, algorithm="auto", pairs=PLAIN):
    cols = cdist.gather_rows(text, layout)
    if pairs.plain:
        row_lse, pos, col_part = contrastive_lse(image, cols, scale, bias, layout.offset, True, algorithm=algorithm)
        col_lse = cdist.combine_column_lse(col_part, layout).narrow(0, layout.offset, layout.local_size)
        # S_jj of this rank's column j = offset + i is the positive logit of local row i.
        return (row_lse - pos).sum() + (col_lse - pos).sum()
    ids, col_ids = pairs.sample_ids, gather_ids(pairs.sample_ids, layout)
    multi = pairs.targets == "multi"
    # "multi" keeps every pair in the LSEs: the op runs without ids (its positives are the own
    # pairs'), and one other_same_id_logit_sums gives the other same-id pairs of both the rows and
    # this rank's share of the columns'
    masked = {} if multi else dict(row_ids=ids, col_ids=col_ids, targets=pairs.targets)
    row_lse, pos, col_part = contrastive_lse(
        image, cols, scale, bias, layout.offset, pairs.both, **masked,
        extra_cols=cdist.gather_negatives(pairs.hard_negatives, layout), algorithm=algorithm)
    if multi:
        row_sum, row_count, col_sum, col_count = other_same_id_logit_sums(image, cols, scale, bias, ids, col_ids,
                                                                          layout.offset, want_cols=pairs.both)
        own, pos = pos, mean_positive(pos, row_sum, row_count)
    partial = (row_lse - pos).sum()
    if not pairs.both:
        return partial
    col_lse = cdist.combine_column_lse(col_part, layout).narrow(0, layout.offset, layout.local_size)
    # without "multi" the own pair: S_jj of this rank's column j = offset + i is local row i's
    col_pos = _column_mean_positives(own, col_sum, col_count, layout) if multi else pos
    return partial + (col_lse - col_pos).sum()


def local_partial(image, text, scale, bias, layout, gather_with_grad=True, algorithm="auto", pairs=PLAIN):
    all_text = cdist.gather_rows(text, layout, with_grad=gather_with_grad)
    all_image = cdist.gather_rows(image, layout, with_grad=gather_with_grad)
    if pairs.plain:
        image_lse, image_pos, _ = contrastive_lse(image, all_text, scale, bias, layout.offset, False,
                                                  algorithm=algorithm)
        text_lse, text_pos, _ = contrastive_lse(text, all_image, scale, bias, layout.offset, False,
                                                algorithm=algorithm)
        return (image_lse - image_pos).sum() + (text_lse - text_pos).sum()
    ids, all_ids = pairs.sample_ids, gather_ids(pairs.sample_ids, layout)
    negatives = cdist.gather_negatives(pairs.hard_negatives, layout, with_grad=gather_with_grad)
    image_lse, image_pos, _ = contrastive_lse(image, all_text, scale, bias, layout.offset, False, row_ids=ids,
                                              col_ids=all_ids, targets=pairs.targets, extra_cols=negatives,
                                              algorithm=algorithm)
    partial = (image_lse - image_pos).sum()
    if not pairs.both:
        return partial
    # the text rows against every image: "mask" and "multi" with the images' ids as the columns'
    text_lse, text_pos, _ = contrastive_lse(text, all_image, scale, bias, layout.offset, False, row_ids=ids,
                                            col_ids=all_ids, targets=pairs.targets, algorithm=algorithm)
    return partial + (text_lse - text_pos).sum()


_PARTIALS = {"exchange": exchange_partial, "local": local_partial, "ring": ring_partial}


def rank_loss(image, text, scale, bias, layout, mode, gather_with_grad, algorithm="auto", pairs=PLAIN):
    """open_clip's local_loss=True loss of this rank, P_r / (2M) (P_r / M for direction
    "image_to_text"), with plain autograd.

    gather_with_grad=True: the gathers' backward reduce-scatters, so this rank's features (and hard
    negatives) receive the gradient of sum_q g_q * L_q (g_q: rank q's upstream gradient), as in
    open_clip. gather_with_grad=False (local mode only): gathered features are constants, as in
    open_clip (the hard negatives too, this rank's included, like its texts among the columns).
    """
    if mode == "local":
        partial = local_partial(image, text, scale, bias, layout, gather_with_grad, algorithm, pairs)
    else:
        partial = _PARTIALS[mode](image, text, scale, bias, layout, algorithm, pairs)
    return partial / (pairs.terms * layout.local_size)


def global_loss(image, text, scale, bias, layout, mode, gather_with_grad, algorithm="auto", pairs=PLAIN):
    """open_clip's local_loss=False loss, sum_r P_r / (2NM) (/ NM for direction "image_to_text"),
    the same value on every rank.

    open_clip computes the whole NM x NM loss on every rank, so rank r's gradients are
        features:  G * dL/d(I_r, T_r) with G = sum_q g_q   (gather_with_grad=True)
                   g_r * dL/d(I_r, T_r)                    (gather_with_grad=False: the 1/N scale
                                                            after DDP's averaging, kept on purpose)
                   (the hard negatives H_r likewise)
        logit_scale, logit_bias:  g_r * dL/ds, g_r * dL/db.
    Here each rank computes only P_r, in the ordinary autograd graph between two Functions that share
    nothing but autograd's edges (so that torch.compile traces them): _SumOfPartials's backward hands
    P_r the *unit* gradient 1/(2NM) (the gathers' reduce-scatter and the column-LSE all-reduce
    complete dL/d(own features)); _OpenClipWeights, the identity on the inputs, also returns a zero
    *probe* that is added to the loss (the value is unchanged), so that its backward receives g_r as
    the probe's gradient. It scales the features' unit gradients by G (or g_r) and all-reduces
    dP_r/ds, dP_r/db into dL/ds, dL/db times g_r. retain_graph and a second backward behave as
    autograd's own.
    """
    if pairs.plain:
        image, text, scale, bias, probe = _OpenClipWeights.apply(layout, gather_with_grad, image, text, scale, bias)
        partial = _PARTIALS[mode](image, text, scale, bias, layout, algorithm=algorithm)
        return _SumOfPartials.apply(partial, layout, 2) + probe.to(partial.dtype)
    image, text, scale, bias, probe, negatives = _OpenClipWeights.apply(layout, gather_with_grad, image, text, scale,
                                                                        bias, pairs.hard_negatives)
    pairs = PairTargets(pairs.sample_ids, pairs.targets, negatives, pairs.direction)
    partial = _PARTIALS[mode](image, text, scale, bias, layout, algorithm=algorithm, pairs=pairs)
    return _SumOfPartials.apply(partial, layout, pairs.terms) + probe.to(partial.dtype)


class _SumOfPartials(torch.autograd.Function):
    """L = sum_r P_r / (2NM) (one all-reduce); backward: the unit gradient 1/(2NM) to P_r (the
    upstream gradient reaches _OpenClipWeights through its probe)."""

    @staticmethod
    def forward(ctx, partial, layout, terms):
        ctx.divisor = terms * layout.total  # 2NM, or NM for the rows' terms alone
        # Nothing here needs it, but a freed saved tensor makes a second backward without
        # retain_graph raise torch's own error here, on every rank, before any collective.
        ctx.save_for_backward(partial)
        return cdist.all_reduce_sum(partial, layout) / ctx.divisor

    @staticmethod
    def backward(ctx, grad):
        partial, = ctx.saved_tensors
        return partial.new_tensor(1.0 / ctx.divisor), None, None


class _OpenClipWeights(torch.autograd.Function):
    """The identity on (image, text, scale, bias[, hard negatives]), plus a zero fp64 probe that
    global_loss adds to the loss; backward: open_clip's weights (global_loss) on the unit gradients
    that reach the inputs, from g_r, the probe's gradient."""

    @staticmethod
    def forward(ctx, layout, gather_with_grad, image, text, scale, bias, *negatives):
        ctx.layout, ctx.gather_with_grad = layout, gather_with_grad
        probe = image.new_zeros((), dtype=torch.float64)
        same = tuple(None if t is None else t.view_as(t) for t in (image, text, scale, bias))
        return same + (probe,) + tuple(None if t is None else t.view_as(t) for t in negatives)

    @staticmethod
    def backward(ctx, g_image, g_text, g_scale, g_bias, g_probe, *g_negatives):
        own = g_probe.detach().double()
        feature_weight = cdist.all_reduce_sum(own, ctx.layout) if ctx.gather_with_grad else own
        out = [None, None, _weighted(g_image, feature_weight), _weighted(g_text, feature_weight)]
        if ctx.needs_input_grad[4] or ctx.needs_input_grad[5]:  # the same on every rank (the losses' shard_layout)
            zero = own.new_zeros(())
            units = torch.stack([zero if g is None else g.double().reshape(()) for g in (g_scale, g_bias)])
            sums = cdist.all_reduce_sum(units, ctx.layout)
            for k, g in enumerate((g_scale, g_bias)):
                out.append(None if g is None else (own * sums[k]).to(g.dtype).reshape(g.shape))
        else:
            out += [None, None]
        return tuple(out) + tuple(_weighted(g, feature_weight) for g in g_negatives)


def _weighted(g, weight):
    if g is None:
        return None
    acc = torch.promote_types(g.dtype, torch.float32)
    return (g.to(acc) * weight.to(acc)).to(g.dtype)
