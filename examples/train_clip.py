"""Train a tiny CLIP on scikit-learn's handwritten digits, end to end, on several ranks.

    torchrun --standalone --nproc_per_node 2 examples/train_clip.py --out runs/demo

Each 8x8 digit is paired with a caption ("the digit 7 written by hand", "a scan of a handwritten
seven", ...). A small CNN encodes the images, a small transformer the captions, and the two are
trained contrastively with clipshard.ClipLoss across the ranks (each rank holds its shard of
every global batch). The text tower keeps 16-bit weights and 16-bit Adam moments, updated with
stochastic rounding by clipshard.optim.AdamW. At the end, rank 0 classifies held-out digits
zero-shot (the nearest of the ten prompts "a handwritten zero" ... "a handwritten nine") and
reports accuracy, the loss's peak memory, optimizer bytes per parameter and wall time; it writes
DIR/metrics.json and DIR/training.png. See docs/example.md.
"""
import time

STARTED = time.perf_counter()  # wall time counts from here: imports, process group, data, training

import argparse  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import random  # noqa: E402
import sys  # noqa: E402
import warnings  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from clip_digits.checkpoint import (CheckpointError, load_agreed_checkpoint, restore, save_checkpoint, saved_steps,  # noqa: E402
                                    set_aside_later_steps)
from clip_digits.data import contrastive_loss_floor, load_digits_data, num_train_images, rank_batch  # noqa: E402
from clip_digits.measure import peak_loss_memory, zero_shot_accuracy  # noqa: E402
from clip_digits.model import build_model  # noqa: E402
from clip_digits.precision import HALF_DTYPES, TEXT_PRECISIONS, build_optimizers, optimizer_bytes_per_param  # noqa: E402
from clip_digits.ranks import Ranks, Refusal, cuda_fits  # noqa: E402
from clip_digits.report import format_table, plot_runs, summary_rows, write_metrics  # noqa: E402

