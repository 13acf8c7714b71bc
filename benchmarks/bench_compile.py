"""A compiled training step against the eager one: a small open_clip model with clipshard's ClipLoss
on a gloo group of --world-size ranks (CPU), forward + loss + backward + gradient average + AdamW step.

Both steps use ClipLoss(local_loss=True, gather_with_grad=True, validate="on_change"); the compiled
one wraps the forward and the loss in torch.compile(fullgraph=True) (--backend, inductor by default;
the backward is compiled with it). Time: median over --steps steps after --warmup untimed ones (the
compile happens in the first), the two steps interleaved so that a busy machine slows both alike.

    PYTHONPATH=. python benchmarks/bench_compile.py [--world-size 2] [--batch 32] [--steps 10]
"""
import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.dist_utils import run_group  # noqa: E402


def _model(seed):
    from open_clip.model import CLIP

    torch.manual_seed(seed)
    return CLIP(embed_dim=64, vision_cfg=dict(layers=2, width=64, patch_size=8, image_size=32),
                text_cfg=dict(context_length=16, vocab_size=1000, width=64, heads=2, layers=2))


def _rank(rank, world, args):
    import clipshard

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    images = torch.randn(args.batch, 3, 32, 32, generator=gen)
    texts = torch.randint(0, 1000, (args.batch, 16), generator=gen)
    steps = {}
    for name in ("eager", "compiled"):
        model = _model(0)
        loss = clipshard.ClipLoss(True, True, rank=rank, world_size=world, validate="on_change")

        def forward(images, texts, model=model, loss=loss):
            image_features, text_features, scale = model(images, texts)
            return loss(image_features, text_features, scale)

        if name == "compiled":
            forward = torch.compile(forward, fullgraph=True, backend=args.backend)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(forward=forward, optimizer=optimizer, model=model):
            value = forward(images, texts)
            value.backward()
            for p in model.parameters():  # DDP's average, by hand (the ranks' parameters stay equal)
                dist.all_reduce(p.grad)
                p.grad /= world
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return value.detach()

        steps[name] = step
    times = {name: [] for name in steps}
    losses = {}
    for k in range(args.warmup + args.steps):
        for name, step in steps.items():
            start = time.perf_counter()
            losses[name] = float(step())
            if k >= args.warmup:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}, losses


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args(argv)
    results = run_group(_rank, args.world_size, args, timeout=3600)
    for rank, (times, losses) in enumerate(results):
        print(f"rank {rank}: eager {times['eager'] * 1e3:.1f} ms, compiled {times['compiled'] * 1e3:.1f} ms per step "
              f"(compiled / eager {times['compiled'] / times['eager']:.2f}); last losses {losses}")
    return results


if __name__ == "__main__":
    main()
