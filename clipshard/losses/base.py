"""What every public loss shares: scalar coercion, open_clip's constructor arguments, the modes, the
codes that name loss options across ranks, and the cross-rank validation of the losses' inputs.

`shard_layout` validates the inputs of every rank in one metadata exchange
(clipshard.parallel.agreement) and returns the ShardLayout: each rank sends one row, FIELDS below,
and every rank checks all rows with the same code, so that a bad input or ranks that disagree raise
the same error on every rank instead of leaving some of them waiting in a collective. The loss's
options travel as explicit fields (OPTIONS), so a disagreement names the option. The optional
inputs beyond the diagonal (sample_ids, targets, hard_negatives, direction; `Extras`) travel in the same
row: their problems as codes, their presence, targets, direction and the hard negatives' count,
feature size and dtype as fields (docs/targets.md).
"""
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from clipshard.ops.compile_marks import constant_under_compile
from clipshard.ops.inputs import (SUPPORTED_DTYPES, TARGETS, FeaturePair, LossScalar, Problem, check_flags,
                                  is_id_vector)
from clipshard.parallel import steady_state
from clipshard.parallel.agreement import differing_values, exchange_rows, require_same
from clipshard.parallel.layout import ShardLayout, metadata_device, process_group, single_process_layout
from clipshard.ops.planned_device import tracing_a_plan
from clipshard.parallel.planned_layout import planned_layout

CLIP_MODES = ("exchange", "local", "ring")  # ClipLoss and DistillClipLoss
SIGLIP_MODES = ("gather", "ring")