LOSSES = ("clipshard", "open_clip")
SAMPLE_IDS = ("none", "label")
TARGETS = ("mask", "multi")
# Flags that define the computation: a resumed run must use the same ones.
RUN_DEFINING = ("seed", "steps", "batch_size", "lr", "weight_decay", "warmup", "loss", "text_precision",
                "half_dtype", "checkpointing", "image_width", "text_width", "text_layers", "text_heads",
                "embed_dim", "eval_every", "sample_ids", "targets")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", help="run folder (default: a new folder under ./runs/ named by the time)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--steps", type=int, default=600, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=256, help="global batch size (all ranks together)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (linear warm-up, cosine decay)")
    p.add_argument("--warmup", type=int, default=20, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (matrices only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss", choices=LOSSES, default="clipshard",
                   help="clipshard.ClipLoss (mode='exchange') or open_clip's ClipLoss, same settings")
    p.add_argument("--sample-ids", choices=SAMPLE_IDS, default="none",
                   help="label: give the loss each pair's digit as its sample id, so that same-digit pairs are "
                        "not treated as negatives (docs/targets.md)")
    p.add_argument("--targets", choices=TARGETS,
                   help="with --sample-ids label: mask (same-digit pairs leave the denominators) or multi (they "
                        "are all positives, averaged); default mask")
    p.add_argument("--text-precision", choices=TEXT_PRECISIONS, default="sr16",
                   help="text tower weights and Adam moments: fp32, 16-bit with stochastic rounding, "
                        "or 16-bit with round-to-nearest")
    p.add_argument("--half-dtype", choices=sorted(HALF_DTYPES), default="bf16", help="the 16-bit format")
    p.add_argument("--no-checkpointing", dest="checkpointing", action="store_false",
                   help="keep the text blocks' activations instead of recomputing them in backward")
    p.add_argument("--micro-batch-size", type=int,
                   help="run each rank's batch through clipshard.GradCache in micro-batches of this many pairs "
                        "(the loss still sees the whole batch; docs/grad_cache.md)")
    p.add_argument("--compare", action="store_true",
                   help="train three times (text precision fp32, sr16, rn16) into DIR/<precision>/ and compare")
    p.add_argument("--eval-every", type=int, default=25, help="held-out zero-shot accuracy every N steps")
    p.add_argument("--checkpoint-every", type=int, default=100, help="save a checkpoint every N steps (0: only at the end)")
    p.add_argument("--stop-after", type=int, help="stop after this step with a checkpoint, as if interrupted")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: CUDA when every rank on this machine gets a GPU of its own")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="torch.distributed backend (auto: NCCL on CUDA, gloo on CPU)")
    p.add_argument("--image-width", type=int, default=32, help="channels of the image CNN")
    p.add_argument("--text-width", type=int, default=64, help="width of the text transformer")
    p.add_argument("--text-layers", type=int, default=2)
    p.add_argument("--text-heads", type=int, default=4)
    p.add_argument("--embed-dim", type=int, default=64, help="shared embedding size")
    return p


def parse_args(argv=None, world_size: int | None = None) -> argparse.Namespace:
    """Parses and validates; errors exit with a message naming the flag."""
    parser = build_parser()
    args = parser.parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    positive = ("steps", "batch_size", "eval_every", "image_width", "text_width", "text_layers",
                "text_heads", "embed_dim")
    for name in positive:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        parser.error(f"--lr must be positive and finite, got {args.lr}")
    if not (args.weight_decay >= 0 and math.isfinite(args.weight_decay)):
        parser.error(f"--weight-decay must be finite and not negative, got {args.weight_decay}")
    for name in ("warmup", "checkpoint_every"):
        if getattr(args, name) < 0:
            parser.error(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    if not 0 <= args.seed < 2**31:  # numpy seeds seed + rank; the data generators multiply it
        parser.error(f"--seed must be in [0, 2**31), got {args.seed}")
    if args.micro_batch_size is not None and args.micro_batch_size < 1:
        parser.error(f"--micro-batch-size must be at least 1, got {args.micro_batch_size}")
    if args.targets is not None and args.sample_ids == "none":
        parser.error(f"--targets {args.targets} needs --sample-ids label: without ids every pair is its own target")
    if args.sample_ids != "none":
        args.targets = args.targets or "mask"
        if args.loss != "clipshard":
            parser.error(f"--sample-ids {args.sample_ids} needs --loss clipshard: open_clip's ClipLoss takes no ids")
    if args.batch_size % world_size:
        parser.error(f"--batch-size ({args.batch_size}) must be divisible by the number of ranks ({world_size})")
    available = num_train_images()
    if args.batch_size > available:
        parser.error(f"--batch-size ({args.batch_size}) must not exceed the {available} training images")
    if args.text_width % args.text_heads:
        parser.error(f"--text-width ({args.text_width}) must be divisible by --text-heads ({args.text_heads})")
    if args.stop_after is not None and not 1 <= args.stop_after < args.steps:
        parser.error(f"--stop-after must be in [1, --steps), got {args.stop_after} with --steps {args.steps}")
    if args.out is not None:
        _check_out_dir(parser, args.out)
    if args.resume and not args.out:
        parser.error("--resume needs --out: the run folder to continue")
    if args.resume and not any(saved_steps(args.out, rank) for rank in range(world_size)):
        parser.error(f"--resume: no checkpoints in {os.path.join(args.out, 'checkpoint')}")
    if args.compare and (args.resume or args.stop_after is not None):
        parser.error("--compare cannot be combined with --resume or --stop-after")
    if args.device == "cuda" and not cuda_fits():
        parser.error(f"--device cuda: each of the {os.environ.get('LOCAL_WORLD_SIZE', 1)} ranks on this machine "
                     f"needs its own GPU, {torch.cuda.device_count()} found")
    device = "cuda" if args.device == "cuda" or (args.device == "auto" and cuda_fits()) else "cpu"
    backend = args.backend if args.backend != "auto" else ("nccl" if device == "cuda" else "gloo")
    if backend == "nccl" and device != "cuda":
        parser.error("--backend nccl needs --device cuda")
    args.device, args.backend = device, backend
    return args


def _check_out_dir(parser: argparse.ArgumentParser, out: str) -> None:
    """--out must be a folder or a path where one can be made (not a file, not under a file)."""
    path = os.path.abspath(out)
    while not os.path.exists(path):
        path = os.path.dirname(path)
    if not os.path.isdir(path):
        parser.error(f"--out {out}: {path} is a file, not a folder")


def make_loss(name: str, ranks: Ranks, targets: str | None = None):
    """The loss; with `targets` ("mask" / "multi"), clipshard's, called with sample_ids= (the digits)."""
    settings = dict(local_loss=True, gather_with_grad=True, rank=ranks.rank, world_size=ranks.world_size)
    if name == "clipshard":
        import functools

        import clipshard
        loss = clipshard.ClipLoss(**settings, mode="exchange")
        return loss if targets is None else functools.partial(loss, targets=targets)
    from open_clip.loss import ClipLoss
    # open_clip gathers with torch.distributed.nn.all_gather, which warns on every call.
    warnings.filterwarnings("ignore", message=r"torch\.distributed\.nn\.functional\.all_gather is deprecated")
    return ClipLoss(**settings)


def lr_factor(step: int, warmup: int, steps: int) -> float:
    """Linear warm-up, then cosine decay to zero."""
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))


