"""One rank's work in the sharded contrastive loss, on one device ("rank simulation").

A rank of 8 holds M = 8192 local rows and sees K = 65536 gathered columns (D = 768, bf16). This
script times (median, 20/80 % quantiles) and measures the peak extra memory (benchmarks/_measure.py) of
  - clipshard's op (torch.ops.clipshard.contrastive_lse_forward / _backward, row + column LSE),
    both algorithms: "chunked" (cuBLAS GEMMs over column chunks + fused elementwise kernels, the
    CUDA default) and "fused" (hand-written tile kernels); on CUDA also the chunked path with each
    variant of its forward kernel (32 or 16 rows per CTA; which is faster decides the default);
  - clipshard.contrastive_lse(..., algorithm="torch"), the pure-PyTorch chunked path, with autograd;
  - the materialised equivalent: logits = s * A @ B^T, row/column logsumexp and their backward;
  - open_clip's local loss doing the same work: two M x K logit blocks and two cross-entropies;
  - one plain M x K x D matmul (cuBLAS on CUDA), the rate every TFLOP/s figure is compared with;
  - ring mode's work on one rank (clipshard/parallel/ring.py) without the transfers: the K columns as K / M
    blocks of M, each computed forward and backward by the op, with the buffers ring mode keeps
    (the block in flight, the travelling column LSE and fp32 column gradient). Its peak memory is
    per-rank ring memory at any world size (it does not depend on K); exchange's is the op's.
TFLOP/s counts useful FLOPs, the same for every implementation: a forward is 2 GEMM-equivalents
(the row and the column log-sum-exps, as open_clip computes them), a backward 3 more (2MKD each),
over the measured time; "x matmul" compares that rate with the plain GEMM's.

Usage: bench_rank_sim.py --device {cpu,cuda} [--json PATH]. On CPU a scaled-down fp32 size runs.
"""
import os
import sys

import torch
import torch.nn.functional as F

import clipshard  # noqa: F401  (loads torch.ops.clipshard)
from clipshard.ops._workspace import workspace_bytes
from clipshard.ops._algorithm import resolve as resolve_algorithm
from clipshard.ops.contrastive_lse import ALGORITHMS

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (fmt, parser_with_common_arguments, peak_memory_bytes, print_table,  # noqa: E402
                      require_device, run_metadata, time_call, time_repeats, write_json)

SIZES = {
    "cuda": dict(M=8192, K=65536, D=768, dtype=torch.bfloat16),
    "cpu": dict(M=512, K=4096, D=256, dtype=torch.float32),
}
ops = torch.ops.clipshard


def has_kernel(device):
    key = "CUDA" if device == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key("clipshard::contrastive_lse_forward", key)


def measure(fn, device, budget_s=1.5, min_reps=3, max_reps=20):
    """Time of about budget_s worth of calls (median, 20/80 % quantiles) and the peak memory of one
    call above what was allocated before it."""
    first = time_call(fn, device)  # warm-up (and first-call allocations); sets the number of repeats
    reps = max(min_reps, min(max_reps, int(budget_s / max(first, 1e-6))))
    result = time_repeats(fn, device, reps, warmup=0)
    result["peak_extra_bytes"] = peak_memory_bytes(fn, device)
    return result


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
                g_row=g_row, g_pos=g_pos, g_col=g_col, workspace=workspace_bytes("bench_rank_sim", device))


def op_forward(p, algorithm):
    return ops.contrastive_lse_forward(p["rows"], p["cols"], p["scale"], None, p["pos"], None, None, True,
                                       algorithm, p["workspace"])


def op_forward_backward(p, algorithm):
    row_lse, _, col_lse = op_forward(p, algorithm)
    return ops.contrastive_lse_backward(p["g_row"], p["g_pos"], p["g_col"], p["rows"], p["cols"],
                                        p["scale"], None, p["pos"], None, None, row_lse, col_lse, algorithm,
                                        p["workspace"])


FORWARD_ROWS_ENV = "CLIPSHARD_CHUNKED_FORWARD_ROWS"  # read by the chunked CUDA forward at every call


