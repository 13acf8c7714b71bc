"""Planned per-rank loss memory at CLIP scale (docs/scale.md): clipshard's ClipLoss in ring and
exchange mode against open_clip's ClipLoss (which materialises each rank's M x NM logits), each
planned the same way, by clipshard.plan_memory's fake world (nothing is computed or allocated).

Global batches 64k .. 16M on 8, 32 and 256 ranks, D = 768 (ViT-L/14's width), bf16 features, the
CUDA kernels' workspace rules. open_clip's loss is taken with local_loss=True and
gather_with_grad=True, its least memory-hungry distributed setting.

    PYTHONPATH=. python benchmarks/plan_scale.py [--dim 768] [--dtype bf16] [--ranks 8 32 256]
"""
import argparse
import os
import sys
import time

import torch
# imported before any process group exists: its functions' default group argument is then None
# (the default group at each call), not the group of the first plan's fake world
import torch.distributed.nn  # noqa: F401

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import clipshard  # noqa: E402
from clipshard.planning import format_bytes, plan_memory  # noqa: E402
from clipshard.planning.loss_plan import plan_call, planned_dtype  # noqa: E402

GLOBAL_BATCHES = (1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)  # 64k, 256k, 1M, 4M, 16M


def plan_open_clip(world_size, batch, dim, dtype):
    """open_clip's ClipLoss planned like clipshard's: its forward + backward on a fake world."""
    from open_clip.loss import ClipLoss

    def make_call():
        loss = ClipLoss(local_loss=True, gather_with_grad=True, rank=0, world_size=world_size)
        image = torch.empty(batch, dim, dtype=dtype, requires_grad=True)
        text = torch.empty(batch, dim, dtype=dtype, requires_grad=True)
        scale = torch.empty((), dtype=torch.float32, requires_grad=True)
        return (lambda: loss(image, text, scale).backward()), (image, text, scale)

    return plan_call(make_call, world_size=world_size, device_type="cuda", setting=[("loss", "open_clip.ClipLoss")])


def _label(n):
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}k"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--dtype", default="bf16")
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 32, 256])
    args = parser.parse_args()
    dtype = planned_dtype("plan_scale", args.dtype)
    started = time.perf_counter()
    print(f"Planned peak per rank of one loss forward + backward, D = {args.dim}, {args.dtype} features, "
          "CUDA rules (clipshard.plan_memory)\n")
    print("| ranks | global batch | local batch | clipshard ring | clipshard exchange | open_clip ClipLoss | "
          "ring plan time |")
    print("|---|---|---|---|---|---|---|")
    for ranks in args.ranks:
        for total in GLOBAL_BATCHES:
            local = total // ranks
            common = dict(world_size=ranks, batch_size=local, dim=args.dim, dtype=dtype, device="cuda")
            ring = plan_memory(clipshard.ClipLoss(mode="ring"), **common)
            exchange = plan_memory(clipshard.ClipLoss(mode="exchange"), **common)
            open_clip = format_bytes(plan_open_clip(ranks, local, args.dim, dtype).peak_bytes)
            print(f"| {ranks} | {_label(total)} | {local} | {format_bytes(ring.peak_bytes)} | "
                  f"{format_bytes(exchange.peak_bytes)} | {open_clip} | {ring.plan_seconds:.1f} s |", flush=True)
    print(f"\nall plans: {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
