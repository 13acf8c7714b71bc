"""The peak memory of a real call, measured: what a plan is checked against (docs/scale.md).

CUDA: the caching allocator's peak of bytes allocated, above what was allocated before the call.
CPU: torch.profiler's allocation records (every allocation and free of torch's CPU allocator, with
its time), replayed in time order; the largest running sum is the peak above the start. Both count
what torch allocates: a backend's staging buffers when it makes them as torch tensors (gloo's
reduce-scatter and all-gather do), not the memory it holds by other means (NCCL's channels).
"""
import contextlib
import os
import sys

import torch


@contextlib.contextmanager
def _quiet_native_output():
    """The CPU profiler prints native start/stop notices straight to the file descriptors."""
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    with open(os.devnull, "w") as null:
        try:
            os.dup2(null.fileno(), 1)
            os.dup2(null.fileno(), 2)
            yield
        finally:
            for fd, target in zip(saved, (1, 2)):
                os.dup2(fd, target)
                os.close(fd)


def _peak_of_allocations(profiler):
    """Largest running sum of the allocations and frees that the profiler saw, in time order."""
    from torch._C._profiler import _EventType

    sizes, pending = [], list(profiler.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        if node.tag == _EventType.Allocation:
            sizes.append((node.start_time_ns, node.extra_fields.alloc_size))
        pending.extend(node.children)
    running = peak = 0
    for _, size in sorted(sizes):
        running += size
        peak = max(peak, running)
    return peak


def measured_peak_bytes(call, device):
    """Runs call() once and returns the peak of the bytes allocated during it on `device` (its
    tensors' device; 'cpu' or a CUDA device), above what was allocated when it started."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        call()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    if device.type != "cpu":
        raise ValueError(f"measured_peak_bytes: device must be the CPU or a CUDA device, got {device}")
    from torch.profiler import ProfilerActivity, profile

    with _quiet_native_output():
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
            call()
    return _peak_of_allocations(profiler)
