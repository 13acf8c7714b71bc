"""DTensor parameters (FSDP2's fully_shard, any device mesh) in clipshard.optim.AdamW.

AdamW's update is elementwise, so a rank updates its local shard of a DTensor parameter with the
same fused kernel as a plain tensor. Two things make the result independent of the sharding:
- the shard is a contiguous range of the full parameter's row-major elements, whose first global
  index (the "index base") goes to the kernel, so that every element draws the stochastic-rounding
  bits of its index in the full parameter (docs/optimizer.md, "FSDP2");
- the state tensors are DTensors with the parameter's mesh and placements (a local shard each, no
  full copy), so that optimizer.state_dict() and torch.distributed.checkpoint save and reshard them.

Supported placements: Replicate() and Shard(0) on any mesh dimension (FSDP2's default, HSDP's
(Replicate(), Shard(0)), uneven and empty shards included). Others (Partial, Shard(d) for d > 0,
FSDP+TP's strided shards) would not give a contiguous range of the full parameter: refused.
"""
import math

import torch

if torch.distributed.is_available():
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
else:  # torch built without distributed: no tensor is a DTensor
    DTensor = None


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def _supported(placement) -> bool:
    return isinstance(placement, Replicate) or (type(placement) is Shard and placement.dim == 0)


def check_dtensor_param(name: str, p, grad) -> None:
    """Raises a ValueError naming the parameter when the optimizer cannot update this DTensor
    parameter (or its gradient) shard by shard. Plain parameters with plain gradients pass."""
    if not is_dtensor(p):
        if is_dtensor(grad):
            raise ValueError(f"{name} is a plain tensor but its gradient is a DTensor")
        return
    bad = [pl for pl in p.placements if not _supported(pl)]
    if bad:
        raise ValueError(f"{name} is a DTensor with placements {tuple(p.placements)}; clipshard.optim.AdamW "
                         f"updates DTensors placed as Replicate() or Shard(0) only (not {bad[0]})")
    if not is_dtensor(grad):
        raise ValueError(f"{name} is a DTensor but its gradient is a plain tensor of shape {tuple(grad.shape)}")
    if grad.device_mesh != p.device_mesh or tuple(grad.placements) != tuple(p.placements):
        raise ValueError(f"{name}: its gradient is placed as {tuple(grad.placements)} on {grad.device_mesh}, "
                         f"the parameter as {tuple(p.placements)} on {p.device_mesh}; they must match")
    if not p.to_local().is_contiguous():
        raise ValueError(f"{name}: the local shard of the DTensor must be contiguous, got strides "
                         f"{p.to_local().stride()}")


def index_base(p) -> int:
    """The index, in the full row-major parameter, of the first element of this rank's shard (0 for
    a plain tensor). Replicate() and Shard(0) shards are whole rows, hence a contiguous range."""
    if not is_dtensor(p) or p.numel() == 0:
        return 0
    _, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return offset[0] * math.prod(p.shape[1:]) if offset else 0


def local(t):
    """The tensor a kernel writes: the local shard of a DTensor (an alias, not a copy), else t."""
    return t.to_local() if is_dtensor(t) else t


def zeros_state_like(p, dtype: torch.dtype):
    """A zero state tensor for parameter p: a DTensor with p's mesh and placements holding a zero
    local shard for a DTensor p, a plain tensor otherwise."""
    if not is_dtensor(p):
        return torch.zeros_like(p, dtype=dtype, memory_format=torch.contiguous_format)
    shard = torch.zeros_like(p.to_local(), dtype=dtype, memory_format=torch.contiguous_format)
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())


def state_in_param_layout(where: str, value: torch.Tensor, p):
    """A copy of a loaded state tensor laid out as parameter p: a DTensor with p's mesh and
    placements for a DTensor p (a plain full tensor, e.g. from an unsharded run, is sliced to this
    rank's shard; a DTensor placed otherwise is redistributed), a plain tensor otherwise (a DTensor
    state of a plain parameter is gathered)."""
    if not is_dtensor(p):
        full = value.full_tensor() if is_dtensor(value) else value
        return full.to(device=p.device, copy=True).contiguous()
    if is_dtensor(value):
        if value.device_mesh != p.device_mesh:
            raise ValueError(f"{where} is a DTensor on {value.device_mesh}, the parameter's mesh is {p.device_mesh}")
        if tuple(value.placements) != tuple(p.placements):
            value = value.redistribute(p.device_mesh, p.placements)
        shard = value.to_local()
    else:
        if value.shape != p.shape:
            raise ValueError(f"{where} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}")
        base, numel = index_base(p), p.to_local().numel()
        shard = value.reshape(-1)[base:base + numel].view(p.to_local().shape)
    shard = shard.to(device=p.to_local().device, copy=True).contiguous()
    return DTensor.from_local(shard, p.device_mesh, p.placements, run_check=False, shape=p.shape,
                              stride=p.stride())
