"""`python -m clipshard plan ...`: a memory plan from the command line (docs/scale.md).

    python -m clipshard plan --loss clip --mode ring --world-size 8 --batch-size 524288 --dim 768 --dtype bf16

prints one rank's planned peak for the loss's forward + backward and the largest allocations at
the peak; with --model (an open_clip model name, e.g. open_clip:ViT-B-16) and --micro-batch, the
plan of a whole GradCache training step of that model.
"""
import argparse
import json

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
    parser.add_argument("--dim", type=int, required=True, help="feature size D")
    parser.add_argument("--dtype", default="fp32", help="features' dtype: fp32, bf16, fp16 or fp64")
    parser.add_argument("--hard-negatives", type=int, default=0, help="hard negatives per rank")
    parser.add_argument("--sample-ids", action="store_true", help="with sample ids (the loss's default targets)")
    parser.add_argument("--teacher-dim", type=int, default=None, help="distill: the teacher's feature size")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="whose kernels and workspace defaults to plan for (default cuda)")
    parser.add_argument("--model", default=None,
                        help="plan a GradCache step of this model: open_clip:<name>, e.g. open_clip:ViT-B-16")
    parser.add_argument("--micro-batch", type=int, default=None, help="GradCache micro-batch size (with --model)")
    parser.add_argument("--optimizer", choices=("clipshard", "torch", "none"), default="clipshard",
                        help="with --model: the optimizer whose state is planned (clipshard.optim.AdamW with its "
                             "default 16-bit states, torch.optim.AdamW, or none)")
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


def make_plan(args):
    """The MemoryPlan the command line asks for."""
    from clipshard.planning import plan_memory

    loss = _loss(args)
    common = dict(world_size=args.world_size, batch_size=args.batch_size, dim=args.dim, dtype=args.dtype,
                  device=args.device)
    if args.model is None:
        if args.micro_batch is not None:
            raise SystemExit("python -m clipshard plan: --micro-batch needs --model")
        return plan_memory(loss, hard_negatives=args.hard_negatives, sample_ids=args.sample_ids,
                           teacher_dim=args.teacher_dim, **common)
    from clipshard.planning.step_plan import plan_named_model_step
    if args.micro_batch is None:
        raise SystemExit("python -m clipshard plan: --model needs --micro-batch")
    return plan_named_model_step(args.model, loss, micro_batch_size=args.micro_batch,
                                 optimizer=None if args.optimizer == "none" else args.optimizer, **common)


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


