"""Sample ids and hard negatives: clipshard.clip_loss against the materialised PyTorch
loss of the same objective, forward + backward, one device.

Configurations (B pairs, features B x D, normalised, logit scale 14.3):
- plain: no ids, no negatives (the materialised loss: open_clip's two cross-entropies);
- ids10-mask / ids10-multi: sample ids where 10 % of the rows share their id with another row,
  targets "mask" (materialised: the logits with the same-id, non-own pairs filled with -inf) and
  "multi" (materialised: SupCon's mean log-probability of the same-id columns, both directions);
- hn1 / hn3 / hn7: h hard negatives per row, H = h B extra text columns in every row's denominator
  (materialised: the rows' cross-entropy over [logits | image @ negatives^T], as sentence-transformers'
  MultipleNegativesRankingLoss writes it, plus the columns' over the B texts).
For each: median time of the forward + backward (benchmarks/_measure.py: wall-clock on CPU, CUDA
events on CUDA; the repeats are interleaved, each round timing every configuration once), peak
memory the call allocates beyond its inputs (feature gradients included), and the two losses'
relative difference (a check that both compute the same objective). The ratios: clipshard over the
materialised loss, and clipshard over clipshard's plain loss, against the targets set for this
benchmark (peak <= 1/20 of the materialised at h = 3; ids <= 1.15 x plain; h negatives <= 1.15 (1 + h)
x plain; below the materialised everywhere), printed as checks.

    python benchmarks/bench_targets.py --device cpu --json bench_results/targets_cpu.json
    python benchmarks/bench_targets.py --quick        # tiny sizes, seconds (the test runs this)
"""
import functools
import os
import sys

import torch
import torch.nn.functional as F

import clipshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (parser_with_common_arguments, peak_memory_bytes, print_table, require_device,  # noqa: E402
                      run_metadata, summarize, time_call, write_json)

HARD_NEGATIVES_PER_ROW = (1, 3, 7)
DUPLICATE_FRACTION = 0.1


# --- the materialised objectives ----------------------------------------------------------------

def _logits(image, text, scale):
    return scale * image @ text.T