def with_forward_rows(rows_per_cta, fn):
    """fn, run with the chunked CUDA forward kernel variant of rows_per_cta rows per CTA."""
    def call():
        saved = os.environ.get(FORWARD_ROWS_ENV)
        os.environ[FORWARD_ROWS_ENV] = rows_per_cta
        try:
            return fn()
        finally:
            if saved is None:
                os.environ.pop(FORWARD_ROWS_ENV)
            else:
                os.environ[FORWARD_ROWS_ENV] = saved
    return call


def torch_path_forward(p, leaves=None):
    rows, cols, scale = leaves or (p["rows"], p["cols"], p["scale"])
    return clipshard.contrastive_lse(rows, cols, scale, None, p["pos"], True, algorithm="torch")


def torch_path_forward_backward(p):
    leaves = [t.detach().requires_grad_() for t in (p["rows"], p["cols"], p["scale"])]
    row_lse, pos_logit, col_lse = torch_path_forward(p, leaves)
    loss = (row_lse * p["g_row"]).sum() + (pos_logit * p["g_pos"]).sum() + (col_lse * p["g_col"]).sum()
    return torch.autograd.grad(loss, leaves)


def print_comparisons(results):
    """The two decisions the first GPU run makes: which forward kernel variant becomes the default,
    and whether the torch path is within 1.5x of the chunked CUDA path."""
    median = {r["name"]: r["median_s"] for r in results if "median_s" in r}
    for mode in ("fwd", "fwd+bwd"):
        wide, narrow = (median.get(f"clipshard chunked {mode}, {n}-row forward kernel") for n in (32, 16))
        if wide and narrow:
            faster, ratio = (16, wide / narrow) if narrow < wide else (32, narrow / wide)
            print(f"chunked forward kernel, {mode}: 32 rows/CTA {wide * 1e3:.3f} ms, 16 rows/CTA "
                  f"{narrow * 1e3:.3f} ms: {faster} rows is faster by {ratio:.3f}x (the default is "
                  "kChunkedForwardRowsDefault in csrc/include/clipshard/launch_rules.h)")
        chunked, portable = median.get(f"clipshard chunked {mode}"), median.get(f"clipshard torch {mode}")
        if chunked and portable:
            print(f"torch path / chunked CUDA path, {mode}: {portable / chunked:.3f}x (target <= 1.5)")