def seed_everything(seed: int, rank: int) -> None:
    torch.manual_seed(seed)  # same on every rank: identical initial weights
    np.random.seed(seed + rank)
    random.seed(seed + rank)


def train(args: argparse.Namespace, ranks: Ranks, out_dir: str, label: str = "",
          started: float | None = None) -> dict | None:
    """One training run into out_dir. Returns the metrics on rank 0 (None elsewhere, or when stopped).
    Its wall time counts from `started` (default: now)."""
    started = time.perf_counter() if started is None else started
    config = {k: getattr(args, k) for k in RUN_DEFINING}
    state = _agreed_resume_state(args, ranks, out_dir, config) if args.resume else None
    seed_everything(args.seed, ranks.rank)
    data = load_digits_data()
    device = ranks.device
    model = build_model(len(data.tokenizer), data.tokenizer.max_length, image_width=args.image_width,
                        text_width=args.text_width, text_layers=args.text_layers, text_heads=args.text_heads,
                        embed_dim=args.embed_dim, checkpointing=args.checkpointing).to(device)
    # Stochastic-rounding bits: the same stream on every rank keeps the replicas identical.
    generators = {"sr": torch.Generator(device).manual_seed(args.seed + 7919)}
    optimizers = build_optimizers(model, args.text_precision, HALF_DTYPES[args.half_dtype], args.lr,
                                  args.weight_decay, generators["sr"])
    schedulers = {name: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, args.warmup, args.steps))
                  for name, opt in optimizers.items()}
    history = {"loss_steps": [], "loss": [], "eval_steps": [], "accuracy": []}
    start_step = 0
    if state is not None:
        restore(state, model=model, optimizers=optimizers, schedulers=schedulers, generators=generators)
        start_step, history = state["step"], state["history"]
        # The resumed step is now the head of the run: later checkpoints (an abandoned timeline that
        # not every rank finished) must never be resumed from nor displace the continuation's own.
        set_aside = ranks.gather(set_aside_later_steps(out_dir, ranks.rank, start_step))
        if ranks.rank == 0:
            print(f"resuming from step {start_step}, the newest step that every rank has")
            for rank, steps in enumerate(set_aside):
                if steps:
                    print(f"rank {rank}: checkpoints of steps {steps} set aside as *.abandoned (not every rank has them)")
    if ranks.distributed:
        model_ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)
    else:
        model_ddp = model
    loss_fn = make_loss(args.loss, ranks, args.targets)
    data = data.to(device)

    def evaluate(step: int) -> None:
        if ranks.rank == 0 and (not history["eval_steps"] or history["eval_steps"][-1] != step):
            history["eval_steps"].append(step)
            history["accuracy"].append(zero_shot_accuracy(model, data.test_images, data.test_labels, data.prompt_ids))

    def checkpoint(step: int) -> None:
        save_checkpoint(out_dir, ranks.rank, step=step, config={**config, "world_size": ranks.world_size},
                        model=model, optimizers=optimizers, schedulers=schedulers, generators=generators,
                        history=history)

    stop = args.stop_after if args.stop_after is not None else args.steps
    progress = _progress_bar(ranks.rank == 0, total=args.steps, initial=start_step, label=label)
    if start_step == 0:
        evaluate(0)
    loop_started = time.perf_counter()
    local_batch = args.batch_size // ranks.world_size
    grad_cache = None
    if args.micro_batch_size:
        import clipshard
        grad_cache = clipshard.GradCache(model_ddp, loss_fn, args.micro_batch_size)
    for step in range(start_step, stop):
        images, token_ids, labels = rank_batch(data, args.batch_size, args.seed, step, ranks.rank, ranks.world_size)
        ids = {} if args.sample_ids == "none" else {"sample_ids": labels}  # the digit: the same id on every rank
        if grad_cache is not None:
            loss = grad_cache(images, token_ids, **ids)  # the model re-runs per micro-batch in loss.backward()
        else:
            image_features, text_features, scale = model_ddp(images, token_ids)
            loss = loss_fn(image_features, text_features, scale, **ids)
        for opt in optimizers.values():
            opt.zero_grad(set_to_none=True)
        loss.backward()
        for name in optimizers:
            optimizers[name].step()
            schedulers[name].step()
        history["loss_steps"].append(step + 1)
        history["loss"].append(ranks.mean(loss))  # mean of the per-rank losses = the global batch's loss
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            evaluate(step + 1)
        if args.checkpoint_every and (step + 1) % args.checkpoint_every == 0 and step + 1 != stop:
            checkpoint(step + 1)
        if progress is not None:
            seconds = time.perf_counter() - loop_started
            progress.update(1)
            progress.set_postfix({"loss": f"{history['loss'][-1]:.3f}",
                                  "samples/s": f"{(step + 1 - start_step) * args.batch_size / seconds:.0f}"})
    train_seconds = time.perf_counter() - loop_started
    if progress is not None:
        progress.close()
    checkpoint(stop)
    if stop < args.steps:
        if ranks.rank == 0:
            print(f"stopped after step {stop} of {args.steps}; continue with --resume --out {out_dir}")
        return None

    loss_memory = _loss_memory_per_rank(args, ranks, model, data)
    evaluate(args.steps)
    if ranks.rank != 0:
        return None
    steps_run = stop - start_step
    n_text, n_all = sum(p.numel() for p in model.text.parameters()), sum(p.numel() for p in model.parameters())
    return {
        "zero_shot_accuracy": history["accuracy"][-1],
        "peak_loss_memory_bytes": max(loss_memory[args.loss]),  # the largest over ranks
        "peak_loss_memory_bytes_by_loss": {name: max(per_rank) for name, per_rank in loss_memory.items()},
        "peak_loss_memory_bytes_per_rank": loss_memory,
        **_optimizer_bytes_per_param(model, optimizers),
        "wall_seconds": time.perf_counter() - started,
        "train_seconds": train_seconds,
        "samples_per_second": steps_run * args.batch_size / train_seconds if steps_run else 0.0,
        "final_loss": history["loss"][-1],
        "loss_last_50_steps": sum(history["loss"][-50:]) / len(history["loss"][-50:]),
        "loss_floor": contrastive_loss_floor(data, args.batch_size, args.seed, args.steps, args.targets),
        "parameters": {"text": n_text, "image_and_logit_scale": n_all - n_text},
        "num_train_images": len(data.train_labels),
        "num_test_images": len(data.test_labels),
        "local_batch_size": local_batch,
        "world_size": ranks.world_size,
        "device": str(device),
        "backend": ranks.backend if ranks.distributed else "none",
        "resumed_from_step": start_step if args.resume else None,
        "config": config,
        "history": history,
    }


