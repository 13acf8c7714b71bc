"""Stochastic rounding fp32 -> fp16/bf16: clipshard vs torch's round-to-nearest cast x.to(dtype) vs
stochastic rounding written in plain PyTorch, per size and dtype, in the same run.

Per row: median time with the 20/80 % quantiles (benchmarks/_measure.py: CUDA events on CUDA,
wall-clock on CPU), elements/s, GB/s (4 bytes read + 2 written per element), the peak memory one
call allocates beyond its input, and the time over the time of torch's round-to-nearest cast and
over that of the plain-PyTorch SR. `clipshard_strided` rounds a transposed view of the same data
(the kernels copy a strided source to contiguous memory first).

    python benchmarks/bench_stochastic_round.py --device cpu --json sr_cpu.json
    python benchmarks/bench_stochastic_round.py --device cuda --json sr_cuda.json --sizes 1M 64M
"""
import os
import sys

import torch

import clipshard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import (parser_with_common_arguments, peak_memory_bytes, print_table,  # noqa: E402
                      require_device, run_metadata, time_repeats, write_json)

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
DEFAULT_REPEATS = {"cpu": 10, "cuda": 30}
DEFAULT_WARMUP = {"cpu": 1, "cuda": 3}


def torch_stochastic_round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """SR written the obvious way: add random low bits to the fp32 pattern, truncate, cast.
    (Correct for bf16 and the fp16 normal range; fp16 subnormals are not handled.)"""
    drop = 16 if dtype == torch.bfloat16 else 13
    noise = torch.randint(0, 1 << drop, x.shape, dtype=torch.int32, device=x.device)
    bits = (x.view(torch.int32) + noise) & ~((1 << drop) - 1)
    return bits.view(torch.float32).to(dtype)


def methods(x: torch.Tensor, dtype: torch.dtype):
    """name -> zero-argument callable; `clipshard_strided` only when x splits into 1024 rows."""
    rows = 1024
    out = {
        "torch_rn": lambda: x.to(dtype),
        "torch_sr": lambda: torch_stochastic_round(x, dtype),
        "clipshard_sr": lambda: clipshard.stochastic_round(x, dtype),
    }
    if x.numel() % rows == 0:
        xt = x.view(rows, -1).t()
        out["clipshard_strided"] = lambda: clipshard.stochastic_round(xt, dtype)
    return out


def parse_size(text: str) -> int:
    """'1M' -> 1048576, '64K' -> 65536, '1000' -> 1000."""
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    suffix = text[-1].upper()
    return int(text[:-1]) * scale[suffix] if suffix in scale else int(text)


def size_label(n: int) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def add_ratios(rows):
    """time / time of torch_rn and of torch_sr for the same size and dtype."""
    median = {(r["size"], r["dtype"], r["method"]): r["median_s"] for r in rows}
    for r in rows:
        for baseline in ("torch_rn", "torch_sr"):
            r[f"vs_{baseline}"] = r["median_s"] / median[(r["size"], r["dtype"], baseline)]


def main():
    parser = parser_with_common_arguments(__doc__)
    parser.add_argument("--sizes", nargs="+", default=["1M", "16M", "64M"],
                        help="element counts, e.g. 1M 64M or 100000 (default: 1M 16M 64M)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="timed calls per row (default: 10 on CPU, 30 on CUDA)")
    args = parser.parse_args()
    require_device("bench_stochastic_round", args.device)
    device = torch.device(args.device)
    repeats = args.repeats or DEFAULT_REPEATS[device.type]
    warmup = DEFAULT_WARMUP[device.type]

    rows = []
    for size_text in args.sizes:
        n = parse_size(size_text)
        x = torch.randn(n, generator=torch.Generator().manual_seed(0)).to(device)
        for dtype_name, dtype in DTYPES.items():
            for name, fn in methods(x, dtype).items():
                row = {"size": n, "dtype": dtype_name, "method": name}
                row.update(time_repeats(fn, device, repeats, warmup))
                moved = n * (4 + 2)  # fp32 read + 16-bit write
                row.update(elements_per_s=n / row["median_s"], gb_per_s=moved / row["median_s"] / 1e9,
                           peak_extra_bytes=peak_memory_bytes(fn, device))
                rows.append(row)
        del x
    add_ratios(rows)

    result = run_metadata(device)
    result.update(benchmark="stochastic_round", repeats=repeats, warmup=warmup, results=rows)
    where = result["gpu"] or f"cpu, {result['threads']} threads"
    print_table([
        ("size", lambda r: size_label(r["size"])),
        ("dtype", lambda r: r["dtype"]),
        ("method", lambda r: r["method"], "<"),
        ("median ms", lambda r: f"{r['median_s'] * 1e3:.3f}"),
        ("[p20, p80] ms", lambda r: f"[{r['p20_s'] * 1e3:.3f}, {r['p80_s'] * 1e3:.3f}]"),
        ("Gelem/s", lambda r: f"{r['elements_per_s'] / 1e9:.3f}"),
        ("GB/s", lambda r: f"{r['gb_per_s']:.1f}"),
        ("peak MiB", lambda r: f"{r['peak_extra_bytes'] / 2**20:.1f}"),
        ("/torch_rn", lambda r: f"{r['vs_torch_rn']:.2f}"),
        ("/torch_sr", lambda r: f"{r['vs_torch_sr']:.2f}"),
    ], rows, title=f"stochastic rounding fp32 -> 16 bit on {where}; median of {repeats} [20%, 80%]; "
                   "ratios are time / baseline time in this run; peak = memory a call allocates beyond its input")
    write_json(args.json, result)


if __name__ == "__main__":
    main()
