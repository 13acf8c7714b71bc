"""CUDA kernels of the contrastive log-sum-exp, both algorithms ("chunked", the CUDA default, and
"fused"), against the fp64 reference (and the CPU kernel where one is registered). Every test needs
a GPU; tests/conftest.py skips them without one."""
import math

import pytest
import torch

import clipshard
from tests.references.contrastive import contrastive_lse_reference

pytestmark = pytest.mark.cuda
ops = torch.ops.clipshard
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
ALGORITHMS = ["chunked", "fused"]
# A small chunked workspace, so that the chunk bookkeeping is exercised (many chunks, K not a
# multiple of the chunk width, chunks narrower than M).
SMALL_WORKSPACE = 1 << 20
# Relative error of one rounding to the gradient dtype (gradients are computed in fp32, then cast).
GRAD_RTOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# M, K, D, pos_offset, scale, bias, want_col_lse: odd sizes around the 64-wide tiles, M != K. The
# tensor-core forward only takes D % 8 == 0 (others fall back to the FMA kernel): both kinds appear.
CASES = [
    (1, 1, 1, 0, 1.0, None, True),
    (1, 3, 17, 2, 14.3, 0.5, True),
    (3, 3, 1000, 0, 100.0, None, False),
    (17, 129, 3, 100, 14.3, -2.0, True),
    (64, 128, 64, 64, 100.0, None, True),
    (65, 130, 33, 1, 1.0, 3.0, True),
    (129, 1000, 17, 871, 100.0, None, True),
    (333, 1025, 136, 500, 14.3, 0.5, True),
    (1000, 4099, 129, 17, 1.0, 1.25, False),
    (2050, 4099, 256, 1000, 100.0, None, True),
    (4099, 4099, 129, 0, 100.0, -10.0, True),
]


