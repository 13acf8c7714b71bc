"""The collectives of clipshard/parallel/collectives.py as torch.compile traces them: functional
collectives (torch.distributed._functional_collectives), whose ops dynamo puts in the graph and whose
autograd formulas are registered with torch (all-gather: backward reduce-scatter sum; all-reduce
sum: backward all-reduce sum), so the gradients are those of the eager Functions. The shapes are
host facts (the ShardLayout's sizes, constants of the compiled graph).
"""
import torch
from torch.distributed import _functional_collectives as fc

# torch renamed the single-tensor functional collectives (the old names warn outside compile).
_all_gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor


def gather_rows(x, layout):
    """Every rank's rows of x in rank order; unequal local sizes are padded to the largest and cut
    out again (slices of a static size, so no data-dependent shape)."""
    width = max(layout.sizes)
    x = x.contiguous()
    if x.shape[0] < width:
        x = torch.cat([x, x.new_zeros(width - x.shape[0], *x.shape[1:])])
    out = _all_gather(x, 0, layout.group)
    if min(layout.sizes) == width:
        return out
    return torch.cat([out.narrow(0, q * width, size) for q, size in enumerate(layout.sizes)])


class _CombineColumnLSE(torch.autograd.Function):
    """C = logsumexp over ranks of the partial column LSEs c_r; backward: (the sum over ranks of the
    gradients of C) * exp(c_r - C). The eager Function's operations in its order, so that the
    compiled gradients have its rounding too (a logit_bias gradient is rounding noise around 0,
    which Adam scales up to a full step: another formula would change the trained bias)."""

    @staticmethod
    def forward(ctx, partial, group):
        high = fc.all_reduce(partial.detach(), "max", group)
        high = torch.where(torch.isfinite(high), high, torch.zeros_like(high))
        combined = high + torch.log(fc.all_reduce(torch.exp(partial - high), "sum", group))
        ctx.group = group
        ctx.save_for_backward(partial, combined)
        return combined

    @staticmethod
    def backward(ctx, grad):
        partial, combined = ctx.saved_tensors
        return fc.all_reduce(grad.contiguous(), "sum", ctx.group) * torch.exp(partial - combined), None


def combine_column_lse(partial, group):
    """C = logsumexp over ranks of the partial column LSEs, differentiable (_CombineColumnLSE)."""
    return _CombineColumnLSE.apply(partial, group)


def all_reduce_sum(x, group):
    """The sum over ranks; differentiable (backward: the sum over ranks of the gradients)."""
    return fc.all_reduce(x, "sum", group)


def ring_shift(send, like, to, source, world_size, group):
    """One step of a ring pass: `send` goes to group rank `to`, and a tensor shaped like `like`
    comes from group rank `source` (an all-to-all in which only those two pairs move data)."""
    inputs, outputs = [0] * world_size, [0] * world_size
    inputs[to], outputs[source] = send.numel(), like.numel()
    return fc.all_to_all_single(send.contiguous().reshape(-1), outputs, inputs, group).view(like.shape)
