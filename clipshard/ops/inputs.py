"""The input rules of every layer (ops, parallel, the losses, optim, rounding), each written once.

A rule that a loss must also check across ranks returns what it found as a `Problem` instead of
raising, so that one device raises it and the cross-rank validation sends it to the other ranks;
`rules()` lists every expectation a rule can state, in order, so that a problem can travel as a
number. The arguments' names come from the caller. Errors name the function, the argument, what was
expected and what came.
"""
from dataclasses import dataclass

import torch

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SUPPORTED_NAMES = "float32, float16, bfloat16 or float64"


def accumulate_dtype(dtype):
    """Outputs and accumulation: fp64 for fp64 inputs, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Problem:
    """What a rule found: `rule` (what was expected, naming the arguments) and `got` (what came)."""

    error: type  # TypeError or ValueError
    rule: str
    got: str

    @property
    def message(self):
        return f"{self.rule}, got {self.got}"

    def raise_for(self, fn):
        raise self.error(f"{fn}: {self.message}")


class FeaturePair:
    """Two 2-D feature tensors (`shapes` describes each, e.g. "M x D"), one dtype among
    SUPPORTED_DTYPES, one device, dense, not empty, with the same feature size D (with
    same_shape: the same shape)."""

    def __init__(self, names, shapes, same_shape=False):
        self.names, self.same_shape = names, same_shape
        both = " and ".join(names)
        self._tensor = tuple(f"{name} must be a tensor" for name in names)
        self._two_dim = tuple(f"{name} must be 2-D ({shape})" for name, shape in zip(names, shapes))
        self._dtype = f"{both} must have the same dtype"
        self._device = f"{both} must be on the same device"
        self._size = f"{both} must have the same shape" if same_shape else f"{both} must have the same feature size D"
        self._dense = f"{both} must be dense (strided) tensors"
        self._supported = f"{names[0]} must be {_SUPPORTED_NAMES}"
        self._empty = f"{both} must not be empty (empty inputs are not supported)"

    def rules(self):
        return (*self._tensor, *self._two_dim, self._dtype, self._device, self._size, self._dense, self._supported,
                self._empty)

    def problem(self, first, second):
        """The first rule that (first, second) breaks, or None."""
        pair = (first, second)
        for t, rule in zip(pair, self._tensor):
            if not isinstance(t, torch.Tensor):
                return Problem(TypeError, rule, type(t).__name__)
        for t, rule in zip(pair, self._two_dim):
            if t.dim() != 2:
                return Problem(ValueError, rule, f"shape {tuple(t.shape)}")
        if first.dtype != second.dtype:
            return Problem(TypeError, self._dtype, f"{first.dtype} and {second.dtype}")
        if first.device != second.device:
            return Problem(ValueError, self._device, f"{first.device} and {second.device}")
        if first.shape != second.shape if self.same_shape else first.shape[1] != second.shape[1]:
            got = (f"{tuple(first.shape)} and {tuple(second.shape)}" if self.same_shape
                   else f"{first.shape[1]} and {second.shape[1]}")
            return Problem(ValueError, self._size, got)
        if not (is_dense(first) and is_dense(second)):
            return Problem(ValueError, self._dense, f"{first.layout} and {second.layout}")
        if first.dtype not in SUPPORTED_DTYPES:
            return Problem(TypeError, self._supported, f"{first.dtype}")
        if 0 in first.shape or 0 in second.shape:
            return Problem(ValueError, self._empty, f"shapes {tuple(first.shape)} and {tuple(second.shape)}")
        return None

    def check(self, fn, first, second):
        problem = self.problem(first, second)
        if problem is not None:
            problem.raise_for(fn)


class LossScalar:
    """A loss's logit scale or bias once numbers are tensors (clipshard.losses.base.as_scalar_tensor):
    a tensor of one element of a supported dtype on the features' device (or None when optional)."""

    def __init__(self, name, optional=False):
        self.name = name
        self._one = f"{name} must be {'None or ' if optional else ''}a tensor with one element on the features' device"
        self._dtype = f"{name} must be a fp32, fp16, bf16 or fp64 tensor"
        self.optional = optional

    def rules(self):
        return self._one, self._dtype

    def problem(self, value, features):
        if value is None and self.optional:
            return None
        if not torch.is_tensor(value) or value.numel() != 1 or value.device != features.device:
            got = f"{tuple(value.shape)} on {value.device}" if torch.is_tensor(value) else type(value).__name__
            return Problem(ValueError, self._one, got)
        if value.dtype not in SUPPORTED_DTYPES:
            return Problem(TypeError, self._dtype, f"{value.dtype}")
        return None


def check_block_features(fn, rows, cols, pos_offset, none_allowed=False):
    """The fused block ops' features (contrastive_lse, siglip_sum, distill_lse): rows M x D and
    cols K x D, and pos_offset placing the M positives among the K columns (or None where
    `none_allowed`: a block without positives)."""
    _BLOCK.check(fn, rows, cols)
    if pos_offset is None and none_allowed:
        return
    if isinstance(pos_offset, bool) or not isinstance(pos_offset, int):
        expected = "an int or None" if none_allowed else "an int"
        raise TypeError(f"{fn}: pos_offset must be {expected}, got {type(pos_offset).__name__}")
    m, k = rows.shape[0], cols.shape[0]
    if pos_offset < 0 or pos_offset + m > k:
        raise ValueError(f"{fn}: pos_offset must satisfy 0 <= pos_offset and pos_offset + M <= K (M = {m}, K = {k}), "
                         f"got {pos_offset}")


