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


def check_bool(fn, name, value):
    """Flags must be real bools: bool('no') is True, so a string or a number would silently mean
    something else."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be True or False, got {value!r} ({type(value).__name__})")


def check_generator(fn, generator, device):
    """`generator` must be None or a torch.Generator on `device`'s type (for CUDA, the same index)."""
    if generator is None:
        return
    if not isinstance(generator, torch.Generator):
        raise TypeError(f"{fn}: generator must be a torch.Generator or None, got {type(generator).__name__}")
    device = torch.device(device)
    have = generator.device
    same_index = device.type != "cuda" or (have.index or 0) == (device.index if device.index is not None
                                                                 else torch.cuda.current_device())
    if have.type != device.type or not same_index:
        raise ValueError(f"{fn}: generator must be on the tensors' device ({device}), got a generator on {have}")


def check_flags(fn, **flags):
    for name, value in flags.items():
        check_bool(fn, name, value)


def check_rank_and_world_size(fn, rank, world_size):
    """open_clip's loss constructor arguments: ints, rank >= 0, world_size >= 1."""
    for name, value, least in (("rank", rank, 0), ("world_size", world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name} must be an int, got {value!r} ({type(value).__name__})")
        if value < least:
            raise ValueError(f"{fn}: {name} must be >= {least}, got {value}")
