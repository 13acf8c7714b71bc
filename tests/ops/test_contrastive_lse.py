"""CPU tests of the fused contrastive log-sum-exp op and the single-device clip_loss, against the
materialised fp64 references of tests/references and against open_clip's ClipLoss."""
import math

import pytest
import torch

import clipshard
from clipshard import clip_loss, contrastive_lse
from tests.references.contrastive import clip_loss_reference, contrastive_lse_reference

OPS = torch.ops.clipshard
WS = 1 << 12  # a workspace budget that forces the chunked algorithm into 128-column chunks
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# Allowed max |error| relative to max(1, max |reference|): outputs are accumulated in fp32 (fp64 for
# fp64) from the exact input values; gradients come back rounded to the input dtype.
OUT_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-6, torch.bfloat16: 2e-6}
GRAD_TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (M, K, D, pos_offset): odd sizes around the 128 x 512 tile, M != K, D = 1.
SHAPES = [(1, 1, 1, 0), (3, 17, 1, 14), (17, 17, 3, 0), (129, 1000, 17, 871), (1000, 1000, 129, 0)]
SCALES = [1.0, 14.3, 100.0]
# (with_bias, want_col_lse); the largest shape runs one combination per scale to keep the file fast.
COMBOS = [(False, True), (True, False), (True, True)]


def features(n, d, dtype, normalize=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if normalize:
        x = torch.nn.functional.normalize(x, dim=1)
    return x.to(dtype)


def assert_close(actual, expected, tol, what):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual - expected).abs().max().item() if expected.numel() else 0.0
    bound = tol * max(1.0, expected.abs().max().item() if expected.numel() else 0.0)
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


def run_case(dtype, m, k, d, pos_offset, scale, with_bias, want_col, normalize=True, grad_tol=None):
    """Values and all gradients (random upstream gradients on every output) against the reference."""
    rows = features(m, d, dtype, normalize, seed=1).requires_grad_()
    cols = features(k, d, dtype, normalize, seed=2).requires_grad_()
    s = torch.tensor(scale, dtype=torch.float64 if dtype == torch.float64 else torch.float32, requires_grad=True)
    b = torch.tensor(-3.7, dtype=s.dtype, requires_grad=True) if with_bias else None
    out = contrastive_lse(rows, cols, s, b, pos_offset, want_col)

    leaves = [x.detach().double().requires_grad_() for x in (rows, cols, s)]
    leaves += [b.detach().double().requires_grad_()] if with_bias else []
    ref = contrastive_lse_reference(*leaves[:3], leaves[3] if with_bias else None, pos_offset, want_col)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for name, o, r in zip(("row_lse", "pos_logit", "col_lse"), out, ref):
        assert o.dtype == acc, f"{name} dtype {o.dtype}"
        assert_close(o, r, OUT_TOL[dtype], name)

    g = torch.Generator().manual_seed(3)
    upstream = [torch.randn(o.shape, generator=g, dtype=torch.float64) for o in out]
    inputs = [rows, cols, s] + ([b] if with_bias else [])
    grads = torch.autograd.grad([o for o in out if o.numel()], inputs,
                                [u.to(o.dtype) for o, u in zip(out, upstream) if o.numel()])
    ref_grads = torch.autograd.grad([r for r in ref if r.numel()], leaves, [u for u in upstream if u.numel()])
    # d scale and d bias are sums over all M x K logits of terms of either sign: their error scales
    # with the total upstream gradient, not with the (possibly cancelling) result.
    total = sum(u.abs().sum().item() for u in upstream)
    for name, x, gr, rg in zip(("rows", "cols", "scale", "bias"), inputs, grads, ref_grads):
        assert gr.dtype == x.dtype, f"grad {name} dtype {gr.dtype} != {x.dtype}"
        if name in ("rows", "cols"):
            assert_close(gr, rg, grad_tol or GRAD_TOL[dtype], f"grad {name}")
        else:
            assert_close(gr, rg, OUT_TOL[dtype] * total / max(1.0, rg.abs().item()), f"grad {name}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale", SCALES)
