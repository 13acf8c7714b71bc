"""The public CLIP loss: `clip_loss` (functional) and `ClipLoss`, a drop-in for open_clip's ClipLoss
(docs/distributed.md)."""
import torch

from clipshard import distributed as cdist
from clipshard import sharded_loss

_MODES = ("exchange", "local")


def _resolve_mode(fn, mode, local_loss, gather_with_grad):
    if mode is None:
        return "exchange" if gather_with_grad else "local"
    if mode not in _MODES:
        raise ValueError(f"{fn}: mode must be 'exchange', 'local' or None, got {mode!r}")
    if mode == "exchange" and local_loss and not gather_with_grad:
        raise ValueError(
            f"{fn}: mode='exchange' cannot reproduce open_clip's (local_loss=True, "
            "gather_with_grad=False) gradients, which drop the terms of each rank's features in the "
            "other ranks' rows; use mode='local' (the default there) or gather_with_grad=True"
        )
    return mode


def _config_code(local_loss, gather_with_grad, mode):
    return int(local_loss) | int(gather_with_grad) << 1 | int(mode == "exchange") << 2


def _sharded_clip_loss(fn, image, text, scale, bias, *, local_loss, gather_with_grad, mode, group,
                       rank_arg=None, world_size_arg=None):
    mode = _resolve_mode(fn, mode, local_loss, gather_with_grad)
    layout = cdist.shard_layout(
        fn, image, text, scale, bias, group, config=_config_code(local_loss, gather_with_grad, mode),
        rank_arg=rank_arg, world_size_arg=world_size_arg,
    )
    if layout.world_size == 1:
        # One process: all of open_clip's options give the same loss and gradients.
        return sharded_loss.rank_loss(image, text, scale, bias, layout, "exchange", True)
    if local_loss:
        return sharded_loss.rank_loss(image, text, scale, bias, layout, mode, gather_with_grad)
    return sharded_loss.global_loss(image, text, scale, bias, layout, mode, gather_with_grad)


def clip_loss(image_features, text_features, logit_scale, logit_bias=None, *, local_loss=False,
              gather_with_grad=True, mode=None, group=None):
    """CLIP contrastive loss (CE over image rows + CE over text rows) / 2, never materialising the
    similarity matrix.

    Distributed when `group` is given or torch.distributed is initialised (the world group), else
    on one process. The options follow open_clip's ClipLoss: local_loss=True returns this rank's
    loss over its own rows and columns of the global similarity matrix, local_loss=False the
    full-batch loss; gather_with_grad=True gives the exact full-batch gradient, False keeps
    open_clip's gradient semantics (docs/distributed.md). mode: "exchange" (default with
    gather_with_grad=True) or "local". Returns an fp32 scalar (fp64 for fp64 features).
    """
    group, _ = cdist.resolve_group("clip_loss", group)
    return _sharded_clip_loss(
        "clip_loss", image_features, text_features, logit_scale, logit_bias, local_loss=local_loss,
        gather_with_grad=gather_with_grad, mode=mode, group=group,
    )


class ClipLoss(torch.nn.Module):
    """Drop-in replacement for open_clip.loss.ClipLoss (open_clip 3.3 signature), with the same
    per-rank loss value and feature gradients for all four (local_loss, gather_with_grad)
    combinations; see docs/distributed.md for logit_scale / logit_bias gradients per mode.

    world_size=1 with no `group` computes this process's loss alone, like open_clip. Otherwise the
    process group is `group` (default: the world group) and rank / world_size must agree with it.
    cache_labels is accepted and has no effect (no label tensor is built). mode: see clip_loss.
    """

    def __init__(self, local_loss=False, gather_with_grad=False, cache_labels=False, rank=0,
                 world_size=1, use_horovod=False, *, mode=None, group=None):
        super().__init__()
        if use_horovod:
            raise ValueError("ClipLoss: use_horovod=True is not supported; clipshard communicates "
                             "through torch.distributed (launch with torchrun)")
        self.local_loss = local_loss
        self.gather_with_grad = gather_with_grad
        self.cache_labels = cache_labels
        self.rank = rank
        self.world_size = world_size
        self.use_horovod = use_horovod
        self.mode = _resolve_mode("ClipLoss", mode, local_loss, gather_with_grad)
        self.group = group

    def forward(self, image_features, text_features, logit_scale, logit_bias=None, output_dict=False):
        if self.world_size == 1 and self.group is None:
            group, rank_arg, world_size_arg = None, None, None
        else:
            group, _ = cdist.resolve_group("ClipLoss", self.group, self.world_size)
            explicit = not (self.world_size == 1 and self.rank == 0)
            rank_arg, world_size_arg = (self.rank, self.world_size) if explicit else (None, None)
        loss = _sharded_clip_loss(
            "ClipLoss", image_features, text_features, logit_scale, logit_bias,
            local_loss=self.local_loss, gather_with_grad=self.gather_with_grad, mode=self.mode,
            group=group, rank_arg=rank_arg, world_size_arg=world_size_arg,
        )
        return {"contrastive_loss": loss} if output_dict else loss