def _agreed_resume_state(args: argparse.Namespace, ranks: Ranks, out_dir: str, config: dict) -> dict:
    """This rank's checkpoint of the newest step that every rank has, checked against this run's
    flags. A problem on any rank raises Refusal on every rank, with the same message."""
    try:
        state = load_agreed_checkpoint(out_dir, ranks.rank, ranks.gather)
    except CheckpointError as error:
        raise Refusal(str(error)) from None
    problems = sorted({p for p in ranks.gather(_resume_problem(state, config, ranks.world_size, args.stop_after))
                       if p is not None})
    if problems:
        raise Refusal("; ".join(problems))
    return state


def _resume_problem(state: dict, config: dict, world_size: int, stop_after: int | None) -> str | None:
    """Why this run cannot continue from `state`, or None."""
    changed = {k: (state["config"].get(k), v) for k, v in config.items() if state["config"].get(k) != v}
    if changed:
        return f"--resume: these settings differ from the checkpoint's (saved, given): {changed}"
    if state["config"]["world_size"] != world_size:
        return f"--resume: the checkpoint was written by {state['config']['world_size']} ranks, this run has {world_size}"
    if stop_after is not None and stop_after <= state["step"]:
        return f"--resume: --stop-after {stop_after} is not after step {state['step']}, where the run resumes"
    return None