_BLOCK = FeaturePair(("rows", "cols"), ("M x D", "K x D"))


def check_logit_scalar(fn, name, value, rows):
    """A block op's scale or bias: a Python number becomes a 0-dim tensor; a one-element tensor of
    any shape (open_clip's nonscalar_logit_scale uses shape (1,)) is viewed as 0-dim, so its
    gradient keeps its shape."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{fn}: {name} must be a float or a one-element tensor, got {type(value).__name__}")
        return torch.tensor(float(value), dtype=accumulate_dtype(rows.dtype), device=rows.device)
    if value.numel() != 1:
        raise ValueError(f"{fn}: {name} must be a one-element tensor, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {value.dtype}")
    if value.device != rows.device:
        raise ValueError(f"{fn}: {name} must be on the same device as rows ({rows.device}), got {value.device}")
    return value.reshape(())


def check_bool(fn, name, value):
    """Flags must be real bools: bool('no') is True, so a string or a number would silently mean
    something else."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be True or False, got {value!r} ({type(value).__name__})")


def check_flags(fn, **flags):
    for name, value in flags.items():
        check_bool(fn, name, value)


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


TARGETS = ("mask", "multi")  # what sample ids mean for a block op (docs/targets.md)


def _describe(t):
    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"a {t.dim()}-D {str(t.dtype).removeprefix('torch.')} tensor of shape {tuple(t.shape)} on {t.device}"


def is_dense(t):
    """Whether tensor t is strided (dense). Under torch.compile always: dynamo refuses sparse tensors
    when it wraps them, and refuses reading `.layout` while it traces a backward (a ring backward
    calls the checked ops)."""
    return torch.compiler.is_compiling() or t.layout == torch.strided


def is_id_vector(ids, length, device):
    """Whether `ids` is a sample-id vector: a 1-D strided int64 tensor of `length` ids on `device`."""
    return (isinstance(ids, torch.Tensor) and ids.dim() == 1 and ids.dtype == torch.int64 and ids.shape[0] == length
            and ids.device == device and is_dense(ids))


def check_ids(fn, name, ids, length, device):
    """A sample-id vector: a 1-D int64 tensor of `length` ids on `device` (the rows' device)."""
    if is_id_vector(ids, length, device):
        return
    error = TypeError if not isinstance(ids, torch.Tensor) or ids.dtype != torch.int64 else ValueError
    raise error(f"{fn}: {name} must be a 1-D int64 tensor of length {length} on {device}, got {_describe(ids)}")


def check_targets(fn, targets, rows, cols, row_ids, col_ids, default=None):
    """The sample ids of a block (row_ids for the M rows, col_ids for the K columns: both or neither)
    and what they mean: targets "mask" or "multi" with ids, None without them. Returns the targets,
    `default` when ids come without targets (None: targets must then be given)."""
    if (row_ids is None) != (col_ids is None):
        given = lambda t: "None" if t is None else "given"  # noqa: E731
        raise ValueError(f"{fn}: row_ids and col_ids must be given together, got row_ids {given(row_ids)} and "
                         f"col_ids {given(col_ids)}")
    if targets is not None and (not isinstance(targets, str) or targets not in TARGETS):
        raise ValueError(f"{fn}: targets must be None, 'mask' or 'multi', got {targets!r}")
    if row_ids is None:
        if targets is not None:
            raise ValueError(f"{fn}: targets={targets!r} needs the sample ids row_ids and col_ids, got none")
        return None
    check_ids(fn, "row_ids", row_ids, rows.shape[0], rows.device)
    check_ids(fn, "col_ids", col_ids, cols.shape[0], rows.device)
    if targets is None:
        if default is None:
            raise ValueError(f"{fn}: row_ids and col_ids need targets='mask' or 'multi', got targets=None")
        return default
    return targets


def check_extra_cols(fn, extra_cols, cols):
    """Extra columns (hard negatives): None or an H x D tensor (H >= 0) of the same dtype, device and
    feature size D as cols."""
    if extra_cols is None:
        return
    expected = f"extra_cols must be None or an H x D tensor like cols ({_describe(cols)})"
    if not isinstance(extra_cols, torch.Tensor):
        raise TypeError(f"{fn}: {expected}, got {_describe(extra_cols)}")
    if extra_cols.dtype != cols.dtype:
        raise TypeError(f"{fn}: {expected}: same dtype, got {_describe(extra_cols)}")
    if (extra_cols.dim() != 2 or extra_cols.shape[1] != cols.shape[1] or extra_cols.device != cols.device
            or not is_dense(extra_cols)):
        raise ValueError(f"{fn}: {expected}, got {_describe(extra_cols)}")