def make_inputs(M, K, D, dtype, scale, bias, seed=0, spread=1.0):
    """Unit-norm random features (as CLIP feeds the loss) times `spread`, cast to dtype."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = torch.nn.functional.normalize(torch.randn(M, D, generator=gen, device="cuda"), dim=1)
    cols = torch.nn.functional.normalize(torch.randn(K, D, generator=gen, device="cuda"), dim=1)
    scale_t = torch.tensor(scale, device="cuda")
    bias_t = None if bias is None else torch.tensor(bias, device="cuda")
    return (rows * spread).to(dtype), (cols * spread).to(dtype), scale_t, bias_t


def upstream(M, K, want_col, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g_row = torch.randn(M, generator=gen, device="cuda")
    g_pos = torch.randn(M, generator=gen, device="cuda")
    g_col = torch.randn(K, generator=gen, device="cuda") if want_col else None
    return g_row, g_pos, g_col


def forward(rows, cols, scale, bias, pos, want_col, algorithm, workspace=SMALL_WORKSPACE):
    return ops.contrastive_lse_forward(rows, cols, scale, bias, pos, None, None, want_col, algorithm, workspace)


def backward(grads, rows, cols, scale, bias, pos, outs, algorithm, workspace=SMALL_WORKSPACE):
    g_row, g_pos, g_col = grads
    row_lse, _, col_lse = outs
    return ops.contrastive_lse_backward(g_row, g_pos, g_col, rows, cols, scale, bias, pos, None, None, row_lse,
                                        col_lse if g_col is not None else None, algorithm, workspace)


def reference_grads(rows, cols, scale, bias, pos, grads):
    """fp64 autograd gradients of sum(g_row row_lse) + sum(g_pos pos_logit) + sum(g_col col_lse)."""
    g_row, g_pos, g_col = grads
    leaves = [t.detach().double().requires_grad_() for t in (rows, cols, scale)]
    if bias is not None:
        leaves.append(bias.detach().double().requires_grad_())
    row_lse, pos_logit, col_lse = contrastive_lse_reference(
        *leaves[:3], leaves[3] if bias is not None else None, pos, g_col is not None)
    loss = (row_lse * g_row.double()).sum() + (pos_logit * g_pos.double()).sum()
    if g_col is not None:
        loss = loss + (col_lse * g_col.double()).sum()
    return torch.autograd.grad(loss, leaves)


def lse_atol(scale, D):
    """fp32 accumulation: D products per logit (unit-norm features), K terms per exp-sum."""
    return 3e-5 + 4e-6 * (1 + scale) * math.sqrt(D)


def assert_close_grad(got, ref, dtype, name):
    assert got.dtype == dtype, f"{name}: dtype {got.dtype}, expected {dtype}"
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}"
    rtol = GRAD_RTOL[dtype]
    atol = rtol * max(ref.abs().max().item(), 1e-3)
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def assert_close_sum(got, ref, bound, name):
    """grad_scale / grad_bias are sums of M x K terms whose absolute values add up to <= bound."""
    assert got.dim() == 0, f"{name}: expected a 0-dim tensor, got shape {tuple(got.shape)}"
    err = abs(got.double().item() - ref.item())
    assert err <= 1e-4 * bound + 1e-6, f"{name}: got {got.item()}, expected {ref.item()} (bound {bound})"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}K{}D{}p{}s{}b{}c{}".format(*c))
def test_forward_backward_match_fp64_reference(case, dtype, algorithm):
    M, K, D, pos, scale, bias, want_col = case
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, dtype, scale, bias)
    outs = forward(rows, cols, scale_t, bias_t, pos, want_col, algorithm)
    ref = contrastive_lse_reference(rows, cols, scale_t, bias_t, pos, want_col)
    atol = lse_atol(scale, D)
    for name, got, expected in zip(("row_lse", "pos_logit", "col_lse"), outs, ref):
        assert got.dtype == torch.float32, f"{name}: dtype {got.dtype}"
        assert got.shape == expected.shape, f"{name}: shape {tuple(got.shape)}"
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=atol,
                                   msg=lambda m, n=name: f"{n}: {m}")

    grads = upstream(M, K, want_col)
    got = backward(grads, rows, cols, scale_t, bias_t, pos, outs, algorithm)
    expected = reference_grads(rows, cols, scale_t, bias_t, pos, grads)
    assert_close_grad(got[0], expected[0], dtype, "grad_rows")
    assert_close_grad(got[1], expected[1], dtype, "grad_cols")
    # sum |dS| <= sum |g_row| + sum |g_col| + sum |g_pos| (softmax rows/columns sum to 1); |dot| <= 1.
    g_abs = sum(g.abs().sum().item() for g in grads if g is not None)
    assert got[2].dtype == scale_t.dtype
    assert_close_sum(got[2], expected[2], g_abs, "grad_scale")
    if bias is not None:
        assert got[3].dtype == bias_t.dtype
        assert_close_sum(got[3], expected[3], g_abs, "grad_bias")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_logits_do_not_overflow(dtype, algorithm):
    """Features of norm 10 and scale 100: logits near +-1e4, far past exp's fp32 range."""
    M, K, D, pos = 70, 200, 8, 30
    rows, cols, scale_t, _ = make_inputs(M, K, D, dtype, 100.0, None, seed=3, spread=10.0)
    outs = forward(rows, cols, scale_t, None, pos, True, algorithm)
    ref = contrastive_lse_reference(rows, cols, scale_t, None, pos, True)
    for got, expected in zip(outs, ref):
        assert torch.isfinite(got).all()
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=5e-2)
    grads = upstream(M, K, True)
    got = backward(grads, rows, cols, scale_t, None, pos, outs, algorithm)
    expected = reference_grads(rows, cols, scale_t, None, pos, grads)
    for g, e in zip(got[:2], expected[:2]):
        assert torch.isfinite(g).all()
        rtol = max(1e-3, GRAD_RTOL[dtype])
        torch.testing.assert_close(g.double(), e, rtol=rtol, atol=10 * rtol * e.abs().max().item())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_row_outputs_do_not_depend_on_want_col_lse(dtype, algorithm):
    rows, cols, scale_t, bias_t = make_inputs(100, 300, 40, dtype, 14.3, 0.5)
    with_col = forward(rows, cols, scale_t, bias_t, 7, True, algorithm)
    without = forward(rows, cols, scale_t, bias_t, 7, False, algorithm)
    assert torch.equal(with_col[0], without[0]) and torch.equal(with_col[1], without[1])
    assert without[2].numel() == 0 and without[2].dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_misaligned_features_fall_back_and_stay_correct(dtype):
    """Contiguous views starting 2 bytes past a 16-byte boundary cannot take 16-byte loads."""
    M, K, D, pos = 100, 260, 64, 60
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, dtype, 14.3, 0.5, seed=4)
    shifted = lambda t: torch.cat([t.new_zeros(1), t.flatten()])[1:].view(t.shape)  # noqa: E731
    rows_m, cols_m = shifted(rows), shifted(cols)
    assert rows_m.data_ptr() % 16 != 0 and rows_m.is_contiguous() and torch.equal(rows_m, rows)
    outs = forward(rows_m, cols_m, scale_t, bias_t, pos, True, "fused")
    ref = contrastive_lse_reference(rows, cols, scale_t, bias_t, pos, True)
    for got, expected in zip(outs, ref):
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=lse_atol(14.3, D))


