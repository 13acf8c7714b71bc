"""A training step's peak memory and time against the local batch M: the plain step (with and
without activation checkpointing) vs clipshard.GradCache, and the loss alone; then
open_clip_train's own --accum-freq algorithm vs GradCache at K = 4 and 8.

The model is a small open_clip CLIP (ViT and text transformer of --layers x --width, 32 x 32
images in 8 x 8 patches, 16 tokens), fp32, clipshard.ClipLoss. One step = forward, loss, backward
(gradients set to None before each). Peak memory: benchmarks/_measure.py (on CPU the allocations
torch.profiler records, beyond what is live when the step starts: activations, features, cached
feature gradients and the parameters' gradients). Time: median of --repeats steps after one
warm-up, each configuration in the same run.

The accumulation comparison runs open_clip_train's --accum-freq K as its train.py does it (the K
micro-batches' features under no_grad, then per micro-batch a forward with grad, the loss of the
whole accumulated batch with that micro-batch's features swapped in, and a backward: K loss
evaluations a step) and GradCache over the same K micro-batches, --steps AdamW steps each from
the same weights and data, and reports the step time, the largest per-step loss difference and
the share of open_clip's step its K loss evaluations take (K x the loss alone on the whole batch).
That table uses its own, smaller towers (--accum-layers x --accum-width) and a large batch, where
the loss is a visible share of the step; with the first table's towers it is a percent or two.

    python benchmarks/bench_grad_cache.py --json bench_results/grad_cache_cpu.json
"""
import copy
import os
import sys

import torch

import clipshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (parser_with_common_arguments, peak_memory_bytes, print_table, require_device,  # noqa: E402
                      run_metadata, time_repeats, write_json)

IMAGE, PATCH, CONTEXT, VOCAB = 32, 8, 16, 1000


def build_model(layers, width, device, checkpointing=False):
    import open_clip
    torch.manual_seed(0)
    model = open_clip.CLIP(embed_dim=width,
                           vision_cfg=dict(image_size=IMAGE, patch_size=PATCH, layers=layers, width=width, head_width=64),
                           text_cfg=dict(context_length=CONTEXT, vocab_size=VOCAB, width=width, heads=width // 64,
                                         layers=layers),
                           output_dict=True).to(device)
    model.set_grad_checkpointing(checkpointing)
    return model


def make_batch(size, seed, device):
    gen = torch.Generator().manual_seed(seed)
    images = torch.randn(size, 3, IMAGE, IMAGE, generator=gen)
    texts = torch.randint(0, VOCAB, (size, CONTEXT), generator=gen)
    return images.to(device), texts.to(device)


def plain_step(model, loss_fn, images, texts):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(**model(images, texts))
    loss.backward()
    return loss.detach()


def grad_cache_step(model, loss_fn, images, texts, micro):
    model.zero_grad(set_to_none=True)
    loss = clipshard.GradCache(model, loss_fn, micro)(images, texts)
    loss.backward()
    return loss.detach()


def open_clip_accum_step(model, loss_fn, images, texts, micro):
    """open_clip_train's --accum-freq: features cached without grad, then per micro-batch a forward
    with grad, the loss of the whole batch (that micro-batch's features swapped in), a backward."""
    model.zero_grad(set_to_none=True)
    pieces = list(zip(images.split(micro), texts.split(micro)))
    with torch.no_grad():
        cached = [model(i, t) for i, t in pieces]
    for index, (i, t) in enumerate(pieces):
        out = model(i, t)
        features = {k: torch.cat([out[k] if j == index else c[k] for j, c in enumerate(cached)])
                    for k in ("image_features", "text_features")}
        loss = loss_fn(**features, logit_scale=out["logit_scale"])
        loss.backward()
    return loss.detach()


def memory_and_time(step, device, repeats):
    """Peak memory of one step, and the time of `repeats` steps (none: NaN, memory only)."""
    peak = peak_memory_bytes(step, device)
    if repeats == 0:
        return {"peak_bytes": peak, "median_s": float("nan"), "p20_s": float("nan"), "p80_s": float("nan")}
    return {"peak_bytes": peak, **time_repeats(step, device, repeats)}


def batch_rows(args, device):
    loss_fn = clipshard.ClipLoss()
    models = {False: build_model(args.layers, args.width, device), True: build_model(args.layers, args.width, device, True)}
    rows = []
    for size in args.sizes:
        images, texts = make_batch(size, size, device)
        configs = {
            "plain": lambda: plain_step(models[False], loss_fn, images, texts),
            "plain+checkpointing": lambda: plain_step(models[True], loss_fn, images, texts),
            f"GradCache m={args.micro}": lambda: grad_cache_step(models[False], loss_fn, images, texts, args.micro),
        }
        features = unit_features(size, args.width, device)
        configs["loss alone"] = lambda: loss_fn(*features, torch.tensor(14.3, device=device)).backward()
        results = {}
        for name, fn in configs.items():
            results[name] = memory_and_time(fn, device, args.repeats)
            print(f"  M = {size} {name}: {results[name]['peak_bytes'] / 2**20:.1f} MiB, "
                  f"{results[name]['median_s']:.3f} s", flush=True)
        for name, result in results.items():
            rows.append({"M": size, "config": name, **result,
                         "time_vs_checkpointing": result["median_s"] / results["plain+checkpointing"]["median_s"],
                         "time_vs_plain": result["median_s"] / results["plain"]["median_s"]})
    return rows