def _loss_memory_per_rank(args, ranks: Ranks, model, data) -> dict[str, list[int]]:
    """Peak memory of one loss call (forward + backward) on each rank's shard of the last batch, for
    clipshard's loss and (when open_clip is installed) open_clip's."""
    images, token_ids, _ = rank_batch(data, args.batch_size, args.seed, args.steps - 1, ranks.rank, ranks.world_size)
    with torch.no_grad():
        image_features, text_features, scale = model(images, token_ids)
    per_rank = {}
    for name in LOSSES:
        try:
            loss_fn = make_loss(name, ranks)
        except ImportError:
            if name == args.loss:
                raise
            continue
        per_rank[name] = ranks.gather(peak_loss_memory(loss_fn, image_features, text_features, scale))
    return per_rank


def _optimizer_bytes_per_param(model, optimizers: dict) -> dict[str, float]:
    """Weights + optimizer states per parameter: each tower, and both together."""
    text = list(model.text.parameters())
    image = [p for p in model.parameters() if all(p is not q for q in text)]
    per_text = optimizer_bytes_per_param(text, optimizers["text"])
    per_image = optimizer_bytes_per_param(image, optimizers["image"])
    n_text, n_image = sum(p.numel() for p in text), sum(p.numel() for p in image)
    return {"optimizer_bytes_per_param": (per_text * n_text + per_image * n_image) / (n_text + n_image),
            "optimizer_bytes_per_param_text": per_text,
            "optimizer_bytes_per_param_image": per_image}


def _progress_bar(enabled: bool, total: int, initial: int, label: str):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=label or "train", unit="step", dynamic_ncols=True)


def default_out_dir() -> str:
    return os.path.join("runs", time.strftime("%Y%m%d-%H%M%S"))


def main(argv=None) -> None:
    args = parse_args(argv)
    ranks = Ranks(args.device, args.backend)
    with ranks.leaving_cleanly():  # a refusal or a failure exits with status 1 and a message
        out_dir = ranks.broadcast(args.out or default_out_dir())  # one folder, named by rank 0's clock
        if ranks.rank == 0:
            os.makedirs(out_dir, exist_ok=True)
        if args.compare:
            _compare(args, ranks, out_dir)
        else:
            _single(args, ranks, out_dir)


def _single(args: argparse.Namespace, ranks: Ranks, out_dir: str) -> None:
    metrics = train(args, ranks, out_dir, started=STARTED)
    if metrics is None:
        return
    write_metrics(out_dir, metrics)
    plot_runs(os.path.join(out_dir, "training.png"), {args.text_precision: metrics["history"]},
              metrics["loss_floor"], f"tiny CLIP on digits: {args.steps} steps, batch {args.batch_size}, "
                                     f"{ranks.world_size} ranks, text {args.text_precision}")
    print(format_table(summary_rows(metrics)))
    print(f"wrote {out_dir}/metrics.json and {out_dir}/training.png")


def _compare(args: argparse.Namespace, ranks: Ranks, out_dir: str) -> None:
    """The same run with the text tower in fp32, sr16 and rn16: accuracy, loss, bytes per parameter."""
    results = {}
    for precision in TEXT_PRECISIONS:
        args.text_precision = precision
        run_dir = os.path.join(out_dir, precision)
        if ranks.rank == 0:
            os.makedirs(run_dir, exist_ok=True)
        metrics = train(args, ranks, run_dir, label=precision)
        if metrics is not None:
            write_metrics(run_dir, metrics)
            results[precision] = metrics
    if ranks.rank != 0:
        return
    rows = [("text precision", "accuracy   loss, last 50 steps   text bytes/param   train s")]
    rows += [(p, f"{100 * m['zero_shot_accuracy']:6.1f}%   {m['loss_last_50_steps']:19.4f}   "
                 f"{m['optimizer_bytes_per_param_text']:16.2f}   {m['train_seconds']:7.1f}")
             for p, m in results.items()]
    rows.append(("loss floor", f"{results['fp32']['loss_floor']:.4f}"))
    print(format_table(rows))
    write_metrics(out_dir, {"compare": {p: {k: v for k, v in m.items() if k != "history"} for p, m in results.items()}})
    plot_runs(os.path.join(out_dir, "compare.png"), {p: m["history"] for p, m in results.items()},
              results["fp32"]["loss_floor"],
              f"text tower precision, lr {args.lr}, {args.steps} steps, batch {args.batch_size}")
    print(f"wrote {out_dir}/metrics.json and {out_dir}/compare.png")


if __name__ == "__main__":
    sys.exit(main())
