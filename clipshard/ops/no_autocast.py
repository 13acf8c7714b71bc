"""Autocast does not apply inside clipshard's ops.

Each op chooses its own precision from its inputs' dtype: fp32 accumulation (and fp32 outputs) for
16-bit features, the features' dtype otherwise (docs/fused_loss.md). Under torch.autocast, PyTorch
would instead recast the matrix products the ops make (those of the portable "torch" path, of the
hand-written backwards, and those a compiled kernel requests from PyTorch) to 16 bits, and mix
dtypes in them: fp32 features would lose precision they were given, and a backward run inside the
autocast block would differ from one run after it. So the ops' entry points and their backwards run
with autocast off for their tensors' device: under autocast an op computes exactly what it computes
outside, the inputs in the dtype they come in (autocast has already decided that for the layers that
produced them).
"""
import contextlib
import functools

import torch


def without_autocast(device):
    """A context in which autocast is off for `device` (a no-op where autocast is off or does not exist)."""
    if not torch.amp.is_autocast_available(device.type) or not torch.is_autocast_enabled(device.type):
        return contextlib.nullcontext()
    return torch.autocast(device.type, enabled=False)


def autocast_off(fn):
    """`fn` run with autocast off for the device of its first tensor argument."""
    @functools.wraps(fn)
    def run(*args, **kwargs):
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        if device is None:
            return fn(*args, **kwargs)
        with without_autocast(device):
            return fn(*args, **kwargs)

    return run
