"""Collectives around the local contrastive kernels (docs/distributed.md).

Everything that talks to other ranks lives here, as autograd Functions over torch.distributed
collectives, so that the kernels only ever see local tensors:

- `gather_rows`: all-gather of features along dim 0 (unequal local sizes allowed); backward is a
  reduce-scatter (sum) of the gradient.
- `combine_column_lse`: C[j] = logsumexp_r c_r[j] over ranks; backward all-reduces the incoming
  gradient and returns g_C * exp(c_r - C).
- `all_reduce_sum_with_grad`: a sum over ranks whose backward all-reduces the gradient (the
  distillation loss combines its partial column statistics with it);
- `shard_layout`: one small all-gather of per-rank metadata that validates the inputs of every rank
  (so that a bad input raises on all ranks instead of hanging some of them) and returns the local
  sizes of all ranks; `raise_on_every_rank` does the same for a problem a caller found in inputs
  shard_layout does not know (the distillation loss's teachers).

The process group's backend decides the transport (NCCL/RCCL for CUDA and ROCm tensors, gloo for
CPU tensors, XCCL for XPU, ...); nothing here depends on the device type. Features travel in their
own dtype; log-sum-exps travel in fp32.
"""
import math
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

# Recent torch versions renamed the single-tensor collectives (deprecating the old names); older
# versions only have the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3}


def _device_code(device_type):
    """A number for a device type name, the same in every process (Python's hash() is salted per
    process): every device type torch supports is accepted, and ranks must agree on it."""
    return zlib.crc32(device_type.encode())


# Names of the device types whose codes an error message may have to print back.
_KNOWN_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "mtia", "xla", "lazy", "ipu", "maia",
                       "privateuseone")


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's rows sit in the global (concatenated) batch."""

    sizes: tuple  # local batch size of every rank, in rank order
    rank: int
    group: object  # a ProcessGroup, or None for a single process

    @property
    def world_size(self):
        return len(self.sizes)

    @property
    def offset(self):
        return sum(self.sizes[: self.rank])

    @property
    def local_size(self):
        return self.sizes[self.rank]

    @property
    def total(self):
        return sum(self.sizes)


def single_process_layout(batch_size):
    return ShardLayout(sizes=(batch_size,), rank=0, group=None)


def resolve_group(fn, group, world_size=None):
    """The process group to use and its size; world_size (open_clip's argument) > 1 without an
    initialised process group is an error."""
    initialised = dist.is_available() and dist.is_initialized()
    if group is None and not initialised:
        if world_size not in (None, 1):
            raise RuntimeError(
                f"{fn}: world_size={world_size} but torch.distributed is not initialised; call "
                "torch.distributed.init_process_group first (or use world_size=1)"
            )
        return None, 1
    if not initialised:
        raise RuntimeError(f"{fn}: a process group was given but torch.distributed is not initialised")
    group = group if group is not None else dist.group.WORLD
    return group, dist.get_world_size(group)


# ---------------------------------------------------------------------------------------------
# Validation across ranks
# ---------------------------------------------------------------------------------------------

# Problems a rank can find in its own inputs; the code travels to the other ranks so that they
# raise too (with the description) instead of waiting in a collective.
_LOCAL_PROBLEMS = {
    1: "image_features and text_features must be 2-D",
    2: "image_features and text_features must have the same dtype",
    3: "image_features and text_features must be on the same device",
    4: "image_features and text_features must have the same shape",
    5: "features must be fp32, fp16, bf16 or fp64",
    7: "the local batch must not be empty",
    8: "logit_scale must be a tensor with one element on the features' device",
    9: "logit_bias must be None or a tensor with one element on the features' device",
    10: "features must be dense (strided) tensors",
    11: "the feature dimension D must be at least 1",
    12: "logit_scale must be a fp32, fp16, bf16 or fp64 tensor",
    13: "logit_bias must be a fp32, fp16, bf16 or fp64 tensor",
    14: "image_features and text_features must be torch.Tensors",
}
_TYPE_PROBLEMS = (2, 5, 12, 13, 14)  # raised as TypeError on the rank that has them, ValueError otherwise


