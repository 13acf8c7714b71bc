"""The distillation loss over ranks (docs/distillation.md), in the gathered modes of ClipLoss
(clipshard/parallel/exchange.py), with open_clip's DistillClipLoss gradients.

Rank r holds M pairs of student features (I_r, T_r) and of teacher features (I'_r, T'_r) starting at
global row `offset`. Its *partials* are two sums over its own rows and columns of the global
logit matrix S (student) and T (teacher; a stack of teachers, averaged after their softmaxes):

    contrastive  P_r = sum_{i in r} (rowLSE_i(S) - S_ii) + sum_{j in r} (colLSE_j(S) - S_jj)
    distill      D_r = sum_{i in r} (rowLSE_i(S) - rowCross_i) + sum_{j in r} (colLSE_j(S) - colCross_j)

with rowCross_i = sum_j softmax(T_i.)_j S_ij (the mean over teachers), colCross likewise over the
column. open_clip's per-rank losses (local_loss=True) are (P_r, D_r) / (2M), its full-batch losses
sum_r (P_r, D_r) / (2NM).

- exchange: one op call on the row block I_r against the gathered columns; the column statistics
  of every rank's partial block are combined with autograd: the LSEs by a log-sum-exp over ranks,
  the cross term by a sum over ranks of each rank's part weighted by its share of the teacher's
  column normaliser, exp(teacherColLSE_r - teacherColLSE).
- local: two row-only op calls, I_r against all T and T_r against all I (open_clip's local_loss=True,
  gather_with_grad=False, where the gathered features are constants).
- ring: exchange's partials with the text blocks passed around the ring (distill_ring.py).
"""
import torch

from clipshard.parallel import collectives as cdist
from clipshard.ops.distill_lse import distill_lse
from clipshard.parallel.distill_two_pass import global_losses_two_passes
from clipshard.ops.planned_device import tracing_a_plan
from clipshard.parallel.distill_ring import partial_terms, ring_partials, weighted_rows


def _gather_teacher(teacher, layout, with_grad=True):
    """All ranks' T x M_q x Dt teacher features, T x K x Dt."""
    return cdist.gather_rows(teacher.transpose(0, 1), layout, with_grad=with_grad).transpose(0, 1)


def exchange_partials(image, text, scale, teacher, layout, algorithm="auto"):
    """teacher: (teacher_image, teacher_text, teacher_scale, row weights or None), the stack of
    clipshard/losses/distill.py."""
    teacher_image, teacher_text, teacher_scale, weights = teacher
    cols = cdist.gather_rows(text, layout)
    teacher_cols = _gather_teacher(teacher_text, layout)
    row_lse, pos, _, row_cross, col_part, teacher_col_part, cross_part = distill_lse(
        image, cols, weighted_rows(teacher_image, weights), teacher_cols, scale, teacher_scale, layout.offset, True,
        algorithm=algorithm)
    own = slice(layout.offset, layout.offset + layout.local_size)
    col_lse = cdist.combine_column_lse(col_part, layout)[own]
    teacher_col_lse = cdist.combine_column_lse(teacher_col_part, layout)
    share = torch.exp(teacher_col_part - teacher_col_lse)
    col_cross = cdist.all_reduce_sum_with_grad(share * cross_part, layout)[:, own]
    # S_jj of this rank's column j = offset + i is the positive logit of local row i
    return partial_terms(row_lse, pos, row_cross, col_lse, pos, col_cross)


def local_partials(image, text, scale, teacher, layout, gather_with_grad=True, algorithm="auto"):
    teacher_image, teacher_text, teacher_scale, weights = teacher
    all_text = cdist.gather_rows(text, layout, with_grad=gather_with_grad)
    all_image = cdist.gather_rows(image, layout, with_grad=gather_with_grad)
    all_teacher_text = _gather_teacher(teacher_text, layout, gather_with_grad)
    all_teacher_image = _gather_teacher(teacher_image, layout, gather_with_grad)
    image_lse, image_pos, _, image_cross, *_ = distill_lse(
        image, all_text, weighted_rows(teacher_image, weights), all_teacher_text, scale, teacher_scale,
        layout.offset, False, algorithm=algorithm)
    text_lse, text_pos, _, text_cross, *_ = distill_lse(
        text, all_image, weighted_rows(teacher_text, weights), all_teacher_image, scale, teacher_scale,
        layout.offset, False, algorithm=algorithm)
    return partial_terms(image_lse, image_pos, image_cross, text_lse, text_pos, text_cross)


_PARTIALS = {"exchange": exchange_partials, "local": local_partials, "ring": ring_partials}


def rank_losses(teachers, image, text, scale, layout, mode, gather_with_grad, algorithm="auto"):
    """open_clip's local_loss=True (contrastive, distill) of this rank, (P_r, D_r) / (2M), with plain
    autograd (the gathers' backward reduce-scatters, as open_clip's gather_with_grad=True does).
    `teachers`: (leaves, stack) where stack(*leaves) gives the `teacher` of exchange_partials."""
    leaves, stack = teachers
    if mode == "local":
        partials = local_partials(image, text, scale, stack(*leaves), layout, gather_with_grad, algorithm)
    else:
        partials = _PARTIALS[mode](image, text, scale, stack(*leaves), layout, algorithm)
    return partials / (2 * layout.local_size)


