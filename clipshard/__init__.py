"""clipshard: sharded, fused CLIP contrastive loss, stochastic rounding and half-precision AdamW."""
import torch  # noqa: F401  (loads libtorch before the extension)

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.rounding import stochastic_round, stochastic_round_  # noqa: F401

__version__ = "0.1.0"
from clipshard.fused_op import contrastive_lse  # noqa: E402,F401
from clipshard.loss import ClipLoss, clip_loss  # noqa: E402,F401