def _local_problem(image, text, scale, bias):
    """(code, message) of the first problem with this rank's inputs, or (0, None). Everything that
    would make this rank fail after the metadata exchange belongs here."""

    def fail(code, detail):
        return code, f"{_LOCAL_PROBLEMS[code]}, got {detail}"

    for name, value in (("image_features", image), ("text_features", text)):
        if not torch.is_tensor(value):
            return fail(14, f"{type(value).__name__} for {name}")
    if image.dim() != 2 or text.dim() != 2:
        return fail(1, f"shapes {tuple(image.shape)} and {tuple(text.shape)}")
    if image.dtype != text.dtype:
        return fail(2, f"{image.dtype} and {text.dtype}")
    if image.device != text.device:
        return fail(3, f"{image.device} and {text.device}")
    if image.shape != text.shape:
        return fail(4, f"{tuple(image.shape)} and {tuple(text.shape)}")
    if image.layout != torch.strided or text.layout != torch.strided:
        return fail(10, f"{image.layout} and {text.layout}")
    if image.dtype not in _DTYPE_CODES:
        return fail(5, f"{image.dtype}")
    if image.shape[0] == 0:
        return fail(7, f"{tuple(image.shape)}")
    if image.shape[1] == 0:
        return fail(11, f"{tuple(image.shape)}")
    if not torch.is_tensor(scale) or scale.numel() != 1 or scale.device != image.device:
        got = f"{tuple(scale.shape)} on {scale.device}" if torch.is_tensor(scale) else type(scale).__name__
        return fail(8, got)
    if scale.dtype not in _DTYPE_CODES:
        return fail(12, f"{scale.dtype}")
    if bias is not None and (not torch.is_tensor(bias) or bias.numel() != 1 or bias.device != image.device):
        got = f"{tuple(bias.shape)} on {bias.device}" if torch.is_tensor(bias) else type(bias).__name__
        return fail(9, got)
    if bias is not None and bias.dtype not in _DTYPE_CODES:
        return fail(13, f"{bias.dtype}")
    return 0, None


def _requires_grad_bits(image, text, scale, bias):
    """Which inputs autograd will differentiate: a rank under torch.no_grad() would skip the backward
    collectives that the other ranks enter."""
    grad_mode = torch.is_grad_enabled()
    flags = (image.requires_grad, text.requires_grad, scale.requires_grad,
             bias is not None and bias.requires_grad)
    return sum(int(grad_mode and f) << k for k, f in enumerate(flags))