def as_scalar_tensor(value, like):
    """Python numbers become 0-dim tensors on the features' device; one-element tensors become 0-dim."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and torch.is_tensor(like):
        acc = torch.float64 if like.dtype == torch.float64 else torch.float32
        return torch.tensor(float(value), dtype=acc, device=like.device)
    if torch.is_tensor(value) and value.numel() == 1 and value.dim() != 0:
        return value.reshape(())
    return value


def check_rank_and_world_size(fn, rank, world_size):
    """open_clip's loss constructor arguments: ints, rank >= 0, world_size >= 1."""
    for name, value, least in (("rank", rank, 0), ("world_size", world_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{fn}: {name} must be an int, got {value!r} ({type(value).__name__})")
        if value < least:
            raise ValueError(f"{fn}: {name} must be >= {least}, got {value}")


def check_horovod(fn, use_horovod):
    if use_horovod:
        raise ValueError(f"{fn}: use_horovod=True is not supported; clipshard communicates through "
                         "torch.distributed (launch with torchrun)")


def resolve_group(fn, group, world_size=None):
    """The process group to use (None: this process alone); world_size (open_clip's argument) > 1
    without an initialised process group is an error."""
    resolved = process_group(fn, group)
    if resolved is None and world_size not in (None, 1):
        raise RuntimeError(f"{fn}: world_size={world_size} but torch.distributed is not initialised; call "
                           "torch.distributed.init_process_group first (or use world_size=1)")
    return resolved


def resolve_mode(fn, mode, local_loss, gather_with_grad):
    """ClipLoss's and DistillClipLoss's mode; None follows gather_with_grad."""
    check_flags(fn, local_loss=local_loss, gather_with_grad=gather_with_grad)
    if mode is None:
        return "exchange" if gather_with_grad else "local"
    if mode not in CLIP_MODES:
        raise ValueError(f"{fn}: mode must be 'exchange', 'local', 'ring' or None, got {mode!r}")
    if mode in ("exchange", "ring") and local_loss and not gather_with_grad:
        raise ValueError(
            f"{fn}: mode={mode!r} cannot reproduce open_clip's (local_loss=True, "
            "gather_with_grad=False) gradients, which drop the terms of each rank's features in the "
            "other ranks' rows; use mode='local' (the default there) or gather_with_grad=True"
        )
    return mode


def mixes_ranks_scales(local_loss, mode):
    """Whether a rank's loss combines terms computed by other ranks with their own logit scales
    (and biases) (the column LSEs of exchange and ring, the sum of local_loss=False), so that the
    ranks must agree on them. open_clip scales each rank's loss by that rank's own values, which only
    mode="local" with local_loss=True reproduces (it computes both of its LSEs itself)."""
    return mode != "local" or not local_loss


@dataclass(frozen=True)
class Options:
    """A loss's options as they travel across ranks; None where the loss has no such option."""

    loss: str  # one of LOSSES
    mode: str
    local_loss: bool = None
    gather_with_grad: bool = None
    teachers: int = None
    average_after_softmax: bool = None


LOSSES = ("the CLIP loss", "the SigLIP loss", "the distillation loss")
_MODES = ("exchange", "local", "ring", "gather")  # every loss's modes
_FLAG = {-1: "(none)", 0: False, 1: True}
# Per option: (description in messages, how a code is shown).
OPTIONS = {
    "loss": ("loss options (which loss)", dict(enumerate(LOSSES))),
    "mode": ("loss options (mode)", dict(enumerate(_MODES))),
    "local_loss": ("loss options (local_loss)", _FLAG),
    "gather_with_grad": ("loss options (gather_with_grad)", _FLAG),
    "teachers": ("teacher count", {}),
    "average_after_softmax": ("loss options (average_after_softmax)", _FLAG),
}


def _option_codes(options):
    values = {"loss": LOSSES.index(options.loss), "mode": _MODES.index(options.mode)}
    for name in ("local_loss", "gather_with_grad", "teachers", "average_after_softmax"):
        value = getattr(options, name)
        values[name] = -1 if value is None else int(value)
    return [values[name] for name in OPTIONS]


DTYPE_CODES = {dtype: k for k, dtype in enumerate(SUPPORTED_DTYPES)}
DTYPE_NAMES = {k: str(dtype) for dtype, k in DTYPE_CODES.items()}


@constant_under_compile
def _device_code(device_type):
    """A number for a device type name, the same in every process (Python's hash() is salted per
    process): every device type torch supports is accepted, and ranks must agree on it."""
    return zlib.crc32(device_type.encode())


# Names of the device types whose codes an error message may have to print back.
_KNOWN_DEVICE_TYPES = ("cpu", "cuda", "xpu", "mps", "meta", "hpu", "mtia", "xla", "lazy", "ipu", "maia",
                       "privateuseone")
_DEVICE_NAMES = {_device_code(t): t for t in _KNOWN_DEVICE_TYPES}


DIRECTIONS = ("both", "image_to_text")


@dataclass(frozen=True)
class Extras:
    """A loss's optional inputs beyond the diagonal, as the caller gave them (docs/targets.md).

    sample_ids: None or a 1-D int64 tensor, one global id per local pair, on the features' device.
    targets: None, "mask" or "multi" (None means `default_targets` when sample_ids is given).
    hard_negatives: None or an H_r x D tensor like text_features (H_r >= 0, may differ per rank).
    direction: "both" or "image_to_text" (the CLIP loss), None for a loss without directions.
    """

    sample_ids: object = None
    targets: object = None
    hard_negatives: object = None
    direction: object = None
    default_targets: str = "mask"

    @property
    def resolved_targets(self):
        """None without sample_ids, else targets or the loss's default."""
        if self.sample_ids is None:
            return None
        return self.default_targets if self.targets is None else self.targets


NO_EXTRAS = Extras()


class _ExtraRules:
    """The per-rank rules of Extras, each one expectation (so that a problem travels as a number)."""

    ids = ("sample_ids must be None or a 1-D int64 tensor with one id per pair (the length of the local "
           "batch) on the features' device")
    targets = "targets must be None, 'mask' or 'multi'"
    targets_without_ids = "targets needs sample_ids (the targets are defined by the pairs' ids)"
    direction = "direction must be 'both' or 'image_to_text'"
    negatives = ("hard_negatives must be None or a 2-D tensor (H x D, H >= 0) with text_features' dtype, "
                 "feature size D and device")

    @classmethod
    def rules(cls):
        return cls.ids, cls.targets, cls.targets_without_ids, cls.direction, cls.negatives


def _describe_tensor(t):
    if not torch.is_tensor(t):
        return type(t).__name__
    return f"a {t.dim()}-D {t.dtype} tensor of shape {tuple(t.shape)} on {t.device}"


def extras_problem(extras, image, text):
    """The first Problem with one rank's Extras (image, text already valid), or None."""
    ids, negatives = extras.sample_ids, extras.hard_negatives
    if ids is not None and not is_id_vector(ids, image.shape[0], image.device):
        return Problem(ValueError, _ExtraRules.ids,
                       f"{_describe_tensor(ids)} (local batch {image.shape[0]} on {image.device})")
    if extras.targets is not None and extras.targets not in TARGETS:
        return Problem(ValueError, _ExtraRules.targets, repr(extras.targets))
    if extras.targets is not None and ids is None:
        return Problem(ValueError, _ExtraRules.targets_without_ids, f"targets={extras.targets!r} and sample_ids=None")
    if extras.direction is not None and extras.direction not in DIRECTIONS:
        return Problem(ValueError, _ExtraRules.direction, repr(extras.direction))
    if negatives is not None and not (torch.is_tensor(negatives) and negatives.dim() == 2
                                      and negatives.shape[1] == text.shape[1] and negatives.dtype == text.dtype
                                      and negatives.device == text.device and negatives.layout == torch.strided):
        return Problem(ValueError, _ExtraRules.negatives,
                       f"{_describe_tensor(negatives)} (text_features: {text.dtype}, D = {text.shape[1]}, "
                       f"on {text.device})")
    return None


def check_extras(fn, extras, image, text):
    """One device: raise the first problem of `extras` (image and text already checked)."""
    problem = extras_problem(extras, image, text)
    if problem is not None:
        problem.raise_for(fn)


def check_direction(fn, direction):
    """A constructor's direction argument."""
    if direction not in DIRECTIONS:
        raise ValueError(f"{fn}: direction must be 'both' or 'image_to_text', got {direction!r}")


def _extra_fields(extras):
    """The Extras' fields of a valid rank's metadata row (EXTRA_FIELDS' order)."""
    ids, negatives, targets = extras.sample_ids, extras.hard_negatives, extras.resolved_targets
    return [int(ids is not None), -1 if targets is None else TARGETS.index(targets),
            -1 if extras.direction is None else DIRECTIONS.index(extras.direction),
            int(negatives is not None), 0 if negatives is None else negatives.shape[0],
            -1 if negatives is None else negatives.shape[1],
            -1 if negatives is None else DTYPE_CODES[negatives.dtype]]


def requires_grad_bits(tensors):
    """Which inputs autograd will differentiate: a rank under torch.no_grad() would skip the backward
    collectives that the other ranks enter."""
    grad_mode = torch.is_grad_enabled()
    return sum(int(grad_mode and t is not None and t.requires_grad) << k for k, t in enumerate(tensors))


# The features and logit scalars of every loss, and every problem they can have, numbered (0: none;
# the last code is a loss's own problem); the other ranks get the bad rank's message itself.
FEATURES = FeaturePair(("image_features", "text_features"), ("batch x dim", "batch x dim"), same_shape=True)
SCALE, BIAS = LossScalar("logit_scale"), LossScalar("logit_bias", optional=True)
_RULES = FEATURES.rules() + SCALE.rules() + BIAS.rules() + _ExtraRules.rules()
_OWN_PROBLEM = len(_RULES) + 1

# The Extras' fields: presence of sample_ids, targets (resolved), direction, presence of
# hard_negatives, their count H_r (may differ per rank), feature size and dtype.
EXTRA_FIELDS = ("has_ids", "targets", "direction", "has_negatives", "negatives", "negatives_dim", "negatives_dtype")
# Column order of the metadata row each rank contributes (the option fields are OPTIONS').
FIELDS = ("batch", "dim", "dtype", "device", "has_bias", "requires_grad", *OPTIONS, "rank_arg", "world_size_arg",
          "scale_dtype", "bias_dtype", *EXTRA_FIELDS)
_PRESENCE = {"has_ids": "sample_ids", "has_negatives": "hard_negatives"}  # given on every rank or on none
# What must agree, in the order checked: (field, description, how a code is shown).
_MUST_AGREE = (
    ("dim", "feature dimension D", {}),
    ("dtype", "feature dtype", DTYPE_NAMES),
    ("device", "feature device type", _DEVICE_NAMES),
    ("has_bias", "presence of logit_bias", {}),
    ("has_ids", "sample_ids", {}),
    ("has_negatives", "hard_negatives", {}),
    ("requires_grad", "requires_grad pattern of (image, text, logit_scale, logit_bias, hard_negatives) under the "
     "grad mode", {}),
    *((name, what, shown) for name, (what, shown) in OPTIONS.items()),
    ("targets", "targets", {-1: "(none)", **dict(enumerate(TARGETS))}),
    ("direction", "direction", {-1: "(none)", **dict(enumerate(DIRECTIONS))}),
    ("scale_dtype", "logit_scale dtype", DTYPE_NAMES),
    ("bias_dtype", "logit_bias dtype", DTYPE_NAMES),
    ("negatives_dim", "hard_negatives feature size D", {}),
    ("negatives_dtype", "hard_negatives dtype", DTYPE_NAMES),
)


def input_problem(image, text, scale, bias, extras=NO_EXTRAS):
    """The first Problem with one rank's inputs, or None. Everything that would make this rank fail
    after the metadata exchange belongs here."""
    problem = FEATURES.problem(image, text)
    if problem is None:
        problem = SCALE.problem(scale, image) or BIAS.problem(bias, image) or extras_problem(extras, image, text)
    return problem


def shard_layout(fn, image, text, scale, bias, group, options, *, rank_arg=None, world_size_arg=None,
                 same_scale_and_bias=False, own_problem=None, extras=NO_EXTRAS, validate="every_call"):
    """Validate the inputs of all ranks (one metadata exchange with a process group) and return the
    ShardLayout. scale and bias are tensors already (as_scalar_tensor). rank_arg / world_size_arg
    are open_clip's constructor arguments, checked against the group when given.
    same_scale_and_bias=True requires every rank to hold the same logit_scale and logit_bias values
    (mixes_ranks_scales). own_problem: None or the Problem the loss found in inputs of its own
    (the distillation loss's teachers). extras: the
    Extras (sample_ids, targets, hard_negatives, direction): validated on every rank; presence,
    targets, direction and the hard negatives' D and dtype must agree; the layout's
    negative_sizes are every rank's H_r (its negatives_layout() gathers them). validate:
    "every_call", or "on_change" (clipshard/parallel/steady_state.py: a call whose metadata row is
    the one validated last checks it on the device, without a host read)."""
    problem = input_problem(image, text, scale, bias, extras)
    code = _RULES.index(problem.rule) + 1 if problem else 0
    if problem is None and own_problem is not None:
        problem, code = own_problem, _OWN_PROBLEM
    if group is None:
        if problem is not None:
            problem.raise_for(fn)
        return _with_negatives(single_process_layout(image.shape[0]), extras)
    if tracing_a_plan():  # a memory plan on fake tensors: no values to exchange
        if problem is not None:
            problem.raise_for(fn)
        negatives = None if extras.hard_negatives is None else extras.hard_negatives.shape[0]
        return planned_layout(group, image.shape[0], negatives)
    if problem is not None:
        fields = [0] * len(FIELDS)
    else:
        fields = [image.shape[0], image.shape[1], DTYPE_CODES[image.dtype], _device_code(image.device.type),
                  int(bias is not None), requires_grad_bits((image, text, scale, bias, extras.hard_negatives)),
                  *_option_codes(options), -1 if rank_arg is None else rank_arg,
                  -1 if world_size_arg is None else world_size_arg, DTYPE_CODES[scale.dtype],
                  -1 if bias is None else DTYPE_CODES[bias.dtype], *_extra_fields(extras)]
    values = (scale, bias) if problem is None else (None, None)
    reported = None if problem is None else (problem.error, code, problem.message)
    checks = (same_scale_and_bias, bias is not None, extras.hard_negatives is not None)
    if torch.compiler.is_compiling():
        return _layout_while_compiling(fn, group, (code, *fields), values, reported, checks)
    if validate == "on_change":
        layout = steady_state.steady(fn, group, (code, *fields), values, same_scale_and_bias)
        if layout is not None:
            return layout
    return _validated_on_host(fn, group, fields, values, reported, checks, validate)


def _validated_on_host(fn, group, fields, values, reported, checks, validate):
    """The metadata exchange and every check of its table on the host; the ShardLayout. checks:
    (same_scale_and_bias, has_bias, has_negatives)."""
    same_scale_and_bias, has_bias, has_negatives = checks
    steady_ranks = None
    if validate == "on_change":
        steady_ranks = lambda rows: steady_state.some_rank_kept(fn, group, rows)  # noqa: E731
    table, values = exchange_rows(fn, group, fields, values, reported, steady_ranks)
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    column = {name: [row[k] for row in table] for k, name in enumerate(FIELDS)}
    for q, (given_rank, given_size) in enumerate(zip(column["rank_arg"], column["world_size_arg"])):
        if given_size not in (-1, world_size):
            raise ValueError(f"{fn}: rank {q} was given world_size={given_size} but the process group has "
                             f"{world_size} ranks")
        if given_rank not in (-1, q):
            raise ValueError(f"{fn}: rank {q} of the process group was given rank={given_rank}")
    for name, what, shown in _MUST_AGREE:
        if name in _PRESENCE:
            require_same_presence(fn, _PRESENCE[name], column[name])
        else:
            require_same(fn, column[name], what, shown)
    if same_scale_and_bias:
        for k, name in enumerate(("logit_scale", "logit_bias")[: 1 + has_bias]):
            require_same_values(fn, name, [row[k] for row in values])
    negative_sizes = tuple(column["negatives"]) if has_negatives else None
    layout = ShardLayout(sizes=tuple(column["batch"]), rank=rank, group=group, negative_sizes=negative_sizes)
    if validate == "on_change":
        steady_state.remember(fn, group, [(0, *row) for row in table], metadata_device(group), layout)
    return layout


def _layout_while_compiling(fn, group, key, values, reported, checks):
    """Under torch.compile: the host validation runs while dynamo traces (when this rank's row is
    not the one validated last; compiled code is specialised on the shapes it saw, and a change
    retraces), and the compiled graph checks the header on the device at every call, as
    validate="on_change" does (clipshard/parallel/steady_state.py)."""
    ranks, tag = tuple(dist.get_process_group_ranks(group)), c10d._get_group_tag(group)
    # a size that dynamo made dynamic after a change is specialised again (len(range(n)) makes dynamo
    # guard on n's value): the layout is a constant of the compiled graph
    key = tuple(len(range(k)) if k >= 0 else k for k in key)
    if reported is not None:  # the error's class by name and the rule it breaks (constants for dynamo; the
        # message's "got ..." part may hold a symbolic size)
        reported = (reported[0].__name__, reported[1])
    # the values (logit scale and bias) are not known while tracing: the graph compares them
    sizes, negative_sizes, keys = _validated_while_tracing(fn, tag, ranks, key, reported,
                                                           (False, *checks[1:]))
    steady_state.check_on_device(fn, group, keys, values, checks[0])
    return ShardLayout(sizes=sizes, rank=dist.get_rank(group), group=group, negative_sizes=negative_sizes)


@constant_under_compile
def _validated_while_tracing(fn, tag, ranks, key, reported, checks):
    """(sizes, negative sizes, every rank's validated row) for `_layout_while_compiling`; dynamo
    calls this once while tracing, with real values (the logit scalars travel as NaN: the compiled
    graph compares them)."""
    group = c10d._find_pg_by_ranks_and_tag(tag, list(ranks))
    layout = steady_state.known_result(fn, group, key)
    if reported is not None:
        reported = ({"ValueError": ValueError, "TypeError": TypeError}[reported[0]], reported[1], _rule_of(reported[1]))
    if layout is None:
        layout = _validated_on_host(fn, group, list(key[1:]), (None, None), reported, checks, "on_change")
    return layout.sizes, layout.negative_sizes, steady_state.known_keys(fn, group)


def _rule_of(code):
    """The rule a problem code breaks, for the message of a rank whose inputs were seen while dynamo
    traced (their own message may hold a symbolic size)."""
    return _RULES[code - 1] if code <= len(_RULES) else "the loss's own inputs break its rules (its error says which)"


def _with_negatives(layout, extras):
    if extras.hard_negatives is None:
        return layout
    return ShardLayout(sizes=layout.sizes, rank=layout.rank, group=layout.group,
                       negative_sizes=(extras.hard_negatives.shape[0],))


def require_same_presence(fn, name, column):
    """Raise on every rank if the optional input `name` is given on some ranks only (column: 0/1)."""
    if len(set(column)) > 1:
        per_rank = ", ".join(f"rank {q}: {'given' if v else 'None'}" for q, v in enumerate(column))
        raise ValueError(f"{fn}: {name} must be given on every rank or on none, got {per_rank}")


def require_same_values(fn, name, column):
    """Raise on every rank if the ranks' values of the logit scalar `name` differ (NaN equals NaN)."""
    if differing_values(column):
        per_rank = ", ".join(f"rank {q}: {v!r}" for q, v in enumerate(column))
        raise ValueError(
            f"{fn}: all ranks must use the same {name} here, got {per_rank}: with mode 'exchange' or "
            "'ring', or local_loss=False, a rank's loss combines terms that the other ranks computed "
            f"with their own {name} (mode='local' with local_loss=True uses each rank's own value, "
            "as open_clip does; docs/distributed.md)")