def test_values_and_gradients(dtype, shape, scale):
    m, k, d, pos_offset = shape
    combos = COMBOS if m * k < 10 ** 6 else [COMBOS[SCALES.index(scale)]]
    for with_bias, want_col in combos:
        run_case(dtype, m, k, d, pos_offset, scale, with_bias, want_col)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_large_logits_do_not_overflow(dtype):
    # Unnormalised features at scale 100: logits in the thousands, every tile on the wide-range path.
    # Rounding S to fp32 alone moves the gradients by ~4e-5 of their maximum here (PyTorch's own
    # materialised fp32 loss errs by as much), hence the wider fp32 bound.
    run_case(dtype, 150, 530, 40, 7, 100.0, True, True, normalize=False,
             grad_tol=1e-4 if dtype == torch.float32 else None)


def test_several_column_super_blocks():
    # D = 2048 fp32 limits the backward's per-thread column accumulator to 1024 columns: K = 1500
    # needs two super-blocks.
    run_case(torch.float32, 200, 1500, 2048, 1300, 14.3, True, True)


def compare_with_reference(rows, cols, scale, bias, pos_offset, out_tol, grad_tol):
    """Values and gradients (random upstream gradients) of the op vs the fp64 reference."""
    leaves = [x.detach().clone().requires_grad_() for x in (rows, cols, scale, bias)]
    out = contrastive_lse(*leaves, pos_offset)
    ref_leaves = [x.detach().double().requires_grad_() for x in (rows, cols, scale, bias)]
    ref = contrastive_lse_reference(*ref_leaves, pos_offset)
    upstream = [torch.randn(o.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(i))
                for i, o in enumerate(out)]
    for o, r in zip(out, ref):
        assert_close(o, r, out_tol, "output")
    grads = torch.autograd.grad(out, leaves, [u.to(o.dtype) for o, u in zip(out, upstream)])
    ref_grads = torch.autograd.grad(ref, ref_leaves, upstream)
    for g, rg in zip(grads[:2], ref_grads[:2]):
        assert_close(g, rg, grad_tol, "feature grad")
    total = sum(u.abs().sum().item() for u in upstream)
    for g, rg in zip(grads[2:], ref_grads[2:]):
        assert_close(g, rg, out_tol * total / max(1.0, rg.abs().item()), "scale/bias grad")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_narrow_and_wide_tiles_in_one_row(dtype):
    # Column tiles alternate between tiny logits (one-exponential path) and huge ones (two-exponential
    # path), so every row merges partial sums of both kinds; rows 0..199 span two row blocks.
    rows = features(200, 24, dtype, seed=30)
    cols = features(1100, 24, dtype, seed=31)
    cols[512:1024] *= 30
    s, b = torch.tensor(14.3, dtype=dtype), torch.tensor(0.5, dtype=dtype)
    compare_with_reference(rows, cols, s, b, 900, OUT_TOL[dtype], 1e-12 if dtype == torch.float64 else 1e-4)


def test_non_contiguous_inputs():
    base_rows = features(40, 30, torch.float32, seed=32)
    base_cols = features(33, 120, torch.float32, seed=33)
    rows = base_rows[::2, ::3]  # 20 x 10, strided
    cols = base_cols[:, ::12][:30]  # 30 x 10, strided
    assert not rows.is_contiguous() and not cols.is_contiguous()
    s, b = torch.tensor(9.0), torch.tensor(-0.25)
    compare_with_reference(rows, cols, s, b, 4, OUT_TOL[torch.float32], GRAD_TOL[torch.float32])
    compare_with_reference(rows.T.contiguous().T, cols, s, b, 4, OUT_TOL[torch.float32], GRAD_TOL[torch.float32])


