"""Benchmark of clipshard.optim.AdamW: memory per parameter and step time.

1. Bytes per parameter of weights, gradients and optimizer state, measured from the tensors each
   setup actually holds after one step: clipshard with bf16 weights and bf16 states (no master
   copy), torch.optim.AdamW on fp32 weights, and the usual mixed-precision setup (bf16 weights, an
   fp32 master copy, fp32 moments).
2. Median step time (20/80 % quantiles) at several model sizes, for clipshard (bf16/bf16 and
   fp32/fp32) and torch.optim.AdamW (foreach and fused, fp32; foreach on bf16 weights with
   round-to-nearest), with the effective bandwidth: the bytes one fused pass must move (read
   weight, grad, both moments; write weight and moments) over the step time, the bytes each setup
   holds (weights, grads, state) and the peak memory one step allocates beyond them
   (benchmarks/_measure.py). On CUDA also the device's measured copy bandwidth and the fraction of
   it each optimizer achieves.
Usage: python benchmarks/bench_optim.py --device {cpu,cuda} [--json PATH] [--sizes 10e6 50e6]
"""
import os
import sys

import torch

import clipshard  # noqa: F401
from clipshard.optim import AdamW

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (fmt, parser_with_common_arguments, peak_memory_bytes, print_table,  # noqa: E402
                      require_device, run_metadata, time_repeats, write_json)


