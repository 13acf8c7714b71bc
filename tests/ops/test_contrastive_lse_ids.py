"""The compiled contrastive_lse kernels with sample ids ("mask": same-id pairs other than the
positive leave both log-sum-exps, dS = 0 there) and without positives (pos_offset -1), on the CPU
("fused" tile kernels and "chunked"), against a materialised fp64 reference written here from the
formulas; cuda-marked twins for the chunked CUDA path and the fused CUDA kernels' refusal."""
import pytest
import torch

OPS = torch.ops.clipshard
WS = 1 << 12  # the chunked algorithm then works in 128-column chunks
ALGORITHMS = ("fused", "chunked")
# max |error| / max(1, max |reference|) of the outputs; the feature gradients of 16-bit inputs come
# back rounded to their dtype.
OUT_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def features(n, d, dtype, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1).to(device, dtype)


def duplicate_ids(n, seed, fraction=0.1):
    """n ids of which about `fraction` repeat an earlier one."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randperm(10 * n, generator=g)[:n]
    repeat = torch.rand(n, generator=g) < fraction
    repeat[0] = False
    earlier = (torch.rand(n, generator=g) * torch.arange(n)).long()
    return torch.where(repeat, ids[earlier], ids)


def reference(rows, cols, scale, bias, pos_offset, row_ids, col_ids, upstream):
    """fp64 outputs and gradients from the formulas: S = scale rows cols^T + bias; excluded(i, j) =
    same id and j != pos_offset + i; LSEs over the kept pairs (-inf when none); dS = g_row softmax_row
    + g_col softmax_col + g_pos [positive], 0 at excluded pairs; then the chain rule through S."""
    rows, cols = rows.double().cpu(), cols.double().cpu()
    scale = float(scale)
    bias = 0.0 if bias is None else float(bias)
    m, k = rows.shape[0], cols.shape[0]
    dots = rows @ cols.T
    s = scale * dots + bias
    own = torch.zeros(m, k, dtype=torch.bool)
    if pos_offset != -1:
        own[torch.arange(m), pos_offset + torch.arange(m)] = True
    excluded = torch.zeros(m, k, dtype=torch.bool) if row_ids is None else (
        (row_ids.cpu()[:, None] == col_ids.cpu()[None, :]) & ~own)
    masked = s.masked_fill(excluded, -torch.inf)
    row_lse, col_lse = torch.logsumexp(masked, 1), torch.logsumexp(masked, 0)
    pos = s[own] if pos_offset != -1 else torch.full((m,), torch.nan, dtype=torch.float64)
    g_row, g_pos, g_col = (u.double().cpu() for u in upstream)
    soft_row = torch.where(excluded, 0.0, torch.exp(s - row_lse[:, None]))
    soft_col = torch.where(excluded, 0.0, torch.exp(s - col_lse[None, :]))
    ds = g_row[:, None] * soft_row + g_col[None, :] * soft_col + own * g_pos[:, None]
    grads = (scale * ds @ cols, scale * ds.T @ rows, (ds * dots).sum(), ds.sum())
    return (row_lse, pos, col_lse), grads, ds.abs().sum().item()


def realistic_upstream(m, k, seed):
    """Upstream gradients of a CLIP loss: about 0.5 / M per row and 0.5 / K per column, the positives'
    the negated sum."""
    g = torch.Generator().manual_seed(seed)
    g_row = 0.5 / m * (1 + 0.2 * torch.rand(m, generator=g, dtype=torch.float64))
    g_col = 0.5 / k * (1 + 0.2 * torch.rand(k, generator=g, dtype=torch.float64))
    return g_row, -g_row, g_col


def assert_close(actual, expected, tol, what):
    actual, expected = actual.double().cpu(), expected.double()
    assert actual.shape == expected.shape, what
    assert torch.equal(torch.isnan(actual), torch.isnan(expected)), f"{what}: NaN at different entries"
    infinite = torch.isinf(expected)
    assert torch.equal(actual[infinite], expected[infinite]), f"{what}: -inf entries differ"
    finite = torch.isfinite(expected)
    if not finite.any():
        return
    err = (actual[finite] - expected[finite]).abs().max().item()
    bound = tol * max(1.0, expected[finite].abs().max().item())
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def run_op(rows, cols, scale, bias, pos_offset, row_ids, col_ids, upstream, algorithm, workspace=WS):
    """The op's outputs, and the gradients of sum(upstream * outputs) through its autograd."""
    acc = torch.float64 if rows.dtype == torch.float64 else torch.float32
    leaves = [rows.detach().clone().requires_grad_(), cols.detach().clone().requires_grad_(),
              torch.tensor(scale, dtype=acc, device=rows.device, requires_grad=True)]
    if bias is not None:
        leaves.append(torch.tensor(bias, dtype=acc, device=rows.device, requires_grad=True))
    out = OPS.contrastive_lse_forward(*leaves[:3], leaves[3] if bias is not None else None, pos_offset, row_ids,
                                      col_ids, True, algorithm, workspace)
    weighted = sum((o * u.to(o.device, o.dtype)).sum() for o, u in zip(out, upstream) if o is not out[1])
    weighted = weighted + (out[1] * upstream[1].to(out[1].device, out[1].dtype)).nan_to_num().sum()
    grads = torch.autograd.grad(weighted, leaves)
    return [o.detach() for o in out], grads


