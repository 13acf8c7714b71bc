"""Agreement across ranks before any collective: every rank contributes one metadata row (int64
fields, then fp64 values) in one all-gather, and every rank checks all rows with the same code, so
that a problem on one rank, or ranks that disagree, raise the same error on every rank instead of
leaving some of them waiting in a collective.

The caller owns the row: what each field and value means, what a problem's message says, and
what a message says about a disagreement; this module only moves and compares numbers, and, when a
rank has a problem, that rank's message (so that every rank's error says what it passed).
"""
import math
import struct

import torch
import torch.distributed as dist

from clipshard.parallel.collectives import all_gather_single
from clipshard.parallel.layout import metadata_device

# A value that cannot be read (on the meta device, which holds no data, or absent) travels as NaN.
_NAN_BITS = struct.unpack("<q", struct.pack("<d", math.nan))[0]


def exchange_rows(fn, group, fields, values, problem=None, steady_ranks=None):
    """Every rank's (fields, values), in rank order, after raising on every rank if any rank has a
    problem.

    fields: ints, values: 0-dim floating-point tensors or None; their counts must be the same on
    every rank (a rank with a problem still sends placeholders). problem: None or (exception
    class, code >= 1, message): the rank that has it raises `message`, the others a ValueError
    naming that rank and carrying the same message (what that rank expected and what it got).
    steady_ranks: None, or a function of the table's rows ([code, *fields] per rank) that says
    whether some ranks made a steady call (validate="on_change", steady_state.py): they check on the
    device and take part in no broadcast, so the bad rank's message is then not sent.
    Returns (list of field lists, list of value lists as Python floats).
    """
    code = 0 if problem is None else problem[1]
    if group is None:
        if problem is not None:
            raise problem[0](f"{fn}: {problem[2]}")
        return [list(fields)], None
    world_size, rank = dist.get_world_size(group), dist.get_rank(group)
    device = metadata_device(group)
    mine = torch.tensor([code, *fields] + [_NAN_BITS] * len(values), dtype=torch.int64, device=device)
    if problem is None:
        bits = mine[1 + len(fields):].view(torch.float64)
        for k, value in enumerate(values):
            if value is not None and value.device.type != "meta":
                bits[k: k + 1].copy_(value.detach().reshape(1))
    everyone = torch.empty(world_size * mine.numel(), dtype=torch.int64, device=device)
    all_gather_single(everyone, mine, group=group)
    everyone = everyone.view(world_size, -1).cpu()  # one copy to the host
    table = everyone[:, : 1 + len(fields)].tolist()
    quiet = steady_ranks is not None and steady_ranks(table)
    _raise_first(fn, group, device, [row[0] for row in table], rank, problem, send_message=not quiet)
    floats = everyone[:, 1 + len(fields):].contiguous().view(torch.float64).tolist()
    return [row[1:] for row in table], floats


def _raise_first(fn, group, device, codes, rank, problem, send_message=True):
    """Raises on every rank if a rank has a problem: the first such rank its own error, the others
    a ValueError naming that rank and quoting its message (one broadcast, only when a rank has one
    and send_message)."""
    bad = next((q for q, code in enumerate(codes) if code), None)
    if bad is None:
        return
    if bad == rank:
        if send_message:
            _broadcast_message(group, device, bad, problem[2])
        raise problem[0](f"{fn}: {problem[2]} (on rank {bad})")
    if not send_message:
        raise ValueError(f"{fn}: rank {bad} has invalid inputs (its own error says which; with validate='on_change' "
                         "it is not sent while other ranks check on the device)")
    raise ValueError(f"{fn}: rank {bad} has invalid inputs: {_broadcast_message(group, device, bad, '')}")


_MESSAGE_BYTES = 4096  # a longer message arrives cut, ending in "..."


def _broadcast_message(group, device, source, message):
    """`message` of rank `source` of `group` (UTF-8, at most _MESSAGE_BYTES) on every rank."""
    data = message.encode()
    if len(data) > _MESSAGE_BYTES:
        data = data[: _MESSAGE_BYTES - 3] + b"..."
    buffer = torch.zeros(_MESSAGE_BYTES, dtype=torch.uint8)
    buffer[: len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    buffer = buffer.to(device)
    dist.broadcast(buffer, group_src=source, group=group)
    return bytes(buffer.cpu().tolist()).rstrip(b"\0").decode(errors="replace")


def raise_on_every_rank(fn, problem, group):
    """`problem`: (exception class, message) of this rank's inputs, or None. One all-gather of a
    flag (exchange_rows without fields), so that a problem on one rank raises on every rank."""
    exchange_rows(fn, group, (), (), None if problem is None else (problem[0], 1, problem[1]))


def require_same(fn, column, what, shown=None):
    """Raise on every rank if the ranks' `column` (one number per rank, in rank order) differ;
    `shown` maps a number to what the message prints."""
    if len(set(column)) > 1:
        per_rank = ", ".join(f"rank {q}: {(shown or {}).get(v, v)}" for q, v in enumerate(column))
        raise ValueError(f"{fn}: all ranks must use the same {what}, got {per_rank}")


def differing_values(column):
    """Whether the ranks' float values differ (NaN equals NaN: a value no rank could read)."""
    first = column[0]
    return any(v != first and not (math.isnan(v) and math.isnan(first)) for v in column)