@pytest.mark.parametrize("allow_tf32", [False, True])
def test_fp32_follows_torch_tf32_flag(allow_tf32):
    """The chunked path's fp32 GEMMs follow torch.backends.cuda.matmul.allow_tf32: False must be
    exact-fp32 accurate; True may use TF32 (10-bit mantissa) products."""
    M, K, D, pos, scale = 300, 700, 256, 100, 14.3
    rows, cols, scale_t, _ = make_inputs(M, K, D, torch.float32, scale, None, seed=5)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allow_tf32
    try:
        outs = forward(rows, cols, scale_t, None, pos, True, "chunked")
        grads = upstream(M, K, True)
        got = backward(grads, rows, cols, scale_t, None, pos, outs, "chunked")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    ref = contrastive_lse_reference(rows, cols, scale_t, None, pos, True)
    atol = lse_atol(scale, D) if not allow_tf32 else 2e-3 * (1 + scale)
    for out, expected in zip(outs, ref):
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=atol)
    expected = reference_grads(rows, cols, scale_t, None, pos, grads)
    rtol = 1e-4 if not allow_tf32 else 1e-2
    for g, e in zip(got[:2], expected[:2]):
        torch.testing.assert_close(g.double(), e, rtol=rtol, atol=rtol * e.abs().max().item())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_realistic_upstream_gradients_survive_16_bit(dtype, algorithm):
    """g = 0.5 / M as a mean loss gives, scale 14.3, K = 65536: each negative pair's logit gradient
    is ~1e-9, below fp16's smallest subnormal; the fp16 pre-scale must keep it. Checked per entry
    against the sum of its terms' magnitudes."""
    M, K, D, pos, scale = 256, 65536, 64, 1000, 14.3
    rows, cols, scale_t, _ = make_inputs(M, K, D, dtype, scale, None, seed=21)
    g_row = torch.full((M,), 0.5 / M, device="cuda")
    g_col = torch.full((K,), 0.5 / M, device="cuda")
    g_pos = -(g_row + g_col[pos:pos + M])
    grads = (g_row, g_pos, g_col)
    outs = forward(rows, cols, scale_t, None, pos, True, algorithm, workspace=64 << 20)
    got = backward(grads, rows, cols, scale_t, None, pos, outs, algorithm, workspace=64 << 20)
    expected = reference_grads(rows, cols, scale_t, None, pos, grads)
    # |d grad_rows[i, f]| <= s * sum_j |dS_ij| |c_jf|: bounded through |dS| sums per row.
    r64, c64 = rows.double(), cols.double()
    S = scale * r64 @ c64.T
    dS = (g_row.double()[:, None] * torch.softmax(S, 1) + g_col.double()[None, :] * torch.softmax(S, 0))
    dS[torch.arange(M), pos + torch.arange(M, device="cuda")] += g_pos.double()
    bound_rows = scale * dS.abs() @ c64.abs()
    bound_cols = scale * dS.abs().T @ r64.abs()
    for got_g, ref_g, bound, name in ((got[0], expected[0], bound_rows, "grad_rows"),
                                      (got[1], expected[1], bound_cols, "grad_cols")):
        err = (got_g.double() - ref_g).abs()
        worst = (err / (GRAD_RTOL[dtype] * bound + 1e-30)).max().item()
        assert worst <= 1.0, f"{name}: error {worst:.2f}x the allowed rounding error"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_no_host_synchronisation(algorithm):
    M, K, D, pos = 300, 2000, 64, 100
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, torch.bfloat16, 14.3, 0.5, seed=22)
    grads = upstream(M, K, True, seed=23)
    forward(rows, cols, scale_t, bias_t, pos, True, algorithm)  # warm-up (cuBLAS handles, allocator)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outs = forward(rows, cols, scale_t, bias_t, pos, True, algorithm)
        backward(grads, rows, cols, scale_t, bias_t, pos, outs, algorithm)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_non_contiguous_inputs_match_contiguous(algorithm):
    M, K, D, pos = 90, 300, 48, 20
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, torch.bfloat16, 14.3, 0.5, seed=24)
    cols_t = cols.T.contiguous().T  # same values, column-major
    assert not cols_t.is_contiguous()
    grads = upstream(M, K, True, seed=25)
    a = forward(rows, cols, scale_t, bias_t, pos, True, algorithm)
    b = forward(rows, cols_t, scale_t, bias_t, pos, True, algorithm)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    ga = backward(grads, rows, cols, scale_t, bias_t, pos, a, algorithm)
    gb = backward(grads, rows, cols_t, scale_t, bias_t, pos, b, algorithm)
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x.float(), y.float(), rtol=2e-2, atol=1e-4 * x.abs().max().item())


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_deterministic_backward_is_bitwise_reproducible(dtype, algorithm):
    M, K, D, pos = 500, 1500, 96, 333
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, dtype, 100.0, -1.0, seed=7)
    grads = upstream(M, K, True, seed=8)
    first_out = forward(rows, cols, scale_t, bias_t, pos, True, algorithm)
    first = backward(grads, rows, cols, scale_t, bias_t, pos, first_out, algorithm)
    second_out = forward(rows, cols, scale_t, bias_t, pos, True, algorithm)
    second = backward(grads, rows, cols, scale_t, bias_t, pos, second_out, algorithm)
    for a, b in zip(first_out + first, second_out + second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_inputs_give_nan_outputs(dtype, algorithm):
    M, K, D, pos = 40, 90, 24, 10
    rows, cols, scale_t, _ = make_inputs(M, K, D, dtype, 14.3, None, seed=9)
    rows[2, 5] = float("nan")
    outs = forward(rows, cols, scale_t, None, pos, True, algorithm)
    row_lse, pos_logit, col_lse = outs
    assert torch.isnan(row_lse[2]) and torch.isnan(pos_logit[2])
    assert torch.isnan(col_lse).all(), "row 2 takes part in every column's log-sum-exp"
    others = torch.arange(M, device="cuda") != 2
    assert torch.isfinite(row_lse[others]).all() and torch.isfinite(pos_logit[others]).all()
    got = backward(upstream(M, K, True), rows, cols, scale_t, None, pos, outs, algorithm)
    assert torch.isnan(got[0][2]).all() and torch.isnan(got[1]).any() and torch.isnan(got[2])

    nan_scale = torch.tensor(float("nan"), device="cuda")
    rows, cols, _, _ = make_inputs(M, K, D, dtype, 1.0, None, seed=9)
    outs = forward(rows, cols, nan_scale, None, pos, True, algorithm)
    assert all(torch.isnan(t).all() for t in outs)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_memory_stays_linear_in_rows_and_columns(algorithm):
    """M = K = 16384: an M x K buffer would take 1 GiB (fp32) / 512 MiB (bf16). The fused kernels
    may only use O((M + K) D) scratch; the chunked path its workspace budget on top of that."""
    M = K = 16384
    D = 64
    workspace = 64 << 20
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, torch.bfloat16, 14.3, 0.5, seed=11)
    grads = upstream(M, K, True, seed=12)
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    outs = forward(rows, cols, scale_t, bias_t, 0, True, algorithm, workspace=workspace)
    result = backward(grads, rows, cols, scale_t, bias_t, 0, outs, algorithm, workspace=workspace)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    budget = 16 * (M + K) * D + 64 * (M + K) + (4 << 20) + (workspace if algorithm == "chunked" else 0)
    assert extra <= budget, f"peak extra memory {extra / 2**20:.1f} MiB > {budget / 2**20:.1f} MiB"
    assert extra < M * K * 2 // 4
    assert all(torch.isfinite(t).all() for t in outs + result)


