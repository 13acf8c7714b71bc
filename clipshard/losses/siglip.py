"""The public SigLIP loss: `siglip_loss` (functional) and `SigLipLoss`, a drop-in for open_clip's
SigLipLoss (docs/siglip.md).

Rank r of N holds M_r image/text pairs. Its loss is

    L_r = (1 / M_r) * sum_{i < M_r} sum_{j < sum_q M_q} softplus(-z_ij * l_ij),
    l_ij = logit_scale * x_i . y_j + logit_bias,  z_ij = +1 iff j = offset_r + i, else -1,

over its own images x against the texts y of every rank. A rank's feature gradients are those of
sum_q g_q * L_q (g_q: rank q's upstream gradient) and its logit_scale / logit_bias gradients are
those of its own loss: exactly what open_clip's neighbour exchanges compute, for each of its
dist_impl values. Two modes compute it:
- "gather" (the default): the texts are all-gathered (in their own dtype) and each rank runs the
  fused op on its row block; the gradient of the gathered texts is reduce-scattered to their owners.
  Per-rank memory O(N M D).
- "ring": the text blocks travel around the ring of ranks (clipshard/parallel/siglip_ring.py), per-rank
  memory O(M D) whatever the world size; the same loss and gradients.

Sample ids and hard negatives (docs/siglip.md, "Sample ids and hard negatives"): with sample_ids
(one global id per pair), a pair (i, j) other than the own one with the same id is +1 (targets
"multi", the default) or has no term ("mask"); hard negatives (H_r x D on rank r) are extra -1
columns for every image row of every rank, divided by M_r like the other terms. The ids travel
with the texts (all-gathered, or passed around the ring with their block), the hard negatives like
the texts (all-gathered with a reduce-scatter of their gradient, or appended to their owner's ring
block), so their gradient comes home to their owner. Without ids and hard negatives every mode
runs today's code.
"""
import torch

from clipshard.losses import base
from clipshard.ops import check_algorithm
from clipshard.ops.inputs import check_flags
from clipshard.ops.siglip_sum import ALGORITHMS, siglip_sum
from clipshard.parallel import collectives
from clipshard.parallel.siglip_ring import siglip_ring_loss
from clipshard.parallel.steady_state import check_validate

DIST_IMPLS = ("bidir", "shift", "reduce", "gather")
MODES = base.SIGLIP_MODES


def _check_mode(fn, mode):
    """None means "gather" (the default)."""
    if mode is None:
        return "gather"
    if mode not in MODES:
        raise ValueError(f"{fn}: mode must be 'gather', 'ring' or None, got {mode!r}")
    return mode


def _check_dist_impl(fn, dist_impl):
    """open_clip's values are all accepted (they give the same result here); None means 'bidir'."""
    if dist_impl is None:
        return "bidir"
    if dist_impl not in DIST_IMPLS:
        raise ValueError(f"{fn}: dist_impl must be one of {', '.join(map(repr, DIST_IMPLS))} or None, "
                         f"got {dist_impl!r}")
    return dist_impl


def _extras(hard_negatives, sample_ids, targets):
    return base.Extras(sample_ids=sample_ids, targets=targets, hard_negatives=hard_negatives, default_targets="multi")


def _loss(fn, image, text, scale, bias, group, rank_arg=None, world_size_arg=None, algorithm="auto",
          mode="gather", extras=base.NO_EXTRAS, validate="every_call"):
    scale, bias = base.as_scalar_tensor(scale, image), base.as_scalar_tensor(bias, image)
    layout = base.shard_layout(fn, image, text, scale, bias, group, base.Options("the SigLIP loss", mode),
                               rank_arg=rank_arg, world_size_arg=world_size_arg, extras=extras, validate=validate)
    if extras.sample_ids is not None or extras.hard_negatives is not None:
        return _loss_with_extras(image, text, scale, bias, layout, algorithm, mode, extras, validate)
    if mode == "ring" and layout.world_size > 1:
        return siglip_ring_loss(image, text, scale, bias, layout, algorithm, sync_free=validate == "on_change")
    all_text = collectives.gather_rows(text, layout)
    return siglip_sum(image, all_text, scale, bias, pos_offset=layout.offset, algorithm=algorithm) / layout.local_size


def _loss_with_extras(image, text, scale, bias, layout, algorithm, mode, extras, validate):
    """The loss with sample ids and / or hard negatives. A group without any hard negative (every
    H_r = 0) computes the loss without them: hard_negatives then gets no gradient."""
    ids, targets = extras.sample_ids, extras.resolved_targets
    negatives = extras.hard_negatives
    if negatives is not None and sum(layout.negative_sizes) == 0:
        negatives = None
    if mode == "ring" and layout.world_size > 1:
        return siglip_ring_loss(image, text, scale, bias, layout, algorithm, sample_ids=ids, targets=targets,
                                hard_negatives=negatives, sync_free=validate == "on_change")
    all_text = collectives.gather_rows(text, layout)
    kwargs = {}
    if ids is not None:
        kwargs.update(row_ids=ids, col_ids=collectives.gather_rows(ids, layout, with_grad=False), targets=targets)
    if negatives is not None:
        kwargs["extra_cols"] = collectives.gather_negatives(negatives, layout)
    return siglip_sum(image, all_text, scale, bias, pos_offset=layout.offset, algorithm=algorithm,
                      **kwargs) / layout.local_size


