"""Which device's rules apply while clipshard.plan_memory traces a loss (docs/scale.md).

A plan traces the loss on fake CPU tensors whatever device it plans for (a fake CUDA tensor's
backward asks the CUDA driver for a context, which a machine without a GPU does not have). While a
plan for CUDA traces, the decisions that depend on the device follow CUDA's rules instead of the
CPU's: the algorithm "auto" picks (the CUDA kernels, which the plan assumes the GPU machine's build
has) and the chunked kernels' default workspace budget. `tracing_a_plan()` is the one flag every
planned branch of the package reads (the layout, the ranks' agreement checks, the seed draw).
Outside a plan this module changes nothing.
"""
import contextlib
import contextvars

import torch

_planned_device_type = contextvars.ContextVar("clipshard_planned_device_type", default=None)


@contextlib.contextmanager
def rules_of(device_type):
    """Within the block, CPU tensors follow the rules of `device_type` ("cpu" or "cuda")."""
    token = _planned_device_type.set(device_type)
    try:
        yield
    finally:
        _planned_device_type.reset(token)


def planned_device_type():
    """The device type a plan being traced is for, or None outside a plan."""
    return _planned_device_type.get()


def tracing_a_plan():
    """Whether a memory plan is being traced. The decisions that read values across ranks then take
    the ordinary training step's branch (every rank holds this rank's sizes and the same upstream
    gradient), a check of this rank's inputs needs no exchange, and no random bits are drawn."""
    return _planned_device_type.get() is not None


def rules_device(device):
    """The device whose rules apply to tensors on `device`: the planned device for the CPU tensors
    of a plan being traced, else `device` itself."""
    device = torch.device(device)
    planned = _planned_device_type.get()
    if planned is None or device.type != "cpu":
        return device
    return torch.device(planned)
