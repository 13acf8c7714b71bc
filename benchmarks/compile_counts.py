"""Graph breaks and host reads per call of every distributed loss path (docs/distributed.md,
"Compiling and host syncs").

On a gloo group of --world-size ranks (CPU, tiny sizes), for each path:
- graph breaks: torch._dynamo.explain over the loss call (forward; the backward of a fully traced
  forward is traced with it);
- host reads: clipshard.diagnostics.host_reads.HostReads over one steady-state call (forward and
  backward) after a first call, which validates the ranks' inputs.

    PYTHONPATH=. python benchmarks/compile_counts.py [--world-size 2] [--paths exchange,ring] [--validate on_change]
"""
import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.dist_utils import run_group  # noqa: E402


def _features(rank, rows, dim=8, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(1000 * seed + rank)
    out = torch.randn(2, rows, dim, generator=gen, dtype=torch.float64)
    out = torch.nn.functional.normalize(out, dim=-1).to(dtype)
    return out[0].requires_grad_(), out[1].requires_grad_()


def _ids(rank, rows):
    return torch.arange(rows) // 2 + 100 * rank  # pairs of rows share an id


def path_inputs(name, rank, world, validate=None, dtype=torch.float32):
    """(loss callable, positional inputs) of one path on `rank`: M = 6 pairs of D = 8 (4 + 2 rank
    pairs for the "unequal" variants), random unit features."""
    import clipshard

    opts = {} if validate is None else {"validate": validate}
    rows = 6 if not name.endswith("unequal") else 4 + 2 * rank
    image, text = _features(rank, rows, dtype=dtype)
    scale = torch.tensor(10.0, dtype=dtype, requires_grad=True)
    bias = torch.tensor(-2.0, dtype=dtype, requires_grad=True)
    family, _, variant = name.partition(":")
    if family.startswith("clip"):
        mode, local_loss, gather_with_grad = {
            "clip exchange": ("exchange", True, True), "clip exchange global": ("exchange", False, True),
            "clip exchange global nograd": ("exchange", False, False), "clip local": ("local", True, True),
            "clip local nograd": ("local", True, False), "clip local global": ("local", False, True),
            "clip local global nograd": ("local", False, False), "clip ring": ("ring", True, True),
            "clip ring global": ("ring", False, True), "clip ring global nograd": ("ring", False, False)}[family]
        extras = {}
        if variant.startswith("ids"):
            extras = dict(sample_ids=_ids(rank, rows), targets=variant.split("-")[1])
        elif variant == "negatives":
            extras = dict(hard_negatives=_features(rank, 1 + rank, seed=1, dtype=dtype)[0])
        direction = "image_to_text" if variant == "image_to_text" else "both"
        loss = clipshard.ClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world, mode=mode,
                                  direction=direction, **opts)
        return (lambda i, t, s: loss(i, t, s, **extras)), (image, text, scale)
    if family.startswith("siglip"):
        loss = clipshard.SigLipLoss(rank=rank, world_size=world, mode=family.split()[1], **opts)
        extras = {}
        if variant.startswith("ids"):
            extras = dict(sample_ids=_ids(rank, rows), targets=variant.split("-")[1])
        elif variant == "negatives":
            extras = dict(hard_negatives=_features(rank, 1 + rank, seed=1, dtype=dtype)[0])
        return (lambda i, t, s, b: loss(i, t, s, b, **extras)), (image, text, scale, bias)
    mode, local_loss = {"distill exchange": ("exchange", True), "distill ring": ("ring", True),
                        "distill local global": ("local", False), "distill exchange global": ("exchange", False),
                        "distill ring global": ("ring", False)}[family]
    teacher_image, teacher_text = _features(rank, rows, seed=2, dtype=dtype)
    loss = clipshard.DistillClipLoss(local_loss, True, rank=rank, world_size=world, mode=mode, **opts)
    teacher = (teacher_image.detach(), teacher_text.detach(), torch.tensor(20.0, dtype=dtype))
    return (lambda i, t, s: sum(loss(i, t, s, *teacher))), (image, text, scale)


PATHS = ("clip exchange", "clip exchange global", "clip exchange global nograd", "clip local", "clip local nograd",
         "clip local global", "clip local global nograd", "clip ring", "clip ring global", "clip ring global nograd",
         "clip exchange:ids-mask", "clip exchange:ids-multi", "clip exchange:negatives", "clip exchange:image_to_text",
         "clip ring:ids-mask", "clip ring:ids-multi", "clip ring global:ids-multi",
         "clip ring:negatives", "clip exchange:unequal", "clip ring:unequal",
         "siglip gather", "siglip ring", "siglip gather:ids-multi", "siglip ring:negatives", "siglip ring:unequal",
         "distill exchange", "distill ring", "distill local global", "distill exchange global", "distill ring global")


def _step(call, inputs):
    loss = call(*inputs)
    loss.backward(torch.tensor(0.5, dtype=loss.dtype))
    return loss


def measure_rank(rank, world, paths, validate):
    import torch._dynamo
    from clipshard.diagnostics.host_reads import HostReads
    from clipshard.parallel import steady_state

    torch._dynamo.config.cache_size_limit = 64
    out = {}
    for name in paths:
        steady_state.forget_all()  # each path is a program of its own (the paths differ on some ranks only)
        call, inputs = path_inputs(name, rank, world, validate)
        _step(call, inputs)  # the first call validates the ranks' inputs
        with HostReads() as reads:
            _step(call, inputs)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(call)(*inputs)
        out[name] = {"host_reads": reads.count, "graph_breaks": explained.graph_break_count,
                     "reasons": sorted({str(b.reason).splitlines()[0][:100] for b in explained.break_reasons})}
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--paths", default=",".join(PATHS))
    parser.add_argument("--validate", default=None, help="the losses' validate= option (default: theirs)")
    parser.add_argument("--reasons", action="store_true", help="print the graph breaks' reasons")
    args = parser.parse_args(argv)
    paths = args.paths.split(",")
    results = run_group(measure_rank, args.world_size, paths, args.validate, timeout=3600)
    print(f"{'path':32} {'graph breaks':>12} {'host reads per call':>20}   "
          "(rank 0; other ranks in brackets if they differ)")
    for name in paths:
        mine = results[0][name]
        others = {r: res[name] for r, res in enumerate(results[1:], 1)
                  if (res[name]["graph_breaks"], res[name]["host_reads"]) != (mine["graph_breaks"], mine["host_reads"])}
        note = "" if not others else " [" + ", ".join(f"rank {r}: {o['graph_breaks']} / {o['host_reads']}"
                                                      for r, o in others.items()) + "]"
        print(f"{name:32} {mine['graph_breaks']:>12} {mine['host_reads']:>20}{note}")
        if args.reasons:
            for reason in mine["reasons"]:
                print(f"    {reason}")
    return results


if __name__ == "__main__":
    main()