def model_tensors(total, dtype, device, seed=0):
    """~`total` parameters split like a transformer: many matrices plus small vectors."""
    gen = torch.Generator().manual_seed(seed)
    big = max(total // 64, 1)
    sizes = [big] * 60 + [1024 + 37 * i for i in range(40)]
    sizes.append(max(total - sum(sizes), 1))
    params = [(torch.randn(n, generator=gen) * 0.02).to(device=device, dtype=dtype).requires_grad_()
              for n in sizes]
    for p in params:
        p.grad = (torch.randn(p.numel(), generator=gen) * 1e-3).to(device=device, dtype=dtype)
    return params


def tensor_bytes(tensors):
    return sum(t.numel() * t.element_size() for t in tensors)


def state_tensors(opt):
    return [v for s in opt.state.values() for k, v in s.items() if k != "step" and torch.is_tensor(v)]


def bytes_per_parameter(device):
    """Measured from the tensors each setup holds after one step."""
    n = 1_000_000
    rows = {}
    params = model_tensors(n, torch.bfloat16, device)
    opt = AdamW(params)
    opt.step()
    count = sum(p.numel() for p in params)
    rows["clipshard AdamW, bf16 weights + bf16 states"] = (
        tensor_bytes(params), tensor_bytes([p.grad for p in params]), tensor_bytes(state_tensors(opt)), count)
    params = model_tensors(n, torch.float32, device)
    opt = torch.optim.AdamW(params)
    opt.step()
    rows["torch AdamW, fp32 weights + fp32 states"] = (
        tensor_bytes(params), tensor_bytes([p.grad for p in params]), tensor_bytes(state_tensors(opt)), count)
    params = model_tensors(n, torch.bfloat16, device)
    master = [p.detach().float().requires_grad_() for p in params]
    for m, p in zip(master, params):
        m.grad = p.grad.float()
    opt = torch.optim.AdamW(master)
    opt.step()
    rows["mixed precision: bf16 weights + fp32 master + fp32 states"] = (
        tensor_bytes(params), tensor_bytes([p.grad for p in params]),
        tensor_bytes(master) + tensor_bytes(state_tensors(opt)), count)
    out = {}
    for name, (weights, grads, state, count) in rows.items():
        out[name] = {"weights": weights / count, "grads": grads / count, "optimizer_state": state / count,
                     "weights_plus_state": (weights + state) / count,
                     "weights_grads_state": (weights + grads + state) / count}
    return out


def copy_bandwidth(device):
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(256 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = time_repeats(lambda: dst.copy_(src), device, repeats=10, warmup=3)["median_s"]
    return 2 * src.numel() * src.element_size() / seconds


def configs():
    """(name, param dtype, bytes per parameter, bytes per state element, make optimizer)."""
    yield "clipshard bf16/bf16 SR", torch.bfloat16, 2, 2, lambda ps: AdamW(ps)
    yield "clipshard fp32/fp32", torch.float32, 4, 4, lambda ps: AdamW(ps)
    yield "torch foreach fp32", torch.float32, 4, 4, lambda ps: torch.optim.AdamW(ps, foreach=True)
    yield "torch fused fp32", torch.float32, 4, 4, lambda ps: torch.optim.AdamW(ps, fused=True)
    yield "torch foreach bf16 RN", torch.bfloat16, 2, 2, lambda ps: torch.optim.AdamW(ps, foreach=True)


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--sizes", type=float, nargs="+", default=None,
                        help="model sizes in parameters (default: 10e6 50e6 on CPU, 10e6 100e6 on CUDA)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    require_device("bench_optim", args.device)
    device = torch.device(args.device)
    sizes = [int(s) for s in (args.sizes or ([10e6, 100e6] if device.type == "cuda" else [10e6, 50e6]))]
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    result = run_metadata(device)

    result["bytes_per_parameter"] = bytes_per_parameter(device)
    print_table([
        ("setup", lambda item: item[0], "<"),
        ("weights", lambda item: f"{item[1]['weights']:.2f}"),
        ("grads", lambda item: f"{item[1]['grads']:.2f}"),
        ("state", lambda item: f"{item[1]['optimizer_state']:.2f}"),
        ("w+state", lambda item: f"{item[1]['weights_plus_state']:.2f}"),
        ("w+g+state", lambda item: f"{item[1]['weights_grads_state']:.2f}"),
    ], list(result["bytes_per_parameter"].items()),
        title="bytes per parameter (measured from the tensors held after one step)")

    copy_bw = copy_bandwidth(device) if device.type == "cuda" else None
    result["copy_bandwidth_GBps"] = copy_bw / 1e9 if copy_bw else None
    rows = []
    for size in sizes:
        for name, dtype, param_bytes, state_bytes, make in configs():
            params = model_tensors(size, dtype, device)
            try:
                opt = make(params)
                row = time_repeats(opt.step, device, repeats, warmup=2)
            except (RuntimeError, NotImplementedError) as error:  # e.g. fused unsupported here
                print(f"{name} at {size:.0e}: skipped ({str(error).splitlines()[0]})")
                continue
            count = sum(p.numel() for p in params)
            moved = count * (3 * param_bytes + 4 * state_bytes)  # read p, g, m, v; write p, m, v
            row.update(size=count, optimizer=name, effective_GBps=moved / row["median_s"] / 1e9,
                       held_bytes=tensor_bytes(params + [p.grad for p in params] + state_tensors(opt)),
                       step_peak_extra_bytes=peak_memory_bytes(opt.step, device))
            if copy_bw:
                row["fraction_of_copy_bandwidth"] = moved / row["median_s"] / copy_bw
            rows.append(row)
            del opt, params
    result["step_times"] = rows
    for row in rows:
        base = next((r for r in rows if r["size"] == row["size"] and r["optimizer"] == "torch foreach fp32"), None)
        row["speedup_vs_torch_foreach_fp32"] = base["median_s"] / row["median_s"] if base else None

    columns = [
        ("params", lambda r: f"{r['size']:,}"),
        ("optimizer", lambda r: r["optimizer"], "<"),
        ("median ms", lambda r: f"{r['median_s'] * 1e3:.2f}"),
        ("[p20, p80] ms", lambda r: f"[{r['p20_s'] * 1e3:.2f}, {r['p80_s'] * 1e3:.2f}]"),
        ("GB/s", lambda r: f"{r['effective_GBps']:.1f}"),
        ("vs torch foreach fp32", lambda r: fmt(r["speedup_vs_torch_foreach_fp32"], ".2f") + "x"),
        ("held MiB", lambda r: f"{r['held_bytes'] / 2**20:.0f}"),
        ("step extra MiB", lambda r: f"{r['step_peak_extra_bytes'] / 2**20:.1f}"),
    ]
    if copy_bw:
        columns.append(("frac of copy bw", lambda r: f"{r['fraction_of_copy_bandwidth']:.0%}"))
    title = (f"\nstep time on {device} ({result['threads']} threads), median of {repeats} [20%, 80%]; "
             "effective bandwidth = minimal bytes of one fused pass / time; held = weights + grads + "
             "state; step extra = peak memory one step allocates beyond them")
    if copy_bw:
        title += f"\ndevice copy bandwidth: {copy_bw / 1e9:.0f} GB/s"
    print_table(columns, rows, title=title)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
