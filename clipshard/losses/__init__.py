"""The public losses, drop-ins for open_clip's: clip.py (ClipLoss, clip_loss), siglip.py (SigLipLoss,
siglip_loss), distill.py (DistillClipLoss), all on base.py (scalar coercion, open_clip's
constructor arguments, the modes, the option codes and the cross-rank validation of the inputs).

Imports: clipshard.ops, clipshard.parallel; never grad_cache, the integrations or diagnostics.
"""
from clipshard.losses.clip import ClipLoss, clip_loss
from clipshard.losses.distill import DistillClipLoss
from clipshard.losses.siglip import SigLipLoss, siglip_loss

__all__ = ["ClipLoss", "DistillClipLoss", "SigLipLoss", "clip_loss", "siglip_loss"]
