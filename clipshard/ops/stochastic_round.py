"""The stochastic rounding ops (docs/stochastic_rounding.md): fake (shape) kernels and the
straight-through autograd of torch.ops.clipshard.stochastic_round / stochastic_round_into. The
public, checked functions are clipshard.rounding's."""
import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops import first_use


@torch.library.register_fake("clipshard::stochastic_round")
def _stochastic_round_fake(src, dtype, seed, offset, saturate):
    return src.new_empty(src.shape, dtype=dtype)


def _stochastic_round_backward(ctx, grad):
    return grad.float(), None, None, None, None  # straight-through: d result / d src = identity


torch.library.register_autograd("clipshard::stochastic_round", _stochastic_round_backward)


@torch.library.register_fake("clipshard::stochastic_round_into")
def _stochastic_round_into_fake(dst, src, seed, offset, saturate):
    return None


def round_to(src, dtype, seed, offset, saturate):
    """A new tensor: `src` (fp32) rounded stochastically to `dtype` with Philox(seed, offset), by the
    compiled kernel (or its fallback if that failed its first-use check: clipshard/ops/first_use.py)."""
    return first_use.kernel("stochastic_round", src.device, dtype)(src, dtype, seed, offset, saturate)


def round_into(dst, src, seed, offset, saturate):
    """Writes `src` rounded stochastically into `dst` (no autograd record; the caller bumps dst's version)."""
    first_use.kernel("stochastic_round_into", src.device, dst.dtype)(dst, src, seed, offset, saturate)
