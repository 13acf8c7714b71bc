"""The compiled SigLIP op with labels by sample id (torch.ops.clipshard.siglip_forward's row_ids,
col_ids, mask_same_ids) on the CPU and, marked `cuda`, on a GPU, against an fp64 reference
materialised from the label rule:

    z_ij = +1 if j == pos_offset + i; else, if row_ids[i] == col_ids[j]: no term (mask_same_ids)
    or +1; else -1.

Ids that match only at the positives must give the bits of the op without ids."""
import pytest
import torch

OPS = torch.ops.clipshard
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
NO_IDS = (None, None, False)


def features(n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1).to(dtype)


def make_ids(kind, m, k, pos_offset, seed):
    """(row_ids, col_ids) of `kind`: "dup10" (distinct ids but ~10% of the columns repeat another
    column's id; each row has its positive's id, or a random column's without positives), "few"
    (rows and columns drawn independently from 5 ids: most pairs same-id, some positives not),
    "equal" (one id for all), "distinct" (the ids match exactly at the positives)."""
    g = torch.Generator().manual_seed(seed)
    own = torch.arange(m) + (pos_offset or 0)
    if kind == "distinct":
        return own + (k if pos_offset is None else 0), torch.arange(k)
    if kind == "equal":
        return torch.full((m,), 7), torch.full((k,), 7)
    if kind == "few":
        return torch.randint(0, 5, (m,), generator=g), torch.randint(0, 5, (k,), generator=g)
    col_ids = torch.arange(k) * 3 + 1000
    repeat = torch.rand(k, generator=g) < 0.1
    col_ids[repeat] = col_ids[torch.randint(0, k, (int(repeat.sum()),), generator=g)]
    rows_of = own if pos_offset is not None else torch.randint(0, k, (m,), generator=g)
    return col_ids[rows_of], col_ids


def reference(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids):
    """(sum over the pairs with a term of softplus(-z * l), sum |dl|, sum |dl * dot|), fp64,
    differentiable in rows, cols, scale and bias (fp64 leaves)."""
    dots = rows @ cols.T
    logits = scale * dots + (0.0 if bias is None else bias)
    index = torch.arange(rows.shape[0])
    positive = torch.zeros_like(logits, dtype=torch.bool)
    if pos_offset is not None:
        positive[index, pos_offset + index] = True
    same = torch.zeros_like(positive) if row_ids is None else row_ids[:, None] == col_ids[None, :]
    z = torch.where(positive | same, 1.0, -1.0).double()
    weight = (~(same & ~positive & mask_same_ids)).double()
    loss = (weight * torch.nn.functional.softplus(-z * logits)).sum()
    dl = (weight * torch.sigmoid(-z * logits)).detach()
    return loss, dl.sum().item(), (dl * dots.detach().abs()).sum().item()


def tolerances(dtype, scale):
    """(loss relative, feature gradients relative to their largest entry, scale and bias gradients
    relative to sum |dl * dot| and sum |dl|). fp32 logits are off by about scale * 1e-7 (the GEMM's
    rounding); 16-bit feature gradients are rounded to their dtype at the end."""
    if dtype == torch.float64:
        return 1e-10, 1e-10, 1e-10
    fp32 = max(1e-5, 3e-7 * (1 + scale))
    return fp32, {torch.float32: fp32, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype], fp32


def rel_error(actual, expected):
    actual, expected = actual.double().cpu(), expected.double().cpu()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


def leaves(device, dtype, m, k, d, scale, bias):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    tensors = [features(m, d, dtype, 1), features(k, d, dtype, 2), torch.tensor(scale, dtype=acc)]
    tensors += [] if bias is None else [torch.tensor(bias, dtype=acc)]
    return [t.to(device).requires_grad_() for t in tensors]


def check(device, dtype, m, k, d, pos_offset, kind, mask, scale=10.0, bias=-10.0, workspace_bytes=1):
    """The op's loss and gradients (upstream 0.5 / M) against the reference; returns the reference's
    relative distance from the labels without ids (how far a kernel that ignored them would be)."""
    inputs = leaves(device, dtype, m, k, d, scale, bias)
    row_ids, col_ids = make_ids(kind, m, k, pos_offset, seed=m + k)
    b = inputs[3] if bias is not None else None
    loss = OPS.siglip_forward(*inputs[:3], b, pos_offset, row_ids.to(device), col_ids.to(device), mask, True,
                              workspace_bytes)[0]
    upstream = 0.5 / m
    grads = torch.autograd.grad(loss * upstream, inputs)
    ref_leaves = [x.detach().cpu().double().requires_grad_() for x in inputs]
    ref_b = ref_leaves[3] if bias is not None else None
    ref, dl_sum, dl_dot_sum = reference(*ref_leaves[:3], ref_b, pos_offset, row_ids, col_ids, mask)
    ref_grads = torch.autograd.grad(ref * upstream, ref_leaves)
    loss_tol, feature_tol, scalar_tol = tolerances(dtype, scale)
    case = f"{device} {dtype} M={m} K={k} pos_offset={pos_offset} {kind} mask={mask} scale={scale} bias={bias}"
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), case
    assert abs(loss.item() - ref.item()) <= loss_tol * abs(ref.item()), f"{case}: loss {loss.item()} vs {ref.item()}"
    for name, x, got, want in zip(("rows", "cols", "scale", "bias"), inputs, grads, ref_grads):
        assert got.dtype == x.dtype and got.shape == x.shape and got.device == x.device, f"{case}: {name}"
        if name in ("rows", "cols"):
            assert rel_error(got, want) <= feature_tol, f"{case}: grad {name} {rel_error(got, want):.3g}"
        else:
            bound = scalar_tol * upstream * (dl_dot_sum if name == "scale" else dl_sum) + 1e-300
            error = abs(got.item() - want.item())
            assert error <= bound, f"{case}: grad {name} error {error:.3g} > {bound:.3g}"
    without_ids = reference(*[x.detach() for x in ref_leaves[:3]], None if ref_b is None else ref_b.detach(),
                            pos_offset, None, None, False)[0]
    return abs(without_ids.item() - ref.item()) / max(abs(ref.item()), 1e-300)


