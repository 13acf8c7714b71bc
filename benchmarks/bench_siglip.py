"""SigLIP loss: clipshard's fused SigLipLoss vs open_clip's SigLipLoss vs a naive materialised loss.

CPU (default), one process: B x B logits for each batch size B (features B x D, normalised, fp32,
logit_scale 10, logit_bias -10: SigLIP's initialisation). Modes: "forward" with the inputs
requiring grad (a training step's forward: clipshard computes the gradients here too, see
docs/siglip.md), "forward+backward", and "forward (no grad)" (evaluation). Then, unless
--world-size 0, a gloo group of that many ranks on this machine (one thread each) at B_local =
--dist-batch: per-rank forward + backward of clipshard (the default, gathered texts, and
mode="ring") vs open_clip (its default 'bidir' exchange); --distributed-only skips the one-process part.

CUDA (--device cuda): one rank's share of a world of 8 on one GPU, M = 8192 rows against
K = 65536 columns, D = 768, bf16: clipshard's fused op on the M x K block vs open_clip's eager
loss over the same 8 column blocks (its _loss per neighbour block, without the communication).

Time: median and 20/80 % quantiles; memory: the peak bytes the loss allocates beyond its inputs
(benchmarks/_measure.py). All implementations run in the same process and the same run, so the
ratios are the figures to read on a shared machine. `clipshard_torch` is clipshard's loss through the
portable PyTorch path (algorithm="torch", docs/portable.md); `torch_vs_clipshard` in the JSON is its
time over the compiled op's.

    python benchmarks/bench_siglip.py --device cpu --json bench_results/siglip_cpu.json
"""
import datetime
import os
import socket
import sys
import traceback
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import clipshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (comparison_columns, fmt, parser_with_common_arguments, peak_memory_bytes, print_table,  # noqa: E402
                      require_device, run_metadata, summarize, time_call, time_repeats, write_json)
from bench_loss import add_ratios  # noqa: E402

MIB = 2 ** 20
MODES = (("forward", True, False), ("forward+backward", True, True), ("forward (no grad)", False, False))


def naive_loss(image_features, text_features, logit_scale, logit_bias):
    """The definition, materialised: B x B logits, labels and softplus terms."""
    logits = logit_scale * image_features @ text_features.T + logit_bias
    labels = 2 * torch.eye(logits.shape[0], device=logits.device, dtype=logits.dtype) - 1
    return torch.nn.functional.softplus(-labels * logits).sum() / image_features.shape[0]


def open_clip_loss_class():
    try:
        from open_clip.loss import SigLipLoss
    except ImportError:
        print("open_clip not installed: comparing with the naive loss only", file=sys.stderr)
        return None
    return SigLipLoss


def make_inputs(rows, cols, dim, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(rows, dim, generator=g), dim=1)
    text = torch.nn.functional.normalize(torch.randn(cols, dim, generator=g), dim=1)
    image, text = (f.to(device=device, dtype=dtype).requires_grad_() for f in (image, text))
    scale = torch.tensor(10.0, device=device, requires_grad=True)
    bias = torch.tensor(-10.0, device=device, requires_grad=True)
    return image, text, scale, bias


def step(loss_fn, inputs, grad_enabled, backward):
    with torch.set_grad_enabled(grad_enabled):
        loss = loss_fn(*inputs)
        if backward:
            return torch.autograd.grad(loss, inputs)
        return loss


def bench_one(loss_fn, inputs, device, repeats, grad_enabled, backward):
    fn = lambda: step(loss_fn, inputs, grad_enabled, backward)  # noqa: E731
    result = time_repeats(fn, device, repeats)
    result["peak_bytes"] = peak_memory_bytes(fn, device)
    return result


def single_process_rows(args, impls, shapes):
    rows = []
    for rows_m, cols_k in shapes:
        inputs = make_inputs(rows_m, cols_k, args.dim, getattr(torch, args.dtype), args.device)
        for mode, grad_enabled, backward in MODES:
            for name, fn in impls.items():
                r = bench_one(fn, inputs, args.device, args.repeats, grad_enabled, backward)
                rows.append({"impl": name, "mode": mode, "batch": f"{rows_m}x{cols_k}", "dim": args.dim,
                             "dtype": args.dtype, **r})
                print(f"  {name:15s} {mode:18s} {rows_m}x{cols_k} {r['median_s'] * 1e3:10.1f} ms "
                      f"{r['peak_bytes'] / MIB:10.1f} MiB", file=sys.stderr, flush=True)
        del inputs
    add_ratios(rows)
    return rows


def cpu_impls():
    impls = {"clipshard": clipshard.SigLipLoss(), "clipshard_torch": clipshard.SigLipLoss(algorithm="torch"),
             "naive": naive_loss}
    open_clip_cls = open_clip_loss_class()
    if open_clip_cls is not None:
        impls["open_clip"] = open_clip_cls()
    return impls


def cuda_impls(blocks):
    """One rank of a world of `blocks`: its M images against all K = blocks * M texts."""
    def ours(image, text, scale, bias):
        return clipshard.siglip_sum(image, text, scale, bias, pos_offset=0) / image.shape[0]

    def portable(image, text, scale, bias):
        return clipshard.siglip_sum(image, text, scale, bias, pos_offset=0, algorithm="torch") / image.shape[0]

    impls = {"clipshard": ours, "clipshard_torch": portable}
    open_clip_cls = open_clip_loss_class()
    if open_clip_cls is not None:
        oc = open_clip_cls()

        def open_clip_eager(image, text, scale, bias):  # what its neighbour exchange computes, per block
            m = image.shape[0]
            loss = oc._loss(image, text[:m], scale, bias)
            for q in range(1, blocks):
                loss = loss + oc._loss(image, text[q * m:(q + 1) * m], scale, bias, negative_only=True)
            return loss

        impls["open_clip"] = open_clip_eager
    return impls


