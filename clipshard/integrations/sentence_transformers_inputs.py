"""The inputs of the patched sentence-transformers losses: the embeddings and the sample ids, checked
on this rank, and, when the loss gathers across devices, agreed on by every rank in one metadata
exchange (clipshard.parallel.agreement) before any collective: a bad input on one rank, or ranks that
disagree on the options, raise the same error on every rank instead of a hang.

Without gather_across_devices the library's loss is per rank (no collective), and so is this check.
"""
import zlib

import torch
import torch.distributed as dist

from clipshard.integrations import sentence_transformers_options as options
from clipshard.integrations.sentence_transformers_loss import DIRECTIONS, PARTITION_MODES, TARGETS
from clipshard.losses.base import DTYPE_CODES, DTYPE_NAMES
from clipshard.ops.inputs import SUPPORTED_DTYPES
from clipshard.parallel.agreement import exchange_rows, require_same
from clipshard.parallel.layout import ShardLayout, single_process_layout

_PROBLEM_CODE = 1


def embeddings_problem(embeddings):
    """(exception class, message) for embeddings the library could not use either, or None."""
    if not isinstance(embeddings, (list, tuple)) or len(embeddings) < 2:
        count = len(embeddings) if isinstance(embeddings, (list, tuple)) else type(embeddings).__name__
        return ValueError, f"Expected at least 2 embeddings, got {count}"
    first = embeddings[0]
    for k, e in enumerate(embeddings):
        if not torch.is_tensor(e) or e.dim() != 2:
            got = f"shape {tuple(e.shape)}" if torch.is_tensor(e) else type(e).__name__
            return ValueError, f"embeddings[{k}] must be a 2-D tensor (batch x dim), got {got}"
        if e.shape != first.shape or e.dtype != first.dtype or e.device != first.device:
            return ValueError, (f"every embedding column must have the shape, dtype and device of embeddings[0] "
                                f"({tuple(first.shape)}, {first.dtype}, {first.device}), got embeddings[{k}]: "
                                f"{tuple(e.shape)}, {e.dtype}, {e.device}")
    return None


def ids_problem(ids, batch, device):
    """(exception class, message) for sample ids (the batch's labels) that are not B int ids with
    values, or None (ids on another device than the embeddings are moved there)."""
    expected = f"labels (the sample ids) must be a 1-D integer tensor of length {batch} (the local batch)"
    if not torch.is_tensor(ids):
        return TypeError, f"{expected}, got {type(ids).__name__}"
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        return TypeError, f"{expected}, got dtype {ids.dtype} (a score or label column is not an id column)"
    if ids.dim() != 1 or ids.shape[0] != batch:
        return ValueError, f"{expected}, got shape {tuple(ids.shape)}"
    if ids.is_meta:
        return ValueError, f"{expected} with values, got a tensor on the meta device (no values to read)"
    return None


def layout_problem(embeddings):
    """Why embeddings that the library accepts are not fused (sparse or of another dtype), or None."""
    first = embeddings[0]
    if first.layout != torch.strided:
        return f"{first.layout} embeddings (only dense ones are fused)"
    if first.dtype not in SUPPORTED_DTYPES:
        return f"{first.dtype} embeddings"
    return None


def _code(text):
    return zlib.crc32(str(text).encode())


def _directions_code(directions):
    return sum(1 << k for k, d in enumerate(DIRECTIONS) if d in directions)


_SIMILARITIES = ("cos_sim", "pytorch_cos_sim", "dot_score")
_SHOWN = {  # how the codes of _AGREE's fields read in a message
    "dtype": DTYPE_NAMES,
    "similarity_fct": {_code(name): name for name in _SIMILARITIES},
    "directions": {m: "+".join(d for k, d in enumerate(DIRECTIONS) if m >> k & 1) for m in range(1, 16)},
    "partition_mode": {_code(m): m for m in PARTITION_MODES},
    "hardness_mode": {_code(m): str(m) for m in options.HARDNESS_MODES},
    "targets of the sample ids": {_code(t): str(t) for t in TARGETS},
    "fused or fallen back": {_code(None): "fused"},
}


# What each rank sends (after its problem code): the fields that must agree, in the order checked,
# with how a value is shown in the message.
_AGREE = ("dim", "dtype", "device", "embedding columns", "similarity_fct", "directions", "partition_mode",
          "hardness_mode", "sample ids (given or not)", "targets of the sample ids", "fused or fallen back")


def check_and_layout(fn, loss, embeddings, ids, targets, gather, reason):
    """Check this rank's inputs (and, when `gather` and torch.distributed is initialised with
    several ranks, every rank's) and return the ShardLayout of the batch to gather (a single
    process's without gathering). ids: the sample ids or None; reason: options.fallback_reason
    of this rank (None when fused)."""
    problem = embeddings_problem(embeddings)
    if problem is None and ids is not None:
        problem = ids_problem(ids, embeddings[0].shape[0], embeddings[0].device)
    group_size = dist.get_world_size() if gather and dist.is_available() and dist.is_initialized() else 1
    if group_size == 1:
        if problem is not None:
            raise problem[0](f"{fn}: {problem[1]}")
        _check_ids_fused(fn, ids, reason)
        return single_process_layout(embeddings[0].shape[0])
    group = dist.group.WORLD
    first = embeddings[0] if problem is None else None
    fields = [0] * (1 + len(_AGREE)) if problem is not None else [
        first.shape[0], first.shape[1], DTYPE_CODES.get(first.dtype, -1), _code(first.device.type), len(embeddings),
        _code(options.similarity_name(loss.similarity_fct)), _directions_code(loss.directions), _code(loss.partition_mode),
        _code(loss.hardness_mode), int(ids is not None), _code(targets), _code(reason)]
    values = [torch.tensor(float(v), dtype=torch.float64) for v in (loss.scale, loss.hardness_strength)]
    table, floats = exchange_rows(fn, group, fields, values if problem is None else (None, None),
                                  None if problem is None else (problem[0], _PROBLEM_CODE, problem[1]))
    for k, what in enumerate(_AGREE, start=1):
        require_same(fn, [row[k] for row in table], what, _SHOWN.get(what))
    for k, name in enumerate(("scale", "hardness_strength")):
        require_same(fn, [row[k] for row in floats], name)
    sizes = tuple(row[0] for row in table)
    _check_ids_fused(fn, ids, reason)
    if reason is not None and len(set(sizes)) > 1:
        raise ValueError(f"{fn}: unequal local batches {list(sizes)} with gather_across_devices=True need "
                         f"clipshard's fused loss, but {reason} falls back to the library's computation, whose "
                         "gather needs equal local batches")
    return ShardLayout(sizes=sizes, rank=dist.get_rank(group), group=group)


def _check_ids_fused(fn, ids, reason):
    if ids is not None and reason is not None:
        raise ValueError(f"{fn}: sample ids (labels_as_ids) need clipshard's fused loss, but {reason} falls back "
                         "to the library's own computation, which has no sample ids")
