"""A fake world of N ranks for a memory plan: fake tensors on a fake process group (docs/scale.md).

torch ships a `fake` process-group backend for its own tests: its collectives return at once and
leave their outputs as they are, so one process can play rank 0 of any world size. Under torch's
FakeTensorMode no tensor holds memory or values: every op computes only its outputs' shapes and
dtypes. Together they run clipshard's real loss code at any size in seconds. The plan's layout
(every rank with the same local batch) replaces the metadata exchange, which needs values
(clipshard/parallel/planned_layout.py), and the device rules follow the device planned for
(clipshard/ops/planned_device.py).
"""
import contextlib

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode

from clipshard.ops.planned_device import rules_of


def _register_fake_backend():
    try:  # importing it registers the backend "fake" with torch.distributed
        import torch.testing._internal.distributed.fake_pg  # noqa: F401
    except ImportError as error:
        raise RuntimeError("clipshard.plan_memory needs torch's fake process group "
                           "(torch.testing._internal.distributed.fake_pg), which this torch lacks") from error


@contextlib.contextmanager
def fake_process_group(world_size):
    """Within the block, torch.distributed's default group is a fake group of `world_size` ranks
    in which this process is rank 0. Refused while a real default group exists (a process has one
    default group): plan before init_process_group, or in another process."""
    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("clipshard.plan_memory: torch.distributed is already initialised in this process; a plan "
                           "runs on a fake process group of its own, so make it before init_process_group (or in a "
                           "separate process, e.g. `python -m clipshard plan ...`)")
    _register_fake_backend()
    from torch._C._distributed_c10d import FakeStore
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _settle_autograd_threads():
    """Autograd starts its per-device worker threads once, at a process's first backward, for the
    devices that torch reports then; a forked child of a process with such threads refuses to run
    a backward. On a machine without a usable GPU, FakeTensorMode installs a no-op CUDA device guard
    that reports a device, so a process whose first backward came during or after a plan would start
    a CUDA worker thread for nothing, and its fork-based children (torch.multiprocessing, forked
    ranks) could not train. One real CPU backward before the plan starts the threads as they are
    without it (none on such a machine); after a process's first backward it changes nothing."""
    with torch.enable_grad():
        torch.ones((), requires_grad=True).mul(1.0).backward()


@contextlib.contextmanager
def fake_world(world_size, device_type):
    """Fake tensors (made in the block on the CPU; see planned_device for why) on a fake group of
    `world_size` ranks (none for a world of 1), with the rules of `device_type`. Yields the
    FakeTensorMode."""
    _settle_autograd_threads()
    group = fake_process_group(world_size) if world_size > 1 else contextlib.nullcontext()
    with group, rules_of(device_type), FakeTensorMode() as mode:
        yield mode