@pytest.mark.skipif(
    not torch._C._dispatch_has_kernel_for_dispatch_key("clipshard::contrastive_lse_forward", "CPU"),
    reason="no CPU kernel registered in this build")
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_cpu_kernel(dtype):
    M, K, D, pos = 77, 301, 50, 200
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, dtype, 14.3, 0.25, seed=13)
    grads = upstream(M, K, True, seed=14)
    outs = forward(rows, cols, scale_t, bias_t, pos, True, "chunked")
    got = backward(grads, rows, cols, scale_t, bias_t, pos, outs, "chunked")
    cpu = lambda ts: [None if t is None else t.cpu() for t in ts]  # noqa: E731
    c_rows, c_cols, c_scale, c_bias = cpu([rows, cols, scale_t, bias_t])
    c_outs = forward(c_rows, c_cols, c_scale, c_bias, pos, True, "fused")
    c_got = backward(cpu(grads), c_rows, c_cols, c_scale, c_bias, pos, c_outs, "fused")
    for a, b in zip(outs, c_outs):
        torch.testing.assert_close(a.cpu(), b, rtol=1e-5, atol=lse_atol(14.3, D))
    for a, b in zip(got[:2], c_got[:2]):
        rtol = 2 * GRAD_RTOL[dtype]
        torch.testing.assert_close(a.cpu().double(), b.double(), rtol=rtol,
                                   atol=rtol * b.abs().max().item())


