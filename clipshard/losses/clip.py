"""The public CLIP loss: `clip_loss` (functional) and `ClipLoss`, a drop-in for open_clip's ClipLoss.
One device: docs/fused_loss.md; over ranks: docs/distributed.md; sample ids, targets, hard negatives
and direction: docs/targets.md."""
import torch

from clipshard.losses import base
from clipshard.ops import check_algorithm
from clipshard.ops.contrastive_lse import ALGORITHMS, contrastive_lse
from clipshard.ops.inputs import check_flags
from clipshard.parallel import exchange
from clipshard.parallel.steady_state import check_validate


def _single_device_loss(image_features, text_features, logit_scale, logit_bias=None, algorithm="auto"):
    """open_clip's ClipLoss on one device: (CE(logits_per_image) + CE(logits_per_text)) / 2 with
    logits = logit_scale * image_features @ text_features^T (+ logit_bias), the positives on the
    diagonal. One fused pass gives the row and column log-sum-exps from the same similarity tiles;
    the B x B logits are never stored."""
    row_lse, pos_logit, col_lse = contrastive_lse(image_features, text_features, logit_scale, logit_bias,
                                                  pos_offset=0, want_col_lse=True, algorithm=algorithm)
    return ((row_lse - pos_logit).mean() + (col_lse - pos_logit).mean()) / 2


def _single_device_targets_loss(image, text, scale, bias, algorithm, pairs):
    """The loss with sample ids, targets and hard negatives on one device (docs/targets.md): row i's LSE over the texts
    (targets "mask": without the same-id pairs other than its own) and the hard negatives, minus its
    positive (its own pair, or with "multi" the mean logit of the texts of its id); the columns
    likewise over the images (with "multi", the mean logit of the images of its id), without the
    hard negatives. Direction "image_to_text": the rows' mean."""
    ids = pairs.sample_ids
    row_lse, pos_logit, col_lse = contrastive_lse(image, text, scale, bias, 0, pairs.both, row_ids=ids, col_ids=ids,
                                                  targets=pairs.targets, extra_cols=pairs.hard_negatives,
                                                  algorithm=algorithm)
    rows = (row_lse - pos_logit).mean()
    if not pairs.both:
        return rows
    # The columns' positives sum to the rows' ("mask": the same own pairs; "multi": both sums are
    # sum over id groups g of (1 / |g|) sum_{i, j in g} S_ij), so the mean column term uses them.
    return (rows + (col_lse - pos_logit).mean()) / 2


def _loss(fn, image, text, scale, bias, *, local_loss, gather_with_grad, mode, group, rank_arg=None,
          world_size_arg=None, algorithm="auto", extras=base.NO_EXTRAS, validate="every_call"):
    if group is None:  # the op checks and names the scalars
        base.FEATURES.check(fn, image, text)
        base.check_extras(fn, extras, image, text)
        pairs = _pair_targets(extras)
        if pairs.plain:
            return _single_device_loss(image, text, scale, bias, algorithm)
        return _single_device_targets_loss(image, text, scale, bias, algorithm, pairs)
    scale, bias = base.as_scalar_tensor(scale, image), base.as_scalar_tensor(bias, image)
    layout = base.shard_layout(
        fn, image, text, scale, bias, group,
        base.Options("the CLIP loss", mode, local_loss=local_loss, gather_with_grad=gather_with_grad),
        rank_arg=rank_arg, world_size_arg=world_size_arg,
        same_scale_and_bias=base.mixes_ranks_scales(local_loss, mode), extras=extras, validate=validate)
    pairs = _pair_targets(extras)
    if layout.world_size == 1:  # a group of one: every option gives the single-device loss
        if pairs.plain:
            return _single_device_loss(image, text, scale, bias, algorithm)
        return _single_device_targets_loss(image, text, scale, bias, algorithm, pairs)
    if local_loss:
        return exchange.rank_loss(image, text, scale, bias, layout, mode, gather_with_grad, algorithm, pairs)
    return exchange.global_loss(image, text, scale, bias, layout, mode, gather_with_grad, algorithm, pairs)


def _pair_targets(extras):
    """The validated Extras as the modes take them."""
    return exchange.PairTargets(extras.sample_ids, extras.resolved_targets, extras.hard_negatives,
                                extras.direction or "both")


def _extras(direction, hard_negatives, sample_ids, targets):
    return base.Extras(sample_ids=sample_ids, targets=targets, hard_negatives=hard_negatives, direction=direction,
                       default_targets="mask")


