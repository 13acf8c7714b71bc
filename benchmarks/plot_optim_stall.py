"""The stall that stochastic rounding prevents, as loss curves.

The regression of tests/optim/stall_problem.py (the one tests/optim/test_adamw.py checks: 256
samples, 64 weights initialised at 1.0, targets from weights 1 + 0.1 * N(0, 1)) trained with
clipshard.optim.AdamW (lr 1e-3, no weight decay) three ways: fp32 weights and states; bf16 weights
and states with stochastic rounding; the same with round to nearest. Adam moves each weight by
about lr per step, below half an ulp of bf16 at 1.0 (2^-8), so round to nearest never moves a
weight, while stochastic rounding follows the fp32 curve down to bf16's quantisation floor.
Saves optim_stall.png (and .json) under --out and prints the losses.
Usage: python benchmarks/plot_optim_stall.py --out DIR [--steps 400] [--device cpu]
"""
import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root, for tests/
from tests.optim.stall_problem import stall_regression  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    setups = {
        "fp32 weights + states": (torch.float32, True),
        "bf16 weights + states, stochastic rounding": (torch.bfloat16, True),
        "bf16 weights + states, round to nearest": (torch.bfloat16, False),
    }
    curves = {name: stall_regression(dtype, stochastic, args.steps, args.lr, args.device)[0]
              for name, (dtype, stochastic) in setups.items()}
    for name, losses in curves.items():
        marks = ", ".join(f"step {i}: {losses[i]:.3g}" for i in (0, 50, 100, 200, args.steps - 1) if i < args.steps)
        print(f"{name:45} {marks}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "optim_stall.json"), "w") as f:
        json.dump({"lr": args.lr, "steps": args.steps, "losses": curves}, f)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, losses in curves.items():
        ax.semilogy(losses, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (MSE)")
    ax.set_title(f"AdamW, lr {args.lr:g}: updates below half a bf16 ulp")
    ax.legend()
    fig.tight_layout()
    path = os.path.join(args.out, "optim_stall.png")
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


if __name__ == "__main__":
    main()
