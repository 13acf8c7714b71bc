"""What clipshard.GradCache needs around the model: splitting a batch into micro-batches, reading
the model's outputs (open_clip's dict or tuple convention), and the state a re-run must replay
(random generators, autocast). Errors name GradCache and the argument."""
import contextlib
from collections.abc import Mapping

import torch

from clipshard.parallel import agreement
from clipshard.ops.planned_device import tracing_a_plan

FN = "GradCache"
FEATURES = ("image_features", "text_features")
UNBATCHED = ("logit_scale", "logit_bias")  # dict keys (tuple positions 2, 3) that have no batch dimension


# --- inputs -------------------------------------------------------------------------------------

def _tensors(name, value):
    """[(label, tensor)] of an input: a tensor, or a dict / tuple / list of tensors."""
    if torch.is_tensor(value):
        items = [(name, value)]
    elif isinstance(value, Mapping):
        items = [(f"{name}[{key!r}]", v) for key, v in value.items()]
    elif isinstance(value, (tuple, list)):
        items = [(f"{name}[{i}]", v) for i, v in enumerate(value)]
    else:
        raise TypeError(f"{FN}: {name} must be a tensor or a dict / tuple of tensors, got {type(value).__name__}")
    for label, v in items:
        if not torch.is_tensor(v) or v.dim() == 0:
            raise TypeError(f"{FN}: {label} must be a tensor with a batch dimension, got "
                            f"{type(v).__name__ if not torch.is_tensor(v) else 'a 0-dim tensor'}")
    if not items:
        raise ValueError(f"{FN}: {name} holds no tensors")
    return items


def _common_rows(items, what):
    first_label, first = items[0]
    for label, tensor in items:
        if tensor.shape[0] != first.shape[0]:
            raise ValueError(f"{FN}: {what} must have the same batch size (first dimension), got "
                             f"{first.shape[0]} rows in {first_label} and {tensor.shape[0]} in {label}")
    return first_label, first.shape[0]


def batch_size(images, texts):
    """The common first dimension of every tensor in images and texts."""
    first_label, rows = _common_rows(_tensors("images", images) + _tensors("texts", texts), "images and texts")
    if rows == 0:
        raise ValueError(f"{FN}: the batch is empty ({first_label} has 0 rows)")
    return rows


def negative_count(hard_negative_texts):
    """The common first dimension of every tensor in hard_negative_texts (0 allowed: a rank may have none)."""
    return _common_rows(_tensors("hard_negative_texts", hard_negative_texts), "the tensors of hard_negative_texts")[1]


def check_sample_ids(sample_ids, rows):
    """sample_ids as GradCache hands it to loss_fn: one int64 id per pair of the batch (not split)."""
    if not torch.is_tensor(sample_ids) or sample_ids.dim() != 1 or sample_ids.dtype != torch.int64 \
            or sample_ids.shape[0] != rows:
        got = (f"{type(sample_ids).__name__}" if not torch.is_tensor(sample_ids)
               else f"{sample_ids.dtype} of shape {tuple(sample_ids.shape)}")
        raise ValueError(f"{FN}: sample_ids must be a 1-D int64 tensor with one id per pair ({rows}), got {got}")


def negative_features(output, rows):
    """encode_text's result for a micro-batch of `rows` hard negative texts: their H x D features."""
    if not torch.is_tensor(output) or output.dim() != 2 or output.shape[0] != rows:
        got = tuple(output.shape) if torch.is_tensor(output) else type(output).__name__
        raise ValueError(f"{FN}: encode_text must return the features of its texts, a tensor of shape "
                         f"({rows}, D) for this micro-batch of hard_negative_texts, got {got}")
    return output


def split(value, size):
    """The micro-batches of an input along dim 0, each of `size` rows (the last may be shorter)."""
    if torch.is_tensor(value):
        return list(torch.split(value, size))
    if isinstance(value, Mapping):
        parts = {key: split(v, size) for key, v in value.items()}
        return [type(value)({key: chunks[i] for key, chunks in parts.items()}) for i in range(_count(parts))]
    parts = [split(v, size) for v in value]
    return [type(value)(chunks[i] for chunks in parts) for i in range(len(parts[0]))]


def _count(parts):
    return len(next(iter(parts.values())))


# --- outputs ------------------------------------------------------------------------------------

