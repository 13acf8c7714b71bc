"""Benchmark of clipshard.optim.AdamW: memory per parameter and step time.

1. Bytes per parameter of weights, gradients and optimizer state, measured from the tensors each
   setup actually holds after one step: clipshard with bf16 weights and bf16 states (no master
   copy), torch.optim.AdamW on fp32 weights, and the usual mixed-precision setup (bf16 weights, an
   fp32 master copy, fp32 moments).
2. Median step time (20/80 % quantiles) at several model sizes, for clipshard (bf16/bf16 and
   fp32/fp32) and torch.optim.AdamW (foreach and fused, fp32; foreach on bf16 weights with
   round-to-nearest), with the effective bandwidth: the bytes one fused pass must move (read
   weight, grad, both moments; write weight and moments) over the step time. On CUDA also the
   device's measured copy bandwidth and the fraction of it each optimizer achieves.
Usage: python benchmarks/bench_optim.py --device {cpu,cuda} [--json PATH] [--sizes 10e6 50e6]
"""
import argparse
import json
import statistics
import time

import torch

import clipshard  # noqa: F401
from clipshard.optim import AdamW


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


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_steps(opt, device, repeats, warmup=2):
    for _ in range(warmup):
        opt.step()
    synchronize(device)
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            opt.step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            opt.step()
            times.append(time.perf_counter() - t0)
    q = statistics.quantiles(times, n=5) if len(times) > 1 else times * 4
    return statistics.median(times), q[0], q[3]


def copy_bandwidth(device):
    """Bytes read + written per second by a large device-to-device copy."""
    src = torch.empty(256 * 2**20, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    synchronize(device)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def configs(device):
    fused_ok = True
    yield "clipshard bf16/bf16 SR", torch.bfloat16, 2, 2, lambda ps: AdamW(ps)
    yield "clipshard fp32/fp32", torch.float32, 4, 4, lambda ps: AdamW(ps)
    yield "torch foreach fp32", torch.float32, 4, 4, lambda ps: torch.optim.AdamW(ps, foreach=True)
    if fused_ok:
        yield "torch fused fp32", torch.float32, 4, 4, lambda ps: torch.optim.AdamW(ps, fused=True)
    yield "torch foreach bf16 RN", torch.bfloat16, 2, 2, lambda ps: torch.optim.AdamW(ps, foreach=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", default=None)
    parser.add_argument("--sizes", type=float, nargs="+", default=None,
                        help="model sizes in parameters (default: 10e6 50e6 on CPU, 10e6 100e6 on CUDA)")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_optim: --device cuda but no CUDA device is available")
    sizes = [int(s) for s in (args.sizes or ([10e6, 100e6] if device.type == "cuda" else [10e6, 50e6]))]
    repeats = args.repeats or (20 if device.type == "cuda" else 5)
    result = {"device": str(device), "torch": torch.__version__, "threads": torch.get_num_threads()}
    if device.type == "cuda":
        result["gpu"] = torch.cuda.get_device_name(device)

    result["bytes_per_parameter"] = bytes_per_parameter(device)
    print("bytes per parameter (measured from the tensors held after one step)")
    print(f"{'setup':58} {'weights':>8} {'grads':>6} {'state':>6} {'w+state':>8} {'w+g+state':>10}")
    for name, r in result["bytes_per_parameter"].items():
        print(f"{name:58} {r['weights']:8.2f} {r['grads']:6.2f} {r['optimizer_state']:6.2f} "
              f"{r['weights_plus_state']:8.2f} {r['weights_grads_state']:10.2f}")

    copy_bw = copy_bandwidth(device) if device.type == "cuda" else None
    result["copy_bandwidth_GBps"] = copy_bw / 1e9 if copy_bw else None
    rows = []
    for size in sizes:
        for name, dtype, param_bytes, state_bytes, make in configs(device):
            params = model_tensors(size, dtype, device)
            try:
                opt = make(params)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                median, q20, q80 = time_steps(opt, device, repeats)
            except (RuntimeError, NotImplementedError) as error:  # e.g. fused unsupported here
                print(f"{name} at {size:.0e}: skipped ({str(error).splitlines()[0]})")
                continue
            count = sum(p.numel() for p in params)
            moved = count * (3 * param_bytes + 4 * state_bytes)  # read p, g, m, v; write p, m, v
            row = {"size": count, "optimizer": name, "median_s": median, "q20_s": q20, "q80_s": q80,
                   "effective_GBps": moved / median / 1e9,
                   "peak_memory_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda"
                   else tensor_bytes(params) + tensor_bytes([p.grad for p in params]) + tensor_bytes(state_tensors(opt))}
            if copy_bw:
                row["fraction_of_copy_bandwidth"] = moved / median / copy_bw
            rows.append(row)
            del opt, params
    result["step_times"] = rows

    print(f"\nstep time on {device} ({result['threads']} threads), median of {repeats} "
          f"[20%, 80%]; effective bandwidth = minimal bytes of one fused pass / time")
    if copy_bw:
        print(f"device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    header = f"{'params':>11} {'optimizer':24} {'median ms':>10} {'[q20, q80]':>17} {'GB/s':>7} {'vs torch foreach fp32':>22}"
    print(header + ("  frac of copy bw" if copy_bw else ""))
    for row in rows:
        base = next(r for r in rows if r["size"] == row["size"] and r["optimizer"] == "torch foreach fp32")
        line = (f"{row['size']:>11,} {row['optimizer']:24} {row['median_s'] * 1e3:10.2f} "
                f"[{row['q20_s'] * 1e3:7.2f}, {row['q80_s'] * 1e3:7.2f}] {row['effective_GBps']:7.1f} "
                f"{base['median_s'] / row['median_s']:21.2f}x")
        print(line + (f"  {row['fraction_of_copy_bandwidth']:15.0%}" if copy_bw else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