def check(rows, cols, scale, bias, pos_offset, row_ids, col_ids, algorithm, seed=5, grad_tol=None):
    m, k = rows.shape[0], cols.shape[0]
    upstream = realistic_upstream(m, k, seed)
    if pos_offset == -1:  # no positive logits: their gradient is not used
        upstream = (upstream[0], torch.zeros(m, dtype=torch.float64), upstream[2])
    out, grads = run_op(rows, cols, scale, bias, pos_offset, row_ids, col_ids, upstream, algorithm)
    ref_out, ref_grads, total = reference(rows, cols, scale, bias, pos_offset, row_ids, col_ids, upstream)
    dtype = rows.dtype
    for name, o, r in zip(("row_lse", "pos_logit", "col_lse"), out, ref_out):
        assert_close(o, r, OUT_TOL[dtype], name)
    for name, g, r in zip(("rows", "cols"), grads[:2], ref_grads[:2]):
        assert g.dtype == dtype
        assert_close(g, r, grad_tol or GRAD_TOL[dtype], f"grad {name}")
    # d scale and d bias sum M x K terms of either sign: their error scales with sum |dS| (1 + |dot|).
    for name, g, r in zip(("scale", "bias"), grads[2:], ref_grads[2:]):
        assert_close(g, r, OUT_TOL[dtype] * 2 * total / max(1.0, abs(r.item())), f"grad {name}")
    return out, ref_out