# --- world size > 1 (gloo) ------------------------------------------------------------------------

def _dist_rank(rank, world_size, port, args, results):
    try:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
        warnings.filterwarnings("ignore", category=FutureWarning)
        inputs = make_inputs(args.dist_batch, args.dist_batch, args.dim, torch.float32, "cpu", seed=rank)
        losses = {"clipshard": clipshard.SigLipLoss(rank=rank, world_size=world_size),
                  "clipshard ring": clipshard.SigLipLoss(rank=rank, world_size=world_size, mode="ring")}
        open_clip_cls = open_clip_loss_class()
        if open_clip_cls is not None:
            losses["open_clip"] = open_clip_cls(rank=rank, world_size=world_size)

        def run(loss_fn):
            dist.barrier()
            return lambda: step(loss_fn, inputs, True, True)

        times = {name: [] for name in losses}
        for k in range(args.steps + 1):  # interleaved, so that a busy machine slows both alike
            for name, loss_fn in losses.items():
                seconds = time_call(run(loss_fn), "cpu")
                if k > 0:
                    times[name].append(seconds)
        out = {name: {**summarize(times[name]), "peak_bytes": peak_memory_bytes(run(fn), "cpu")}
               for name, fn in losses.items()}
        results.put((rank, out))
    except BaseException:  # noqa: BLE001 (report to the parent instead of hanging it)
        results.put((rank, {"error": traceback.format_exc()}))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def distributed_rows(args):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = [ctx.Process(target=_dist_rank, args=(r, args.world_size, port, args, results))
             for r in range(args.world_size)]
    for proc in procs:
        proc.start()
    per_rank = dict(results.get(timeout=args.timeout) for _ in range(args.world_size))
    for proc in procs:
        proc.join(timeout=30)
    rows = []
    for rank in range(args.world_size):
        res = per_rank[rank]
        if "error" in res:
            raise RuntimeError(f"rank {rank} failed:\n{res['error']}")
        base = res.get("open_clip")
        for name, m in res.items():
            rows.append({"impl": name, "rank": rank, **m,
                         "time_vs_open_clip": m["median_s"] / base["median_s"] if base else None,
                         "mem_vs_open_clip": m["peak_bytes"] / base["peak_bytes"] if base else None})
    return rows


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", help="CPU: batch sizes B (default 4096 8192)")
    parser.add_argument("--dim", type=int, default=None, help="feature size D (default 512 on CPU, 768 on CUDA)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="default float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (default 5 on CPU, 10 on CUDA)")
    parser.add_argument("--cuda-rows", type=int, default=8192, help="CUDA: rows M (one rank's batch)")
    parser.add_argument("--cuda-blocks", type=int, default=8, help="CUDA: K = blocks * M columns (world size)")
    parser.add_argument("--world-size", type=int, default=2, help="CPU: gloo ranks for the distributed part (0: skip)")
    parser.add_argument("--dist-batch", type=int, default=4096, help="CPU: local batch per rank, distributed part")
    parser.add_argument("--steps", type=int, default=3, help="timed steps of the distributed part")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--distributed-only", action="store_true", help="CPU: only the gloo part")
    args = parser.parse_args()
    require_device("bench_siglip", args.device)
    cuda = args.device == "cuda"
    args.dim = args.dim or (768 if cuda else 512)
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.repeats = args.repeats or (10 if cuda else 5)
    if cuda:
        shapes = [(args.cuda_rows, args.cuda_rows * args.cuda_blocks)]
        impls = cuda_impls(args.cuda_blocks)
    else:
        shapes = [(b, b) for b in (args.sizes or [4096, 8192])]
        impls = cpu_impls()

    rows = [] if args.distributed_only else single_process_rows(args, impls, shapes)
    if rows:
        print_table([
            ("rows x cols", lambda r: r["batch"]),
            ("mode", lambda r: r["mode"], "<"),
            ("impl", lambda r: r["impl"], "<"),
            *comparison_columns(),
        ], rows, title=f"\nSigLIP loss, one process ({args.device}, {torch.get_num_threads()} threads), D={args.dim}, "
                       f"{args.dtype}, scale 10, bias -10; median of {args.repeats}; memory = peak bytes the loss allocates")
    report = {"meta": {**run_metadata(args.device), "repeats": args.repeats}, "results": rows}

    if not cuda and args.world_size > 1:
        dist_rows = distributed_rows(args)
        print_table([
            ("impl", lambda r: r["impl"], "<"),
            ("rank", lambda r: str(r["rank"])),
            ("median s", lambda r: f"{r['median_s']:.3f}"),
            ("p20-p80 s", lambda r: f"{r['p20_s']:.3f}-{r['p80_s']:.3f}"),
            ("peak MiB", lambda r: f"{r['peak_bytes'] / MIB:.1f}"),
            ("time/oc", lambda r: fmt(r["time_vs_open_clip"], ".3f")),
            ("mem/oc", lambda r: fmt(r["mem_vs_open_clip"], ".4f")),
        ], dist_rows, title=f"\nSigLIP loss, gloo world size {args.world_size} (one thread per rank), B_local="
                            f"{args.dist_batch}, D={args.dim}, fp32, forward + backward; median of {args.steps} steps")
        report["distributed"] = {"world_size": args.world_size, "batch_local": args.dist_batch, "rows": dist_rows}
    write_json(args.json, report)


if __name__ == "__main__":
    main()
