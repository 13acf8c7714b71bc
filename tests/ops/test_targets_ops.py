"""Sample ids, targets "mask" / "multi" and extra columns (hard negatives) in the block ops
(contrastive_lse, contrastive_lse_backward, siglip_sum, siglip_block, other_same_id_logit_sums), against the
materialised fp64 references of tests/references/targets.py: values and the gradients of a loss-like
scalar (upstream weights around 0.5 / M) with respect to rows, cols, extra_cols, scale and bias, in
fp64 and fp32, over several column chunks; all ids equal, all distinct (bit-equal to the call
without ids), ~10% duplicates, no positives (pos_offset None), no extra columns (H = 0); bad inputs."""
import math

import pytest
import torch

from clipshard.ops.contrastive_lse import contrastive_lse, contrastive_lse_backward
from clipshard.ops.same_id import other_same_id_logit_sums, other_same_id_logit_sums_backward
from clipshard.ops.siglip_sum import siglip_block, siglip_sum
from tests.references.similarity import similarity_reference
from tests.references.targets import contrastive_block_terms, siglip_block_sum

ALGORITHMS = ["torch", "auto"]
DTYPES = [torch.float64, torch.float32]
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
# M, K, D, pos_offset, scale, bias, workspace_bytes, ids kind, H (extra columns). workspace_bytes=1:
# chunks of 128 columns, so K = 301 takes three.
CASES = [
    (37, 53, 19, 7, 14.3, 0.75, None, "duplicates", 5),
    (37, 301, 19, 11, 100.0, -2.0, 1, "duplicates", 0),
    (37, 301, 19, None, 14.3, None, 1, "duplicates", 3),
    (29, 301, 13, 0, 30.0, 0.5, 1, "equal", 4),
    (41, 260, 17, 219, 14.3, None, 1, "distinct", 2),
    (23, 131, 5, None, 50.0, 1.5, 1, "equal", 1),
]


def case_id(case):
    return "M{}K{}D{}p{}s{}b{}w{}-{}-H{}".format(*case)


def features(n, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1).to(dtype)


def sample_ids(m, k, pos_offset, kind, seed):
    """(row_ids, col_ids): the own pair shares its id; "distinct": every other id differs; "equal":
    one id for all; "duplicates": ~10% of the rows repeat another row's id and ~10% of the other
    columns take a row's id."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "equal":
        return torch.full((m,), 7, dtype=torch.int64), torch.full((k,), 7, dtype=torch.int64)
    row_ids = torch.arange(m, dtype=torch.int64) * 3 + 1000
    col_ids = torch.arange(k, dtype=torch.int64) * 3 + 1001  # never a row's id
    if kind == "duplicates":
        repeat = torch.rand(m, generator=gen) < 0.1
        row_ids = torch.where(repeat, row_ids[torch.randint(0, m, (m,), generator=gen)], row_ids)
        collide = torch.rand(k, generator=gen) < 0.1
        col_ids = torch.where(collide, row_ids[torch.randint(0, m, (k,), generator=gen)], col_ids)
    if pos_offset is not None:
        col_ids[pos_offset: pos_offset + m] = row_ids
    return row_ids, col_ids


def block_inputs(case, dtype, seed=0):
    m, k, d, pos, scale, bias, workspace, kind, h = case
    rows, cols, extra = (features(n, d, dtype, seed + i) for i, n in enumerate((m, k, h)))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.tensor(scale, dtype=acc)
    b = None if bias is None else torch.tensor(bias, dtype=acc)
    row_ids, col_ids = sample_ids(m, k, pos, kind, seed + 10)
    return rows, cols, extra, s, b, row_ids, col_ids


def leaves(*tensors, double=False):
    return [None if t is None else (t.double() if double else t).detach().clone().requires_grad_() for t in tensors]


def upstream(n, m, seed):
    """Positive upstream gradients around 0.5 / M, different per entry."""
    gen = torch.Generator().manual_seed(seed)
    return (0.5 + 0.5 * torch.rand(n, generator=gen, dtype=torch.float64)) / m


def lse_objective(row_lse, pos, col_lse, m):
    """A loss-like scalar: weighted row and column LSEs minus the weighted finite positives."""
    pos = torch.where(torch.isfinite(pos), pos.double(), torch.zeros_like(pos, dtype=torch.float64))
    return ((upstream(m, m, 1) * row_lse.double()).sum() - (upstream(m, m, 2) * pos).sum()
            + (upstream(col_lse.shape[0], m, 3) * col_lse.double()).sum())


def grads_of(objective, tensors):
    """The gradients of objective with respect to the tensors that are not None."""
    wanted = [t for t in tensors if t is not None]
    return torch.autograd.grad(objective, wanted, allow_unused=True, materialize_grads=True)  # H = 0: unused


def without_extra_grad(grads):
    """grads_of(..., (rows, cols, extra_cols, scale, bias)) less the extra columns' gradient."""
    return grads[:2] + grads[3:]


