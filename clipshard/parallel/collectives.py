"""Autograd collectives around the local kernels (docs/distributed.md), so that the kernels only
ever see local tensors:

- `gather_rows`: all-gather of features along dim 0 (unequal local sizes allowed); backward is a
  reduce-scatter (sum) of the gradient; `gather_negatives` the same for the hard negatives.
- `combine_column_lse`: C[j] = logsumexp_r c_r[j] over ranks; backward all-reduces the incoming
  gradient and returns g_C * exp(c_r - C).
- `all_reduce_sum_with_grad`: a sum over ranks whose backward all-reduces the gradient (the
  distillation loss combines its partial column statistics with it); `all_reduce_sum` and
  `same_on_every_rank` without autograd.

Under torch.compile the same functions use functional collectives
(torch.distributed._functional_collectives), which dynamo traces and whose autograd formulas are
the ones above (all-gather <-> reduce-scatter sum, all-reduce sum <-> all-reduce sum), so a compiled
step has no graph break here (docs/distributed.md, "Compiling and host syncs").

The process group's backend decides the transport (NCCL/RCCL for CUDA and ROCm tensors, gloo for
CPU tensors, XCCL for XPU, ...); nothing here depends on the device type. Features travel in their
own dtype; log-sum-exps travel in fp32.
"""
import torch
import torch.distributed as dist

from clipshard.parallel import traced_collectives as traced
from clipshard.ops.planned_device import tracing_a_plan

# Recent torch versions renamed the single-tensor collectives (deprecating the old names); older
# versions only have the old names.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _GatherRows(torch.autograd.Function):
    """All-gather along dim 0; backward = reduce-scatter (sum) of the gradient.

    Unequal local sizes: every rank pads its rows to the largest local size, one
    all_gather_into_tensor moves (world * max) rows, and the padding is cut out. Padding keeps the
    single-buffer collectives (the fast path of NCCL, and the only reduce-scatter gloo offers);
    only the last batch of an epoch is usually unequal, so the wasted bytes are rare.
    """

    @staticmethod
    def forward(ctx, x, layout):
        ctx.layout = layout
        return _gather(x.contiguous(), layout)

    @staticmethod
    def backward(ctx, grad):
        layout = ctx.layout
        width = max(layout.sizes)
        if min(layout.sizes) == width:
            padded = grad.contiguous()
        else:
            padded = grad.new_zeros(layout.world_size * width, *grad.shape[1:])
            mask = _row_mask(layout, grad.device)
            padded.view(layout.world_size, width, -1)[mask] = grad.reshape(grad.shape[0], -1)
        out = grad.new_empty(width, *grad.shape[1:])
        _reduce_scatter_single(out, padded, group=layout.group)
        return out[: layout.local_size], None


def _row_mask(layout, device):
    """(world, max) boolean mask of the real (unpadded) rows."""
    width = max(layout.sizes)
    sizes = torch.tensor(layout.sizes, device=device)
    return torch.arange(width, device=device)[None, :] < sizes[:, None]


def _gather(x, layout):
    width = max(layout.sizes)
    if min(layout.sizes) == width:
        out = x.new_empty(layout.total, *x.shape[1:])
        all_gather_single(out, x, group=layout.group)
        return out
    padded = x.new_zeros(width, *x.shape[1:])
    padded[: x.shape[0]] = x
    out = x.new_empty(layout.world_size * width, *x.shape[1:])
    all_gather_single(out, padded, group=layout.group)
    return out.view(layout.world_size, width, -1)[_row_mask(layout, x.device)].view(layout.total, *x.shape[1:])


def gather_rows(x, layout, *, with_grad=True):
    """Concatenation over ranks of every rank's `x` (rows in rank order). With with_grad, the
    gradient of the result is reduce-scattered back (summed over ranks) to each rank's `x`."""
    if layout.world_size == 1:
        return x if with_grad else x.detach()
    if torch.compiler.is_compiling():
        return traced.gather_rows(x if with_grad else x.detach(), layout)
    if with_grad:
        return _GatherRows.apply(x, layout)
    with torch.no_grad():
        return _gather(x.detach().contiguous(), layout)


def gather_negatives(negatives, layout, *, with_grad=True):
    """Every rank's extra rows (the losses' hard negatives, H_r on rank r as
    layout.negative_sizes says, H_r may be 0) in rank order, gathered like `gather_rows`; None
    when `negatives` is None or no rank has any."""
    if negatives is None or sum(layout.negative_sizes) == 0:
        return None
    return gather_rows(negatives, layout.negatives_layout(), with_grad=with_grad)


class _CombineColumnLSE(torch.autograd.Function):
    """C = logsumexp over ranks of the partial column LSEs c_r (all ranks hold all columns).

    Forward: all_reduce MAX, then all_reduce SUM of exp(c_r - max). Backward: each rank's loss
    touches only its own columns of C, so the full gradient of C is the SUM over ranks of the
    incoming gradients; dC/dc_r = exp(c_r - C).
    """

    @staticmethod
    def forward(ctx, partial, group):
        high = partial.detach().clone()
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        high = torch.where(torch.isfinite(high), high, torch.zeros_like(high))
        total = torch.exp(partial - high)
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        combined = high + torch.log(total)
        ctx.group = group
        ctx.save_for_backward(partial, combined)
        return combined

    @staticmethod
    def backward(ctx, grad):
        partial, combined = ctx.saved_tensors
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad * torch.exp(partial - combined), None


def combine_column_lse(partial, layout):
    """Global column LSE from each rank's partial column LSE (fp32 or wider)."""
    if layout.world_size == 1:
        return partial
    if torch.compiler.is_compiling():
        return traced.combine_column_lse(partial, layout.group)
    return _CombineColumnLSE.apply(partial, layout.group)


def same_on_every_rank(values, layout):
    """Whether every rank holds the same `values` (a small tensor): one all-reduce MAX of
    (values, -values, NaN flags). A NaN is a difference: a MAX reduction drops NaN (every
    comparison with it is false), so without the flags NaN on one rank would pass for agreement.
    A memory plan (fake tensors, no values) takes the ordinary step's answer: True."""
    if tracing_a_plan():
        return True
    values = values.detach().double().reshape(-1)
    nan = torch.isnan(values)
    finite_or_inf = torch.where(nan, torch.zeros_like(values), values)
    packed = torch.cat([finite_or_inf, -finite_or_inf, nan.double()])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=layout.group)
    high, negated_low, any_nan = packed.split(values.numel())
    return bool((high == -negated_low).all() & (any_nan == 0).all())  # one read by the host


def all_reduce_sum(x, layout):
    """Sum over ranks of a (detached) tensor; no autograd."""
    if torch.compiler.is_compiling() and layout.world_size > 1:
        return traced.all_reduce_sum(x.detach(), layout.group)
    x = x.detach().clone()
    if layout.world_size > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=layout.group)
    return x


class _AllReduceSum(torch.autograd.Function):
    """y = sum over ranks of x (every rank holds y). Every rank's loss may use y, so the gradient of
    x is the sum over ranks of the incoming gradients: backward is an all-reduce too."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.detach().clone()
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM, group=ctx.group)
        return grad, None


def all_reduce_sum_with_grad(x, layout):
    """Sum over ranks of `x`, differentiable (module docstring)."""
    if layout.world_size == 1:
        return x
    if torch.compiler.is_compiling():
        return traced.all_reduce_sum(x, layout.group)
    return _AllReduceSum.apply(x, layout.group)