def materialised_plain(image, text, scale):
    logits = _logits(image, text, scale)
    labels = torch.arange(len(logits), device=logits.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def materialised_mask(image, text, scale, ids):
    logits = _logits(image, text, scale)
    labels = torch.arange(len(logits), device=logits.device)
    masked = logits.masked_fill((ids[:, None] == ids[None, :]) & (labels[:, None] != labels[None, :]), float("-inf"))
    return (F.cross_entropy(masked, labels) + F.cross_entropy(masked.T, labels)) / 2


def materialised_multi(image, text, scale, ids):
    logits = _logits(image, text, scale)
    same = ids[:, None] == ids[None, :]
    counts = same.sum(1)  # symmetric: the columns' counts are the same
    rows = -(F.log_softmax(logits, 1) * same).sum(1) / counts
    cols = -(F.log_softmax(logits, 0) * same).sum(0) / counts
    return (rows.mean() + cols.mean()) / 2


def materialised_hard_negatives(image, text, scale, negatives):
    logits = _logits(image, text, scale)
    labels = torch.arange(len(logits), device=logits.device)
    rows = torch.cat([logits, _logits(image, negatives, scale)], 1)
    return (F.cross_entropy(rows, labels) + F.cross_entropy(logits.T, labels)) / 2


# --- inputs and configurations ------------------------------------------------------------------

def _features(rows, dim, generator, device):
    return F.normalize(torch.randn(rows, dim, generator=generator), dim=1).to(device).requires_grad_()


def duplicate_ids(batch, generator, device):
    """0..B-1 with DUPLICATE_FRACTION of the rows given the id of another row (chosen at random)."""
    ids = torch.arange(batch)
    chosen = torch.randperm(batch, generator=generator)[:int(DUPLICATE_FRACTION * batch)]
    ids[chosen] = torch.randint(0, batch, (len(chosen),), generator=generator)
    return ids.to(device)


def configurations(batch, dim, device, scale, hard_negatives_per_row=HARD_NEGATIVES_PER_ROW):
    """[(name, h, inputs, clipshard's loss, the materialised loss)]: fn(*inputs) -> loss."""
    g = torch.Generator().manual_seed(0)
    image, text = _features(batch, dim, g, device), _features(batch, dim, g, device)
    logit_scale = torch.tensor(scale, device=device, requires_grad=True)
    base = (image, text, logit_scale)
    ids = duplicate_ids(batch, g, device)
    configs = [("plain", 0, base, clipshard.clip_loss, materialised_plain)]
    for targets, reference in (("mask", materialised_mask), ("multi", materialised_multi)):
        configs.append((f"ids10-{targets}", 0, base,
                        functools.partial(clipshard.clip_loss, sample_ids=ids, targets=targets),
                        functools.partial(reference, ids=ids)))
    for h in hard_negatives_per_row:
        negatives = _features(h * batch, dim, g, device)
        configs.append((f"hn{h}", h, (*base, negatives),
                        lambda i, t, s, n: clipshard.clip_loss(i, t, s, hard_negatives=n),
                        materialised_hard_negatives))
    return configs


# --- measurement --------------------------------------------------------------------------------

def _step(loss_fn, inputs):
    return torch.autograd.grad(loss_fn(*inputs), inputs)


def warm_up_and_measure_memory(loss_fn, inputs, device):
    """The warm-up call (whose loss value is kept) and the peak memory of one forward + backward."""
    loss = loss_fn(*inputs)
    torch.autograd.grad(loss, inputs)
    return {"loss": loss.item(), "peak_bytes": peak_memory_bytes(lambda: _step(loss_fn, inputs), device)}


def run(batch, dim, device, scale, repeats, hard_negatives_per_row=HARD_NEGATIVES_PER_ROW):
    """The timed calls are interleaved: each of the `repeats` rounds times every configuration's
    clipshard and materialised step once, so a change of the machine's load between configurations
    moves the ratios far less than timing one configuration's repeats after another's."""
    configs = configurations(batch, dim, device, scale, hard_negatives_per_row)
    calls = {(name, side): (loss_fn, inputs) for name, _, inputs, ours, reference in configs
             for side, loss_fn in (("clipshard", ours), ("materialised", reference))}
    results = {key: warm_up_and_measure_memory(loss_fn, inputs, device) for key, (loss_fn, inputs) in calls.items()}
    times = {key: [] for key in calls}
    for round_ in range(repeats):
        for key, (loss_fn, inputs) in calls.items():
            times[key].append(time_call(functools.partial(_step, loss_fn, inputs), device))
        print(f"  round {round_ + 1} of {repeats} timed", file=sys.stderr, flush=True)
    rows = []
    for name, h, _, _, _ in configs:
        mine = {**results[name, "clipshard"], **summarize(times[name, "clipshard"])}
        theirs = {**results[name, "materialised"], **summarize(times[name, "materialised"])}
        rows.append({"config": name, "h": h, "batch": batch, "dim": dim,
                     "clipshard": mine, "materialised": theirs,
                     "loss_difference": abs(mine["loss"] - theirs["loss"]) / abs(theirs["loss"]),
                     "time_vs_materialised": mine["median_s"] / theirs["median_s"],
                     "mem_vs_materialised": mine["peak_bytes"] / theirs["peak_bytes"]})
    plain = rows[0]["clipshard"]["median_s"]
    for r in rows:
        r["time_vs_plain"] = r["clipshard"]["median_s"] / plain
    return rows


def checks(rows):
    """[(target, measured, holds)]: the targets set for this benchmark on these rows."""
    found = []
    for r in rows:
        if r["h"] == 3:
            found.append(("peak <= 1/20 of the materialised at h = 3", f"1/{1 / r['mem_vs_materialised']:.1f}",
                          r["mem_vs_materialised"] <= 1 / 20))
        if r["config"].startswith("ids"):
            found.append((f"{r['config']}: time <= 1.15 x plain", f"{r['time_vs_plain']:.3f} x",
                          r["time_vs_plain"] <= 1.15))
        if r["h"]:
            limit = 1.15 * (1 + r["h"])
            found.append((f"{r['config']}: time <= 1.15 x (1 + {r['h']}) = {limit:.2f} x plain",
                          f"{r['time_vs_plain']:.3f} x", r["time_vs_plain"] <= limit))
        found.append((f"{r['config']}: time below the materialised", f"{r['time_vs_materialised']:.3f} x",
                      r["time_vs_materialised"] < 1))
        found.append((f"{r['config']}: peak below the materialised", f"{r['mem_vs_materialised']:.4f} x",
                      r["mem_vs_materialised"] < 1))
    return found


def main(argv=None):
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--batch", type=int, default=8192, help="pairs B")
    parser.add_argument("--dim", type=int, default=512, help="feature size D")
    parser.add_argument("--scale", type=float, default=14.3, help="logit scale (already exponentiated)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats of each call")
    parser.add_argument("--hard-negatives", type=int, nargs="+", default=list(HARD_NEGATIVES_PER_ROW),
                        help="the values of h (hard negatives per row) to measure")
    parser.add_argument("--quick", action="store_true", help="B = 64, D = 16, 1 repeat: seconds, for the test")
    args = parser.parse_args(argv)
    require_device("bench_targets", args.device)
    if args.quick:
        args.batch, args.dim, args.repeats = 64, 16, 1
    rows = run(args.batch, args.dim, args.device, args.scale, args.repeats, args.hard_negatives)
    ms = lambda seconds: f"{seconds * 1e3:.1f}"  # noqa: E731
    print_table([
        ("config", lambda r: r["config"], "<"),
        ("clipshard ms", lambda r: ms(r["clipshard"]["median_s"])),
        ("p20-p80", lambda r: f"{ms(r['clipshard']['p20_s'])}-{ms(r['clipshard']['p80_s'])}"),
        ("materialised ms", lambda r: ms(r["materialised"]["median_s"])),
        ("clipshard MiB", lambda r: f"{r['clipshard']['peak_bytes'] / 2**20:.1f}"),
        ("materialised MiB", lambda r: f"{r['materialised']['peak_bytes'] / 2**20:.1f}"),
        ("time/mat", lambda r: f"{r['time_vs_materialised']:.3f}"),
        ("mem/mat", lambda r: f"{r['mem_vs_materialised']:.4f}"),
        ("time/plain", lambda r: f"{r['time_vs_plain']:.3f}"),
        ("loss diff", lambda r: f"{r['loss_difference']:.1e}"),
    ], rows, title=f"\nforward + backward, one device ({args.device}, {torch.get_num_threads()} threads), "
                   f"B={args.batch}, D={args.dim}, fp32, scale={args.scale}; median of {args.repeats}; "
                   "memory = peak bytes the call allocates beyond its inputs")
    found = checks(rows)
    print("\ntargets" + (" (quick sizes: not meaningful)" if args.quick else ""))
    for target, measured, holds in found:
        print(f"  {'ok  ' if holds else 'MISS'} {target}: {measured}")
    write_json(args.json, {"meta": {**run_metadata(args.device), "scale": args.scale, "repeats": args.repeats,
                                    "quick": args.quick},
                           "results": rows, "checks": [{"target": t, "measured": m, "holds": h} for t, m, h in found]})
    return rows


if __name__ == "__main__":
    main()