def clip_loss(image_features, text_features, logit_scale, logit_bias=None, *, local_loss=False,
              gather_with_grad=True, mode=None, group=None, algorithm="auto", direction="both",
              hard_negatives=None, sample_ids=None, targets=None, validate="every_call"):
    """CLIP contrastive loss (CE over image rows + CE over text rows) / 2, never materialising the
    similarity matrix.

    Distributed when `group` is given or torch.distributed is initialised (then over the world
    group), else on one device. The options follow open_clip's ClipLoss: local_loss=True returns
    this rank's loss over its own rows and columns of the global similarity matrix, local_loss=False
    the full-batch loss; gather_with_grad=True gives the exact full-batch gradient, False keeps
    open_clip's gradient semantics (docs/distributed.md). mode: "exchange" (default with
    gather_with_grad=True), "local", or "ring" (exchange's results with the text features passed
    between neighbouring ranks instead of gathered: per-rank memory independent of the world size,
    slower on small problems). algorithm: contrastive_lse's ("auto", "fused", "chunked" or "torch";
    docs/portable.md). Returns a 0-dim fp32 tensor (fp64 for fp64 features).

    Beyond the diagonal (docs/targets.md); none of these changes the loss when left at its default:
    direction: "both" (open_clip's (CE_i2t + CE_t2i) / 2) or "image_to_text" (the rows' CE only,
    query -> documents, not halved). hard_negatives: H_r x D tensor like text_features (H_r may
    differ per rank, 0 allowed): extra columns in every image row's denominator (gathered over
    ranks like the texts), never positives, no column term. sample_ids: the M pairs' global ids
    (1-D int64 on the features' device; image i and text i share sample_ids[i]). targets: with
    sample_ids, "mask" (the default: pairs of one id other than the own pair leave the
    denominators) or "multi" (every same-id pair is a positive: the positive term is the mean
    logit of the same-id pairs).

    validate: "every_call" (the ranks' inputs are validated on the host at every call) or
    "on_change" (validated on the host at the first call and whenever this rank's shapes, dtypes or
    options change, otherwise checked on the device without a host read; every rank must change at
    the same call: docs/distributed.md, "Compiling and host syncs").
    """
    mode = base.resolve_mode("clip_loss", mode, local_loss, gather_with_grad)
    check_validate("clip_loss", validate)
    check_algorithm("clip_loss", algorithm, ALGORITHMS)
    group = base.resolve_group("clip_loss", group)
    return _loss("clip_loss", image_features, text_features, logit_scale, logit_bias, local_loss=local_loss,
                 gather_with_grad=gather_with_grad, mode=mode, group=group, algorithm=algorithm,
                 extras=_extras(direction, hard_negatives, sample_ids, targets), validate=validate)


class ClipLoss(torch.nn.Module):
    """Drop-in replacement for open_clip.loss.ClipLoss (open_clip 3.3 signature), with the same
    per-rank loss value and feature gradients for all four (local_loss, gather_with_grad)
    combinations; see docs/distributed.md for logit_scale / logit_bias gradients per mode.

    world_size=1 with no `group` computes this process's loss alone, like open_clip. Otherwise the
    process group is `group` (default: the world group); rank and world_size, when not left at
    their defaults, must agree with it. cache_labels is accepted and has no effect (no label tensor
    is built). mode, algorithm, direction, validate: see clip_loss. Horovod is not supported.
    """

    def __init__(self, local_loss=False, gather_with_grad=False, cache_labels=False, rank=0,
                 world_size=1, use_horovod=False, *, mode=None, group=None, algorithm="auto", direction="both",
                 validate="every_call"):
        super().__init__()
        check_flags("ClipLoss", cache_labels=cache_labels, use_horovod=use_horovod)
        base.check_rank_and_world_size("ClipLoss", rank, world_size)
        base.check_horovod("ClipLoss", use_horovod)
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.cache_labels = cache_labels
        self.rank = rank
        self.world_size = world_size
        self.use_horovod = use_horovod
        self.mode = base.resolve_mode("ClipLoss", mode, local_loss, gather_with_grad)
        self.group = group
        check_algorithm("ClipLoss", algorithm, ALGORITHMS)
        self.algorithm = algorithm
        base.check_direction("ClipLoss", direction)
        self.direction = direction
        check_validate("ClipLoss", validate)
        self.validate = validate

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, output_dict=False, *,
                hard_negatives=None, sample_ids=None, targets=None):
        """The CLIP loss of this rank's batch, as open_clip's ClipLoss.forward computes it.

        image_features, text_features: (batch, dim) tensors of one dtype (fp32, fp16, bf16 or fp64)
            on one device, usually L2-normalised; row i of each is a positive pair. Batches may
            differ in size between ranks.
        logit_scale: the multiplier of the similarities, already exponentiated (open_clip's models
            return `logit_scale.exp()`), a 0-dim or one-element tensor or a Python number.
        logit_bias: optional additive bias of the logits, same forms as logit_scale.
        output_dict: return {"contrastive_loss": loss} instead of the loss.
        hard_negatives, sample_ids, targets: see clip_loss (docs/targets.md).

        Returns a 0-dim fp32 tensor for fp32 / fp16 / bf16 features (fp64 for fp64): accumulation
        is in fp32 whatever the feature dtype, and the B x B logits are never stored. Gradients
        reach both feature tensors, logit_scale and logit_bias (docs/distributed.md per option),
        and the hard negatives.
        """
        check_flags("ClipLoss", output_dict=output_dict)
        alone = self.world_size == 1 and self.group is None  # open_clip's single process, even under torchrun
        group = None if alone else base.resolve_group("ClipLoss", self.group, self.world_size)
        explicit = not (self.world_size == 1 and self.rank == 0)
        loss = _loss("ClipLoss", image_features, text_features, logit_scale, logit_bias, local_loss=self.local_loss,
                     gather_with_grad=self.gather_with_grad, mode=self.mode, group=group,
                     rank_arg=self.rank if explicit and not alone else None,
                     world_size_arg=self.world_size if explicit and not alone else None, algorithm=self.algorithm,
                     extras=_extras(self.direction, hard_negatives, sample_ids, targets), validate=self.validate)
        return {"contrastive_loss": loss} if output_dict else loss
