"""Timing and peak-memory helpers shared by the benchmarks.

Peak memory is the largest amount of memory allocated by `fn` beyond what was allocated when it
started (inputs that already exist are not counted; outputs and gradients that `fn` creates are).
- CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats (the caching allocator's own
  accounting of live tensor bytes).
- CPU: torch.profiler with profile_memory=True records every allocation and free that goes through
  PyTorch's CPU allocator (tensors made by ATen ops, by the Python layer and by C++ kernels through
  at::empty); the peak is the maximum of their running sum in time order. Buffers a library
  allocates behind PyTorch's back (plain malloc in a kernel, gloo's internal transport buffers) are
  not seen. Profiling slows the call down, so memory and time are measured in separate calls.
"""
import statistics
import time

import torch


def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device):
    """Wall-clock seconds of one call of fn(), device work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median(values):
    return statistics.median(values)


def _walk(nodes):
    for node in nodes:
        yield node
        yield from _walk(node.children)


def _cpu_peak_bytes(fn):
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = prof.profiler.kineto_results.experimental_event_tree()
    changes = sorted((e.start_time_ns, e.extra_fields.alloc_size) for e in _walk(events)
                     if e.tag == _EventType.Allocation)
    live = peak = 0
    for _, size in changes:
        live += size
        peak = max(peak, live)
    return peak


def _cuda_peak_bytes(fn, device):
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def peak_memory_bytes(fn, device):
    """Peak bytes allocated by fn() beyond those live when it starts (see the module docstring)."""
    if torch.device(device).type == "cuda":
        return _cuda_peak_bytes(fn, device)
    return _cpu_peak_bytes(fn)