def good_args():
    rows, cols, scale_t, bias_t = make_inputs(5, 9, 8, torch.float32, 2.0, 0.5)
    return dict(rows=rows, cols=cols, scale=scale_t, bias=bias_t, pos=2)


def call_forward(a):
    return forward(a["rows"], a["cols"], a["scale"], a["bias"], a["pos"], True, a.get("algorithm", "chunked"))


BAD_INPUTS = [
    ("rows on the CPU", lambda a: a.update(rows=a["rows"].cpu()), r"device"),
    ("scale on the CPU", lambda a: a.update(scale=a["scale"].cpu()), r"scale must be on the device"),
    ("bias on the CPU", lambda a: a.update(bias=a["bias"].cpu()), r"bias must be on the device"),
    ("D mismatch", lambda a: a.update(cols=a["cols"][:, :7].contiguous()), r"same feature size D"),
    ("dtype mismatch", lambda a: a.update(cols=a["cols"].half()), r"same dtype"),
    ("float64", lambda a: a.update(rows=a["rows"].double(), cols=a["cols"].double()), r"float64"),
    ("1-D rows", lambda a: a.update(rows=a["rows"][0]), r"2-D"),
    ("empty rows", lambda a: a.update(rows=a["rows"][:0]), r"non-empty"),
    ("unknown algorithm", lambda a: a.update(algorithm="tiles"), r"algorithm must be"),
    ("scale not 0-dim", lambda a: a.update(scale=a["scale"].reshape(1)), r"scale must be a 0-dim"),
    ("pos_offset too large", lambda a: a.update(pos=5), r"pos_offset"),
    ("negative pos_offset", lambda a: a.update(pos=-1), r"pos_offset"),
]


@pytest.mark.parametrize("what,mutate,pattern", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(what, mutate, pattern):
    args = good_args()
    call_forward(args)  # the unmodified arguments are fine
    mutate(args)
    with pytest.raises(RuntimeError, match="contrastive_lse_forward: .*" + pattern):
        call_forward(args)


def test_backward_rejects_bad_gradient_shapes():
    a = good_args()
    outs = call_forward(a)
    g_row, g_pos, g_col = upstream(5, 9, True)
    with pytest.raises(RuntimeError, match=r"contrastive_lse_backward: grad_row_lse must have shape \[5\]"):
        backward((g_row[:4], g_pos, g_col), a["rows"], a["cols"], a["scale"], a["bias"], a["pos"], outs, "chunked")
    with pytest.raises(RuntimeError, match=r"contrastive_lse_backward: grad_col_lse must have shape \[9\]"):
        backward((g_row, g_pos, g_col[:8]), a["rows"], a["cols"], a["scale"], a["bias"], a["pos"], outs, "chunked")
    with pytest.raises(RuntimeError, match=r"contrastive_lse_backward: grad_col_lse is given, so col_lse"):
        ops.contrastive_lse_backward(g_row, g_pos, g_col, a["rows"], a["cols"], a["scale"], a["bias"],
                                     a["pos"], None, None, outs[0], None, "chunked", SMALL_WORKSPACE)


def public_forward_backward(rows, cols, scale, bias, pos, grads, **kwargs):
    """clipshard.contrastive_lse's outputs and the autograd gradients of sum(g * outputs) for
    (rows, cols, scale[, bias])."""
    leaves = [t.detach().clone().requires_grad_() for t in (rows, cols, scale)]
    if bias is not None:
        leaves.append(bias.detach().clone().requires_grad_())
    outs = clipshard.contrastive_lse(*leaves[:3], leaves[3] if bias is not None else None, pos, True, **kwargs)
    loss = sum((o.float() * g).sum() for o, g in zip(outs, grads))
    return [o.detach() for o in outs], torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype", DTYPES)
def test_torch_algorithm_matches_cuda_algorithms_on_the_device(dtype):
    """algorithm="torch" (pure PyTorch, chunked) against both compiled algorithms, same inputs on the
    GPU: each is also checked against fp64 above, so agreement within rounding is expected."""
    M, K, D, pos, scale, bias = 333, 1025, 136, 500, 14.3, 0.5
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, dtype, scale, bias, seed=31)
    grads = upstream(M, K, True, seed=32)
    torch_outs, torch_grads = public_forward_backward(rows, cols, scale_t, bias_t, pos, grads, algorithm="torch")
    for algorithm in ALGORITHMS:
        outs, got = public_forward_backward(rows, cols, scale_t, bias_t, pos, grads, algorithm=algorithm)
        for name, a, b in zip(("row_lse", "pos_logit", "col_lse"), outs, torch_outs):
            torch.testing.assert_close(a.double(), b.double(), rtol=1e-5, atol=2 * lse_atol(scale, D),
                                       msg=lambda m, n=name: f"{algorithm} vs torch, {n}: {m}")
        for name, a, b in zip(("grad_rows", "grad_cols"), got[:2], torch_grads[:2]):
            rtol = 2 * GRAD_RTOL[dtype]
            torch.testing.assert_close(a.double(), b.double(), rtol=rtol, atol=rtol * b.abs().max().item(),
                                       msg=lambda m, n=name: f"{algorithm} vs torch, {n}: {m}")
        g_abs = sum(g.abs().sum().item() for g in grads)
        for name, a, b in zip(("grad_scale", "grad_bias"), got[2:], torch_grads[2:]):
            assert abs(a.item() - b.item()) <= 2e-4 * g_abs + 1e-6, f"{algorithm} vs torch, {name}: {a} vs {b}"