def _metadata_device(group):
    """Where the metadata travels: a device every rank's backend serves whatever its inputs are (a
    rank with inputs on an unusable device must still take part, to report it): NCCL's (RCCL's)
    CUDA device, the current accelerator for the other backends that serve only their accelerator
    (XCCL on XPU, HCCL on HPU), else the CPU (gloo, mpi, "cpu:gloo,cuda:nccl" pairs)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend in _ACCELERATOR_ONLY_BACKENDS:
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")


_ACCELERATOR_ONLY_BACKENDS = ("xccl", "hccl")

# Column order of the metadata each rank contributes.
_META_FIELDS = ("problem", "batch", "dim", "dtype", "device", "has_bias", "requires_grad",
                "config", "rank_arg", "world_size_arg", "scale_dtype", "bias_dtype")


def shard_layout(fn, image, text, scale, bias, group, *, config=0, rank_arg=None, world_size_arg=None,
                 same_scale_and_bias=False):
    """Validate the inputs of all ranks and return the ShardLayout.

    With a process group, every rank contributes one small int64 row of metadata (one all-gather)
    and every rank checks all rows with the same code, so an inconsistency raises the same error on
    every rank. `config` encodes the loss options, which must agree too (different options would run
    different collectives and hang). rank_arg / world_size_arg are open_clip's constructor
    arguments, checked against the group when given. The row ends with the values of logit_scale
    and logit_bias (their fp64 bits); same_scale_and_bias=True requires every rank to hold the same
    values (a loss whose ranks combine terms computed with their own scales; docs/distributed.md).
    """
    code, message = _local_problem(image, text, scale, bias)
    if group is None:
        if code:
            raise (TypeError if code in _TYPE_PROBLEMS else ValueError)(f"{fn}: {message}")
        return single_process_layout(image.shape[0])

    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    if code:  # every rank raises on the problem code before looking at the other fields
        row = [code] + [0] * (len(_META_FIELDS) - 1)
    else:
        row = [
            code,
            image.shape[0],
            image.shape[1],
            _DTYPE_CODES[image.dtype],
            _device_code(image.device.type),
            int(bias is not None),
            _requires_grad_bits(image, text, scale, bias),
            config,
            -1 if rank_arg is None else rank_arg,
            -1 if world_size_arg is None else world_size_arg,
            _DTYPE_CODES[scale.dtype],
            -1 if bias is None else _DTYPE_CODES[bias.dtype],
        ]
    device = _metadata_device(group)
    mine = torch.tensor(row + [0, 0], dtype=torch.int64, device=device)
    if not code:  # the values of logit_scale and logit_bias (if given): the bits of two fp64 numbers
        values = torch.stack([t.detach().reshape(()) for t in (scale, bias) if t is not None])
        mine[len(row): len(row) + len(values)].view(torch.float64).copy_(values)
    everyone = torch.empty(world_size * mine.numel(), dtype=torch.int64, device=device)
    _all_gather_single(everyone, mine, group=group)
    everyone = everyone.view(world_size, -1).cpu()  # one copy to the host
    table = everyone[:, : len(row)].tolist()
    _check_table(fn, table, rank, world_size, message)
    if same_scale_and_bias:
        _check_same_values(fn, everyone[:, len(row):].contiguous().view(torch.float64).tolist(), bias is not None)
    return ShardLayout(sizes=tuple(r[1] for r in table), rank=rank, group=group)


def _check_same_values(fn, values, has_bias):
    """Raise on every rank if the ranks' logit_scale (or logit_bias) values differ (NaN equals NaN)."""
    for k, name in enumerate(("logit_scale", "logit_bias")[: 1 + has_bias]):
        column = [row[k] for row in values]
        if any(v != column[0] and not (math.isnan(v) and math.isnan(column[0])) for v in column):
            per_rank = ", ".join(f"rank {q}: {v!r}" for q, v in enumerate(column))
            raise ValueError(
                f"{fn}: all ranks must use the same {name} here, got {per_rank}: with mode 'exchange' or "
                "'ring', or local_loss=False, a rank's loss combines terms that the other ranks computed "
                f"with their own {name} (mode='local' with local_loss=True uses each rank's own value, "
                "as open_clip does; docs/distributed.md)")