def assert_close(got, ref, tol, what):
    atol = tol * max(ref.abs().nan_to_num(0.0).max().item() if ref.numel() else 0.0, 1e-12)
    torch.testing.assert_close(got.double(), ref, rtol=tol, atol=atol, equal_nan=True, msg=lambda m: f"{what}: {m}")


def assert_all_close(got, ref, tol, names, case):
    assert len(got) == len(ref)
    for name, g, r in zip(names, got, ref):
        assert_close(g, r, tol, f"{case_id(case)} {name}")


def run_contrastive(case, dtype, targets, algorithm, with_extra=True, use_ids=True):
    m, k, d, pos, scale, bias, workspace, kind, h = case
    rows, cols, extra, s, b, row_ids, col_ids = block_inputs(case, dtype)
    extra = extra if with_extra else None
    ids = dict(row_ids=row_ids, col_ids=col_ids, targets=targets) if use_ids else {}
    got_leaves = leaves(rows, cols, extra, s, b)
    out = contrastive_lse(got_leaves[0], got_leaves[1], got_leaves[3], got_leaves[4], pos, extra_cols=got_leaves[2],
                          algorithm=algorithm, workspace_bytes=workspace, **ids)
    return out, grads_of(lse_objective(*out, m), got_leaves), (rows, cols, extra, s, b, row_ids, col_ids)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("targets", ["mask", "multi"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_contrastive_lse_matches_reference(case, dtype, targets, algorithm):
    m, pos = case[0], case[3]
    out, grads, (rows, cols, extra, s, b, row_ids, col_ids) = run_contrastive(case, dtype, targets, algorithm)
    ref_leaves = leaves(rows, cols, extra, s, b, double=True)
    row_lse, row_pos, col_lse, _ = contrastive_block_terms(ref_leaves[0], ref_leaves[1], ref_leaves[3], ref_leaves[4],
                                                           pos, row_ids, col_ids, targets, ref_leaves[2])
    ref_grads = grads_of(lse_objective(row_lse, row_pos, col_lse, m), ref_leaves)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(o.dtype == acc for o in out)
    assert torch.isnan(out[1]).tolist() == torch.isnan(row_pos).tolist()
    assert_all_close(out, (row_lse, row_pos, col_lse), TOL[dtype], ("row_lse", "pos_logit", "col_lse"), case)
    assert_all_close(grads, ref_grads, TOL[dtype], ("d rows", "d cols", "d extra_cols", "d scale", "d bias"), case)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("targets", ["mask", "multi"])
def test_contrastive_distinct_ids_bit_equal_to_no_ids(targets, algorithm):
    """All ids distinct: "mask" excludes nothing and "multi"'s only positive is the own pair, so the
    call gives the call without ids, bit for bit (same algorithm as the ids call takes)."""
    case = (37, 301, 19, 11, 14.3, 0.75, 1, "distinct", 0)
    with_ids, grads_ids, _ = run_contrastive(case, torch.float32, targets, algorithm)
    without, grads_without, _ = run_contrastive(case, torch.float32, None, algorithm, use_ids=False)
    for got, ref in zip(with_ids + grads_ids, without + grads_without):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_contrastive_no_extra_columns(algorithm):
    """H = 0 extra columns change nothing; pos_offset None without ids gives NaN positives."""
    case = (37, 53, 19, 7, 14.3, 0.75, None, "duplicates", 0)
    with_empty, grads_empty, _ = run_contrastive(case, torch.float64, "mask", algorithm)
    without, grads_without, _ = run_contrastive(case, torch.float64, "mask", algorithm, with_extra=False)
    assert grads_empty[2].shape == (0, 19)
    for got, ref in zip(with_empty + without_extra_grad(grads_empty), without + grads_without):
        assert torch.equal(got, ref)
    rows, cols = features(5, 3, torch.float64, 0), features(8, 3, torch.float64, 1)
    row_lse, pos, col_lse = contrastive_lse(rows, cols, 2.0, None, None, algorithm=algorithm)
    assert torch.isnan(pos).all()
    assert_close(row_lse, torch.logsumexp(similarity_reference(rows, cols, torch.tensor(2.0)), 1), 1e-12, "row_lse")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES[1:4], ids=case_id)
def test_contrastive_lse_backward_with_ids(case, dtype, algorithm):
    """Ring mode's manual backward with the "mask" exclusion, for the LSEs of the forward."""
    m, k, d, pos, scale, bias, workspace, kind, h = case
    rows, cols, _, s, b, row_ids, col_ids = block_inputs(case, dtype)
    row_lse, pos_logit, col_lse = contrastive_lse(rows, cols, s, b, pos, row_ids=row_ids, col_ids=col_ids,
                                                  targets="mask", algorithm=algorithm, workspace_bytes=workspace)
    g_row, g_col = upstream(m, m, 1).to(row_lse.dtype), upstream(k, m, 3).to(row_lse.dtype)
    g_pos = -upstream(m, m, 2).to(row_lse.dtype)
    got = contrastive_lse_backward(g_row, g_pos, g_col, rows, cols, s, b, pos, row_lse, col_lse, row_ids=row_ids,
                                   col_ids=col_ids, algorithm=algorithm, workspace_bytes=workspace)
    ref_leaves = leaves(rows, cols, s, b, double=True)
    ref_row, ref_pos, ref_col, _ = contrastive_block_terms(*ref_leaves, pos, row_ids, col_ids, "mask")
    ref_grads = grads_of(lse_objective(ref_row, ref_pos, ref_col, m), ref_leaves)
    if b is None:
        assert torch.equal(got[3], torch.zeros_like(got[3]))
    assert_all_close(got[:4 if b is not None else 3], ref_grads, TOL[dtype], ("d rows", "d cols", "d scale", "d bias"),
                     case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_other_same_id_logit_sums(case, dtype):
    m, k, d, pos, scale, bias, workspace, kind, h = case
    rows, cols, _, s, b, row_ids, col_ids = block_inputs(case, dtype)
    got_leaves = leaves(rows, cols, s, b)
    got = other_same_id_logit_sums(*got_leaves, row_ids, col_ids, pos)
    ref_leaves = leaves(rows, cols, s, b, double=True)
    logits = similarity_reference(*ref_leaves)
    same = row_ids[:, None] == col_ids[None, :]
    if pos is not None:  # the own pairs are left out
        same[torch.arange(m), pos + torch.arange(m)] = False
    masked = torch.where(same, logits, torch.zeros_like(logits))
    ref = (masked.sum(1), same.sum(1).double(), masked.sum(0), same.sum(0).double())
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    assert all(t.dtype == acc for t in got)
    assert torch.equal(got[1].double(), ref[1]) and torch.equal(got[3].double(), ref[3])
    assert_all_close(got, ref, TOL[dtype], ("row_sum", "row_count", "col_sum", "col_count"), case)
    weights = [upstream(n, m, seed) for n, seed in ((m, 1), (k, 2))]
    objective = lambda out: (weights[0] * out[0].double()).sum() - (weights[1] * out[2].double()).sum()  # noqa: E731
    ref_grads = grads_of(objective(ref), ref_leaves)
    assert_all_close(grads_of(objective(got), got_leaves), ref_grads, TOL[dtype],
                     ("d rows", "d cols", "d scale", "d bias"), case)
    # the closed form that ring mode's backward uses (no autograd), the same gradients
    closed = other_same_id_logit_sums_backward(rows, cols, s, b, row_ids, col_ids, pos, weights[0].to(acc),
                                               -weights[1].to(acc))
    assert all(t is None or t.dtype == acc for t in closed) and (closed[3] is None) == (b is None)
    assert_all_close([t for t in closed if t is not None], ref_grads, TOL[dtype],
                     ("d rows", "d cols", "d scale", "d bias"), case)


def run_siglip(case, dtype, targets, algorithm, with_extra=True, use_ids=True):
    m, k, d, pos, scale, bias, workspace, kind, h = case
    rows, cols, extra, s, b, row_ids, col_ids = block_inputs(case, dtype, seed=5)
    extra = extra if with_extra else None
    ids = dict(row_ids=row_ids, col_ids=col_ids, targets=targets) if use_ids else {}
    got_leaves = leaves(rows, cols, extra, s, b)
    loss = siglip_sum(got_leaves[0], got_leaves[1], got_leaves[3], got_leaves[4], pos, extra_cols=got_leaves[2],
                      algorithm=algorithm, workspace_bytes=workspace, **ids)
    return loss, grads_of(loss * (0.5 / m), got_leaves), (rows, cols, extra, s, b, row_ids, col_ids)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("targets", ["mask", "multi"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_siglip_sum_matches_reference(case, dtype, targets, algorithm):
    m, pos = case[0], case[3]
    loss, grads, (rows, cols, extra, s, b, row_ids, col_ids) = run_siglip(case, dtype, targets, algorithm)
    ref_leaves = leaves(rows, cols, extra, s, b, double=True)
    ref = siglip_block_sum(ref_leaves[0], ref_leaves[1], ref_leaves[3], ref_leaves[4], pos, row_ids, col_ids,
                           targets, ref_leaves[2])
    ref_grads = grads_of(ref * (0.5 / m), ref_leaves)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert_close(loss, ref.detach(), TOL[dtype], f"{case_id(case)} loss")
    assert_all_close(grads, ref_grads, TOL[dtype], ("d rows", "d cols", "d extra_cols", "d scale", "d bias"), case)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("non_finite", ["inf", "nan"])
def test_siglip_mask_skips_a_dropped_pair_whatever_its_similarity(non_finite, device, algorithm):
    """targets "mask": a dropped pair has no term on every path, not a term times 0: an fp32
    similarity that overflows (Inf) or is Inf - Inf (NaN) there changes no loss and no gradient
    (d scale was NaN on the torch path and on CUDA, finite on the CPU kernel)."""
    m, k, d, pos, j = 6, 9, 5, 2, 7  # row 0's same-id column j is not its own (pos)
    rows, cols = features(m, d, torch.float32, 0), features(k, d, torch.float32, 1)
    rows[:, :2], cols[:, :2] = 0.0, 0.0  # only row 0 and column j use the first two dimensions
    big = 1e20  # 1e40 overflows fp32, not fp64
    rows[0, :2] = torch.tensor([big, big])
    cols[j, :2] = torch.tensor([big, big if non_finite == "inf" else -big])
    row_ids = torch.arange(m) + 100
    col_ids = torch.arange(k) + 200
    col_ids[pos:pos + m] = row_ids
    col_ids[j] = row_ids[0]
    s, b = torch.tensor(10.0), torch.tensor(-3.0)
    dot = (rows[0:1] @ cols[j:j + 1].T).item()
    assert (dot == float("inf")) if non_finite == "inf" else math.isnan(dot)
    got_leaves = leaves(*(t.to(device) for t in (rows, cols, s, b)))
    loss = siglip_sum(*got_leaves, pos, row_ids=row_ids.to(device), col_ids=col_ids.to(device), targets="mask",
                      algorithm=algorithm)
    got = [g.cpu() for g in grads_of(loss * (0.5 / m), got_leaves)]
    loss = loss.detach().cpu()
    ref_leaves = leaves(rows, cols, s, b, double=True)
    ref = siglip_block_sum(*ref_leaves, pos, row_ids, col_ids, "mask")
    ref_grads = grads_of(ref * (0.5 / m), ref_leaves)
    assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in got)
    assert_close(loss, ref.detach(), 1e-5, "loss")
    assert_all_close(got, ref_grads, 1e-5, ("d rows", "d cols", "d scale", "d bias"), (m, k, d, pos, 10, -3, 0, "", 0))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("targets", ["mask", "multi"])
def test_siglip_distinct_ids_and_no_extra_columns(targets, algorithm):
    """All ids distinct: the call without ids, bit for bit (same algorithm); H = 0 changes nothing."""
    case = (37, 301, 19, 11, 14.3, -10.0, 1, "distinct", 0)
    with_ids, grads_ids, _ = run_siglip(case, torch.float32, targets, algorithm)
    without, grads_without, _ = run_siglip(case, torch.float32, None, algorithm, with_extra=False, use_ids=False)
    for got, ref in zip((with_ids,) + without_extra_grad(grads_ids), (without,) + grads_without):
        assert torch.equal(got, ref)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("mask_same_ids", [True, False])
@pytest.mark.parametrize("case", CASES[1:3], ids=case_id)
def test_siglip_block_with_ids(case, mask_same_ids, algorithm):
    """The ring's block call: the sum and its unit-upstream gradients."""
    m, k, d, pos, scale, bias, workspace, kind, h = case
    rows, cols, _, s, b, row_ids, col_ids = block_inputs(case, torch.float64, seed=5)
    b = torch.tensor(-10.0, dtype=torch.float64) if b is None else b
    loss, *got = siglip_block(rows, cols, s, b, pos, True, row_ids=row_ids, col_ids=col_ids,
                              mask_same_ids=mask_same_ids, algorithm=algorithm, workspace_bytes=workspace)
    ref_leaves = leaves(rows, cols, s, b, double=True)
    ref = siglip_block_sum(*ref_leaves, pos, row_ids, col_ids, "mask" if mask_same_ids else "multi")
    assert_close(loss, ref.detach(), 1e-10, "loss")
    assert_all_close(got, grads_of(ref, ref_leaves), 1e-10, ("d rows", "d cols", "d scale", "d bias"), case)


def bad_calls():
    rows, cols, extra = features(6, 8, torch.float32, 0), features(10, 8, torch.float32, 1), features(3, 8, torch.float32, 2)
    r_ids, c_ids = torch.arange(6), torch.arange(10)
    both = lambda r, c, **kw: dict(row_ids=r, col_ids=c, **kw)  # noqa: E731
    return rows, cols, [
        (both(r_ids[:5], c_ids, targets="mask"), ValueError, "row_ids must be a 1-D int64 tensor of length 6 on cpu, got"),
        (both(r_ids, c_ids[:9], targets="mask"), ValueError, "col_ids must be a 1-D int64 tensor of length 10 on cpu"),
        (both(r_ids.int(), c_ids, targets="mask"), TypeError, "row_ids must be a 1-D int64 tensor.*int32"),
        (both(r_ids, c_ids.float(), targets="mask"), TypeError, "col_ids must be a 1-D int64 tensor.*float32"),
        (both(r_ids, c_ids.to("meta"), targets="mask"), ValueError, "col_ids must be .* on cpu, got .* on meta"),
        (both(r_ids[:, None], c_ids, targets="mask"), ValueError, r"row_ids must be a 1-D .*2-D int64 tensor"),
        (both([0] * 6, c_ids, targets="mask"), TypeError, "row_ids must be a 1-D int64 tensor .*, got list"),
        (both(r_ids, None, targets="mask"), ValueError, "row_ids and col_ids must be given together"),
        (dict(targets="mask"), ValueError, "targets='mask' needs the sample ids row_ids and col_ids"),
        (both(r_ids, c_ids, targets="both"), ValueError, "targets must be None, 'mask' or 'multi', got 'both'"),
        (dict(extra_cols=extra[:, :5]), ValueError, "extra_cols must be None or an H x D tensor like cols"),
        (dict(extra_cols=extra.double()), TypeError, "extra_cols .*same dtype"),
        (dict(extra_cols=extra[0]), ValueError, "extra_cols must be None or an H x D tensor"),
        (dict(extra_cols=extra.to("meta")), ValueError, "extra_cols .* on meta"),
    ]


@pytest.mark.parametrize("case", range(len(bad_calls()[2])))
def test_bad_inputs(case):
    rows, cols, calls = bad_calls()
    kwargs, error, message = calls[case]
    with pytest.raises(error, match=f"contrastive_lse: {message}"):
        contrastive_lse(rows, cols, 1.0, **kwargs)
    with pytest.raises(error, match=f"siglip_sum: {message}"):
        siglip_sum(rows, cols, 1.0, **kwargs)


def test_ids_need_targets_for_contrastive_only():
    rows, cols = features(6, 8, torch.float32, 0), features(10, 8, torch.float32, 1)
    ids = dict(row_ids=torch.arange(6), col_ids=torch.arange(10))
    with pytest.raises(ValueError, match="contrastive_lse: row_ids and col_ids need targets='mask' or 'multi'"):
        contrastive_lse(rows, cols, 1.0, **ids)
    assert torch.equal(siglip_sum(rows, cols, 1.0, **ids), siglip_sum(rows, cols, 1.0, **ids, targets="multi"))
    with pytest.raises(ValueError, match="contrastive_lse_backward: col_ids must be a 1-D int64 tensor of length 10"):
        contrastive_lse_backward(None, None, None, rows, cols, torch.tensor(1.0), None, 0, None, None,
                                 row_ids=ids["row_ids"], col_ids=ids["col_ids"][:3])
    with pytest.raises(TypeError, match="siglip_block: mask_same_ids must be True or False"):
        siglip_block(rows, cols, torch.tensor(1.0), None, 0, False, mask_same_ids="yes")
    with pytest.raises(ValueError, match="other_same_id_logit_sums: row_ids must be a 1-D int64 tensor of length 6"):
        other_same_id_logit_sums(rows, cols, 1.0, None, ids["col_ids"], ids["col_ids"])
    with pytest.raises(ValueError, match=r"other_same_id_logit_sums: pos_offset must be None or an int with 0 <= "
                                         r"pos_offset <= K - M = 4, got 5"):
        other_same_id_logit_sums(rows, cols, 1.0, None, ids["row_ids"], ids["col_ids"], 5)
