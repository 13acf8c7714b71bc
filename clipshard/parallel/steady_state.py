"""Cross-rank validation without a host read in steady state: the losses' validate="on_change"
(docs/distributed.md, "Compiling and host syncs").

The metadata exchange (clipshard.parallel.agreement.exchange_rows) all-gathers one row per rank,
[problem code, fields..., values...], and every rank reads the table on the host to check it. On a
GPU that read waits for the forward to finish, every call. With validate="on_change" a call whose
row (code and fields: host-side facts such as shapes, dtypes and options) is the one this rank had
when the ranks last validated is *steady*: it all-gathers the same row as a header, with a
functional collective, and checks on the device, with torch._assert_async, that every rank's fields
are still the validated ones (and, where the loss needs it, that the ranks' values agree); no host
read. A call whose row changed revalidates through the host as before.

Every rank runs the same collective either way (a steady rank's header gather is the changed rank's
metadata exchange: same size, dtype and device), so a rank that changed alone cannot leave the
others waiting: the steady ranks' device check fails, and the changed rank, which sees in the table
that some ranks kept their validated fields, raises too. What the option gives up: a change on some
ranks only raises on every rank even when it would be valid (a last batch smaller on some ranks
only: use drop_last=True, or validate="every_call"), and the steady ranks' message cannot say which
rank changed what (on a GPU it surfaces at the next synchronisation, as a device-side assertion).
The validated rows are kept per (loss name, process group, slot): ranks must make the same calls in
the same order, as they must anyway for the collectives to match.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

VALIDATE = ("every_call", "on_change")

_NAN = float("nan")


def check_validate(fn, validate):
    if validate not in VALIDATE:
        raise ValueError(f"{fn}: validate must be 'every_call' or 'on_change', got {validate!r}")


@dataclass(frozen=True)
class _Validated:
    keys: tuple  # every rank's validated (code, *fields), in rank order
    keys_on_device: torch.Tensor  # the same, N x K int64 on the metadata device
    result: object  # what the caller derived from the table (a ShardLayout, or None)


_VALIDATED = {}


def _slot(fn, group, slot):
    return fn, group, slot


def steady(fn, group, key, values, check_values, slot=""):
    """If this rank's `key` (code, *fields) is the one validated last in this slot: the header
    gather and its device check, and the validated result (a steady call). Else None: the caller
    revalidates through the host (exchange_rows), then calls `remember`."""
    known = _VALIDATED.get(_slot(fn, group, slot))
    if known is None or known.keys[dist.get_rank(group)] != tuple(key):
        return None
    check_on_device(fn, group, known.keys_on_device, values, check_values)
    return known.result


def known_result(fn, group, key, slot=""):
    """The validated result if this rank's `key` is the one validated last, else None (no check)."""
    known = _VALIDATED.get(_slot(fn, group, slot))
    return None if known is None or known.keys[dist.get_rank(group)] != tuple(key) else known.result


def some_rank_kept(fn, group, rows, slot=""):
    """Whether some rank's row ([code, *fields]) is the one it had at the last validation in this
    slot: that rank made a steady call (a host-validating rank then knows it is not listening)."""
    known = _VALIDATED.get(_slot(fn, group, slot))
    return known is not None and any(tuple(row) == key for row, key in zip(rows, known.keys))


def known_keys(fn, group, slot=""):
    """(every rank's validated row, the metadata device's name) of a slot."""
    known = _VALIDATED[_slot(fn, group, slot)]
    return known.keys, str(known.keys_on_device.device)


def check_on_device(fn, group, keys, values, check_values):
    """All-gather this rank's validated row with its `values` as fp64 bits (the metadata exchange's
    row: the same collective) and assert on the device that every rank's row is its validated one
    and, with check_values, that the ranks' values agree (NaN equal to NaN). keys: the validated
    rows, an N x K int64 tensor on the metadata device, or (rows, device name) as known_keys gives."""
    from torch.distributed import _functional_collectives as fc

    if not torch.is_tensor(keys):
        keys = torch.tensor(keys[0], dtype=torch.int64, device=torch.device(keys[1]))
    mine = keys[dist.get_rank(group)]
    bits = [v.detach().reshape(1).to(torch.float64) if v is not None and v.device.type != "meta"
            else mine.new_full((1,), _NAN, dtype=torch.float64) for v in values]
    header = torch.cat([mine] + [b.to(mine.device).view(torch.int64) for b in bits])
    gather = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor  # renamed in recent torch
    table = gather(header, 0, group).view(keys.shape[0], -1)
    width = keys.shape[1]
    same = (table[:, :width] == keys).all()
    if check_values and values:
        floats = table[:, width:].contiguous().view(torch.float64)
        first = floats[:1]
        same = same & ((floats == first) | (torch.isnan(floats) & torch.isnan(first))).all()
    torch._assert_async(same, f"{fn}: the ranks' inputs changed since the ranks validated them, on some ranks "
                              "only, or are invalid on some rank, or their logit scales or biases differ where they "
                              "must agree (validate='on_change' checks this on the device and cannot say which; "
                              "the rank that changed raises the detailed error, and validate='every_call' "
                              "names it on every rank)")


def remember(fn, group, keys, device, result, slot=""):
    """After a host validation of the table's `keys` (every rank's (code, *fields)): raise if some
    ranks kept their validated fields while this one changed (they made a steady call, whose check
    fails), else keep the keys and `result` for the next steady calls."""
    keys = tuple(tuple(k) for k in keys)
    known = _VALIDATED.get(_slot(fn, group, slot))
    if known is not None:
        kept = [q for q, (old, new) in enumerate(zip(known.keys, keys)) if old == new]
        if kept:
            changed = [q for q in range(len(keys)) if q not in kept]
            raise ValueError(
                f"{fn}: with validate='on_change' every rank must change the shapes, dtypes or options of its "
                f"inputs at the same call, but ranks {changed} changed them and ranks {kept} did not (a last "
                "batch smaller on some ranks only: use drop_last=True, or validate='every_call')")
    keys_on_device = torch.tensor(keys, dtype=torch.int64, device=device)
    _VALIDATED[_slot(fn, group, slot)] = _Validated(keys, keys_on_device, result)


def forget_all():
    """Drop every validated row (every rank at the same point: the next calls validate on the host)."""
    _VALIDATED.clear()