def _check_table(fn, table, rank, world_size, own_message):
    """Raise the same error on every rank if any rank's row is bad or rows disagree."""
    field = {name: k for k, name in enumerate(_META_FIELDS)}
    for q, row in enumerate(table):
        code = row[field["problem"]]
        if code:
            if q == rank:
                error = TypeError if code in _TYPE_PROBLEMS else ValueError
                raise error(f"{fn}: {own_message} (on rank {q})")
            raise ValueError(f"{fn}: rank {q} has invalid inputs: {_LOCAL_PROBLEMS[code]}")
    for q, row in enumerate(table):
        if row[field["world_size_arg"]] not in (-1, world_size):
            raise ValueError(
                f"{fn}: rank {q} was given world_size={row[field['world_size_arg']]} but the process "
                f"group has {world_size} ranks"
            )
        if row[field["rank_arg"]] not in (-1, q):
            raise ValueError(f"{fn}: rank {q} of the process group was given rank={row[field['rank_arg']]}")
    must_agree = {
        "dim": "feature dimension D",
        "dtype": "feature dtype",
        "device": "feature device type",
        "has_bias": "presence of logit_bias",
        "requires_grad": "requires_grad pattern of (image, text, logit_scale, logit_bias) under the grad mode",
        "config": "loss options (local_loss, gather_with_grad, mode)",
        "scale_dtype": "logit_scale dtype",
        "bias_dtype": "logit_bias dtype",
    }
    for name, what in must_agree.items():
        values = [row[field[name]] for row in table]
        if len(set(values)) > 1:
            dtypes = {v: str(k) for k, v in _DTYPE_CODES.items()}
            shown = {"dtype": dtypes, "scale_dtype": dtypes, "bias_dtype": dtypes,
                     "device": {_device_code(t): t for t in _KNOWN_DEVICE_TYPES}}.get(name, {})
            per_rank = ", ".join(f"rank {q}: {shown.get(v, v)}" for q, v in enumerate(values))
            raise ValueError(f"{fn}: all ranks must use the same {what}, got {per_rank}")


# ---------------------------------------------------------------------------------------------
# Autograd collectives
# ---------------------------------------------------------------------------------------------


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
        _all_gather_single(out, x, group=layout.group)
        return out
    padded = x.new_zeros(width, *x.shape[1:])
    padded[: x.shape[0]] = x
    out = x.new_empty(layout.world_size * width, *x.shape[1:])
    _all_gather_single(out, padded, group=layout.group)
    return out.view(layout.world_size, width, -1)[_row_mask(layout, x.device)].view(layout.total, *x.shape[1:])


def gather_rows(x, layout, *, with_grad=True):
    """Concatenation over ranks of every rank's `x` (rows in rank order). With with_grad, the
    gradient of the result is reduce-scattered back (summed over ranks) to each rank's `x`."""
    if layout.world_size == 1:
        return x if with_grad else x.detach()
    if with_grad:
        return _GatherRows.apply(x, layout)
    with torch.no_grad():
        return _gather(x.detach().contiguous(), layout)


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
    return _CombineColumnLSE.apply(partial, layout.group)


def same_on_every_rank(values, layout):
    """Whether every rank holds the same `values` (a small tensor): one all-reduce MAX of
    (values, -values, NaN flags). A NaN is a difference: a MAX reduction drops NaN (every
    comparison with it is false), so without the flags NaN on one rank would pass for agreement."""
    values = values.detach().double().reshape(-1)
    nan = torch.isnan(values)
    finite_or_inf = torch.where(nan, torch.zeros_like(values), values)
    packed = torch.cat([finite_or_inf, -finite_or_inf, nan.double()])
    dist.all_reduce(packed, op=dist.ReduceOp.MAX, group=layout.group)
    high, negated_low, any_nan = packed.split(values.numel())
    return bool((high == -negated_low).all()) and not bool(any_nan.any())


def all_reduce_sum(x, layout):
    """Sum over ranks of a (detached) tensor; no autograd."""
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
    return _AllReduceSum.apply(x, layout.group)


def raise_on_every_rank(fn, problem, group):
    """`problem`: (exception class, message) of this rank's inputs, or None. One all-gather of a
    flag, so that a problem on one rank raises on every rank instead of leaving the others waiting
    in a collective."""
    if group is None:
        if problem is not None:
            raise problem[0](f"{fn}: {problem[1]}")
        return
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = _metadata_device(group)
    mine = torch.tensor([int(problem is not None)], dtype=torch.int64, device=device)
    everyone = torch.empty(world_size, dtype=torch.int64, device=device)
    _all_gather_single(everyone, mine, group=group)
    flags = everyone.tolist()
    if problem is not None:
        raise problem[0](f"{fn}: {problem[1]} (on rank {rank})")
    if any(flags):
        raise ValueError(f"{fn}: rank {flags.index(1)} has invalid inputs (its error says which)")
