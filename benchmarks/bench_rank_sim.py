"""One rank's work in the sharded contrastive loss, on one device ("rank simulation").

A rank of 8 holds M = 8192 local rows and sees K = 65536 gathered columns (D = 768, bf16). This
script times (median of CUDA events, 20/80 % quantiles) and measures the peak extra memory of
  - the fused op (torch.ops.clipshard.contrastive_lse_forward / _backward, row + column LSE),
    both kernel paths (tensor_cores False / True);
  - the materialised equivalent: logits = s * A @ B^T, row/column logsumexp and their backward;
  - open_clip's local loss doing the same work: two M x K logit blocks and two cross-entropies;
  - one plain M x K x D matmul (cuBLAS on CUDA), the rate every TFLOP/s figure is compared with.
TFLOP/s counts matmul FLOPs of the maths, not of the implementation: 2MKD per M x K logit block
forward, three times that forward + backward (S, dA, dB).

Usage: bench_rank_sim.py --device {cpu,cuda} [--json PATH]. On CPU a scaled-down fp32 size runs.
"""
import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import clipshard  # noqa: F401  (loads torch.ops.clipshard)

SIZES = {
    "cuda": dict(M=8192, K=65536, D=768, dtype=torch.bfloat16),
    "cpu": dict(M=512, K=4096, D=256, dtype=torch.float32),
}
ops = torch.ops.clipshard


def has_kernel(device):
    key = "CUDA" if device == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key("clipshard::contrastive_lse_forward", key)


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(fn, device, budget_s=1.5, min_reps=3, max_reps=20):
    """(median, q20, q80) seconds and peak memory above what was allocated before the call."""
    sync(device)
    start = time.perf_counter()
    fn()  # warm-up (and first-call allocations)
    sync(device)
    first = time.perf_counter() - start
    peak = None
    if device == "cuda":
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del out
    reps = max(min_reps, min(max_reps, int(budget_s / max(first, 1e-6))))
    times = []
    for _ in range(reps):
        if device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(begin.elapsed_time(end) / 1e3)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    q = statistics.quantiles(times, n=10) if len(times) > 1 else [times[0]] * 9
    return statistics.median(times), q[1], q[7], peak


def make_problem(M, K, D, dtype, device):
    gen = torch.Generator(device=device).manual_seed(0)
    unit = lambda n: F.normalize(torch.randn(n, D, generator=gen, device=device), dim=1).to(dtype)  # noqa: E731
    rows, cols, gathered_rows = unit(M), unit(K), unit(K)
    scale = torch.tensor(14.3, device=device)
    pos = K // 2 - M // 2 if K >= M else 0  # this rank's positives sit mid-way in the gathered columns
    # Upstream gradients of open_clip's per-rank loss: 1/(2M) on each LSE, -1/M on the positives.
    g_row = torch.full((M,), 0.5 / M, device=device)
    g_pos = torch.full((M,), -1.0 / M, device=device)
    g_col = torch.zeros(K, device=device)
    g_col[pos:pos + M] = 0.5 / M
    return dict(rows=rows, cols=cols, gathered_rows=gathered_rows, scale=scale, pos=pos,
                g_row=g_row, g_pos=g_pos, g_col=g_col)


def fused_forward(p, tensor_cores):
    return ops.contrastive_lse_forward(p["rows"], p["cols"], p["scale"], None, p["pos"], True,
                                       False, tensor_cores)


def fused_forward_backward(p, tensor_cores):
    row_lse, _, col_lse = fused_forward(p, tensor_cores)
    return ops.contrastive_lse_backward(p["g_row"], p["g_pos"], p["g_col"], p["rows"], p["cols"],
                                        p["scale"], None, p["pos"], row_lse, col_lse, False,
                                        tensor_cores, True)


def materialised_lse(rows, cols, scale, pos):
    logits = scale * rows @ cols.T  # the input dtype, as under autocast
    wide = logits.float()  # what autocast's fp32 log-softmax does
    index = torch.arange(rows.shape[0], device=rows.device)
    return torch.logsumexp(wide, 1), wide[index, pos + index], torch.logsumexp(wide, 0)


def materialised_forward_backward(p):
    leaves = [t.detach().requires_grad_() for t in (p["rows"], p["cols"], p["scale"])]
    row_lse, pos_logit, col_lse = materialised_lse(*leaves, p["pos"])
    loss = (row_lse * p["g_row"]).sum() + (pos_logit * p["g_pos"]).sum() + (col_lse * p["g_col"]).sum()
    return torch.autograd.grad(loss, leaves)


def local_loss(image, text, image_all, text_all, scale, pos):
    """open_clip ClipLoss(local_loss=True) on one rank: rows of this rank against all columns."""
    labels = torch.arange(image.shape[0], device=image.device) + pos
    per_image = scale * image @ text_all.T
    per_text = scale * text @ image_all.T
    return (F.cross_entropy(per_image.float(), labels) + F.cross_entropy(per_text.float(), labels)) / 2


