"""Optimizers for the two towers, and what their weights and states cost per parameter.

- image tower and logit_scale: fp32 weights, fp32 Adam moments;
- text tower, by --text-precision:
    fp32  fp32 weights and moments (the baseline);
    sr16  16-bit weights and 16-bit moments, updates written back with stochastic rounding;
    rn16  the same storage, updates rounded to nearest (what a plain 16-bit cast does).
All of them use clipshard.optim.AdamW. The stochastic-rounding generator is seeded identically
on every rank: after DDP's all-reduce every rank holds the same gradients, and the same random
bits keep the replicas bit-identical.
"""
import torch
from torch import nn

TEXT_PRECISIONS = ("fp32", "sr16", "rn16")
HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
BETAS, EPS = (0.9, 0.98), 1e-6  # CLIP's Adam settings


def _param_groups(params: list[tuple[str, nn.Parameter]], weight_decay: float) -> list[dict]:
    """Decay matrices only (as CLIP does): no decay on biases, norms, embeddings' scale-free parts."""
    decay = [p for n, p in params if p.ndim >= 2 and "embedding" not in n]
    rest = [p for n, p in params if not (p.ndim >= 2 and "embedding" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def to_half(module: nn.Module, dtype: torch.dtype, stochastic: bool, generator: torch.Generator) -> None:
    """Store the module's weights in 16 bits, rounding stochastically or to nearest."""
    if stochastic:
        from clipshard.optim import to_half_precision_
        to_half_precision_(module, dtype, generator=generator)
    else:
        module.to(dtype)


def build_optimizers(model: nn.Module, text_precision: str, half_dtype: torch.dtype, lr: float,
                     weight_decay: float, generator: torch.Generator) -> dict[str, torch.optim.Optimizer]:
    """Converts model.text to the chosen precision (before DDP wraps the model) and returns
    {"image": ..., "text": ...} optimizers."""
    if text_precision not in TEXT_PRECISIONS:
        raise ValueError(f"build_optimizers: text_precision must be one of {TEXT_PRECISIONS}, got {text_precision!r}")
    from clipshard.optim import AdamW

    image_params = [(f"image.{n}", p) for n, p in model.image.named_parameters()]
    image_params.append(("logit_scale", model.logit_scale))
    optimizers = {"image": AdamW(_param_groups(image_params, weight_decay), lr=lr, betas=BETAS, eps=EPS)}
    text_params = list(model.text.named_parameters())
    if text_precision == "fp32":
        optimizers["text"] = AdamW(_param_groups(text_params, weight_decay), lr=lr, betas=BETAS, eps=EPS)
        return optimizers
    stochastic = text_precision == "sr16"
    to_half(model.text, half_dtype, stochastic, generator)  # same Parameter objects, 16-bit data
    optimizers["text"] = AdamW(_param_groups(text_params, weight_decay), lr=lr, betas=BETAS, eps=EPS,
                               state_dtype=half_dtype, stochastic_rounding=stochastic, generator=generator)
    return optimizers


def optimizer_bytes_per_param(params: list[nn.Parameter], optimizer: torch.optim.Optimizer) -> float:
    """(bytes of the weights + bytes of every optimizer state tensor) / number of weights.

    Gradients are not counted (they are transient); scalar step counters are (they are tiny)."""
    count = sum(p.numel() for p in params)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    state_bytes = sum(v.numel() * v.element_size()
                      for p in params for v in optimizer.state.get(p, {}).values() if torch.is_tensor(v))
    return (weight_bytes + state_bytes) / count
