"""Sums of the logits of a block's *other* same-id pairs, for targets "multi" (docs/targets.md).

With S = scale * rows @ cols^T + bias and the own pairs (i, pos_offset + i) (none when pos_offset
is None), a row's other same-id pairs are the columns with its id except its own column:

    row_sum[i] = sum_{j != pos_offset + i, col_ids[j] == row_ids[i]} S_ij,
    col_sum[j] = sum_{i: pos_offset + i != j, row_ids[i] == col_ids[j]} S_ij,

with their counts. The callers add the own pair's logit, which the fused op computes anyway, and
divide by 1 + count (`mean_positive`). With all ids distinct every sum here is an exact zero and
every gradient through it too, so "multi" then gives the bits of the loss without ids.

By linearity no pair is visited: row i's sum is scale * rows_i . (sum of the columns with id a_i,
minus its own column) + bias * count, O((M + K) D). The group sums are deterministic on every device
and have static shapes (no torch.unique, no index_add, no host sync): the M + K ids are sorted once
(stable); in sorted order an id group is a contiguous run, and a segmented scan (log2(M + K) rounds,
each adding to every element the one `shift` places before it when both have the same id, a fixed
tree of additions) leaves each run's total at its last element; a second scan, reversed, spreads the
total over the run. The sort's permutation is undone by a gather whose backward is the inverse
gather, never a scatter-add.
"""
import torch

from clipshard.ops.inputs import _BLOCK, accumulate_dtype, check_ids, check_logit_scalar


class _Permute(torch.autograd.Function):
    """values[order] with the backward grad[inverse] (order a permutation, inverse its inverse):
    index_select's own backward is index_add, float atomics on CUDA."""

    @staticmethod
    def forward(ctx, values, order, inverse):
        ctx.save_for_backward(inverse)
        return values.index_select(0, order)

    @staticmethod
    def backward(ctx, grad):
        inverse, = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _run_totals(values, sorted_ids):
    """For every element of `values` (N x W, in the order of the non-decreasing sorted_ids [N]) the
    sum of its run of equal ids. A run of one element is returned exactly (nothing is added to it)."""
    n = values.shape[0]
    # forward scan: after the round with shift d, element i holds the sum of its run's elements in
    # (i - 2d, i]; the run's last element ends with the run's total
    partial, shift = values, 1
    while shift < n:
        same = (sorted_ids[shift:] == sorted_ids[:-shift]).unsqueeze(1)
        tail = partial[shift:]
        partial = torch.cat([partial[:shift], torch.where(same, tail + partial[:-shift], tail)])
        shift *= 2
    last = torch.cat([sorted_ids[1:] != sorted_ids[:-1], sorted_ids.new_ones(min(n, 1), dtype=torch.bool)])
    spread = torch.where(last.unsqueeze(1), partial, torch.zeros_like(partial))
    # reversed scan over zeros and one total per run: every element gets its run's total
    shift = 1
    while shift < n:
        same = (sorted_ids[:-shift] == sorted_ids[shift:]).unsqueeze(1)
        head = spread[:-shift]
        spread = torch.cat([torch.where(same, head + spread[shift:], head), spread[-shift:]])
        shift *= 2
    return spread


def _own_pairs(row_ids, col_ids, pos_offset, k):
    """(own_row [M], own_col [K]): bool, whether row i's own column / column j's own row exists and
    shares its id (a slice and a pad: the own pairs are a diagonal)."""
    m = row_ids.shape[0]
    if pos_offset is None:
        return row_ids.new_zeros(m, dtype=torch.bool), col_ids.new_zeros(k, dtype=torch.bool)
    own_row = row_ids == col_ids[pos_offset:pos_offset + m]
    return own_row, torch.nn.functional.pad(own_row, (pos_offset, k - m - pos_offset))


def other_same_id_logit_sums(rows, cols, scale, bias, row_ids, col_ids, pos_offset=None):
    """(row_sum [M], row_count [M], col_sum [K], col_count [K]): per row the sum of its logits with the
    other columns of its id (its own column pos_offset + i left out) and their number, per column
    likewise with the rows, in the accumulation dtype (fp32; fp64 for fp64 features), counts as
    floats. rows M x D, cols K x D, scale and bias floats or one-element tensors (bias may be None),
    row_ids [M] / col_ids [K] int64 on the rows' device, pos_offset None or 0 <= pos_offset <= K - M.
    Differentiable in rows, cols, scale and bias; deterministic, no host sync."""
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
    # one element per row and per column: (column features, row features, column count, row count),
    # each filled by its own kind, so that a run's total holds both groups' sums
    ones = lambda n: r.new_ones(n, 1)  # noqa: E731
    zeros = lambda n, w: r.new_zeros(n, w)  # noqa: E731
    values = torch.cat([torch.cat([zeros(m, d), r, zeros(m, 1), ones(m)], 1),
                        torch.cat([c, zeros(k, d), ones(k), zeros(k, 1)], 1)])
    sorted_ids, order = torch.sort(torch.cat([row_ids, col_ids]), stable=True)
    inverse = torch.argsort(order)
    totals = _Permute.apply(_run_totals(_Permute.apply(values, order, inverse), sorted_ids), inverse, order)
    own_row, own_col = _own_pairs(row_ids, col_ids, pos_offset, k)
    # leave the own pair out: its column (row) is subtracted from the group's sum, exactly zero for a
    # group of one
    own_cols = c[pos_offset:pos_offset + m] if pos_offset is not None else zeros(m, d)
    own_rows = torch.nn.functional.pad(r, (0, 0, pos_offset, k - m - pos_offset)) if pos_offset is not None \
        else zeros(k, d)
    row_group, col_group = totals[:m, :d], totals[m:, d:2 * d]
    row_group = torch.where(own_row.unsqueeze(1), row_group - own_cols, row_group)
    col_group = torch.where(own_col.unsqueeze(1), col_group - own_rows, col_group)
    row_count = totals[:m, 2 * d] - own_row.to(acc)
    col_count = totals[m:, 2 * d + 1] - own_col.to(acc)
    row_sum = (r * row_group).sum(1) * s
    col_sum = (c * col_group).sum(1) * s
    if b is not None:
        row_sum, col_sum = row_sum + b * row_count, col_sum + b * col_count
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
