"""`python -m clipshard plan ...`: a memory plan from the command line (docs/scale.md).

    python -m clipshard plan --loss clip --mode ring --world-size 8 --batch-size 524288 --dim 768 --dtype bf16

prints one rank's planned peak for the loss's forward + backward and the largest allocations at
the peak; with --model (an open_clip model name, e.g. open_clip:ViT-B-16) and --micro-batch, the
plan of a whole GradCache training step of that model.
"""
import argparse
import json

import torch

_LOSSES = ("clip", "siglip", "distill")


def _parser():
    parser = argparse.ArgumentParser(prog="python -m clipshard plan",
                                     description="Plan one rank's peak memory of a clipshard loss (or a GradCache "
                                                 "step) on N ranks without running it: clipshard's own code on fake "
                                                 "tensors over a fake process group.")
    parser.add_argument("--loss", choices=_LOSSES, default="clip", help="ClipLoss, SigLipLoss or DistillClipLoss")
    parser.add_argument("--mode", default=None,
                        help="the loss's mode: exchange, local or ring (clip, distill); gather or ring (siglip)")
    parser.add_argument("--local-loss", action="store_true", help="ClipLoss/DistillClipLoss local_loss=True")
    parser.add_argument("--direction", choices=("both", "image_to_text"), default="both", help="ClipLoss direction")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks N")
    parser.add_argument("--batch-size", type=int, required=True, help="local batch per rank (global: N times it)")
    parser.add_argument("--dim", type=int, default=None, help="feature size D (a loss; a model has its own)")
    parser.add_argument("--dtype", default="fp32",
                        help="features' dtype: fp32, bf16, fp16 or fp64; with --model, bf16 / fp16 run the step "
                             "under autocast")
    parser.add_argument("--hard-negatives", type=int, default=0, help="hard negatives per rank")
    parser.add_argument("--sample-ids", action="store_true", help="with sample ids (the loss's default targets)")
    parser.add_argument("--teacher-dim", type=int, default=None, help="distill: the teacher's feature size")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="whose kernels and workspace defaults to plan for (default cuda)")
    parser.add_argument("--model", default=None,
                        help="plan a GradCache step of this model: open_clip:<name>, e.g. open_clip:ViT-B-16")
    parser.add_argument("--micro-batch", type=int, default=None, help="GradCache micro-batch size (with --model)")
    parser.add_argument("--optimizer", choices=("clipshard", "clipshard-bf16", "torch", "none"),
                        default="clipshard",
                        help="with --model: the optimizer whose state is planned (clipshard.optim.AdamW with its "
                             "defaults, the same with bf16 moments, torch.optim.AdamW, or none)")
    parser.add_argument("--batch-on-host", action="store_true",
                        help="with --model: the batch stays in host memory, each micro-batch is copied to the "
                             "device (default: the whole local batch is on the device)")
    parser.add_argument("--rows", type=int, default=12, help="allocation kinds listed in the report")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    return parser


def _loss(args):
    import clipshard

    options = {"mode": args.mode}
    if args.loss == "siglip":
        return clipshard.SigLipLoss(**options)
    options["local_loss"] = args.local_loss
    options["gather_with_grad"] = args.mode in ("exchange", "ring") or args.mode is None
    if args.loss == "distill":
        return clipshard.DistillClipLoss(**options)
    return clipshard.ClipLoss(direction=args.direction, **options)


def _optimizer(name):
    """The --optimizer choice as plan_memory's optimizer argument."""
    if name == "clipshard-bf16":
        import clipshard.optim
        return lambda parameters: clipshard.optim.AdamW(parameters, state_dtype=torch.bfloat16)
    return None if name == "none" else name


def _open_clip_model(spec):
    """An open_clip model named by 'open_clip:<name>', built on the meta device (no weights)."""
    kind, _, name = spec.partition(":")
    if kind != "open_clip" or not name:
        raise SystemExit(f"python -m clipshard plan: --model must be open_clip:<model name>, got {spec!r}")
    import open_clip
    return open_clip.create_model(name, pretrained=None, device="meta")


def make_plan(args):
    """The MemoryPlan the command line asks for."""
    from clipshard.planning import plan_memory

    loss = _loss(args)
    common = dict(world_size=args.world_size, batch_size=args.batch_size, device=args.device)
    if args.model is None:
        if args.micro_batch is not None:
            raise SystemExit("python -m clipshard plan: --micro-batch needs --model")
        if args.dim is None:
            raise SystemExit("python -m clipshard plan: --dim is needed to plan a loss")
        return plan_memory(loss, dim=args.dim, dtype=args.dtype, hard_negatives=args.hard_negatives,
                           sample_ids=args.sample_ids, teacher_dim=args.teacher_dim, **common)
    if args.micro_batch is None:
        raise SystemExit("python -m clipshard plan: --model needs --micro-batch")
    from clipshard.grad_cache import GradCache
    cache = GradCache(_open_clip_model(args.model), loss, micro_batch_size=args.micro_batch)
    autocast = None if args.dtype in ("fp32", "float32") else args.dtype
    return plan_memory(cache, optimizer=_optimizer(args.optimizer), autocast=autocast,
                       batch_on_device=not args.batch_on_host, sample_ids=args.sample_ids, **common)


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        plan = make_plan(args)
    except (ValueError, TypeError, RuntimeError) as error:
        raise SystemExit(f"python -m clipshard plan: {error}")
    if args.json:
        print(json.dumps({"peak_bytes": plan.peak_bytes, "setting": dict(plan.setting),
                          "plan_seconds": round(plan.plan_seconds, 3),
                          "counted_before": [{"bytes": b, "what": w} for b, w in plan.counted_before],
                          "peak_allocations": [{"bytes": b, "what": w, "count": n} for b, w, n in plan.by_kind()]},
                         indent=1, default=str))
    else:
        plan.report(rows=args.rows)
    return 0