def ring_forward_backward(p, algorithm):
    """One rank's ring-mode work on K / M blocks of M columns, transfers replaced by copies."""
    rows, M = p["rows"], p["rows"].shape[0]
    blocks = p["cols"].split(M)
    acc = torch.float32
    row_lse, columns = None, []
    for block in blocks:  # forward: row LSE folded online, column accumulator passed on
        in_flight = block.clone()  # the next block, received while this one is computed
        row, _, col = ops.contrastive_lse_forward(rows, block, p["scale"], None, 0, None, None, True, algorithm,
                                                  p["workspace"])
        row_lse = row if row_lse is None else torch.logaddexp(row_lse, row)
        # the travelling accumulator and its received copy; the K floats kept stand in for the full
        # column LSEs that travel with the blocks in backward
        columns.append(torch.logaddexp(col, col.clone()))
        del in_flight
    grad_rows = torch.zeros(rows.shape, dtype=acc, device=rows.device)
    for block, column in zip(blocks, columns):  # backward: recompute, travelling fp32 column gradient
        in_flight = block.clone()
        d_rows, d_cols, _, _ = ops.contrastive_lse_backward(
            p["g_row"], p["g_pos"], p["g_col"][:M], rows, block, p["scale"], None, 0, None, None, row_lse, column, algorithm,
            p["workspace"])
        grad_rows += d_rows
        travelling = torch.zeros(block.shape, dtype=acc, device=rows.device).add_(d_cols)  # received + own
        del in_flight, travelling
    return grad_rows


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
    args = parser_with_common_arguments(__doc__).parse_args()
    device = args.device
    require_device("bench_rank_sim", device)
    size = SIZES[device]
    M, K, D, dtype = size["M"], size["K"], size["D"], size["dtype"]
    p = make_problem(M, K, D, dtype, device)
    block = 2 * M * K * D  # FLOPs of one M x K logit block
    default_algorithm = resolve_algorithm("contrastive_lse", "auto", torch.device(device), ALGORITHMS)

    configs = [("matmul M x K x D (reference rate)", lambda: p["rows"] @ p["cols"].T, block, None)]
    for algorithm in ("chunked", "fused"):
        configs.append((f"clipshard {algorithm} fwd", lambda a=algorithm: op_forward(p, a), 2 * block, "fwd"))
        configs.append((f"clipshard {algorithm} fwd+bwd", lambda a=algorithm: op_forward_backward(p, a),
                        5 * block, "fwd+bwd"))
    if device == "cuda":
        for n in ("32", "16"):
            configs.append((f"clipshard chunked fwd, {n}-row forward kernel",
                            with_forward_rows(n, lambda: op_forward(p, "chunked")), 2 * block, "fwd"))
            configs.append((f"clipshard chunked fwd+bwd, {n}-row forward kernel",
                            with_forward_rows(n, lambda: op_forward_backward(p, "chunked")), 5 * block, "fwd+bwd"))
    configs.append(("clipshard torch fwd", lambda: torch_path_forward(p), 2 * block, "fwd"))
    configs.append(("clipshard torch fwd+bwd", lambda: torch_path_forward_backward(p), 5 * block, "fwd+bwd"))
    if K % M == 0:
        configs.append((f"clipshard ring, {K // M} blocks, fwd+bwd", lambda: ring_forward_backward(p, default_algorithm),
                        5 * block, "fwd+bwd"))
    configs += [
        ("materialised fwd", lambda: materialised_lse(p["rows"], p["cols"], p["scale"], p["pos"]), 2 * block, "fwd"),
        ("materialised fwd+bwd", lambda: materialised_forward_backward(p), 5 * block, "fwd+bwd"),
        ("open_clip local fwd", lambda: local_forward(p), 2 * block, "fwd"),
        ("open_clip local fwd+bwd", lambda: local_forward_backward(p), 5 * block, "fwd+bwd"),
    ]

    results, failed = [], False
    for name, fn, flops, mode in configs:
        row = dict(name=name, mode=mode, flops=flops)
        if name.startswith("clipshard") and "torch" not in name and not has_kernel(device):
            row["error"] = f"no {device.upper()} kernel registered in this build"
        else:
            try:
                row.update(measure(fn, device))
                row["tflops"] = flops / row["median_s"] / 1e12
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
        if base and base["peak_extra_bytes"]:
            r["memory_vs_local"] = r["peak_extra_bytes"] / base["peak_extra_bytes"]

    title = f"rank simulation on {device}: M={M}, K={K}, D={D}, {str(dtype).replace('torch.', '')}"
    if device == "cuda":
        title += f", {torch.cuda.get_device_name()}"
    timed = lambda cell: lambda r: cell(r) if "median_s" in r else "error"  # noqa: E731
    print_table([
        ("config", lambda r: r["name"], "<"),
        ("median ms", timed(lambda r: f"{r['median_s'] * 1e3:.2f}")),
        ("p20-p80 ms", timed(lambda r: f"{r['p20_s'] * 1e3:.2f}-{r['p80_s'] * 1e3:.2f}")),
        ("TFLOP/s", timed(lambda r: f"{r['tflops']:.3f}")),
        ("x matmul", timed(lambda r: fmt(r["fraction_of_matmul_rate"], ".3f"))),
        ("peak MiB", timed(lambda r: f"{r['peak_extra_bytes'] / 2**20:.1f}")),
        ("x local", timed(lambda r: fmt(r["speedup_vs_local"], ".2f"))),
        ("mem/local", timed(lambda r: fmt(r.get("memory_vs_local"), ".4f"))),
    ], results, title=title)
    for r in results:
        if "error" in r:
            print(f"error in {r['name']}: {r['error']}")
    print("TFLOP/s: useful FLOPs (2 GEMM-equivalents of 2MKD forward, 5 forward + backward) over the time; "
          "x matmul: fraction of the plain matmul rate; x local: open_clip local time / this time; "
          "peak MiB: above inputs, outputs included")
    print_comparisons(results)
    write_json(args.json, dict(**run_metadata(device), M=M, K=K, D=D, dtype=str(dtype), results=results))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
