"""Single-device CLIP loss: clipshard.clip_loss vs the naive materialised loss vs open_clip's ClipLoss.

For each batch size B (features B x D, normalised, logit scale 14.3 by default) and dtype it times
the forward and the forward + backward (median and 20/80 % quantiles over repeats, all three
implementations in the same run) and measures the peak memory the loss itself allocates beyond its
inputs (benchmarks/_measure.py: CUDA allocator statistics; on CPU the allocations torch.profiler
records, which include the fused kernels' per-thread scratch tiles since the kernels propagate the
profiler state to their worker threads). Memory that BLAS allocates internally is not a tensor and
is not counted, for any of the three implementations.
Forward memory is taken with the inputs requiring grad (what a training step keeps for the
backward); forward + backward memory includes the returned feature gradients. `clipshard` is
clip_loss with the device's default algorithm (chunked on CUDA, fused on the CPU); on CUDA
`clipshard_fused` is the same loss through the hand-written tile kernels (algorithm="fused");
`clipshard_torch` is the same loss through the portable PyTorch path (algorithm="torch",
docs/portable.md), and `torch_vs_clipshard` its time over the default algorithm's in the same run.

    python benchmarks/bench_loss.py --device cpu --json bench_results/loss_cpu.json
"""
import functools
import os
import sys

import torch

import clipshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (comparison_columns, parser_with_common_arguments, peak_memory_bytes, print_table,  # noqa: E402
                      require_device, run_metadata, time_repeats, write_json)

DEFAULT_SIZES = {"cpu": [2048, 4096, 8192], "cuda": [8192, 16384, 32768]}
DEFAULT_DTYPES = {"cpu": ["float32"], "cuda": ["bfloat16", "float32"]}


def naive_loss(image_features, text_features, logit_scale):
    logits = logit_scale * image_features @ text_features.T
    labels = torch.arange(logits.shape[0], device=logits.device)
    ce = torch.nn.functional.cross_entropy
    return (ce(logits, labels) + ce(logits.T, labels)) / 2


def fused_kernel_loss(image_features, text_features, logit_scale):
    """clip_loss on one device with algorithm="fused" (CUDA's hand-written tile kernels)."""
    row_lse, pos, col_lse = clipshard.contrastive_lse(image_features, text_features, logit_scale,
                                                      algorithm="fused")
    return ((row_lse - pos).mean() + (col_lse - pos).mean()) / 2


def implementations(device, dtype_name):
    impls = {"clipshard": clipshard.clip_loss, "naive": naive_loss}
    if device == "cuda":
        impls["clipshard_fused"] = fused_kernel_loss
    impls["clipshard_torch"] = functools.partial(clipshard.clip_loss, algorithm="torch")
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


def bench_one(loss_fn, inputs, device, repeats, backward):
    fn = lambda: step(loss_fn, inputs, backward)  # noqa: E731
    result = time_repeats(fn, device, repeats)
    result["peak_bytes"] = peak_memory_bytes(fn, device)
    return result


def add_ratios(rows):
    """time_vs_<base> and mem_vs_<base>: this row over the baseline row of the same configuration."""
    def find(impl, row):
        for r in rows:
            if r["impl"] == impl and all(r[k] == row[k] for k in ("mode", "batch", "dim", "dtype")):
                return r
        return None

    for r in rows:
        for base_name in ("open_clip", "naive"):
            base = find(base_name, r)
            r[f"time_vs_{base_name}"] = r["median_s"] / base["median_s"] if base else None
            r[f"mem_vs_{base_name}"] = r["peak_bytes"] / base["peak_bytes"] if base and base["peak_bytes"] else None
        if r["impl"] == "clipshard_torch":  # the portable path against the compiled default
            base = find("clipshard", r)
            r["torch_vs_clipshard"] = r["median_s"] / base["median_s"] if base else None


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", help="batch sizes B (default depends on the device)")
    parser.add_argument("--dim", type=int, default=None, help="feature size D (default 512 on CPU, 768 on CUDA)")
    parser.add_argument("--dtypes", nargs="+", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--scale", type=float, default=14.3, help="logit scale (already exponentiated)")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5 on CPU, 10 on CUDA)")
    args = parser.parse_args()
    require_device("bench_loss", args.device)
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
                    r = bench_one(fn, inputs, args.device, repeats, backward)
                    rows.append({"impl": name, "mode": mode, "batch": batch, "dim": dim, "dtype": dtype_name, **r})
                    print(f"  {name:15s} {mode:17s} B={batch:6d} {dtype_name:9s} {r['median_s'] * 1e3:10.1f} ms "
                          f"{r['peak_bytes'] / 2**20:10.1f} MiB", file=sys.stderr, flush=True)
            del inputs
    add_ratios(rows)

    print_table([
        ("dtype", lambda r: r["dtype"], "<"),
        ("B", lambda r: str(r["batch"])),
        ("mode", lambda r: r["mode"], "<"),
        ("impl", lambda r: r["impl"], "<"),
        *comparison_columns(),
    ], rows, title=f"\nCLIP loss, one device ({args.device}, {torch.get_num_threads()} threads), D={dim}, "
                   f"scale={args.scale}; median of {repeats}; memory = peak bytes the loss allocates")
    write_json(args.json, {"meta": {**run_metadata(args.device), "scale": args.scale, "repeats": repeats},
                           "results": rows})


if __name__ == "__main__":
    main()
