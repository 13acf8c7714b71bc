"""clipshard: sharded, fused CLIP contrastive, SigLIP and distillation losses, a gradient-cache
training step, stochastic rounding and half-precision AdamW.

The integrations (clipshard.integrations) and the self-check (clipshard.diagnostics) are reached
through their own subpackages; the root names them (apply_to_open_clip, apply_to_transformers,
apply_to_sentence_transformers, text_tower_to_half_precision_, self_check) and imports them on first use,
as it does the memory planner (plan_memory, clipshard.planning).
"""
from clipshard import _build_record

# Before anything loads clipshard._C: a library built for another torch release would crash.
_build_record.check_library()

from clipshard.grad_cache import GradCache  # noqa: E402
from clipshard.losses import ClipLoss, DistillClipLoss, SigLipLoss, clip_loss, siglip_loss  # noqa: E402
from clipshard.ops.contrastive_lse import contrastive_lse  # noqa: E402
from clipshard.ops.siglip_sum import siglip_sum  # noqa: E402
from clipshard.rounding import stochastic_round, stochastic_round_  # noqa: E402

__version__ = "0.1.0"  # the one version source: setup.py reads it (build_support.package_version)

# Where the names of the wings live (imported on first use).
_WINGS = {
    "apply_to_open_clip": "clipshard.integrations.open_clip_patch",
    "apply_to_sentence_transformers": "clipshard.integrations.sentence_transformers_patch",
    "apply_to_transformers": "clipshard.integrations.transformers_patch",
    "text_tower_to_half_precision_": "clipshard.integrations.open_clip_text_tower",
    "self_check": "clipshard.diagnostics",
    "plan_memory": "clipshard.planning",
}
# clipshard.optim on first use too: its AdamW.step is marked for torch.compile, which imports
# torch._dynamo (about 1.5 s), and a process that only computes losses has no need of it
_SUBPACKAGES = ("optim",)

__all__ = ["ClipLoss", "DistillClipLoss", "GradCache", "SigLipLoss", "apply_to_open_clip",
           "apply_to_sentence_transformers", "apply_to_transformers",
           "clip_loss", "contrastive_lse", "optim", "plan_memory", "self_check", "siglip_loss", "siglip_sum",
           "stochastic_round",
           "stochastic_round_", "text_tower_to_half_precision_"]


def __getattr__(name):
    import importlib

    if name in _WINGS:
        return getattr(importlib.import_module(_WINGS[name]), name)
    if name in _SUBPACKAGES:
        return importlib.import_module(f"clipshard.{name}")
    raise AttributeError(f"module 'clipshard' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
