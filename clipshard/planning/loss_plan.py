"""clipshard.plan_memory for a loss: one rank's peak of its forward + backward (docs/scale.md).

The loss runs for real, clipshard's own code, on fake tensors in a fake world of N ranks
(clipshard/planning/fake_world.py), with an AllocationTracker counting every allocation from just
before the forward to the end of the backward. The inputs (features, teacher features, hard
negatives, sample ids) exist before and are not counted; their gradients are.
"""
import copy
import time

import torch

from clipshard.losses import ClipLoss, DistillClipLoss, SigLipLoss
from clipshard.planning.allocation_tracker import AllocationTracker
from clipshard.planning.fake_world import fake_world
from clipshard.planning.memory_plan import MemoryPlan

CUDA_ROUNDING = 512  # the CUDA caching allocator rounds every block up to a multiple of 512 bytes
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16,
           "bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp64": torch.float64, "float64": torch.float64}


def planned_dtype(fn, dtype):
    """A torch dtype from a dtype or its name ('bf16', 'fp32', ...)."""
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype, dtype)
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise ValueError(f"{fn}: dtype must be torch.float32, float16, bfloat16 or float64 (or 'fp32', 'fp16', "
                         f"'bf16', 'fp64'), got {dtype!r}")
    return dtype


def checked_device_type(fn, device):
    """'cpu' or 'cuda' from a device or its name."""
    try:
        device_type = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{fn}: device must be 'cpu' or 'cuda', got {device!r}") from error
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: device must be 'cpu' or 'cuda' (the kernels whose workspace a plan knows), "
                         f"got {device!r}")
    return device_type


def positive_int(fn, name, value, least=1):
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"{fn}: {name} must be an int >= {least}, got {value!r}")
    return value


def check_targets(fn, targets, sample_ids):
    if targets not in (None, "mask", "multi"):
        raise ValueError(f"{fn}: targets must be None, 'mask' or 'multi', got {targets!r}")
    if targets is not None and not sample_ids:
        raise ValueError(f"{fn}: targets={targets!r} needs sample_ids=True (the targets are defined by the ids)")


def check_loss(fn, loss):
    """Before the loss is copied into the fake world: anything else has no loss call to plan."""
    if not isinstance(loss, (ClipLoss, SigLipLoss, DistillClipLoss)):
        raise TypeError(f"{fn}: loss must be a clipshard ClipLoss, SigLipLoss or DistillClipLoss, "
                        f"got {type(loss).__name__}")


def _in_world(loss, world_size):
    """A shallow copy of the loss that acts as rank 0 of the fake default group (its own group,
    rank and world_size arguments replaced), leaving the caller's loss as it was."""
    planned = copy.copy(loss)
    planned.group, planned.rank, planned.world_size = None, 0, world_size
    return planned


def _leaf(shape, dtype, requires_grad=True):
    return torch.empty(shape, dtype=dtype).requires_grad_(requires_grad)


def _loss_call(loss, batch, dim, dtype, hard_negatives, sample_ids, targets, teacher_dim):
    """(the function that runs the loss's forward + backward, its input tensors) for a fake world."""
    image, text = _leaf((batch, dim), dtype), _leaf((batch, dim), dtype)
    scale = _leaf((), torch.float32)
    extras = {}
    if hard_negatives:
        extras["hard_negatives"] = _leaf((hard_negatives, dim), dtype)
    if sample_ids:
        extras["sample_ids"] = torch.empty(batch, dtype=torch.int64)
        extras["targets"] = targets
    if isinstance(loss, DistillClipLoss):
        if extras:
            raise ValueError("plan_memory: DistillClipLoss takes neither hard_negatives nor sample_ids (nor targets)")
        teacher = (torch.empty(batch, teacher_dim, dtype=dtype), torch.empty(batch, teacher_dim, dtype=dtype),
                   torch.empty((), dtype=torch.float32))
        return lambda: loss(image, text, scale, *teacher), (image, text, scale, *teacher)
    if isinstance(loss, SigLipLoss):
        bias = _leaf((), torch.float32)
        return lambda: loss(image, text, scale, bias, **extras), (image, text, scale, bias, *extras.values())
    return lambda: loss(image, text, scale, **extras), (image, text, scale, *extras.values())  # a ClipLoss


def _summed(value):
    """A loss's result as one scalar to differentiate (DistillClipLoss returns two terms)."""
    if isinstance(value, dict):
        value = tuple(value.values())
    return sum(value) if isinstance(value, (tuple, list)) else value


def plan_call(make_call, *, world_size, device_type, setting):
    """The MemoryPlan of `call()` as rank 0 of a fake world of `world_size` ranks on `device_type`'s
    rules, where `make_call()` (run inside the fake world, not counted) returns (call, inputs): the
    inputs are kept alive until the call is done, and call() runs the forward and backward."""
    start = time.perf_counter()
    with fake_world(world_size, device_type):
        call, inputs = make_call()
        tracker = AllocationTracker(device_type, round_to=CUDA_ROUNDING if device_type == "cuda" else 1)
        with tracker:
            call()
        del inputs
    allocations = sorted(((a.nbytes, a.what) for a in tracker.peak_allocations), key=lambda a: -a[0])
    return MemoryPlan(tracker.peak_bytes, allocations, setting, time.perf_counter() - start)


def plan_loss(loss, *, world_size, batch_size, dim, dtype, hard_negatives, sample_ids, targets, device, teacher_dim):
    """The MemoryPlan of one rank's forward + backward of `loss` (see clipshard.plan_memory)."""
    fn = "plan_memory"
    positive_int(fn, "world_size", world_size)
    positive_int(fn, "batch_size", batch_size)
    positive_int(fn, "dim", dim)
    positive_int(fn, "hard_negatives", hard_negatives, least=0)
    teacher_dim = dim if teacher_dim is None else positive_int(fn, "teacher_dim", teacher_dim)
    dtype = planned_dtype(fn, dtype)
    device_type = checked_device_type(fn, device)
    check_targets(fn, targets, sample_ids)
    check_loss(fn, loss)

    def make_call():
        forward, inputs = _loss_call(_in_world(loss, world_size), batch_size, dim, dtype, hard_negatives,
                                     bool(sample_ids), targets, teacher_dim)
        return (lambda: _summed(forward()).backward()), inputs

    setting = [("loss", type(loss).__name__), ("mode", getattr(loss, "mode", None)), ("world_size", world_size),
               ("batch_size", batch_size), ("dim", dim), ("dtype", str(dtype).removeprefix("torch.")),
               ("hard_negatives", hard_negatives), ("sample_ids", bool(sample_ids)), ("targets", targets),
               ("device", device_type)]
    return plan_call(make_call, world_size=world_size, device_type=device_type, setting=setting)
