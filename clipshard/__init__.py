"""clipshard: sharded, fused CLIP contrastive and SigLIP losses, a gradient-cache training step, stochastic
rounding and half-precision AdamW."""
import torch  # noqa: F401  (loads libtorch before the extension)

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard import optim  # noqa: F401  (clipshard.optim.AdamW, to_half_precision_)
from clipshard.ops.contrastive_lse import contrastive_lse
from clipshard.grad_cache import GradCache
from clipshard.integrations.open_clip_patch import apply_to_open_clip
from clipshard.integrations.transformers_patch import apply_to_transformers
from clipshard.loss import ClipLoss, clip_loss
from clipshard.distill import DistillClipLoss
from clipshard.rounding import stochastic_round, stochastic_round_
from clipshard.siglip import SigLipLoss, siglip_loss
from clipshard.ops.siglip_sum import siglip_sum

__version__ = "0.1.0"
__all__ = ["ClipLoss", "DistillClipLoss", "GradCache", "SigLipLoss", "apply_to_open_clip", "apply_to_transformers",
           "clip_loss", "contrastive_lse", "optim", "self_check", "siglip_loss", "siglip_sum", "stochastic_round",
           "stochastic_round_",
           "text_tower_to_half_precision_"]


def __getattr__(name):
    """text_tower_to_half_precision_ needs open_clip, and self_check is a wing the core never imports, so
    they are imported on first use."""
    if name == "text_tower_to_half_precision_":
        from clipshard.integrations.open_clip_text_tower import text_tower_to_half_precision_
        return text_tower_to_half_precision_
    if name == "self_check":
        from clipshard.diagnostics import self_check
        return self_check
    raise AttributeError(f"module 'clipshard' has no attribute {name!r}")
