"""Sums of the logits of the same-id pairs of a block, for targets "multi" (docs/targets.md).

    row_sum[i] = sum_{j: col_ids[j] == row_ids[i]} S_ij,   col_sum[j] = sum_{i: row_ids[i] == col_ids[j]} S_ij,

S = scale * rows @ cols^T + bias, with the counts of those pairs. By linearity no pair is visited:
the features of each id group are summed first (torch.unique over both id vectors, then index_add),
and row i's sum is one dot with its group's column sum, scale * rows_i . (sum of cols with id a_i)
+ bias * count. O((M + K) D) time and memory, plain autograd.
"""
import torch

from clipshard.ops.inputs import _BLOCK, accumulate_dtype, check_ids, check_logit_scalar


def _group_sums(values, groups, n_groups):
    """n_groups x ... sums of `values` (N x ...) by group index (N)."""
    return values.new_zeros((n_groups,) + values.shape[1:]).index_add(0, groups, values)


def same_id_logit_sums(rows, cols, scale, bias, row_ids, col_ids):
    """(row_sum [M], row_count [M], col_sum [K], col_count [K]): per row the sum of its logits with the
    columns of its id and their number, per column likewise with the rows, in the accumulation dtype
    (fp32; fp64 for fp64 features), counts as floats. rows M x D, cols K x D, scale and bias floats or
    one-element tensors (bias may be None), row_ids [M] / col_ids [K] int64 on the rows' device.
    Differentiable in rows, cols, scale and bias."""
    fn = "same_id_logit_sums"
    _BLOCK.check(fn, rows, cols)
    check_ids(fn, "row_ids", row_ids, rows.shape[0], rows.device)
    check_ids(fn, "col_ids", col_ids, cols.shape[0], rows.device)
    acc = accumulate_dtype(rows.dtype)
    s = check_logit_scalar(fn, "scale", scale, rows).to(acc)
    b = None if bias is None else check_logit_scalar(fn, "bias", bias, rows).to(acc)
    m = rows.shape[0]
    ids, groups = torch.unique(torch.cat([row_ids, col_ids]), return_inverse=True)
    row_groups, col_groups = groups[:m], groups[m:]
    n = ids.shape[0]
    r, c = rows.to(acc), cols.to(acc)
    ones = lambda t: torch.ones(t.shape[0], dtype=acc, device=t.device)  # noqa: E731
    row_count = _group_sums(ones(c), col_groups, n).index_select(0, row_groups)
    col_count = _group_sums(ones(r), row_groups, n).index_select(0, col_groups)
    row_sum = (r * _group_sums(c, col_groups, n).index_select(0, row_groups)).sum(1) * s
    col_sum = (c * _group_sums(r, row_groups, n).index_select(0, col_groups)).sum(1) * s
    if b is not None:
        row_sum, col_sum = row_sum + b * row_count, col_sum + b * col_count
    return row_sum, row_count, col_sum, col_count
