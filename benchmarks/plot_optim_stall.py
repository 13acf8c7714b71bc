"""The stall that stochastic rounding prevents, as loss curves.

Least-squares regression (256 samples, 64 weights initialised at 1.0, targets from weights
1 + 0.1 * N(0, 1)) trained with clipshard.optim.AdamW (lr 1e-3, no weight decay) three ways: fp32
weights and states; bf16 weights and states with stochastic rounding; the same with round to
nearest. Adam moves each weight by about lr per step, below half an ulp of bf16 at 1.0 (2^-8), so
round to nearest never moves a weight, while stochastic rounding follows the fp32 curve down to
bf16's quantisation floor. Saves optim_stall.png (and .json) under --out and prints the losses.
Usage: python benchmarks/plot_optim_stall.py --out DIR [--steps 400] [--device cpu]
"""
import argparse
import json
import os

import torch

import clipshard  # noqa: F401
from clipshard.optim import AdamW


def train(param_dtype, stochastic, steps, lr, device):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=gen).to(device)
    y = x @ (1.0 + 0.1 * torch.randn(64, generator=gen)).to(device)
    w = torch.ones(64, dtype=param_dtype, device=device, requires_grad=True)
    opt = AdamW([w], lr=lr, weight_decay=0.0, stochastic_rounding=stochastic)
    losses = []
    for _ in range(steps):
        loss = ((x @ w.float() - y) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    curves = {
        "fp32 weights + states": train(torch.float32, True, args.steps, args.lr, args.device),
        "bf16 weights + states, stochastic rounding": train(torch.bfloat16, True, args.steps, args.lr, args.device),
        "bf16 weights + states, round to nearest": train(torch.bfloat16, False, args.steps, args.lr, args.device),
    }
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
