"""Distributed CLIP loss: clipshard's exchange, ring and local modes against open_clip's ClipLoss
(local_loss=True, gather_with_grad=True), forward + backward, per rank, all in the same run.

CPU (default): a gloo group of --world-size ranks on this machine (2 by default), sharing the cores. CUDA: one process
per GPU with NCCL; with a single GPU the run is world size 1 (no communication, so it measures the
local kernels only) and the output says that a multi-GPU run needs more than one GPU.

Time: median and 20/80 % quantiles over --steps steps (after one warm-up) of each rank's forward +
backward; methods are interleaved step by step so that a busy machine slows all of them alike. Memory: peak bytes the
loss step allocates beyond the inputs (benchmarks/_measure.py), in a separate step.

    python benchmarks/bench_distributed.py --device cpu --json bench_distributed.json
    python benchmarks/bench_distributed.py --world-size 4 --batch 2048 --methods exchange,ring
"""
import datetime
import os
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (fmt, parser_with_common_arguments, peak_memory_bytes, print_table, summarize,  # noqa: E402
                      time_call, write_json)

MIB = 2 ** 20


def _methods():
    import clipshard

    methods = {
        "clipshard exchange": lambda r, w: clipshard.ClipLoss(True, True, rank=r, world_size=w, mode="exchange"),
        "clipshard ring": lambda r, w: clipshard.ClipLoss(True, True, rank=r, world_size=w, mode="ring"),
        "clipshard local": lambda r, w: clipshard.ClipLoss(True, True, rank=r, world_size=w, mode="local"),
    }
    try:
        from open_clip.loss import ClipLoss as OpenClipLoss
    except ImportError:
        return methods, "open_clip is not installed: no baseline"
    methods["open_clip"] = lambda r, w: OpenClipLoss(True, True, rank=r, world_size=w)
    return methods, None


def _rank(rank, world_size, port, args, results):
    try:
        backend = "nccl" if args.device == "cuda" else "gloo"
        if args.device == "cuda":
            torch.cuda.set_device(rank)
        device = torch.device(args.device, rank) if args.device == "cuda" else torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=600))
        results.put((rank, _measure_rank(rank, world_size, device, args)))
    except BaseException:  # noqa: BLE001 (report to the parent instead of hanging it)
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure_rank(rank, world_size, device, args):
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(rank)
    normalize = torch.nn.functional.normalize
    image = normalize(torch.randn(args.batch, args.dim, generator=gen), dim=1).to(device, dtype).requires_grad_()
    text = normalize(torch.randn(args.batch, args.dim, generator=gen), dim=1).to(device, dtype).requires_grad_()
    scale = torch.tensor(14.3, device=device, requires_grad=True)
    methods, note = _methods()
    losses = {name: make(rank, world_size) for name, make in methods.items()
              if args.methods is None or name.split()[-1] in args.methods.split(",")}

    def step(loss_fn):
        for t in (image, text, scale):  # gradients of the previous step are freed before measuring
            t.grad = None
        dist.barrier()
        return lambda: loss_fn(image, text, scale).backward()

    out = {"note": note, "methods": {}}
    times = {name: [] for name in losses}
    for k in range(args.steps + 1):
        for name, loss_fn in losses.items():
            seconds = time_call(step(loss_fn), device)
            if k > 0:  # the first step warms up
                times[name].append(seconds)
    for name, loss_fn in losses.items():
        peak = peak_memory_bytes(step(loss_fn), device)
        out["methods"][name] = {**summarize(times[name]), "times_s": times[name], "peak_bytes": peak}
    return out


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run(world_size, args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, world_size, port, args, results)) for r in range(world_size)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=args.timeout) for _ in range(world_size))
    for proc in procs:
        proc.join(timeout=30)
    return [per_rank[r] for r in range(world_size)]


def _summary(per_rank):
    """Per method and rank: time, peak memory and both ratios against open_clip on the same rank."""
    rows, summary = [], {}
    for name in per_rank[0]["methods"]:
        for rank, res in enumerate(per_rank):
            m, base = res["methods"][name], res["methods"].get("open_clip")
            speed = base["median_s"] / m["median_s"] if base else None
            memory = base["peak_bytes"] / max(m["peak_bytes"], 1) if base else None
            rows.append({"method": name, "rank": rank, **m, "speedup": speed, "memory_ratio": memory})
            summary.setdefault(name, []).append({"speedup_vs_open_clip": speed, "memory_ratio_vs_open_clip": memory})
    return rows, summary


def _print_table(rows, args, world_size):
    print_table([
        ("method", lambda r: r["method"], "<"),
        ("rank", lambda r: str(r["rank"])),
        ("time (s)", lambda r: f"{r['median_s']:.3f}"),
        ("peak (MiB)", lambda r: f"{r['peak_bytes'] / MIB:.1f}"),
        ("speed-up", lambda r: fmt(r["speedup"], ".2f") + "x"),
        ("memory /", lambda r: fmt(r["memory_ratio"], ".1f") + "x"),
    ], rows, title=f"world size {world_size}, {args.device}, B_local={args.batch}, D={args.dim}, {args.dtype}; "
                   f"median of {args.steps} steps; peak = bytes the loss step allocates beyond its inputs")
    if all(r["speedup"] is None for r in rows):
        print("(no open_clip baseline)")


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--batch", type=int, default=4096, help="local batch size per rank")
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2, help="CPU ranks (CUDA: one per GPU)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds before giving up")
    parser.add_argument("--methods", help="comma-separated subset of exchange,ring,local,open_clip (default: all)")
    args = parser.parse_args()

    message = None
    if args.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus == 0:
            message = "no CUDA device: nothing measured"
            world_size = 0
        else:
            world_size = min(gpus, args.world_size) if gpus > 1 else 1
            if gpus == 1:
                message = ("one GPU: world size 1 with NCCL (no communication, local kernels only); "
                           "a multi-GPU run needs more than one GPU")
    else:
        world_size = args.world_size
    if message:
        print(message)
    report = {"device": args.device, "world_size": world_size, "batch_local": args.batch, "dim": args.dim,
              "dtype": args.dtype, "steps": args.steps, "message": message}
    if world_size:
        per_rank = _run(world_size, args)
        errors = [r.get("error") for r in per_rank if "error" in r]
        if errors:
            print(errors[0])
            report["error"] = errors[0]
        else:
            rows, summary = _summary(per_rank)
            _print_table(rows, args, world_size)
            report.update(per_rank=per_rank, summary=summary, note=per_rank[0]["note"])
    write_json(args.json, report)
    return 1 if report.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
