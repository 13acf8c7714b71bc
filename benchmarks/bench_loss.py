"""Single-device CLIP loss: clipshard.clip_loss vs the naive materialised loss vs open_clip's ClipLoss.

For each batch size B (features B x D, normalised, logit scale 14.3 by default) and dtype it times
the forward and the forward + backward (median and 20/80 % quantiles over repeats, all three
implementations in the same run) and measures the peak memory the loss itself allocates beyond its
inputs:
  - CUDA: torch.cuda.max_memory_allocated() during the call minus the allocation before it.
  - CPU: the CPU allocator's running total reported to torch.profiler (profile_memory=True): the
    highest total of live tensor bytes allocated during the call (the kernels propagate the profiler
    state to their worker threads, so per-thread scratch tiles are included). Memory that BLAS
    allocates internally is not a tensor and is not counted, for any of the three implementations.
Forward memory is taken with the inputs requiring grad (what a training step keeps for the
backward); forward + backward memory includes the returned feature gradients. On CUDA with 16-bit
features, `clipshard_tc` is the fused loss with the tensor-core path switched on
(clipshard.fused_op.TENSOR_CORES, off by default).

    python benchmarks/bench_loss.py --device cpu --json bench_results/loss_cpu.json
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

import clipshard

DEFAULT_SIZES = {"cpu": [2048, 4096, 8192], "cuda": [8192, 16384, 32768]}
DEFAULT_DTYPES = {"cpu": ["float32"], "cuda": ["bfloat16", "float32"]}


def naive_loss(image_features, text_features, logit_scale):
    logits = logit_scale * image_features @ text_features.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    ce = torch.nn.functional.cross_entropy
    return (ce(logits, labels) + ce(logits.T, labels)) / 2


def with_tensor_cores(loss_fn):
    """The same loss with the CUDA tensor-core path switched on for the call (fp16/bf16 only)."""
    def run(*args):
        saved, clipshard.fused_op.TENSOR_CORES = clipshard.fused_op.TENSOR_CORES, True
        try:
            return loss_fn(*args)
        finally:
            clipshard.fused_op.TENSOR_CORES = saved
    return run


def implementations(device, dtype_name):
    impls = {"clipshard": clipshard.clip_loss, "naive": naive_loss}
    if device == "cuda" and dtype_name in ("bfloat16", "float16"):
        impls["clipshard_tc"] = with_tensor_cores(clipshard.clip_loss)
    try:
        from open_clip.loss import ClipLoss

        impls["open_clip"] = ClipLoss(world_size=1)
    except ImportError:
        print("open_clip not installed: comparing with the naive loss only", file=sys.stderr)
    return impls


def make_inputs(batch, dim, dtype, device, scale):
    g = torch.Generator(device="cpu").manual_seed(0)
    feats = [torch.nn.functional.normalize(torch.randn(batch, dim, generator=g), dim=1) for _ in range(2)]
    image, text = (f.to(device=device, dtype=dtype).requires_grad_() for f in feats)
    logit_scale = torch.tensor(scale, device=device, requires_grad=True)
    return image, text, logit_scale


def step(loss_fn, inputs, backward):
    loss = loss_fn(*inputs)
    if backward:
        return torch.autograd.grad(loss, inputs)
    return loss


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def time_call(fn, device, repeats):
    fn()  # warm-up
    sync(device)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    q = statistics.quantiles(times, n=5, method="inclusive") if len(times) > 1 else [times[0]] * 4
    return {"median_s": statistics.median(times), "p20_s": q[0], "p80_s": q[3]}


def peak_memory_cpu(fn):
    """Highest live total of tensor bytes allocated during fn(), from the profiler's memory events."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events
              if e.get("name") == "[memory]" and e.get("args", {}).get("Device Type") == 0]
    return max([0] + totals)


def peak_memory_cuda(fn):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def bench_one(name, loss_fn, inputs, device, repeats, backward):
    fn = lambda: step(loss_fn, inputs, backward)  # noqa: E731
    result = time_call(fn, device, repeats)
    result["peak_bytes"] = peak_memory_cuda(fn) if device == "cuda" else peak_memory_cpu(fn)
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", help="write the results to this JSON file")
    parser.add_argument("--sizes", type=int, nargs="+", help="batch sizes B (default depends on the device)")
    parser.add_argument("--dim", type=int, default=None, help="feature size D (default 512 on CPU, 768 on CUDA)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--scale", type=float, default=14.3, help="logit scale (already exponentiated)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5 on CPU, 10 on CUDA)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_loss: --device cuda but no CUDA device is available")
    sizes = args.sizes or DEFAULT_SIZES[args.device]
    dim = args.dim or (512 if args.device == "cpu" else 768)
    dtypes = args.dtypes or DEFAULT_DTYPES[args.device]
    repeats = args.repeats or (5 if args.device == "cpu" else 10)

    rows = []
    for dtype_name in dtypes:
        impls = implementations(args.device, dtype_name)
        for batch in sizes:
            inputs = make_inputs(batch, dim, getattr(torch, dtype_name), args.device, args.scale)
            for mode, backward in (("forward", False), ("forward+backward", True)):
                for name, fn in impls.items():
                    r = bench_one(name, fn, inputs, args.device, repeats, backward)
                    rows.append({"impl": name, "mode": mode, "batch": batch, "dim": dim, "dtype": dtype_name, **r})
                    print(f"  {name:10s} {mode:17s} B={batch:6d} {dtype_name:9s} {r['median_s'] * 1e3:10.1f} ms "
                          f"{r['peak_bytes'] / 2**20:10.1f} MiB", file=sys.stderr, flush=True)
            del inputs

    def find(impl, row):
        for r in rows:
            if r["impl"] == impl and all(r[k] == row[k] for k in ("mode", "batch", "dim", "dtype")):
                return r
        return None

    print(f"\nCLIP loss, one device ({args.device}, {torch.get_num_threads()} threads), D={dim}, "
          f"scale={args.scale}; median of {repeats}; memory = peak bytes the loss allocates")
    header = (f"{'dtype':9s} {'B':>6s} {'mode':17s} {'impl':10s} {'median ms':>10s} {'p20-p80 ms':>17s} "
              f"{'peak MiB':>9s} {'time/oc':>8s} {'mem/oc':>8s} {'time/naive':>10s} {'mem/naive':>9s}")
    print(header)
    print("-" * len(header))
    for r in rows:
        for base_name in ("open_clip", "naive"):
            base = find(base_name, r)
            r[f"time_vs_{base_name}"] = r["median_s"] / base["median_s"] if base else None
            r[f"mem_vs_{base_name}"] = r["peak_bytes"] / base["peak_bytes"] if base and base["peak_bytes"] else None
        fmt = lambda x: f"{x:.3f}" if x is not None else "-"  # noqa: E731
        print(f"{r['dtype']:9s} {r['batch']:6d} {r['mode']:17s} {r['impl']:10s} {r['median_s'] * 1e3:10.1f} "
              f"{r['p20_s'] * 1e3:8.1f}-{r['p80_s'] * 1e3:8.1f} {r['peak_bytes'] / 2**20:9.1f} "
              f"{fmt(r['time_vs_open_clip']):>8s} {fmt(r['mem_vs_open_clip']):>8s} "
              f"{fmt(r['time_vs_naive']):>10s} {fmt(r['mem_vs_naive']):>9s}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        meta = {"device": args.device, "threads": torch.get_num_threads(), "torch": torch.__version__,
                "scale": args.scale, "repeats": repeats,
                "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
