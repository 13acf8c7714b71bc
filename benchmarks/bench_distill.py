"""Distillation loss: clipshard.DistillClipLoss vs open_clip's DistillClipLoss, one process.

Default (CPU): B = 8192 pairs, student D = 512, teacher D = 768, fp32, forward + backward of
contrastive_loss + distill_loss with the student's features and logit scale requiring grad and a
frozen teacher (its features under no_grad, as in open_clip's --distill training). CUDA
(--device cuda): the same shapes, bf16 features (--dtype to change). Time: median and 20/80 %
quantiles; memory: the peak bytes each loss allocates beyond its inputs (benchmarks/_measure.py).
Both losses run in the same process and the same run, so the ratios are the figures to read on a
shared machine. `clipshard` is algorithm="auto" (the compiled kernels where this build has them,
else the torch path); `clipshard_torch`, algorithm="torch", is added where the two differ.

    python benchmarks/bench_distill.py --json bench_results/distill_cpu.json
"""
import os
import sys

import torch

import clipshard
from clipshard.ops._algorithm import has_compiled_kernel

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (fmt, parser_with_common_arguments, peak_memory_bytes, print_table, require_device,  # noqa: E402
                      run_metadata, time_repeats, write_json)

MIB = 2 ** 20
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _inputs(batch, dim, teacher_dim, dtype, device):
    gen = torch.Generator().manual_seed(0)

    def unit(d):
        return torch.nn.functional.normalize(torch.randn(batch, d, generator=gen), dim=1).to(device, dtype)

    return (unit(dim), unit(dim), torch.tensor(30.0, device=device), unit(teacher_dim), unit(teacher_dim),
            torch.tensor(100.0, device=device))


def _step(loss, inputs):
    """One forward + backward; the leaves are made here so that their gradients are counted."""
    image, text, scale = (t.detach().clone().requires_grad_() for t in inputs[:3])
    contrastive, distill = loss(image, text, scale, *inputs[3:])
    (contrastive + distill).backward()


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--batch", type=int, default=8192)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--teacher-dim", type=int, default=768)
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="default fp32 on the CPU, bf16 on CUDA")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per loss; 0: peak memory only")
    args = parser.parse_args()
    require_device("bench_distill", args.device)
    dtype = DTYPES[args.dtype or ("bf16" if args.device == "cuda" else "fp32")]
    from open_clip.loss import DistillClipLoss as OpenClipDistillClipLoss
    impls = {"open_clip": OpenClipDistillClipLoss(), "clipshard": clipshard.DistillClipLoss()}
    if has_compiled_kernel("clipshard::distill_lse", torch.device(args.device).type):  # else "auto" is "torch"
        impls["clipshard_torch"] = clipshard.DistillClipLoss(algorithm="torch")
    inputs = _inputs(args.batch, args.dim, args.teacher_dim, dtype, args.device)
    rows = []
    for name, loss in impls.items():
        timing = (time_repeats(lambda: _step(loss, inputs), args.device, args.repeats) if args.repeats
                  else {"median_s": None, "p20_s": None, "p80_s": None})
        peak = peak_memory_bytes(lambda: _step(loss, inputs), args.device)
        rows.append({"impl": name, "peak_bytes": peak, **timing})
    base = rows[0]
    for r in rows:
        r["time_vs_open_clip"] = r["median_s"] / base["median_s"] if args.repeats else None
        r["mem_vs_open_clip"] = r["peak_bytes"] / base["peak_bytes"]
    columns = [("impl", lambda r: r["impl"], "<"),
               ("median ms", lambda r: fmt(r["median_s"] and r["median_s"] * 1e3, ".0f")),
               ("p20-p80 ms", lambda r: f"{r['p20_s'] * 1e3:.0f}-{r['p80_s'] * 1e3:.0f}" if args.repeats else "-"),
               ("peak MiB", lambda r: f"{r['peak_bytes'] / MIB:.1f}"),
               ("time/oc", lambda r: fmt(r["time_vs_open_clip"], ".3f")),
               ("mem/oc", lambda r: fmt(r["mem_vs_open_clip"], ".4f"))]
    print_table(columns, rows, title=f"DistillClipLoss forward+backward, B = {args.batch}, D = {args.dim}, teacher D = "
                                     f"{args.teacher_dim}, {args.dtype or dtype}, {args.device}, "
                                     f"{torch.get_num_threads()} threads")
    write_json(args.json, {"meta": run_metadata(args.device), "batch": args.batch, "dim": args.dim,
                           "teacher_dim": args.teacher_dim, "dtype": str(dtype), "rows": rows})


if __name__ == "__main__":
    main()
