"""Sums of the logits of a block's *other* same-id pairs, for targets "multi" (docs/targets.md).

With S = scale * rows @ cols^T + bias and the own pairs (i, pos_offset + i) (none when pos_offset
is None), a row's other same-id pairs are the columns with its id except its own column:

    row_sum[i] = sum_{j != pos_offset + i, col_ids[j] == row_ids[i]} S_ij,
    col_sum[j] = sum_{i: pos_offset + i != j, row_ids[i] == col_ids[j]} S_ij,

with their counts. The callers add the own pair's logit, which the fused op computes anyway, and
divide by 1 + count (`mean_positive`). With all ids distinct every sum here is an exact zero and
every gradient through it too, so "multi" then gives the bits of the loss without ids.

By linearity no pair is visited: row i's sum is scale * rows_i . (sum of the columns with id a_i,
minus its own column) + bias * count, O((M + K) D) time and memory. The sums by id are
deterministic on every device and have static shapes (no torch.unique, no index_add, no host
sync): the columns are sorted by id once (stable), so that an id's columns are a contiguous run; a
segmented scan (shifted adds within tiles, then across them: a fixed tree of additions) leaves
each run's total at its last element, and a row takes the total at the last position of its id
(searchsorted; zero if its id has no column). Its backward is the same computation with rows and
columns swapped, so no gather there ever needs its scatter-add backward. The counts come from the
same searchsorted, exactly.
"""
import torch
import torch.nn.functional as F

from clipshard.ops.inputs import _BLOCK, accumulate_dtype, check_ids, check_logit_scalar


_TILE = 32  # elements per tile of the two-level scan


