"""sentence-transformers' MultipleNegativesRankingLoss and the loss stage of its
CachedMultipleNegativesRankingLoss against the same losses under clipshard.apply_to_sentence_transformers(),
with gather_across_devices=True: the loss forward + backward on given embeddings (anchor, positive and H
hard-negative columns of B_local x D), time and peak memory per rank, all in one run.

CPU: a gloo group of --world-size ranks on this machine (2 by default), sharing its cores. Per case the
memory step runs first (it also warms up), then --steps timed steps; the methods take turns step by step,
in forward and reverse order by turns, each timed step right after --settle (1) untimed ones of its method.
--methods leaves some out (the library's cached loss stage takes minutes a step at B = 4096).
Peak memory: bytes the step allocates beyond its inputs (benchmarks/_measure.py).

    python benchmarks/bench_sentence_transformers.py --json bench_sentence_transformers.json
    python benchmarks/bench_sentence_transformers.py --quick    # tiny sizes, a smoke test
"""
import datetime
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import parser_with_common_arguments, peak_memory_bytes, print_table, summarize, time_call, write_json  # noqa: E402,E501

MIB = 2 ** 20
METHODS = ("MNRL", "cached MNRL loss stage", "clipshard MNRL", "clipshard cached loss stage")


def _loss(name, mini_batch_size):
    from sentence_transformers.sentence_transformer import losses

    model = torch.nn.Sequential(torch.nn.Identity())
    if "cached" in name:
        return losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=mini_batch_size,
                                                         gather_across_devices=True)
    return losses.MultipleNegativesRankingLoss(model, gather_across_devices=True)


def _step(name, loss, columns, mini_batch_size):
    """One forward + backward of `loss` on fresh leaves of `columns` (the cached loss: its loss stage,
    calculate_loss(with_backward=True), on mini-batches of cached embeddings)."""
    if "cached" in name:
        reps = [[x.detach().requires_grad_() for x in c.split(mini_batch_size)] for c in columns]
        return lambda: loss.calculate_loss(reps, None, with_backward=True)
    leaves = [c.detach().requires_grad_() for c in columns]
    return lambda: loss.compute_loss_from_embeddings(leaves, None).backward()


def _measure_rank(rank, args):
    import logging
    import warnings

    import clipshard

    warnings.filterwarnings("ignore")
    logging.getLogger("sentence_transformers").setLevel(logging.ERROR)
    out = []
    for batch, negatives in args.case_list:
        gen = torch.Generator().manual_seed(1000 * rank + negatives)
        columns = [torch.randn(batch, args.dim, generator=gen) for _ in range(2 + negatives)]
        losses = {name: _loss(name, args.mini_batch_size) for name in args.methods}

        def run(name, fn):
            if name.startswith("clipshard"):
                patch = clipshard.apply_to_sentence_transformers()
                try:
                    return fn()
                finally:
                    patch.undo()
            return fn()

        case = {"batch": batch, "negatives": negatives, "methods": {}}
        for name, loss in losses.items():
            dist.barrier()
            peak = run(name, lambda: peak_memory_bytes(_step(name, loss, columns, args.mini_batch_size), "cpu"))
            case["methods"][name] = {"peak_bytes": peak, "times_s": []}
        for step in range(args.steps):
            # forward and reverse order in turn, and --settle untimed steps of the same method right before
            # each timed one (as in training, where a loss step follows its own previous one), so that no
            # step is timed right after another method's: with the library's cached loss stage (which frees
            # the most memory) in the run, clipshard's step measured up to 1.32x MNRL, without it <= 0.88x
            for name in list(losses) if step % 2 == 0 else list(losses)[::-1]:
                loss = losses[name]
                dist.barrier()
                for _ in range(args.settle):
                    run(name, _step(name, loss, columns, args.mini_batch_size))
                seconds = run(name, lambda: time_call(_step(name, loss, columns, args.mini_batch_size), "cpu"))
                case["methods"][name]["times_s"].append(seconds)
        for m in case["methods"].values():
            m.update(summarize(m["times_s"]))
        out.append(case)
        if rank == 0:
            print(f"case B={batch} H={negatives}: " + ", ".join(
                f"{n} {m['median_s']:.3f} s {m['peak_bytes'] / MIB:.1f} MiB" for n, m in case["methods"].items()),
                flush=True)
    return out


