"""Which fp16 representation of Adam's second moment v survives realistic gradients?

Emulates the exp_avg_sq update v <- beta2 * v + (1 - beta2) * g^2 in fp32 with the stored value
rounded stochastically to fp16 after every step, for three encodings of v in fp16 (v itself,
sqrt(v), v^(1/4)) and, for comparison, v in bf16; gradients are Gaussian with scale 1e-8 .. 1e4.
Reports the relative error of the Adam denominator sqrt(v) against the exact fp64 recursion after
many steps (median and 99th percentile over elements), and the fraction of elements stored as 0 or
Inf. Usage: python benchmarks/measure_fp16_second_moment.py [--steps 2000] [--json PATH]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for tests/
from tests.references.rounding import half_neighbours  # noqa: E402

ENCODINGS = {  # name: (storage dtype, encode v -> stored, decode stored -> v)
    "fp16 v": (torch.float16, lambda v: v, lambda s: s),
    "fp16 sqrt(v)": (torch.float16, torch.sqrt, lambda s: s * s),
    "fp16 v^(1/4)": (torch.float16, lambda v: v.sqrt().sqrt(), lambda s: (s * s) * (s * s)),
    "bf16 v": (torch.bfloat16, lambda v: v, lambda s: s),
}


def stochastic_round(x32, dtype, generator):
    """Proportional stochastic rounding of fp32 x to `dtype` (emulated; values past the largest
    finite one become Inf)."""
    lo, hi = half_neighbours(x32.double(), dtype)
    lo_d, hi_d = lo.double(), hi.double()
    gap = hi_d - lo_d
    p_up = torch.where(gap > 0, (x32.double() - lo_d) / torch.where(gap > 0, gap, 1.0), 0.0)
    up = torch.rand(x32.shape, generator=generator, dtype=torch.float64) < p_up
    out = torch.where(up, hi, lo)
    return torch.where(x32.abs() > torch.finfo(dtype).max, x32.to(dtype), out)


def measure(scale, steps, n, beta2, seed):
    gen = torch.Generator().manual_seed(seed)
    grads = [scale * torch.randn(n, generator=gen) for _ in range(steps)]
    exact = torch.zeros(n, dtype=torch.float64)
    for g in grads:
        exact = beta2 * exact + (1 - beta2) * g.double() ** 2
    results = {}
    for name, (dtype, encode, decode) in ENCODINGS.items():
        stored = torch.zeros(n, dtype=dtype)
        for g in grads:
            v = decode(stored.float()) * beta2 + ((1 - beta2) * g) * g  # fp32, as the kernel does
            stored = stochastic_round(encode(v), dtype, gen)
        v = decode(stored.float()).double()
        rel = (v.sqrt() / exact.sqrt() - 1).abs()
        rel = torch.where(torch.isnan(rel), torch.inf, rel)
        results[name] = {
            "median_rel_err_sqrt_v": rel.median().item(),
            "p99_rel_err_sqrt_v": rel.quantile(0.99).item(),
            "zero_fraction": (v == 0).double().mean().item(),
            "inf_fraction": torch.isinf(v).double().mean().item(),
        }
    return results


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--beta2", type=float, default=0.999)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    table = {}
    print(f"relative error of sqrt(v) after {args.steps} steps, beta2={args.beta2}, {args.n} elements")
    print(f"{'grad scale':>10} | " + " | ".join(f"{name:>22}" for name in ENCODINGS))
    for scale in (1e-8, 1e-6, 1e-4, 1e-2, 1.0, 1e2, 1e4):
        row = measure(scale, args.steps, args.n, args.beta2, seed=0)
        table[f"{scale:g}"] = row
        cells = []
        for name in ENCODINGS:
            r = row[name]
            cell = f"{r['median_rel_err_sqrt_v']:.1e}/{r['p99_rel_err_sqrt_v']:.1e}"
            if r["zero_fraction"] > 0 or r["inf_fraction"] > 0:
                cell += f" 0:{r['zero_fraction']:.0%} inf:{r['inf_fraction']:.0%}"
            cells.append(f"{cell:>22}")
        print(f"{scale:>10g} | " + " | ".join(cells))
    print("cells: median / 99th percentile of |sqrt(v_stored) / sqrt(v_exact) - 1|; 0:/inf: fractions")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "n": args.n, "beta2": args.beta2, "results": table}, f, indent=1)


if __name__ == "__main__":
    main()