def siglip_loss(image_features, text_features, logit_scale, logit_bias=None, *, group=None, algorithm="auto",
                mode=None, hard_negatives=None, sample_ids=None, targets=None, validate="every_call"):
    """SigLIP's sigmoid loss, never materialising the logits.

    Distributed when `group` is given or torch.distributed is initialised (then over the world
    group): this rank's loss over its own images against every rank's texts, with the gradient
    semantics of open_clip's SigLipLoss (see the module docstring). Local batch sizes may differ
    between ranks. On one device, open_clip's single-process loss. logit_scale (already
    exponentiated) and logit_bias: 0-dim or one-element tensors, or Python numbers. algorithm:
    siglip_sum's ("auto", "chunked" or "torch"; docs/portable.md). mode: "gather" (None, the
    default: the texts are all-gathered) or "ring" (the same loss and gradients with the text blocks
    passed between neighbouring ranks: per-rank memory independent of the world size; docs/siglip.md).
    hard_negatives, sample_ids, targets: as SigLipLoss.forward's. validate: as clip_loss's.
    Returns a 0-dim fp32 tensor (fp64 for fp64 features).
    """
    check_algorithm("siglip_loss", algorithm, ALGORITHMS)
    mode = _check_mode("siglip_loss", mode)
    check_validate("siglip_loss", validate)
    group = base.resolve_group("siglip_loss", group)
    return _loss("siglip_loss", image_features, text_features, logit_scale, logit_bias, group, algorithm=algorithm,
                 mode=mode, extras=_extras(hard_negatives, sample_ids, targets), validate=validate)


class SigLipLoss(torch.nn.Module):
    """Drop-in replacement for open_clip.loss.SigLipLoss (open_clip 3.3 signature): the same per-rank
    loss value and the same feature, logit_scale and logit_bias gradients.

    world_size=1 with no `group` computes this process's loss alone, like open_clip. Otherwise the
    process group is `group` (default: the world group); rank and world_size, when not left at their
    defaults, must agree with it. dist_impl: any of open_clip's values ('bidir', the default,
    'shift', 'reduce', 'gather'); all give the same result: the schedule is `mode`'s, not dist_impl's.
    cache_labels is accepted and has no effect (no label tensor is built). validate: see clipshard.clip_loss.
    algorithm, mode: see
    siglip_loss (mode="ring" keeps open_clip's neighbour exchanges' O(M D) per-rank memory).
    """

    def __init__(self, cache_labels=False, rank=0, world_size=1, dist_impl=None, *, group=None, algorithm="auto",
                 mode=None, validate="every_call"):
        super().__init__()
        check_flags("SigLipLoss", cache_labels=cache_labels)
        base.check_rank_and_world_size("SigLipLoss", rank, world_size)
        self.cache_labels = cache_labels
        self.rank = rank
        self.world_size = world_size
        self.dist_impl = _check_dist_impl("SigLipLoss", dist_impl)
        self.group = group
        check_algorithm("SigLipLoss", algorithm, ALGORITHMS)
        self.algorithm = algorithm
        self.mode = _check_mode("SigLipLoss", mode)
        check_validate("SigLipLoss", validate)
        self.validate = validate

    def forward(self, image_features, text_features, logit_scale, logit_bias, output_dict=False, *,
                hard_negatives=None, sample_ids=None, targets=None):
        """The SigLIP loss of this rank's batch, as open_clip's SigLipLoss.forward computes it.

        image_features, text_features: (batch, dim) tensors of one dtype (fp32, fp16, bf16 or fp64)
            on one device, usually L2-normalised; row i of each is a positive pair. Batches may
            differ in size between ranks.
        logit_scale: the multiplier of the similarities, already exponentiated (open_clip's models
            return `logit_scale.exp()`), a 0-dim or one-element tensor or a Python number.
        logit_bias: the additive bias of the logits (SigLIP models learn one), same forms as
            logit_scale, or None.
        output_dict: return {"contrastive_loss": loss} instead of the loss.
        hard_negatives: None or an H x D tensor of extra negative texts (text_features' dtype, device
            and D; H may differ between ranks, 0 allowed): a -1 term for every image of every rank.
            They are gathered like the texts (passed around the ring in ring mode) and their
            gradient comes back to this rank.
        sample_ids: None or a 1-D int64 tensor of the pairs' global ids (length: the local batch,
            on the features' device): pairs with the same id are positives too. Every rank gives
            ids or none does.
        targets: what a same-id pair other than the own one is: "multi" (the default with
            sample_ids: a +1 term) or "mask" (no term); only with sample_ids.

        Returns a 0-dim fp32 tensor for fp32 / fp16 / bf16 features (fp64 for fp64): this rank's
        sum of softplus(-z * logit) over its images against every rank's texts, divided by its
        batch size; accumulation is in fp32 whatever the feature dtype, and no logit matrix is
        stored. Gradients reach both feature tensors, logit_scale and logit_bias (docs/siglip.md).
        """
        check_flags("SigLipLoss", output_dict=output_dict)
        extras = _extras(hard_negatives, sample_ids, targets)
        if self.world_size == 1 and self.group is None:
            loss = _loss("SigLipLoss", image_features, text_features, logit_scale, logit_bias, None,
                         algorithm=self.algorithm, extras=extras)
        else:
            group = base.resolve_group("SigLipLoss", self.group, self.world_size)
            explicit = not (self.world_size == 1 and self.rank == 0)
            loss = _loss("SigLipLoss", image_features, text_features, logit_scale, logit_bias, group,
                         rank_arg=self.rank if explicit else None,
                         world_size_arg=self.world_size if explicit else None, algorithm=self.algorithm,
                         mode=self.mode, extras=extras, validate=self.validate)
        return {"contrastive_loss": loss} if output_dict else loss