def test_only_some_outputs_used():
    rows = features(70, 9, torch.float64, seed=4).requires_grad_()
    cols = features(90, 9, torch.float64, seed=5).requires_grad_()
    s = torch.tensor(20.0, dtype=torch.float64, requires_grad=True)
    row_lse, _, _ = contrastive_lse(rows, cols, s, pos_offset=20)
    grads = torch.autograd.grad(row_lse.sum(), [rows, cols, s])
    ref_rows, ref_lse = rows.detach().requires_grad_(), None
    ref_cols, ref_s = cols.detach().requires_grad_(), s.detach().requires_grad_()
    ref_lse = contrastive_lse_reference(ref_rows, ref_cols, ref_s, None, 20)[0]
    ref_grads = torch.autograd.grad(ref_lse.sum(), [ref_rows, ref_cols, ref_s])
    for gr, rg in zip(grads, ref_grads):
        assert_close(gr, rg, 1e-12, "grad")


def test_gradcheck():
    for scale, normalize in ((2.5, True), (40.0, False)):  # narrow- and wide-range tiles
        rows = features(5, 4, torch.float64, normalize, seed=6).requires_grad_()
        cols = features(8, 4, torch.float64, normalize, seed=7).requires_grad_()
        s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
        b = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
        for want_col in (True, False):
            assert torch.autograd.gradcheck(
                lambda r, c, s, b: contrastive_lse(r, c, s, b, 2, want_col)[: 3 if want_col else 2],
                (rows, cols, s, b))


def test_compile_fullgraph():
    img, txt = features(40, 16, torch.float32, seed=10), features(40, 16, torch.float32, seed=11)
    s = torch.tensor(14.3, requires_grad=True)
    compiled = torch.compile(clip_loss, fullgraph=True, backend="aot_eager")
    a, b = img.clone().requires_grad_(), txt.clone().requires_grad_()
    loss = compiled(a, b, s)
    loss.backward()
    ref = clip_loss_reference(img, txt, s.detach())
    assert_close(loss, ref, 1e-6, "compiled loss")
    a2, b2 = img.clone().requires_grad_(), txt.clone().requires_grad_()
    clip_loss(a2, b2, s.detach()).backward()
    assert_close(a.grad, a2.grad, 1e-6, "compiled grad")


def test_clip_loss_matches_open_clip():
    open_clip_loss = pytest.importorskip("open_clip.loss")
    for b, d, with_bias in ((300, 64, False), (257, 33, True)):
        img, txt = features(b, d, torch.float32, seed=12), features(b, d, torch.float32, seed=13)
        leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_(), torch.tensor(31.4, requires_grad=True)]
        leaves += [torch.tensor(-2.0, requires_grad=True)] if with_bias else []
        ours = clip_loss(*leaves)
        grads = torch.autograd.grad(ours, leaves)
        theirs_leaves = [x.detach().clone().requires_grad_() for x in leaves]
        theirs = open_clip_loss.ClipLoss(world_size=1)(*theirs_leaves)
        theirs_grads = torch.autograd.grad(theirs, theirs_leaves)
        assert_close(ours, theirs, 1e-6, "loss")
        for g1, g2 in zip(grads, theirs_grads):
            assert_close(g1, g2, 1e-5, "grad")
        assert_close(ours, clip_loss_reference(*[x.detach() for x in leaves]), 1e-6, "loss vs fp64")


def test_clip_loss_python_float_scale():
    img, txt = features(20, 8, torch.float32, seed=14), features(20, 8, torch.float32, seed=15)
    assert_close(clip_loss(img, txt, 10.0), clip_loss_reference(img, txt, torch.tensor(10.0)), 1e-6, "loss")


def test_nan_propagates():
    rows, cols = features(300, 10, torch.float32, seed=16), features(700, 10, torch.float32, seed=17)
    rows[5, 3] = float("nan")
    for scale in (1.0, 100.0):
        row_lse, pos, col_lse = contrastive_lse(rows, cols, scale, pos_offset=1)
        assert torch.isnan(row_lse[5]) and torch.isnan(pos[5]) and torch.isnan(col_lse).all()
        mask = torch.arange(300) != 5
        assert torch.isfinite(row_lse[mask]).all() and torch.isfinite(pos[mask]).all()
        rows_g = rows.clone().requires_grad_()
        contrastive_lse(rows_g, cols, scale, pos_offset=1)[0].sum().backward()
        assert torch.isnan(rows_g.grad[5]).all()


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_infinite_feature_matches_torch(dtype):
    # Row 3 holds +inf: its logits are +-inf. The other row block has logits near 1000, so the
    # partial column sums merged with row 3's infinite ones sit far apart.
    rows = features(200, 6, dtype, seed=34) * 70
    cols = features(300, 6, dtype, seed=35)
    rows[3, 0] = math.inf
    out = contrastive_lse(rows, cols, 14.3, pos_offset=50)
    ref = contrastive_lse_reference(rows, cols, torch.tensor(14.3, dtype=dtype), None, 50)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o.double(), r, rtol=1e-5, atol=1e-3, equal_nan=True)
    assert math.isinf(out[0][3]) and torch.isinf(out[2]).any()