@pytest.mark.parametrize("rows_per_cta", ["16", "32"])
def test_both_chunked_forward_variants_match_fp64_reference(rows_per_cta, monkeypatch):
    """chunk_forward_kernel with 32 row states per thread (one CTA per SM) and with 16 (two CTAs
    per SM), chosen by CLIPSHARD_CHUNKED_FORWARD_ROWS (read at every call)."""
    monkeypatch.setenv("CLIPSHARD_CHUNKED_FORWARD_ROWS", rows_per_cta)
    for M, K, D, pos, scale, bias in ((1, 3, 17, 2, 14.3, 0.5), (129, 1000, 17, 871, 100.0, None),
                                      (2050, 4099, 256, 1000, 14.3, -2.0)):
        rows, cols, scale_t, bias_t = make_inputs(M, K, D, torch.bfloat16, scale, bias, seed=33)
        outs = forward(rows, cols, scale_t, bias_t, pos, True, "chunked")
        ref = contrastive_lse_reference(rows, cols, scale_t, bias_t, pos, True)
        for name, got, expected in zip(("row_lse", "pos_logit", "col_lse"), outs, ref):
            torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=lse_atol(scale, D),
                                       msg=lambda m, n=name: f"{rows_per_cta} rows, M={M}, {n}: {m}")


def test_bad_forward_variant_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CLIPSHARD_CHUNKED_FORWARD_ROWS", "8")
    rows, cols, scale_t, _ = make_inputs(5, 9, 8, torch.float32, 2.0, None)
    with pytest.raises(ValueError, match="CLIPSHARD_CHUNKED_FORWARD_ROWS must be one of 16, 32 \\(or unset\\), got \"8\""):
        forward(rows, cols, scale_t, None, 2, True, "chunked")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("force_fallback", [False, True])
def test_both_rows_gradient_paths_match_fp64_reference(dtype, force_fallback, monkeypatch):
    """16-bit backward: grad_rows accumulates with addmm.dtype_out into fp32 where this torch accepts
    it (probed), else through an fp32 buffer; CLIPSHARD_ADDMM_FP32_ACCUMULATOR=0 forces the buffer."""
    if force_fallback:
        monkeypatch.setenv("CLIPSHARD_ADDMM_FP32_ACCUMULATOR", "0")
    M, K, D, pos = 333, 1025, 136, 500
    rows, cols, scale_t, bias_t = make_inputs(M, K, D, dtype, 14.3, 0.5, seed=34)
    grads = upstream(M, K, True, seed=35)
    outs = forward(rows, cols, scale_t, bias_t, pos, True, "chunked")
    got = backward(grads, rows, cols, scale_t, bias_t, pos, outs, "chunked")
    expected = reference_grads(rows, cols, scale_t, bias_t, pos, grads)
    assert_close_grad(got[0], expected[0], dtype, "grad_rows")
    assert_close_grad(got[1], expected[1], dtype, "grad_cols")