def dtypes(device):
    return ([torch.float64] if device == "cpu" else []) + [torch.float32, torch.bfloat16, torch.float16]


# (M, K, D, pos_offset): odd sizes, the positives inside and at the end, none, one pair.
SHAPES = [(37, 301, 7, 100), (129, 1000, 17, 871), (53, 411, 5, None), (1, 1, 3, 0)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["dup10", "few", "equal"])
@pytest.mark.parametrize("mask", [True, False], ids=["mask", "multi"])
def test_labels_by_id_match_fp64_reference(device, kind, mask):
    """Several column chunks (the smallest workspace), every dtype, each shape; the reference with
    ids is far (many tolerances) from the one without, so a kernel that dropped the labels by id
    would fail (except for dropping a few negatives of logit ~ -10, whose terms are ~5e-5: "few" and
    "equal" cover the mask)."""
    for dtype in dtypes(device):
        for m, k, d, pos_offset in SHAPES:
            distance = check(device, dtype, m, k, d, pos_offset, kind, mask)
            if m > 1 and dtype == torch.float32 and not (kind == "dup10" and mask):
                assert distance > 100 * tolerances(dtype, 10.0)[0], (kind, mask, m, distance)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mask", [True, False], ids=["mask", "multi"])
def test_large_scale_and_bias_and_one_chunk(device, mask):
    """|l| up to ~120 (scale 100, bias +-20), a single chunk and several, no bias."""
    for scale, bias, workspace_bytes in ((100.0, 20.0, 1), (100.0, -20.0, 1 << 30), (1.0, None, 1 << 30)):
        check(device, torch.float32, 129, 1000, 17, 871, "dup10", mask, scale, bias, workspace_bytes)
        check(device, torch.float32, 53, 411, 5, None, "few", mask, scale, bias, workspace_bytes)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pos_offset", [100, None])
@pytest.mark.parametrize("with_grad", [True, False])
def test_distinct_ids_give_the_bits_of_no_ids(device, pos_offset, with_grad):
    m, k, d = 37, 301, 7
    row_ids, col_ids = (t.to(device) for t in make_ids("distinct", m, k, pos_offset, seed=0))
    for dtype in dtypes(device):
        rows, cols, scale, bias = (x.detach() for x in leaves(device, dtype, m, k, d, 10.0, -10.0))
        for workspace_bytes in (1, 1 << 30):
            plain = OPS.siglip_forward(rows, cols, scale, bias, pos_offset, *NO_IDS, with_grad, workspace_bytes)
            for mask in (True, False):
                got = OPS.siglip_forward(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask, with_grad,
                                         workspace_bytes)
                for x, y in zip(got, plain):
                    assert x.dtype == y.dtype and torch.equal(x, y), (dtype, workspace_bytes, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_loss_only_pass_with_ids(device):
    """Without with_grad: the same loss (within rounding: a different per-logit routine), empty
    gradients."""
    m, k, d, pos_offset = 129, 1000, 17, 871
    rows, cols, scale, bias = (x.detach() for x in leaves(device, torch.float32, m, k, d, 10.0, -10.0))
    row_ids, col_ids = (t.to(device) for t in make_ids("dup10", m, k, pos_offset, seed=3))
    for mask in (True, False):
        args = (rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask)
        loss_only, with_grad = OPS.siglip_forward(*args, False, 1), OPS.siglip_forward(*args, True, 1)
        assert all(g.numel() == 0 for g in loss_only[1:])
        assert rel_error(loss_only[0], with_grad[0]) <= 1e-6


def test_bad_ids():
    """The op checks the ids itself; errors name the argument and what was expected."""
    ok, s = torch.ones(3, 2), torch.tensor(1.0)
    ids3, ids4 = torch.arange(3), torch.arange(4)
    cols = torch.ones(4, 2)
    cases = [
        ((ok, cols, s, None, 0, ids3, None, False), "row_ids and col_ids must be given both or neither"),
        ((ok, cols, s, None, 0, None, ids4, False), "row_ids and col_ids must be given both or neither"),
        ((ok, cols, s, None, 0, None, None, True), "mask_same_ids=True needs row_ids and col_ids"),
        ((ok, cols, s, None, 0, ids3.int(), ids4, False), "row_ids must be a 1-D int64 tensor of length 3 on cpu"),
        ((ok, cols, s, None, 0, ids3.float(), ids4, False), "row_ids must be a 1-D int64 tensor"),
        ((ok, cols, s, None, 0, ids4, ids4, False), "row_ids must be a 1-D int64 tensor of length 3"),
        ((ok, cols, s, None, 0, ids3, ids3, False), "col_ids must be a 1-D int64 tensor of length 4"),
        ((ok, cols, s, None, 0, ids3, ids4[None], False), "col_ids must be a 1-D int64 tensor"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            OPS.siglip_forward(*args, True, 1)


@pytest.mark.cuda
def test_ids_on_another_device_are_refused():
    rows, cols, s = torch.ones(3, 2, device="cuda"), torch.ones(4, 2, device="cuda"), torch.tensor(1.0, device="cuda")
    with pytest.raises(RuntimeError, match="row_ids must be a 1-D int64 tensor of length 3 on cuda"):
        OPS.siglip_forward(rows, cols, s, None, 0, torch.arange(3), torch.arange(4, device="cuda"), False, True, 1)