def test_infinite_bias():
    rows, cols = features(4, 3, torch.float32, seed=18), features(6, 3, torch.float32, seed=19)
    row_lse, pos, col_lse = contrastive_lse(rows, cols, 5.0, float("-inf"))
    assert (row_lse == -math.inf).all() and (pos == -math.inf).all() and (col_lse == -math.inf).all()


def test_deterministic():
    rows, cols = features(600, 32, torch.float32, seed=20), features(900, 32, torch.float32, seed=21)
    results = []
    for _ in range(2):
        r, c = rows.clone().requires_grad_(), cols.clone().requires_grad_()
        out = contrastive_lse(r, c, 14.3, pos_offset=100)
        (out[0].sum() + out[2].sum() - out[1].sum()).backward()
        results.append((*[o.detach() for o in out], r.grad, c.grad))
    for x, y in zip(*results):
        assert torch.equal(x, y)


def _run_with_grads(rows, cols, algorithm):
    r, c = rows.clone().requires_grad_(), cols.clone().requires_grad_()
    out = contrastive_lse(r, c, 14.3, pos_offset=5, algorithm=algorithm)
    (out[0].sum() + out[2].sum() - out[1].sum()).backward()
    return (*[o.detach() for o in out], r.grad, c.grad)


@pytest.mark.parametrize("algorithm", ["fused", "chunked", "torch"])
def test_deterministic_algorithms_mode_changes_nothing(algorithm):
    """Every path is deterministic already: torch.use_deterministic_algorithms(True) gives the same bits."""
    rows, cols = features(30, 8, torch.float32, seed=24), features(50, 8, torch.float32, seed=25)
    plain = _run_with_grads(rows, cols, algorithm)
    saved = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        strict = _run_with_grads(rows, cols, algorithm)
    finally:
        torch.use_deterministic_algorithms(saved)
    for x, y in zip(plain, strict):
        assert torch.equal(x, y)


def test_thread_count_changes_only_rounding():
    rows, cols = features(600, 32, torch.float32, seed=22), features(900, 32, torch.float32, seed=23)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = contrastive_lse(rows, cols, 14.3)
    finally:
        torch.set_num_threads(threads)
    many = contrastive_lse(rows, cols, 14.3)
    for x, y in zip(one, many):
        assert_close(x, y, 1e-6, "threads")


BAD_INPUTS = [
    (lambda r, c: (r, c[:, :5], 1.0), ValueError, "same feature size D, got 8 and 5"),
    (lambda r, c: (r, c.double(), 1.0), TypeError, "same dtype, got torch.float32 and torch.float64"),
    (lambda r, c: (r.int(), c.int(), 1.0), TypeError, "rows and cols must have the same dtype|float32, float16"),
    (lambda r, c: (r, c.to("meta"), 1.0), ValueError, "same device"),
    (lambda r, c: (r, c, torch.ones(2)), ValueError, r"scale must be a one-element tensor, got shape \(2,\)"),
    (lambda r, c: (r[0], c, 1.0), ValueError, "rows must be 2-D"),
    (lambda r, c: (r[:0], c, 1.0), ValueError, "empty inputs"),
    (lambda r, c: (r, c[:4], 1.0), ValueError, "pos_offset \\+ M <= K"),
]


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_input_wrapper(case):
    make, exc, message = BAD_INPUTS[case]
    rows, cols = features(6, 8, torch.float32), features(10, 8, torch.float32)
    with pytest.raises(exc, match=message):
        contrastive_lse(*make(rows, cols))
    with pytest.raises(ValueError, match="pos_offset must satisfy"):
        contrastive_lse(rows, cols, 1.0, pos_offset=5)


