"""A training problem for clipshard.optim.AdamW: the stall that stochastic rounding prevents."""
import torch

from clipshard.optim import AdamW


def stall_regression(param_dtype, stochastic_rounding, steps=400, lr=1e-3, device="cpu"):
    """Least-squares regression (256 samples, 64 weights initialised at 1.0, targets from weights
    1 + 0.1 * N(0, 1)) trained with clipshard.optim.AdamW (no weight decay; rounding bits from a
    generator seeded with 4). Adam moves each weight by about lr per step: with lr 1e-3 that is below
    half an ulp of bf16 at 1.0 (2^-8), so round to nearest never moves a bf16 weight while
    stochastic rounding follows fp32 training. Returns (the loss before each step, final weights)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=gen).to(device)
    y = x @ (1.0 + 0.1 * torch.randn(64, generator=gen)).to(device)
    w = torch.ones(64, dtype=param_dtype, device=device, requires_grad=True)
    opt = AdamW([w], lr=lr, weight_decay=0.0, stochastic_rounding=stochastic_rounding,
                generator=torch.Generator(device=device).manual_seed(4))
    losses = []
    for _ in range(steps):
        loss = ((x @ w.float() - y) ** 2).mean()
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return losses, w.detach()
