"""Argument checks shared by the Python entry points. Errors name the function, the argument, what
was expected and what came."""
import torch


def check_feature_pair(fn, names, first, second, shapes):
    """`first` and `second` must be 2-D tensors (`shapes` describes each, e.g. "M x D") with the same
    dtype, on the same device."""
    for name, t, shape in zip(names, (first, second), shapes):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"{fn}: {name} must be 2-D ({shape}), got shape {tuple(t.shape)}")
    both = " and ".join(names)
    if first.dtype != second.dtype:
        raise TypeError(f"{fn}: {both} must have the same dtype, got {first.dtype} and {second.dtype}")
    if first.device != second.device:
        raise ValueError(f"{fn}: {both} must be on the same device, got {first.device} and {second.device}")