# (M, K, D, pos_offset): odd sizes; several 128 x 512 tiles and 128-column chunks; M == K.
SHAPES = [(37, 53, 5, 11), (300, 1100, 17, 700), (129, 129, 8, 0)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale", [14.3, 100.0])
def test_duplicate_ids_match_reference(algorithm, shape, scale):
    m, k, d, pos = shape
    col_ids = duplicate_ids(k, seed=m + k)
    row_ids = col_ids[pos:pos + m].clone()  # image i and text i share their sample's id
    out, ref = check(features(m, d, torch.float64, 1), features(k, d, torch.float64, 2), scale, -2.5, pos, row_ids,
                     col_ids, algorithm)
    # The data exclude pairs that matter: without the mask the reference would be far off (at scale
    # 100 the excluded pairs are mostly far below each row's maximum; the tests below cover it).
    if scale == 14.3:
        unmasked, _, _ = reference(features(m, d, torch.float64, 1), features(k, d, torch.float64, 2), scale, -2.5,
                                   pos, None, None, realistic_upstream(m, k, 5))
        assert (unmasked[0] - ref[0]).abs().max() > 1e-3 and (unmasked[2] - ref[2]).abs().max() > 1e-2


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_narrow_dtypes(algorithm, dtype):
    m, k, d, pos = 150, 700, 24, 333
    col_ids = duplicate_ids(k, seed=3)
    check(features(m, d, dtype, 1), features(k, d, dtype, 2), 14.3, None, pos, col_ids[pos:pos + m].clone(),
          col_ids, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_no_positives(algorithm, dtype):
    m, k, d = 140, 600, 9
    out, _ = check(features(m, d, dtype, 1), features(k, d, dtype, 2), 14.3, 1.5, -1, duplicate_ids(m, 8) % 97,
                   duplicate_ids(k, 9) % 97, algorithm)
    assert torch.isnan(out[1]).all()
    # Without ids: plain LSEs over every pair, and NaN positives.
    check(features(m, d, dtype, 1), features(k, d, dtype, 2), 14.3, 1.5, -1, None, None, algorithm)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("pos", [5, -1])
@pytest.mark.parametrize("scale", [14.3, 100.0])
def test_all_ids_equal(algorithm, pos, scale):
    # With positives only the own pair stays in each row, and columns without an own row are empty
    # (LSE -inf, no gradient); without positives every pair is excluded.
    m, k, d = 131, 530, 7
    ids_r, ids_c = torch.full((m,), 42), torch.full((k,), 42)
    out, ref = check(features(m, d, torch.float64, 1), features(k, d, torch.float64, 2), scale, 0.5, pos, ids_r, ids_c,
                     algorithm)
    assert torch.isinf(ref[2]).sum() == (k - m if pos != -1 else k)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("scale", [14.3, 100.0])
def test_distinct_ids_give_the_bits_of_no_ids(algorithm, scale):
    m, k, d, pos = 200, 1030, 13, 500
    rows, cols = features(m, d, torch.float32, 1), features(k, d, torch.float32, 2)
    ids = torch.randperm(k, generator=torch.Generator().manual_seed(4))
    upstream = realistic_upstream(m, k, 6)
    with_ids = run_op(rows, cols, scale, 0.3, pos, ids[pos:pos + m].clone(), ids, upstream, algorithm)
    without = run_op(rows, cols, scale, 0.3, pos, None, None, upstream, algorithm)
    for a, b in zip([*with_ids[0], *with_ids[1]], [*without[0], *without[1]]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("scale", [14.3, 100.0])
def test_rows_and_columns_excluded_within_a_tile(algorithm, scale):
    # Column 517 shares its id with every row of the first 128-row block (none of which owns it): it
    # is entirely excluded in that block's tiles and kept in the others. Row 200 shares its id with
    # the first 512 columns (its own column, 900, is in the second tile): its first column tile is
    # entirely excluded.
    m, k, d, pos = 300, 1100, 11, 700
    col_ids = torch.arange(k) + 1000
    row_ids = col_ids[pos:pos + m].clone()
    row_ids[:128], col_ids[517] = 7, 7
    col_ids[:512], row_ids[200] = 9, 9
    for dtype in (torch.float64, torch.float32):
        check(features(m, d, dtype, 1), features(k, d, dtype, 2), scale, None, pos, row_ids, col_ids, algorithm)


def test_ids_are_checked():
    rows, cols, s = features(4, 3, torch.float32, 1), features(6, 3, torch.float32, 2), torch.tensor(2.0)
    ids_r, ids_c = torch.arange(4), torch.arange(6)
    with pytest.raises(RuntimeError, match="contrastive_lse_forward: row_ids and col_ids must be given together"):
        OPS.contrastive_lse_forward(rows, cols, s, None, 0, ids_r, None, True, "fused", WS)
    with pytest.raises(RuntimeError, match=r"col_ids must be a 1-D int64 tensor of length 6 on cpu, got Int"):
        OPS.contrastive_lse_forward(rows, cols, s, None, 0, ids_r, ids_c.int(), True, "chunked", WS)
    with pytest.raises(RuntimeError, match=r"row_ids must be a 1-D int64 tensor of length 4 on cpu, got Long of shape"):
        OPS.contrastive_lse_backward(torch.ones(4), torch.ones(4), None, rows, cols, s, None, 0, ids_r[:3], ids_c,
                                     torch.ones(4), None, "fused", WS)
    with pytest.raises(RuntimeError, match=r"pos_offset must satisfy 0 <= pos_offset and .*, or be -1 \(no positives\)"):
        OPS.contrastive_lse_forward(rows, cols, s, None, -2, None, None, True, "fused", WS)


# ---------------------------------------------------------------------------------------- CUDA


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("pos", [700, -1])
def test_cuda_chunked_with_ids(dtype, pos):
    m, k, d = 300, 1100, 64
    col_ids = duplicate_ids(k, seed=11, fraction=0.3).cuda()
    row_ids = col_ids[700:700 + m].clone()
    row_ids[:128] = col_ids[5]  # column 5 excluded in a whole row block
    rows, cols = features(m, d, dtype, 1, "cuda"), features(k, d, dtype, 2, "cuda")
    tol = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    for scale in (14.3, 100.0):
        check(rows, cols, scale, -1.0, pos, row_ids, col_ids, "chunked", grad_tol=tol)


@pytest.mark.cuda
def test_cuda_chunked_all_ids_equal_and_distinct():
    m, k, d, pos = 200, 1030, 32, 500
    rows, cols = features(m, d, torch.float32, 1, "cuda"), features(k, d, torch.float32, 2, "cuda")
    same = torch.full((k,), 3, device="cuda")
    check(rows, cols, 100.0, None, pos, same[:m].clone(), same, "chunked", grad_tol=1e-4)
    ids = torch.randperm(k, generator=torch.Generator().manual_seed(4)).cuda()
    upstream = realistic_upstream(m, k, 6)
    with_ids = run_op(rows, cols, 14.3, 0.3, pos, ids[pos:pos + m].clone(), ids, upstream, "chunked")
    without = run_op(rows, cols, 14.3, 0.3, pos, None, None, upstream, "chunked")
    for a, b in zip([*with_ids[0], *with_ids[1]], [*without[0], *without[1]]):
        assert torch.equal(a, b)


@pytest.mark.cuda
def test_cuda_fused_refuses_ids_and_takes_no_positives():
    m, k, d = 70, 300, 16
    rows, cols = features(m, d, torch.float32, 1, "cuda"), features(k, d, torch.float32, 2, "cuda")
    ids_r, ids_c = torch.arange(m, device="cuda"), torch.arange(k, device="cuda")
    with pytest.raises(RuntimeError, match='algorithm="chunked"'):
        OPS.contrastive_lse_forward(rows, cols, torch.tensor(2.0, device="cuda"), None, 0, ids_r, ids_c, True, "fused",
                                    WS)
    with pytest.raises(RuntimeError, match='algorithm="chunked"'):
        OPS.contrastive_lse_backward(torch.ones(m, device="cuda"), torch.ones(m, device="cuda"), None, rows, cols,
                                     torch.tensor(2.0, device="cuda"), None, 0, ids_r, ids_c,
                                     torch.ones(m, device="cuda"), None, "fused", WS)
    for dtype in (torch.float32, torch.bfloat16):  # FMA and tensor-core kernels
        check(rows.to(dtype), cols.to(dtype), 14.3, 0.5, -1, None, None, "fused",
              grad_tol=1e-4 if dtype == torch.float32 else 1.6e-2)