def global_losses(teachers, image, text, scale, layout, mode, gather_with_grad, algorithm="auto", sync_free=False):
    """open_clip's local_loss=False (contrastive, distill), the same values on every rank. sync_free
    (validate="on_change", and always under torch.compile): without a host read, two passes
    (distill_two_pass.py)."""
    leaves, stack = teachers  # T teacher images, T teacher texts, T teacher scales
    n_teacher_features = 2 * (len(leaves) // 3)
    partial = _PARTIALS[mode]

    def partials(image, text, *rest):
        teacher_features, (scale, *teacher_scales) = rest[:n_teacher_features], rest[n_teacher_features:]
        return partial(image, text, scale, stack(*teacher_features, *teacher_scales), layout, algorithm=algorithm)

    inputs = (image, text, *leaves[:n_teacher_features], scale, *leaves[n_teacher_features:])
    if sync_free or torch.compiler.is_compiling():
        return global_losses_two_passes(partials, layout, gather_with_grad, 2 + n_teacher_features, inputs)
    return _GlobalLosses.apply(partials, layout, gather_with_grad, 2 + n_teacher_features, *inputs)


class _GlobalLosses(torch.autograd.Function):
    """Full-batch losses L = (L_contrastive, L_distill) with open_clip's local_loss=False gradients.

    open_clip computes the whole NM x NM problem on every rank, so with g_q rank q's upstream
    gradient (two numbers) rank r's gradients are
        features (student and teacher):  G . dL/d(own features), G = sum_q g_q   (gather_with_grad=True)
                                         g_r . dL/d(own features)               (gather_with_grad=False)
        logit scales:                    g_r . dL/ds.
    Each rank builds the graph of its partials in forward and differentiates it in backward with a
    weight vector that is the same on every rank (the gathers' reduce-scatters and the column
    all-reduces then complete the sums over ranks): when every rank's g is the same, one pass with
    weight g; otherwise one pass per loss (unit weights) and the weighted sums by hand, as
    exchange.py's _GlobalLoss does for ClipLoss's single loss.
    Inputs: the partials function, the layout, gather_with_grad, how many of the tensors are
    features (the rest are logit scales), then the tensors.
    """

    @staticmethod
    def forward(ctx, partials_fn, layout, gather_with_grad, n_features, *inputs):
        leaves = [t.detach().requires_grad_(t.requires_grad) for t in inputs]
        with torch.enable_grad():
            partials = partials_fn(*leaves)
        ctx.graph = (partials, leaves)
        ctx.layout, ctx.gather_with_grad, ctx.n_features = layout, gather_with_grad, n_features
        return cdist.all_reduce_sum(partials, layout) / (2 * layout.total)

    @staticmethod
    def backward(ctx, grad):
        if ctx.graph is None:  # (every rank gets here alike, before any collective)
            raise RuntimeError("the full-batch distillation loss: backward ran twice through the same loss, and "
                               "the first one freed its graph (retain_graph is not supported here); compute the loss "
                               "again for a second backward")
        partials, leaves = ctx.graph
        ctx.graph = None
        layout = ctx.layout
        wanted = [k for k, t in enumerate(leaves) if t.requires_grad]
        own = grad.detach().double()
        table = torch.zeros(layout.world_size, own.numel(), dtype=torch.float64, device=grad.device)
        table[layout.rank] = own
        table = cdist.all_reduce_sum(table, layout)  # every rank's upstream gradient
        uniform = tracing_a_plan() or bool((table == table[0]).all())  # a plan: the ordinary step's branch
        weights = [own] if uniform else list(torch.eye(own.numel(), dtype=torch.float64, device=grad.device))
        passes = []
        for n, weight in enumerate(weights):
            units = torch.autograd.grad(partials, [leaves[k] for k in wanted],
                                        (weight / (2 * layout.total)).to(partials.dtype),
                                        retain_graph=n < len(weights) - 1, allow_unused=True)
            passes.append({k: torch.zeros_like(leaves[k]) if u is None else u for k, u in zip(wanted, units)})
        out = {}
        feature_weight = table.sum(0) if ctx.gather_with_grad else own
        for k in (k for k in wanted if k < ctx.n_features):
            acc = torch.promote_types(leaves[k].dtype, torch.float32)
            if uniform:
                scaled = passes[0][k].to(acc) * (float(layout.world_size) if ctx.gather_with_grad else 1.0)
            else:
                scaled = sum(p[k].to(acc) * feature_weight[c].to(acc) for c, p in enumerate(passes))
            out[k] = scaled.to(leaves[k].dtype)
        # the logit scales' gradients are summed over ranks: one all-reduce for all of them
        scalars = [k for k in wanted if k >= ctx.n_features]
        if scalars:
            sums = cdist.all_reduce_sum(torch.stack([torch.cat([p[k].double().reshape(-1) for k in scalars])
                                                     for p in passes]), layout)
            total = sums[0] if uniform else (own.unsqueeze(1) * sums).sum(0)
            for k, part in zip(scalars, total.split([leaves[k].numel() for k in scalars])):
                out[k] = part.to(leaves[k].dtype).reshape(leaves[k].shape)
        return (None, None, None, None) + tuple(out.get(k) for k in range(len(leaves)))