def test_bad_input_op():
    rows, cols, s = features(6, 8, torch.float32), features(10, 8, torch.float32), torch.tensor(1.0)
    fwd = OPS.contrastive_lse_forward
    with pytest.raises(RuntimeError, match="contrastive_lse_forward: rows and cols must have the same feature size"):
        fwd(rows, cols[:, :3], s, None, 0, None, None, True, "fused", WS)
    with pytest.raises(RuntimeError, match="contrastive_lse_forward: rows and cols must have the same dtype"):
        fwd(rows, cols.half(), s, None, 0, None, None, True, "fused", WS)
    with pytest.raises(RuntimeError, match="contrastive_lse_forward: pos_offset must satisfy"):
        fwd(rows, cols, s, None, -2, None, None, True, "fused", WS)
    with pytest.raises(RuntimeError, match="contrastive_lse_forward: scale must be a 0-dim tensor"):
        fwd(rows, cols, s.reshape(1), None, 0, None, None, True, "fused", WS)
    with pytest.raises(RuntimeError, match="contrastive_lse_forward: empty inputs"):
        fwd(rows[:0], cols, s, None, 0, None, None, True, "fused", WS)
    row_lse, _, _ = fwd(rows, cols, s, None, 0, None, None, True, "fused", WS)
    with pytest.raises(RuntimeError, match="contrastive_lse_backward: grad_col_lse was given but col_lse is None"):
        OPS.contrastive_lse_backward(row_lse, row_lse, torch.ones(10), rows, cols, s, None, 0, None, None, row_lse,
                                     None, "fused", WS)


def test_clip_loss_bad_input():
    img, txt = features(6, 8, torch.float32), features(6, 8, torch.float32)
    with pytest.raises(TypeError, match="clip_loss: image_features and text_features must have the same dtype, "
                                        "got torch.float16 and torch.float32"):
        clip_loss(img.half(), txt, 1.0)
    with pytest.raises(ValueError, match="clip_loss: image_features and text_features must have the same shape"):
        clip_loss(img, txt[:5], 1.0)


def test_public_exports():
    assert clipshard.clip_loss is clip_loss and clipshard.contrastive_lse is contrastive_lse


class _ColumnGradients(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the grad_col_lse argument of every compiled contrastive_lse_backward call."""

    def __init__(self):
        super().__init__()
        self.grad_col_lse = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket == OPS.contrastive_lse_backward:
            self.grad_col_lse.append(args[2])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_unused_col_lse_reaches_the_kernel_as_none(device):
    """Issue 31's wider search (item 11's pattern): with want_col_lse=True and a loss of the row
    statistics alone, autograd materialised zeros for col_lse's gradient, and the kernels formed
    the column softmax term of every logit (an exponential each) to add nothing. It now hands the
    kernel None; the gradients are unchanged."""
    rows = features(40, 8, torch.float32, seed=26).to(device).requires_grad_()
    cols = features(130, 8, torch.float32, seed=27).to(device).requires_grad_()
    calls = _ColumnGradients()
    with calls:
        row_lse, pos_logit, _ = contrastive_lse(rows, cols, 14.3, pos_offset=30)
        (row_lse.mean() - pos_logit.mean()).backward()
    assert calls.grad_col_lse == [None]
    ref_rows, ref_cols = rows.detach().double().requires_grad_(), cols.detach().double().requires_grad_()
    ref = contrastive_lse_reference(ref_rows, ref_cols, torch.tensor(14.3, dtype=torch.float64), None, 30)
    (ref[0].mean() - ref[1].mean()).backward()
    assert_close(rows.grad, ref_rows.grad, 1e-5, "grad rows")
    assert_close(cols.grad, ref_cols.grad, 1e-5, "grad cols")