class Outputs:
    """A model output as named values. keys: dict keys, or positions 0..n-1 of a tuple; batched:
    the keys with a batch dimension (everything but logit_scale / logit_bias); the loss is called
    as loss_fn(**values) for a dict and loss_fn(*values) for a tuple."""

    def __init__(self, output, rows):
        if isinstance(output, Mapping):
            self.is_dict = True
            missing = [k for k in FEATURES if not torch.is_tensor(output.get(k))]
            if missing:
                raise ValueError(f"{FN}: the model's output dict has no tensor {' / '.join(missing)} (keys: "
                                 f"{sorted(output)}); model must return open_clip's dict or tuple of features")
            self.values = dict(output)
            self.batched = [k for k, v in output.items() if k not in UNBATCHED and torch.is_tensor(v)]
        elif isinstance(output, (tuple, list)) and len(output) in (3, 4):
            self.is_dict = False
            if not all(torch.is_tensor(v) for v in output[:2]):
                raise ValueError(f"{FN}: the model's output tuple must start with image_features and "
                                 f"text_features tensors, got {[type(v).__name__ for v in output[:2]]}")
            self.values = dict(enumerate(output))
            self.batched = [0, 1]
        else:
            raise ValueError(f"{FN}: the model must return a dict with image_features and text_features (and "
                             "logit_scale, logit_bias) or the tuple (image_features, text_features, logit_scale"
                             f"[, logit_bias]), got {type(output).__name__}")
        for key in self.batched:
            value = self.values[key]
            if value.dim() == 0 or value.shape[0] != rows:
                raise ValueError(f"{FN}: the model's output {key!r} must have one row per sample ({rows} in this "
                                 f"micro-batch), got shape {tuple(value.shape)}")
        self.unbatched = [k for k, v in self.values.items() if k not in self.batched and torch.is_tensor(v)]

    def call(self, fn, values, keywords):
        """fn on the outputs, with `keywords` (sample_ids, hard_negatives: those given) as keywords."""
        if self.is_dict:
            return fn(**values, **keywords)
        return fn(*(values[i] for i in range(len(values))), **keywords)


# --- what a re-run replays ----------------------------------------------------------------------

class RandomState:
    """The CPU generator's state and, once CUDA is in use, every CUDA device's."""

    def __init__(self):
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None

    def restore(self):
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)


def autocast_state():
    """[(device type, dtype)] of the autocast regions in effect, to re-enter for a re-run."""
    return [(device, torch.get_autocast_dtype(device)) for device in ("cpu", "cuda")
            if torch.is_autocast_enabled(device)]


@contextlib.contextmanager
def autocast(state):
    with contextlib.ExitStack() as stack:
        for device, dtype in state:
            stack.enter_context(torch.autocast(device, dtype=dtype))
        yield


# --- gradient synchronisation over ranks --------------------------------------------------------

def _fsdp_modules(model):
    if not isinstance(model, torch.nn.Module) or not torch.distributed.is_available():
        return []
    from torch.distributed.fsdp import FSDPModule
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def _fsdp_without_sync(modules):
    for module in modules:
        module.set_requires_gradient_sync(False, recurse=False)
    try:
        yield
    finally:
        for module in modules:
            module.set_requires_gradient_sync(True, recurse=False)


def without_gradient_sync(model):
    """A context in which backward passes through `model` accumulate gradients locally: DDP's
    no_sync(), FSDP2's set_requires_gradient_sync(False); nothing for other models."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.no_sync()
    fsdp = _fsdp_modules(model)
    return _fsdp_without_sync(fsdp) if fsdp else contextlib.nullcontext()


def synchronising_module(model):
    """"DDP" or "FSDP2" when backward passes through `model` synchronise gradients over ranks, else None."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return "DDP"
    return "FSDP2" if _fsdp_modules(model) else None


def training_batch_norms(model):
    """Names of the BatchNorm modules of `model` in training mode."""
    if not isinstance(model, torch.nn.Module):
        return []
    return [f"{name or type(model).__name__} ({type(m).__name__})" for name, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]


def check_group(model, loss_fn):
    """The process group whose ranks call GradCache together, over which its own checks raise on
    every rank; None for a single process. A DDP or FSDP model's process group, the world group for
    FSDP2; for any other model (a plain module under DeepSpeed or a hand-written all-reduce, FSDP
    units inside a plain module, a function) the group loss_fn names as its `group` attribute
    (clipshard's losses), else the world group: the loss's collectives run over it, so a rank that
    raised alone would leave the others waiting there."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return model.process_group
    from torch.distributed.fsdp import FullyShardedDataParallel
    if isinstance(model, FullyShardedDataParallel):
        return model.process_group
    group = getattr(loss_fn, "group", None)
    if isinstance(group, torch.distributed.ProcessGroup) and not _fsdp_modules(model):
        return group
    return torch.distributed.group.WORLD


def raise_on_every_rank(group, error):
    """Raises `error` (an exception made here, its message starting with FN, or None) here and an
    error naming this rank and quoting its message on every other rank of `group` (check_group), so
    that one rank's bad input never leaves the others waiting in a collective
    (clipshard.parallel.agreement.raise_on_every_rank)."""
    problem = None if error is None else (type(error), str(error).removeprefix(f"{FN}: "))
    if tracing_a_plan():  # a memory plan on fake tensors: every rank holds these inputs, nothing to exchange
        group = None
    agreement.raise_on_every_rank(FN, problem, group)
