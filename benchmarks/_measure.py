"""What every benchmark shares: command-line basics, timing, peak memory, a text table, JSON output.

Time: CUDA events around the call on the current stream (device time, from the point the call is
issued to the end of its last kernel) on CUDA, wall-clock on CPU. `time_repeats` reports the median
and the 20 % / 80 % quantiles (inclusive method) of several calls after warm-up calls.

Peak memory is the largest amount of memory allocated by `fn` beyond what was allocated when it
started (inputs that already exist are not counted; outputs and gradients that `fn` creates are).
- CUDA: torch.cuda.max_memory_allocated after reset_peak_memory_stats (the caching allocator's own
  accounting of live tensor bytes).
- CPU: torch.profiler with profile_memory=True records every allocation and free that goes through
  PyTorch's CPU allocator (tensors made by ATen ops, by the Python layer and by C++ kernels through
  at::empty); the peak is the maximum of their running sum in time order, starting from zero at the
  call. The allocator's own "Total Allocated" figure is not used: it only hears of frees that happen
  while a profiler runs, so a tensor made in one profiled call and freed between calls stays in it
  and inflates every later reading (tests/test_benchmark_measure.py). Buffers a library allocates
  behind PyTorch's back (plain malloc in a kernel, BLAS workspaces, gloo's transport buffers) are
  not seen. Profiling slows the call down, so memory and time are measured in separate calls.
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch


# --- command line -------------------------------------------------------------------------------

def parser_with_common_arguments(doc):
    """An argument parser with the two options every benchmark takes: --device and --json."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", help="write the results to this JSON file")
    return parser


def require_device(script, device):
    """Exit with a clear message when --device cuda is asked for on a machine without one."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{script}: --device cuda but no CUDA device is available")


# --- time ---------------------------------------------------------------------------------------

def synchronize(device):
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn, device):
    """Seconds of one call of fn(), its device work included."""
    synchronize(device)
    if torch.device(device).type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def summarize(times):
    """{"median_s", "p20_s", "p80_s"} of a list of seconds (inclusive quantiles)."""
    if len(times) == 1:
        return {"median_s": times[0], "p20_s": times[0], "p80_s": times[0]}
    q = statistics.quantiles(times, n=5, method="inclusive")
    return {"median_s": statistics.median(times), "p20_s": q[0], "p80_s": q[3]}


def time_repeats(fn, device, repeats, warmup=1):
    """summarize() of `repeats` timed calls of fn() after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return summarize([time_call(fn, device) for _ in range(repeats)])


# --- memory -------------------------------------------------------------------------------------

def peak_memory_bytes(fn, device):
    """Peak bytes allocated by fn() beyond those live when it starts (see the module docstring):
    clipshard's measurement, the one its memory plans are checked against."""
    from clipshard.planning.measured_peak import measured_peak_bytes
    return measured_peak_bytes(fn, device)


# --- output -------------------------------------------------------------------------------------

def fmt(value, spec, missing="-"):
    """format(value, spec), or `missing` for None."""
    return missing if value is None else format(value, spec)


def comparison_columns():
    """The time, memory and ratio columns of a loss comparison table: rows carry median_s, p20_s,
    p80_s, peak_bytes and the time/memory ratios to open_clip and to the naive loss."""
    return [
        ("median ms", lambda r: f"{r['median_s'] * 1e3:.1f}"),
        ("p20-p80 ms", lambda r: f"{r['p20_s'] * 1e3:.1f}-{r['p80_s'] * 1e3:.1f}"),
        ("peak MiB", lambda r: f"{r['peak_bytes'] / 2**20:.1f}"),
        ("time/oc", lambda r: fmt(r["time_vs_open_clip"], ".3f")),
        ("mem/oc", lambda r: fmt(r["mem_vs_open_clip"], ".4f")),
        ("time/naive", lambda r: fmt(r["time_vs_naive"], ".3f")),
        ("mem/naive", lambda r: fmt(r["mem_vs_naive"], ".4f")),
    ]


def print_table(columns, rows, title=None):
    """Print rows as a text table. columns: [(heading, cell)] or [(heading, cell, "<")] where
    cell(row) returns a string; columns are right-aligned ("<": left-aligned), each as wide as its
    widest entry."""
    cells = [[c[0] for c in columns]] + [[c[1](row) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    left = [len(c) > 2 and c[2] == "<" for c in columns]

    def line(entries):
        return " ".join(e.ljust(w) if to_left else e.rjust(w) for e, w, to_left in zip(entries, widths, left)).rstrip()

    if title:
        print(title)
    print(line(cells[0]))
    print("-" * len(line(cells[0])))
    for entries in cells[1:]:
        print(line(entries))


def run_metadata(device):
    """Where the numbers come from: device, threads, torch version, GPU name."""
    cuda = torch.device(device).type == "cuda"
    return {"device": str(device), "threads": torch.get_num_threads(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(device) if cuda else None}


def write_json(path, data):
    """Write data to path as indented JSON (parent directories created; dtypes and the like as str)."""
    if not path:
        return
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1, default=str)