def _scan_runs(values, sorted_ids):
    """Each element's sum of its run's elements up to itself (values N x W in the order of the
    non-decreasing sorted_ids [N]), so that a run's last element holds the run's total; a new tensor.

    Two levels, a fixed tree of additions either way: within tiles of _TILE elements, log2(_TILE)
    rounds in which every element adds the one d places before it when both have the same id (after
    the round with shift d, element i holds the sum of its run's elements in (i - 2d, i]); across
    tiles, the tiles' last elements are scanned the same way (recursively), and a tile's first run
    adds the sum its id has in the tiles before. A run of one element only ever has zeros added."""
    n, width = values.shape
    tiles, pad = -(-n // _TILE), -n % _TILE
    # the padding continues the last run with zeros, which change no sum
    x = F.pad(values, (0, 0, 0, pad)).view(tiles, _TILE, width)
    ids = torch.cat([sorted_ids, sorted_ids[-1:].expand(pad)]).view(tiles, _TILE)
    shift = 1
    while shift < _TILE:
        same = (ids[:, shift:] == ids[:, :-shift]).unsqueeze(2)
        x[:, shift:] += torch.where(same, x[:, :-shift], 0.0)  # the right side is read before the add
        shift *= 2
    if tiles > 1:
        last_ids = ids[:, -1]
        before = _scan_runs(x[:, -1], last_ids)[:-1]  # per tile: its last id's sum up to its end
        continues = (last_ids[:-1] == ids[1:, 0]).unsqueeze(1) & (ids[1:] == ids[1:, :1])
        x[1:] += torch.where(continues.unsqueeze(2), before.unsqueeze(1), 0.0)
    return x.view(tiles * _TILE, width)[:n]


def _sums_by_id(values, ids, query_ids):
    """For every query id [Q], the sum of the values (N x W) with that id; zero when there is none."""
    if values.shape[0] == 0:
        return values.new_zeros(query_ids.shape[0], values.shape[1])
    sorted_ids, order = torch.sort(ids, stable=True)
    totals = _scan_runs(values.index_select(0, order), sorted_ids)  # each run's total at its end
    last = (torch.searchsorted(sorted_ids, query_ids, right=True) - 1).clamp(min=0)
    found = sorted_ids.index_select(0, last) == query_ids
    return torch.where(found.unsqueeze(1), totals.index_select(0, last), 0.0)


class _SumsById(torch.autograd.Function):
    """_sums_by_id with its own backward: d values_j = the sum of the queries' gradients with id
    ids[j], the same computation with the roles of ids and query_ids swapped (never the scatter-add
    backward of the gathers inside)."""

    @staticmethod
    def forward(ctx, values, ids, query_ids):
        ctx.save_for_backward(ids, query_ids)
        return _sums_by_id(values, ids, query_ids)

    @staticmethod
    def backward(ctx, grad):
        ids, query_ids = ctx.saved_tensors
        return _sums_by_id(grad, query_ids, ids), None, None


def _counts_by_id(ids, query_ids, dtype):
    """For every query id, how many of `ids` equal it (as floats of `dtype`)."""
    sorted_ids = torch.sort(ids).values
    right = torch.searchsorted(sorted_ids, query_ids, right=True)
    return (right - torch.searchsorted(sorted_ids, query_ids)).to(dtype)


def _own_pairs(row_ids, col_ids, pos_offset, k):
    """(own_row [M], own_col [K]): bool, whether row i's own column / column j's own row exists and
    shares its id (a slice and a pad: the own pairs are a diagonal)."""
    m = row_ids.shape[0]
    if pos_offset is None:
        return row_ids.new_zeros(m, dtype=torch.bool), col_ids.new_zeros(k, dtype=torch.bool)
    own_row = row_ids == col_ids[pos_offset:pos_offset + m]
    return own_row, F.pad(own_row, (pos_offset, k - m - pos_offset))


def other_same_id_logit_sums(rows, cols, scale, bias, row_ids, col_ids, pos_offset=None, want_cols=True):
    """(row_sum [M], row_count [M], col_sum [K], col_count [K]): per row the sum of its logits with the
    other columns of its id (its own column pos_offset + i left out) and their number, per column
    likewise with the rows, in the accumulation dtype (fp32; fp64 for fp64 features), counts as
    floats. rows M x D, cols K x D, scale and bias floats or one-element tensors (bias may be None),
    row_ids [M] / col_ids [K] int64 on the rows' device, pos_offset None or 0 <= pos_offset <= K - M.
    want_cols=False: the columns' sum and count are not computed (None). Differentiable in rows,
    cols, scale and bias; deterministic, no host sync."""
    fn = "other_same_id_logit_sums"
    _BLOCK.check(fn, rows, cols)
    check_ids(fn, "row_ids", row_ids, rows.shape[0], rows.device)
    check_ids(fn, "col_ids", col_ids, cols.shape[0], rows.device)
    m, k, d = rows.shape[0], cols.shape[0], rows.shape[1]
    if pos_offset is not None and not (isinstance(pos_offset, int) and 0 <= pos_offset <= k - m):
        raise ValueError(f"{fn}: pos_offset must be None or an int with 0 <= pos_offset <= K - M = {k - m}, "
                         f"got {pos_offset!r}")
    acc = accumulate_dtype(rows.dtype)
    s = check_logit_scalar(fn, "scale", scale, rows).to(acc)
    b = None if bias is None else check_logit_scalar(fn, "bias", bias, rows).to(acc)
    r, c = rows.to(acc), cols.to(acc)
    if col_ids is row_ids:  # (dynamo refuses one tensor as two inputs of an autograd.Function)
        col_ids = col_ids.view_as(col_ids)
    col_totals = _SumsById.apply(c, col_ids, row_ids)  # per row: the columns with its id
    own_row, own_col = _own_pairs(row_ids, col_ids, pos_offset, k)
    # leave the own pair out: its column (row) is subtracted from the group's sum, exactly zero for a
    # group of one
    own_cols = c[pos_offset:pos_offset + m] if pos_offset is not None else r.new_zeros(m, d)
    row_group = torch.where(own_row.unsqueeze(1), col_totals - own_cols, col_totals)
    row_count = _counts_by_id(col_ids, row_ids, acc) - own_row.to(acc)
    row_sum = (r * row_group).sum(1) * s
    if b is not None:
        row_sum = row_sum + b * row_count
    if not want_cols:
        return row_sum, row_count, None, None
    row_totals = _SumsById.apply(r, row_ids, col_ids)  # per column: the rows with its id
    own_rows = F.pad(r, (0, 0, pos_offset, k - m - pos_offset)) if pos_offset is not None else c.new_zeros(k, d)
    col_group = torch.where(own_col.unsqueeze(1), row_totals - own_rows, row_totals)
    col_count = _counts_by_id(row_ids, col_ids, acc) - own_col.to(acc)
    col_sum = (c * col_group).sum(1) * s
    if b is not None:
        col_sum = col_sum + b * col_count
    return row_sum, row_count, col_sum, col_count


def mean_positive(own_logit, other_sum, other_count):
    """The mean logit of the positives: the own pair's logit own_logit (None: the block has no own
    pairs) and the other same-id pairs' sum and count. (own + sum) / (1 + count), which is own
    itself, bit for bit, when there is no other pair; without own pairs sum / count, NaN where
    count is 0 (a row without positives), with a zero gradient there."""
    if own_logit is not None:
        return (own_logit + other_sum) / (1.0 + other_count)
    mean = other_sum / other_count.clamp(min=1.0)
    return torch.where(other_count > 0, mean, torch.full_like(mean, float("nan")))



def _other_group_sums(values, ids, query_ids, own, own_values):
    """For every query [Q]: the sum of the values (N x W) with its id, its own pair's (own_values,
    Q x W, where `own`; None: no own pairs) left out."""
    sums = _sums_by_id(values, ids, query_ids)
    return sums if own_values is None else sums - torch.where(own.unsqueeze(1), own_values, 0.0)


def other_same_id_logit_sums_backward(rows, cols, scale, bias, row_ids, col_ids, pos_offset, g_row_sum, g_col_sum):
    """The gradients (d rows, d cols, d scale, d bias or None) of sum_i g_row_sum_i row_sum_i +
    sum_j g_col_sum_j col_sum_j (other_same_id_logit_sums' outputs, for arguments it has checked), in
    the accumulation dtype, without autograd (a ring backward calls it under torch.compile). Row i
    and column j are an "other pair" of each other (same id, not the own pair) both ways, so with
    g = g_row_sum, h = g_col_sum

        d rows_i = scale * (g_i * (sum of i's other columns) + sum of h_j cols_j over them),
        d cols_j = scale * (h_j * (sum of j's other rows) + sum of g_i rows_i over them),
        d scale  = sum_i g_i rows_i . (i's other columns) + sum_j h_j cols_j . (j's other rows),
        d bias   = sum_i g_i row_count_i + sum_j h_j col_count_j."""
    m, k = rows.shape[0], cols.shape[0]
    acc = accumulate_dtype(rows.dtype)
    r, c, g, h = rows.to(acc), cols.to(acc), g_row_sum.to(acc).unsqueeze(1), g_col_sum.to(acc).unsqueeze(1)
    own_row, own_col = _own_pairs(row_ids, col_ids, pos_offset, k)
    if pos_offset is None:
        at_rows = at_cols = lambda x: None  # noqa: E731
    else:  # the own pairs' values from the other side: a slice of the columns, the rows padded
        at_rows = lambda x: x[pos_offset:pos_offset + m]  # noqa: E731
        at_cols = lambda x: F.pad(x, (0, 0, pos_offset, k - m - pos_offset))  # noqa: E731
    row_group = _other_group_sums(c, col_ids, row_ids, own_row, at_rows(c))
    col_group = _other_group_sums(r, row_ids, col_ids, own_col, at_cols(r))
    weighted_rows, weighted_cols = g * r, h * c
    s = scale.to(acc)
    d_rows = s * (g * row_group + _other_group_sums(weighted_cols, col_ids, row_ids, own_row, at_rows(weighted_cols)))
    d_cols = s * (h * col_group + _other_group_sums(weighted_rows, row_ids, col_ids, own_col, at_cols(weighted_rows)))
    d_scale = (weighted_rows * row_group).sum() + (weighted_cols * col_group).sum()
    d_bias = None
    if bias is not None:
        row_count = _counts_by_id(col_ids, row_ids, acc) - own_row.to(acc)
        col_count = _counts_by_id(row_ids, col_ids, acc) - own_col.to(acc)
        d_bias = (g.squeeze(1) * row_count).sum() + (h.squeeze(1) * col_count).sum()
    return d_rows, d_cols, d_scale, d_bias
