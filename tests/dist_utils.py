"""Run a function on every rank of a real multi-process gloo group on 127.0.0.1.

`run_group(fn, world_size, *args)` starts world_size processes, each joins a fresh gloo
group on a free port and calls fn(rank, world_size, *args); it returns the ranks' return values in
rank order. A rank that raises fails the call with that rank's traceback; a group that does not
finish within `timeout` seconds is terminated and fails the call, so a hang is a failure, not a
stuck test run.

Processes are forked, not spawned: a spawned process re-imports torch (seconds each on a shared
2-core machine), a forked one starts in a fraction of a second. The children run single-threaded
(OpenMP thread pools do not survive a fork) and the parent never joins a process group.
"""
import datetime
import os
import queue
import socket
import time
import traceback

import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT_S = 30  # gloo raises inside a collective that waits longer than this


def free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world_size, port, fn, args, results):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:  # noqa: BLE001 (report every failure to the parent)
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_group(fn, world_size, *args, timeout=120):
    ctx = mp.get_context("fork")
    results = ctx.Queue()
    port = free_port()
    env_threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, results), daemon=True)
             for r in range(world_size)]
    try:
        for proc in procs:
            proc.start()
    finally:
        if env_threads is None:
            del os.environ["OMP_NUM_THREADS"]
        else:
            os.environ["OMP_NUM_THREADS"] = env_threads
    deadline = time.monotonic() + timeout
    outcome = {}
    try:
        while len(outcome) < world_size:
            try:
                rank, ok, value = results.get(timeout=0.2)
                outcome[rank] = (ok, value)
                continue
            except queue.Empty:
                pass
            missing = sorted(set(range(world_size)) - set(outcome))
            dead = [r for r in missing if procs[r].exitcode is not None]
            if dead and results.empty():
                raise RuntimeError(f"ranks {dead} of {world_size} exited without a result (exit codes "
                                   f"{[procs[r].exitcode for r in dead]})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {missing} of {world_size} did not finish within {timeout} s")
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.terminate()
    failures = [f"--- rank {r} ---\n{v}" for r, (ok, v) in sorted(outcome.items()) if not ok]
    if failures:
        raise AssertionError("\n".join(failures))
    return [outcome[r][1] for r in range(world_size)]


def report_worst(worst):
    """Prints the largest differences a comparison found (pytest -s shows them; the notes quote them)."""
    for key in sorted(worst):
        print(f"  max relative difference {key}: {worst[key]:.3g}")