def _rank(rank, world_size, port, args, results):
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=args.timeout))
        results.put((rank, _measure_rank(rank, args)))
    except BaseException:  # noqa: BLE001 (report to the parent instead of hanging it)
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run(args):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args.world_size, port, args, results)) for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=args.timeout) for _ in range(args.world_size))
    for proc in procs:
        proc.join(timeout=30)
    return [per_rank[r] for r in range(args.world_size)]


def _rows(per_rank):
    rows = []
    for rank, cases in enumerate(per_rank):
        for case in cases:
            base = case["methods"]["MNRL"]
            for name, m in case["methods"].items():
                rows.append({"rank": rank, "batch": case["batch"], "negatives": case["negatives"], "method": name,
                             "median_s": m["median_s"], "peak_bytes": m["peak_bytes"],
                             "time_vs_mnrl": m["median_s"] / base["median_s"],
                             "memory_vs_mnrl": m["peak_bytes"] / max(base["peak_bytes"], 1)})
    return rows


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--batches", type=int, nargs="+", default=[1024, 4096], help="local batch sizes")
    parser.add_argument("--negatives", type=int, nargs="+", default=[0, 3, 7], help="hard-negative columns")
    parser.add_argument("--cases", nargs="+", metavar="B:H",
                        help="only these (local batch, negatives) cases, e.g. 1024:7 4096:3 (default: every pair)")
    parser.add_argument("--dim", type=int, default=768)
    parser.add_argument("--mini-batch-size", type=int, default=32, help="the cached loss's mini_batch_size")
    parser.add_argument("--steps", type=int, default=1, help="timed steps per method and case")
    parser.add_argument("--settle", type=int, default=1,
                        help="untimed steps of the same method right before each timed one (0: none)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS),
                        help="which losses to run, quoted (default: all; MNRL, the baseline, always runs)")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=7200, help="seconds before giving up")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (B 64, D 32, H 0 and 3), for a test")
    args = parser.parse_args()
    if args.device != "cpu":
        sys.exit("bench_sentence_transformers.py: CPU only (a gloo group)")
    args.methods = [m for m in METHODS if m in args.methods or m == "MNRL"]
    if args.quick:
        args.batches, args.negatives, args.dim, args.mini_batch_size = [64], [0, 3], 32, 16
    args.case_list = ([tuple(int(x) for x in c.split(":")) for c in args.cases] if args.cases and not args.quick
                      else [(b, h) for b in args.batches for h in args.negatives])
    per_rank = _run(args)
    errors = [r["error"] for r in per_rank if isinstance(r, dict) and "error" in r]
    if errors:
        sys.exit(errors[0])
    rows = _rows(per_rank)
    print_table([
        ("B local", lambda r: str(r["batch"])),
        ("H", lambda r: str(r["negatives"])),
        ("method", lambda r: r["method"], "<"),
        ("rank", lambda r: str(r["rank"])),
        ("time (s)", lambda r: f"{r['median_s']:.3f}"),
        ("/ MNRL", lambda r: f"{r['time_vs_mnrl']:.2f}"),
        ("peak (MiB)", lambda r: f"{r['peak_bytes'] / MIB:.1f}"),
        ("/ MNRL ", lambda r: f"{r['memory_vs_mnrl']:.3f}"),
    ], rows, title=f"{args.world_size} gloo ranks, CPU, D={args.dim}, fp32, gather_across_devices=True; median of "
                   f"{args.steps} step(s); peak = bytes the loss step allocates beyond its inputs")
    if args.json:
        write_json(args.json, {"world_size": args.world_size, "dim": args.dim, "steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