def unit_features(size, width, device):
    """Two random leaf feature tensors of unit rows, as CLIP's towers return them (unnormalised
    N(0, 1) rows give logits in the thousands, whose exp is slower on the CPU)."""
    gen = torch.Generator().manual_seed(size)
    return [torch.nn.functional.normalize(torch.randn(size, width, generator=gen), dim=-1).to(device).requires_grad_()
            for _ in range(2)]


def loss_alone_seconds(loss_fn, size, width, device, repeats):
    """Median time of the loss's forward and backward on `size` random feature pairs."""
    features = unit_features(size, width, device)
    scale = torch.tensor(14.3, device=device)
    return time_repeats(lambda: loss_fn(*features, scale).backward(), device, repeats)["median_s"]


def accumulation_rows(args, device):
    loss_fn = clipshard.ClipLoss()
    base = build_model(args.accum_layers, args.accum_width, device)
    rows = []
    for k in args.accum:
        size = k * args.accum_micro
        batches = [make_batch(size, 1000 * k + s, device) for s in range(args.steps)]
        trajectories = {}
        for name, step in (("open_clip --accum-freq", open_clip_accum_step), ("clipshard GradCache", grad_cache_step)):
            model = copy.deepcopy(base)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            losses = []
            for images, texts in batches:
                losses.append(step(model, loss_fn, images, texts, args.accum_micro).item())
                opt.step()
            timing = time_repeats(lambda: step(model, loss_fn, *batches[0], args.accum_micro), device, args.repeats)
            trajectories[name] = (losses, timing)
        ours, theirs = trajectories["clipshard GradCache"], trajectories["open_clip --accum-freq"]
        difference = max(abs(a - b) / abs(b) for a, b in zip(ours[0], theirs[0]))
        # the share of open_clip's step its K full-batch loss evaluations take
        loss_share = k * loss_alone_seconds(loss_fn, size, args.accum_width, device, args.repeats) / theirs[1]["median_s"]
        for name, (losses, timing) in trajectories.items():
            rows.append({"K": k, "M": size, "config": name, **timing, "losses": losses,
                         "time_vs_open_clip": timing["median_s"] / theirs[1]["median_s"],
                         "max_loss_difference": difference, "open_clip_loss_share": loss_share})
        print(f"  K = {k}: open_clip {theirs[1]['median_s']:.3f} s (its {k} loss evaluations {100 * loss_share:.0f} %), "
              f"GradCache {ours[1]['median_s']:.3f} s, per-step losses within {difference:.1e}", flush=True)
    return rows


STEP_COLUMNS = [("M", lambda r: str(r["M"])), ("step", lambda r: r["config"], "<"),
                ("peak MiB", lambda r: f"{r['peak_bytes'] / 2**20:.1f}"),
                ("median s", lambda r: f"{r['median_s']:.3f}"),
                ("p20-p80 s", lambda r: f"{r['p20_s']:.3f}-{r['p80_s']:.3f}"),
                ("time/ckpt", lambda r: f"{r['time_vs_checkpointing']:.2f}"),
                ("time/plain", lambda r: f"{r['time_vs_plain']:.2f}")]
ACCUMULATION_COLUMNS = [("K", lambda r: str(r["K"])), ("M", lambda r: str(r["M"])), ("step", lambda r: r["config"], "<"),
                        ("median s", lambda r: f"{r['median_s']:.3f}"),
                        ("time/open_clip", lambda r: f"{r['time_vs_open_clip']:.2f}"),
                        ("loss share of open_clip", lambda r: f"{100 * r['open_clip_loss_share']:.0f} %"),
                        ("max rel. loss diff", lambda r: f"{r['max_loss_difference']:.1e}")]


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--sizes", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096],
                        help="local batch sizes M of the first table (none: skip it)")
    parser.add_argument("--micro", type=int, default=128, help="GradCache's micro-batch in the first table")
    parser.add_argument("--layers", type=int, default=4, help="layers of each tower (first table)")
    parser.add_argument("--width", type=int, default=256, help="width of each tower and of the features (first table)")
    parser.add_argument("--accum", type=int, nargs="*", default=[4, 8],
                        help="accumulation steps K of the second table (none: skip it)")
    parser.add_argument("--accum-micro", type=int, default=512,
                        help="micro-batch (open_clip's --batch-size) of the second table: M = K x this")
    parser.add_argument("--accum-layers", type=int, default=1,
                        help="layers of each tower in the second table: small towers and a large M, where the "
                             "loss is a visible share of the step")
    parser.add_argument("--accum-width", type=int, default=128, help="tower and feature width of the second table")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (0: measure memory only)")
    parser.add_argument("--steps", type=int, default=3, help="AdamW steps of the accumulation comparison")
    args = parser.parse_args()
    require_device(__file__, args.device)
    device = torch.device(args.device)
    print(f"small open_clip CLIP: {args.layers} x {args.width} towers, {run_metadata(device)}", flush=True)
    rows = batch_rows(args, device)
    if rows:
        print_table(STEP_COLUMNS, rows, title="one training step against the local batch M")
    accumulation = accumulation_rows(args, device)
    if accumulation:
        print_table(ACCUMULATION_COLUMNS, accumulation,
                    title=f"open_clip's --accum-freq K vs GradCache: {args.accum_layers} x {args.accum_width} towers, "
                          f"micro-batch {args.accum_micro}, {args.steps} AdamW steps")
    write_json(args.json, {"meta": {**run_metadata(device), **vars(args)}, "steps": rows, "accumulation": accumulation})


if __name__ == "__main__":
    main()
