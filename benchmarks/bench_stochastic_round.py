"""Stochastic rounding fp32 -> fp16/bf16: clipshard vs torch's round-to-nearest cast vs a
pure-PyTorch stochastic rounding, per size and dtype. Prints a table and writes JSON.

    python benchmarks/bench_stochastic_round.py --device cpu --json sr_cpu.json
    python benchmarks/bench_stochastic_round.py --device cuda --json sr_cuda.json --sizes 1M 64M
"""
import argparse
import json
import platform
import statistics

import torch
import torch.utils.benchmark as benchmark

import clipshard

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def torch_stochastic_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SR written the obvious way: add random low bits to the fp32 pattern, truncate, cast.
    (Correct for bf16 and the fp16 normal range; fp16 subnormals are not handled.)"""
    drop = 16 if dtype == torch.bfloat16 else 13
    noise = torch.randint(0, 1 << drop, x.shape, dtype=torch.int32, device=x.device)
    bits = (x.view(torch.int32) + noise) & ~((1 << drop) - 1)
    return bits.view(torch.float32).to(dtype)


def methods(x: torch.Tensor, dtype: torch.dtype):
    """name -> zero-argument callable. `clipshard_strided` rounds a transposed view (the kernels
    copy a strided source to contiguous memory first)."""
    rows = 1024
    xt = x.view(rows, -1).t() if x.numel() % rows == 0 else None
    out = {
        "torch_rn": lambda: x.to(dtype),
        "torch_sr": lambda: torch_stochastic_round(x, dtype),
        "clipshard_sr": lambda: clipshard.stochastic_round(x, dtype),
    }
    if xt is not None:
        out["clipshard_strided"] = lambda: clipshard.stochastic_round(xt, dtype)
    return out


def time_cpu(fn) -> float:
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=1.0).median


def time_cuda(fn, repeats: int = 30):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times), torch.cuda.max_memory_allocated() - base


def parse_size(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * scale[text[-1].upper()] if text[-1].upper() in scale else int(text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M", "64M"], help="element counts, e.g. 1M 64M")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_stochastic_round: --device cuda but no CUDA device is available")

    results = []
    for size_text in args.sizes:
        n = parse_size(size_text)
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        for dtype_name, dtype in DTYPES.items():
            for name, fn in methods(x, dtype).items():
                if device.type == "cuda":
                    seconds, peak = time_cuda(fn)
                else:
                    seconds, peak = time_cpu(fn), None
                moved = n * (4 + 2)  # fp32 read + 16-bit write
                results.append({"size": n, "dtype": dtype_name, "method": name, "median_s": seconds,
                                "elements_per_s": n / seconds, "gb_per_s": moved / seconds / 1e9,
                                "peak_extra_bytes": peak})
        del x

    def find(size, dtype_name, method):
        return next((r for r in results if (r["size"], r["dtype"], r["method"]) == (size, dtype_name, method)), None)

    for r in results:
        r["vs_torch_rn"] = r["median_s"] / find(r["size"], r["dtype"], "torch_rn")["median_s"]
        r["vs_torch_sr"] = r["median_s"] / find(r["size"], r["dtype"], "torch_sr")["median_s"]

    threads = torch.get_num_threads()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.processor() or 'cpu'}, {threads} threads"
    print(f"stochastic rounding fp32 -> 16 bit on {where}; median time; ratios are time / baseline time")
    header = f"{'size':>6} {'dtype':>5} {'method':>18} {'median ms':>10} {'Gelem/s':>8} {'GB/s':>7} " \
             f"{'peak MiB':>9} {'/torch_rn':>10} {'/torch_sr':>10}"
    print(header)
    for r in results:
        peak = "n/a" if r["peak_extra_bytes"] is None else f"{r['peak_extra_bytes'] / 2**20:.1f}"
        print(f"{r['size'] >> 20:>5}M {r['dtype']:>5} {r['method']:>18} {r['median_s'] * 1e3:>10.3f} "
              f"{r['elements_per_s'] / 1e9:>8.3f} {r['gb_per_s']:>7.1f} {peak:>9} {r['vs_torch_rn']:>10.2f} "
              f"{r['vs_torch_sr']:>10.2f}")
    if args.json:
        meta = {"device": where, "torch": torch.__version__, "threads": threads}
        with open(args.json, "w") as f:
            json.dump({"benchmark": "stochastic_round", "meta": meta, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