def local_forward(p):
    text = p["cols"][p["pos"]:p["pos"] + p["rows"].shape[0]]
    return local_loss(p["rows"], text, p["gathered_rows"], p["cols"], p["scale"], p["pos"])


def local_forward_backward(p):
    leaves = [t.detach().requires_grad_() for t in (p["rows"], p["cols"], p["gathered_rows"], p["scale"])]
    rows, cols, gathered, scale = leaves
    text = cols[p["pos"]:p["pos"] + rows.shape[0]]
    loss = local_loss(rows, text, gathered, cols, scale, p["pos"])
    return torch.autograd.grad(loss, leaves)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_rank_sim: --device cuda but no CUDA device is available")
    size = SIZES[device]
    M, K, D, dtype = size["M"], size["K"], size["D"], size["dtype"]
    p = make_problem(M, K, D, dtype, device)
    block = 2 * M * K * D  # FLOPs of one M x K logit block

    configs = [("matmul M x K x D (reference rate)", lambda: p["rows"] @ p["cols"].T, block, None)]
    paths = [False, True] if device == "cuda" else [False]
    for tc in paths:
        tag = "tensor-core" if tc else "fma"
        configs.append((f"fused fwd ({tag})", lambda tc=tc: fused_forward(p, tc), block, "fwd"))
        configs.append((f"fused fwd+bwd ({tag})", lambda tc=tc: fused_forward_backward(p, tc),
                        3 * block, "fwd+bwd"))
    configs += [
        ("materialised fwd", lambda: materialised_lse(p["rows"], p["cols"], p["scale"], p["pos"]), block, "fwd"),
        ("materialised fwd+bwd", lambda: materialised_forward_backward(p), 3 * block, "fwd+bwd"),
        ("open_clip local fwd", lambda: local_forward(p), 2 * block, "fwd"),
        ("open_clip local fwd+bwd", lambda: local_forward_backward(p), 6 * block, "fwd+bwd"),
    ]

    results, failed = [], False
    for name, fn, flops, mode in configs:
        row = dict(name=name, mode=mode, flops=flops)
        if name.startswith("fused") and not has_kernel(device):
            row["error"] = f"no {device.upper()} kernel registered in this build"
        else:
            try:
                median, q20, q80, peak = measure(fn, device)
                row.update(median_s=median, q20_s=q20, q80_s=q80, peak_extra_bytes=peak,
                           tflops=flops / median / 1e12)
            except Exception as err:  # report every configuration, fail at the end
                row["error"] = f"{type(err).__name__}: {err}"
                failed = True
        results.append(row)
        if device == "cuda":
            torch.cuda.empty_cache()

    rate = results[0].get("tflops")
    local = {r["mode"]: r for r in results if r["name"].startswith("open_clip") and "median_s" in r}
    for r in results:
        if "median_s" not in r:
            continue
        r["fraction_of_matmul_rate"] = r["tflops"] / rate if rate else None
        base = local.get(r["mode"])
        r["speedup_vs_local"] = base["median_s"] / r["median_s"] if base else None
        if base and base.get("peak_extra_bytes") and r["peak_extra_bytes"] is not None:
            r["memory_vs_local"] = r["peak_extra_bytes"] / base["peak_extra_bytes"]

    title = f"rank simulation on {device}: M={M}, K={K}, D={D}, {str(dtype).replace('torch.', '')}"
    if device == "cuda":
        title += f", {torch.cuda.get_device_name()}"
    print(title)
    header = f"{'config':36s} {'median ms':>10s} {'q20-q80 ms':>15s} {'TFLOP/s':>8s} {'x matmul':>8s} {'peak MiB':>9s} {'x local':>8s} {'mem/local':>9s}"
    print(header)
    print("-" * len(header))
    fmt = lambda v, f: (f.format(v) if v is not None else "n/a")  # noqa: E731
    for r in results:
        if "median_s" not in r:
            print(f"{r['name']:36s} {r['error']}")
            continue
        peak = r["peak_extra_bytes"] / 2**20 if r["peak_extra_bytes"] is not None else None
        print(f"{r['name']:36s} {r['median_s'] * 1e3:10.2f} "
              f"{r['q20_s'] * 1e3:7.2f}-{r['q80_s'] * 1e3:<7.2f} {r['tflops']:8.3f} "
              f"{fmt(r['fraction_of_matmul_rate'], '{:8.3f}'):>8s} {fmt(peak, '{:9.1f}'):>9s} "
              f"{fmt(r['speedup_vs_local'], '{:8.2f}'):>8s} {fmt(r.get('memory_vs_local'), '{:9.4f}'):>9s}")
    print("TFLOP/s: 2MKD per logit block (x3 for fwd+bwd); x matmul: fraction of the plain matmul "
          "rate; x local: open_clip local time / this time; peak MiB: above inputs, outputs included")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(device=device, M=M, K=K, D=D, dtype=str(dtype),
                           gpu=torch.cuda.get_device_name() if device == "cuda" else None,
                           torch=torch.__version__, results=results), fh, indent=2)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
