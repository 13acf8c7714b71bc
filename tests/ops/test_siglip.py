"""CPU tests of the fused SigLIP op (torch.ops.clipshard.siglip_forward, clipshard.siglip_sum) and the
single-device siglip_loss / SigLipLoss, against the materialised fp64 references of
tests/references and against open_clip's own SigLipLoss."""
import math

import pytest
import torch

import clipshard
from clipshard import SigLipLoss, siglip_loss, siglip_sum
from tests.isa_utils import ISA_CHOICES, run_under_each_isa
from tests.references.siglip import siglip_loss_reference, siglip_sum_reference

OPS = torch.ops.clipshard
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
# (M, K, D, pos_offset): odd sizes, M != K, D = 1, positives inside and at the end of the columns.
SHAPES = [(1, 1, 1, 0), (3, 17, 1, 14), (17, 17, 3, 0), (129, 1000, 17, 871), (300, 700, 64, 0)]
SCALES = [1.0, 10.0, 100.0]
BIASES = [-10.0, 0.0, 5.0]


def features(n, d, dtype, seed, normalize=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    if normalize:
        x = torch.nn.functional.normalize(x, dim=1)
    return x.to(dtype)


def logit_gradient_sums(rows, cols, scale, bias, pos_offset):
    """sum |dl| and sum |dl * dot| over the block (fp64): the sizes the bias and scale gradients'
    rounding errors grow with (the signed sums themselves may cancel)."""
    dots = rows.double() @ cols.double().T
    logits = scale * dots + (0.0 if bias is None else bias)
    z = -torch.ones_like(logits)
    index = torch.arange(rows.shape[0])
    if pos_offset is not None:
        z[index, pos_offset + index] = 1.0
    dl = torch.sigmoid(-z * logits)
    return dl.sum().item(), (dl * dots.abs()).sum().item()


def rel_error(actual, expected):
    actual, expected = actual.double(), expected.double()
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-300)).item()


# fp32 logits are off by about scale * 1e-7 (the GEMM's rounding), and every loss term and logit
# gradient moves by at most that much times |dl| <= 1: tolerances grow with the scale.
def loss_tol(dtype, scale):
    return 1e-12 if dtype == torch.float64 else 3e-7 * (1 + scale)


def grad_tol(dtype, scale):
    # fp32: plus the sums over up to a thousand terms of either sign that each gradient entry is;
    # 16-bit gradients are rounded to the input dtype: half an ulp relative to the largest entry.
    return {torch.float64: 1e-10, torch.float32: 2e-6 + 3e-7 * scale, torch.float16: 2e-3,
            torch.bfloat16: 1e-2}[dtype]


# Gradients below the smallest normal of their dtype have fewer bits: half their grid step is the
# least error a rounded result can have.
SUBNORMAL_HALF_STEP = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134}


# A loss that is itself subnormal in fp32 (one logit of -100) is rounded twice (the term, the sum).
LOSS_FLOOR = {torch.float32: 2.0 ** -148, torch.float16: 2.0 ** -148, torch.bfloat16: 2.0 ** -148}


def fp32_gradient_floor(dtype, scale, m, k, upstream):
    """Logit gradients below fp32's smallest normal (2^-126) keep an absolute precision of 2^-149
    only; a gradient entry adds up to max(M, K) of them, times the scale."""
    return 0.0 if dtype == torch.float64 else 2.0 ** -126 * (1 + scale) * max(m, k) * abs(upstream)


def run_case(dtype, m, k, d, pos_offset, scale, bias, upstream, workspace_bytes=None, algorithm="auto"):
    rows = features(m, d, dtype, seed=1).requires_grad_()
    cols = features(k, d, dtype, seed=2).requires_grad_()
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    s = torch.tensor(scale, dtype=acc, requires_grad=True)
    b = None if bias is None else torch.tensor(bias, dtype=acc, requires_grad=True)
    inputs = [rows, cols, s] + ([b] if b is not None else [])
    out = siglip_sum(rows, cols, s, b, pos_offset, workspace_bytes=workspace_bytes, algorithm=algorithm)
    assert out.dtype == acc and out.dim() == 0
    grads = torch.autograd.grad(out * upstream, inputs)

    leaves = [x.detach().double().requires_grad_() for x in inputs]
    ref = siglip_sum_reference(leaves[0], leaves[1], leaves[2], leaves[3] if b is not None else None, pos_offset)
    ref_grads = torch.autograd.grad(ref * upstream, leaves)
    case = f"{dtype} M={m} K={k} D={d} scale={scale} bias={bias}"
    bound = loss_tol(dtype, scale) * ref.item() + LOSS_FLOOR.get(dtype, 0.0)
    assert abs(out.item() - ref.item()) <= bound, f"{case}: loss {out.item()} vs {ref.item()}"
    dl_sum, dl_dot_sum = logit_gradient_sums(leaves[0], leaves[1], scale, bias, pos_offset)
    for name, x, got, want in zip(("rows", "cols", "scale", "bias"), inputs, grads, ref_grads):
        assert got.dtype == x.dtype and got.shape == x.shape, f"{case}: grad {name} {got.dtype} {tuple(got.shape)}"
        if name in ("rows", "cols"):
            error = (got.double() - want).abs().max().item()
            bound = (grad_tol(dtype, scale) * want.abs().max().item() + SUBNORMAL_HALF_STEP.get(dtype, 0.0)
                     + fp32_gradient_floor(dtype, scale, m, k, upstream))
            assert error <= bound, f"{case}: grad {name} error {error:.3g} > {bound:.3g}"
        else:
            bound = (loss_tol(dtype, scale) * abs(upstream) * (dl_dot_sum if name == "scale" else dl_sum)
                     + fp32_gradient_floor(dtype, scale, m, k, upstream) * m)
            error = abs(got.item() - want.item())
            assert error <= bound, f"{case}: grad {name} error {error:.3g} > {bound:.3g}"
    return out, grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("scale", SCALES)
def test_values_and_gradients(dtype, shape, scale):
    m, k, d, pos_offset = shape
    biases = BIASES + [None] if m * k < 10 ** 5 else [BIASES[SCALES.index(scale)]]
    for bias in biases:
        run_case(dtype, m, k, d, pos_offset, scale, bias, upstream=0.5 / m)  # open_clip's 1/M, halved


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
def test_chunk_boundaries(dtype):
    """Small workspaces: chunks narrower than K with a ragged last one, narrower than M, and the
    positives spread over several chunks; every budget gives the reference result."""
    bytes_per_logit = 2 * (8 if dtype == torch.float64 else 4)  # the similarities and their gradient
    cases = [
        (40, 300, 7, 100, 128 * 40 * bytes_per_logit),  # Kc = 128 < K = 300 (chunks 128, 128, 44)
        (200, 1000, 5, 700, 1),                          # Kc = 128 (the minimum) < M = 200
        (200, 1000, 5, 0, 300 * 200 * bytes_per_logit),  # Kc = 256, last chunk 232
        (1, 1, 3, 0, 1),                                 # a single column
        (3, 1000, 2, 997, 1),                            # the positives in the last, ragged chunk
    ]
    for m, k, d, pos_offset, budget in cases:
        for with_grad in (False, True):
            rows, cols = features(m, d, dtype, seed=3), features(k, d, dtype, seed=4)
            acc = torch.float64 if dtype == torch.float64 else torch.float32
            s, b = torch.tensor(10.0, dtype=acc), torch.tensor(-10.0, dtype=acc)
            got = OPS.siglip_forward(rows, cols, s, b, pos_offset, None, None, False, with_grad, budget)
            whole = OPS.siglip_forward(rows, cols, s, b, pos_offset, None, None, False, with_grad, 1 << 30)
            ref = siglip_sum_reference(rows, cols, s, b, pos_offset)
            assert abs(got[0].item() - ref.item()) <= loss_tol(dtype, 10.0) * ref.item(), (m, k, budget)
            for g, w in zip(got[1:], whole[1:]):
                assert g.shape == w.shape and (g.numel() == 0) == (not with_grad)
                if g.numel():
                    assert rel_error(g, w) <= grad_tol(dtype, 10.0), (m, k, budget)
        run_case(dtype, m, k, d, pos_offset, 10.0, -10.0, upstream=1.0, workspace_bytes=budget)


@pytest.mark.parametrize("algorithm", ["chunked", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_without_positives(dtype, algorithm):
    """pos_offset=None (a foreign block of the SigLIP ring, docs/siglip.md): every pair a negative,
    against the fp64 reference, for any M and K (M > K too), over several chunks, with and without
    gradients; the compiled op and the torch path."""
    bytes_per_logit = 2 * (8 if dtype == torch.float64 else 4)
    cases = [(7, 3, 5, None), (1, 1, 3, None), (40, 300, 7, 128 * 40 * bytes_per_logit)]  # chunks 128, 128, 44
    for m, k, d, budget in cases:
        for scale, bias in ((10.0, -10.0), (10.0, None), (100.0, 5.0)):  # scale 100: many logits above 20
            run_case(dtype, m, k, d, None, scale, bias, upstream=0.5 / m, workspace_bytes=budget, algorithm=algorithm)
    rows, cols = features(40, 7, dtype, seed=5), features(300, 7, dtype, seed=6)
    s, b = (torch.tensor(v, dtype=torch.float64 if dtype == torch.float64 else torch.float32) for v in (10.0, -1.0))
    without = siglip_sum(rows, cols, s, b, None, algorithm=algorithm, workspace_bytes=128 * 40 * 16)
    ref = siglip_sum_reference(rows.double(), cols.double(), s.double(), b.double(), None)
    assert abs(without.item() - ref.item()) <= loss_tol(dtype, 10.0) * ref.item()
    # the check can fail: with positives the sum differs by far more than the tolerance
    with_positives = siglip_sum(rows, cols, s, b, 0, algorithm=algorithm)
    assert abs(with_positives.item() - ref.item()) > 100 * loss_tol(dtype, 10.0) * ref.item()


def test_matches_open_clip():
    open_clip_loss = pytest.importorskip("open_clip.loss")
    for b, d, scale, bias in ((300, 64, 10.0, -10.0), (257, 33, 100.0, 5.0), (64, 768, 1.0, 0.0)):
        img, txt = features(b, d, torch.float32, seed=12), features(b, d, torch.float32, seed=13)
        leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_(),
                  torch.tensor(scale, requires_grad=True), torch.tensor(bias, requires_grad=True)]
        ours = SigLipLoss()(*leaves)
        grads = torch.autograd.grad(ours, leaves)
        theirs_leaves = [x.detach().clone().requires_grad_() for x in leaves]
        theirs = open_clip_loss.SigLipLoss()(*theirs_leaves)
        theirs_grads = torch.autograd.grad(theirs, theirs_leaves)
        assert rel_error(ours, theirs) <= 1e-5, (b, scale, bias)
        for name, g1, g2 in zip(("image", "text", "scale", "bias"), grads, theirs_grads):
            assert rel_error(g1, g2) <= 1e-5, (b, scale, bias, name, rel_error(g1, g2))
        ref = siglip_loss_reference(*[x.detach() for x in leaves])
        assert rel_error(ours, ref) <= loss_tol(torch.float32, scale)


def test_one_element_scale_and_bias():
    """open_clip models may hold logit_scale / logit_bias as shape (1,): accepted, with gradients of
    that shape; Python numbers work too."""
    img, txt = features(20, 8, torch.float32, seed=14), features(20, 8, torch.float32, seed=15)
    s, b = torch.full((1,), 10.0, requires_grad=True), torch.full((1,), -10.0, requires_grad=True)
    loss = siglip_loss(img, txt, s, b)
    loss.backward()
    assert s.grad.shape == (1,) and b.grad.shape == (1,)
    s0, b0 = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    siglip_loss(img, txt, s0, b0).backward()
    assert torch.equal(s.grad[0], s0.grad) and torch.equal(b.grad[0], b0.grad)
    ref = siglip_loss_reference(img, txt, torch.tensor(10.0), torch.tensor(-10.0))
    assert rel_error(siglip_loss(img, txt, 10.0, -10.0), ref) <= loss_tol(torch.float32, 10.0)
    assert rel_error(SigLipLoss()(img, txt, 10.0, None), siglip_loss_reference(img, txt, torch.tensor(10.0))) < 1e-5


def test_sixteen_bit_against_open_clip():
    """16-bit features: clipshard accumulates in fp32 from the exact inputs, open_clip computes the
    logits in 16 bits; ours must be no worse than twice open_clip's own error."""
    open_clip_loss = pytest.importorskip("open_clip.loss")
    for dtype in (torch.bfloat16, torch.float16):
        img, txt = features(200, 48, dtype, seed=22), features(200, 48, dtype, seed=23)
        s, b = torch.tensor(10.0), torch.tensor(-10.0)
        ref_leaves = [x.double().requires_grad_() for x in (img, txt, s, b)]
        ref = siglip_loss_reference(*ref_leaves)
        ref_grads = torch.autograd.grad(ref, ref_leaves)
        def errors(impl):
            leaves = [x.clone().requires_grad_() for x in (img, txt, s, b)]
            loss = impl(*leaves)
            grads = torch.autograd.grad(loss, leaves)
            return [rel_error(loss, ref)] + [rel_error(g, r) for g, r in zip(grads, ref_grads)]

        ours, open_clips = errors(SigLipLoss()), errors(open_clip_loss.SigLipLoss())
        for name, mine, theirs in zip(("loss", "image", "text", "scale", "bias"), ours, open_clips):
            assert mine <= max(2 * theirs, grad_tol(dtype, 10.0)), (dtype, name, mine, theirs)


def test_non_contiguous_inputs_and_partial_requires_grad():
    base = features(60, 20, torch.float32, seed=26)
    rows, cols = base[::3, ::2], features(50, 10, torch.float32, seed=27).T.contiguous().T  # strided views
    assert not rows.is_contiguous() and not cols.is_contiguous()
    r = rows.clone().requires_grad_()  # only the rows (and no scalar) need a gradient
    loss = siglip_sum(r, cols, 10.0, -10.0, pos_offset=5)
    loss.backward()
    leaves = [rows.double().requires_grad_(), cols.double(), torch.tensor(10.0), torch.tensor(-10.0)]
    ref = siglip_sum_reference(*leaves, pos_offset=5)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= loss_tol(torch.float32, 10.0) * ref.item()
    assert rel_error(r.grad, leaves[0].grad) <= grad_tol(torch.float32, 10.0)


def test_nan_propagates():
    rows, cols = features(300, 10, torch.float32, seed=16), features(700, 10, torch.float32, seed=17)
    rows[5, 3] = float("nan")
    for scale in (1.0, 100.0):
        r, c = rows.clone().requires_grad_(), cols.clone().requires_grad_()
        s, b = torch.tensor(scale, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        loss = siglip_sum(r, c, s, b, pos_offset=1)
        loss.backward()
        assert torch.isnan(loss)
        assert torch.isnan(r.grad[5]).all() and torch.isfinite(r.grad[torch.arange(300) != 5]).all()
        assert torch.isnan(c.grad).all() and torch.isnan(s.grad) and torch.isnan(b.grad)
    nan_bias = siglip_sum(features(4, 3, torch.float32, seed=1), features(6, 3, torch.float32, seed=2), 1.0,
                          float("nan"))
    assert torch.isnan(nan_bias)


def test_extreme_logits_stay_finite():
    """Scale 100 and |bias| 20 on features of norm 1: logits up to about +-120, every term and
    gradient finite and accurate (no overflow in softplus or sigmoid)."""
    for bias in (-20.0, 20.0):
        run_case(torch.float32, 64, 200, 16, 0, 100.0, bias, upstream=1.0)
    rows = features(8, 4, torch.float32, seed=5)
    rows_inf = rows.clone()
    rows_inf[2, 0] = math.inf  # +-inf logits: softplus gives inf or 0, never NaN unless inf - inf
    loss = siglip_sum(rows_inf, rows, 1.0, 0.0)
    assert torch.isinf(loss) and loss > 0


def test_fp16_gradients_of_the_mean_do_not_overflow_through_the_sum():
    """The op keeps the gradients of the loss *sum*; with fp16 features at scale 100 and nearly
    equal features they exceed 65504 (here about 100 * 2047), while the gradient of the mean
    (divided by M = 2048) is about 100. fp16 features keep the sum's gradients in fp32, so the
    loss's gradients stay finite and right."""
    B, D = 2048, 4
    base = torch.nn.functional.normalize(torch.tensor([[1.0, 0.5, -0.25, 0.125]], dtype=torch.float64), dim=1)
    wiggle = 1e-3 * torch.linspace(-1, 1, B * D, dtype=torch.float64).reshape(B, D)
    image = torch.nn.functional.normalize(base + wiggle, dim=1).half()
    text = torch.nn.functional.normalize(base - wiggle, dim=1).half()
    scale, bias = torch.tensor(100.0), torch.tensor(0.0)
    img, txt = image.clone().requires_grad_(), text.clone().requires_grad_()
    siglip_loss(img, txt, scale, bias).backward()
    ref_img, ref_txt = image.double().requires_grad_(), text.double().requires_grad_()
    siglip_loss_reference(ref_img, ref_txt, scale.double(), bias.double()).backward()
    for got, ref in ((img.grad, ref_img.grad), (txt.grad, ref_txt.grad)):
        assert got.dtype == torch.float16 and torch.isfinite(got).all()
        assert ref.abs().max() > 50  # large, but far inside fp16's range
        torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


def test_gradcheck():
    rows, cols = features(7, 3, torch.float64, seed=6), features(300, 3, torch.float64, seed=7)
    for bias in (None, -2.0):
        leaves = [rows.clone().requires_grad_(), cols.clone().requires_grad_(),
                  torch.tensor(4.0, dtype=torch.float64, requires_grad=True)]
        if bias is not None:
            leaves.append(torch.tensor(bias, dtype=torch.float64, requires_grad=True))

        def fn(*args):  # small workspace: three column chunks
            return siglip_sum(args[0], args[1], args[2], args[3] if len(args) > 3 else None, 200,
                              workspace_bytes=128 * 7 * 16)

        assert torch.autograd.gradcheck(fn, leaves)


def test_compile_fullgraph():
    img, txt = features(40, 16, torch.float32, seed=10), features(40, 16, torch.float32, seed=11)
    s, b = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
    compiled = torch.compile(siglip_loss, fullgraph=True, backend="aot_eager")
    a, t = img.clone().requires_grad_(), txt.clone().requires_grad_()
    loss = compiled(a, t, s, b)
    loss.backward()
    a2, t2 = img.clone().requires_grad_(), txt.clone().requires_grad_()
    s2, b2 = s.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    eager = siglip_loss(a2, t2, s2, b2)
    eager.backward()
    assert torch.equal(loss, eager)
    for got, want in ((a.grad, a2.grad), (t.grad, t2.grad), (s.grad, s2.grad), (b.grad, b2.grad)):
        assert torch.equal(got, want)
    with torch.no_grad():  # the loss-only pass
        assert torch.equal(compiled(img, txt, s, b), siglip_loss(img, txt, s, b))


def test_no_gradients_without_grad_mode():
    """Without autograd the op runs its loss-only pass and returns empty gradients."""
    rows, cols = features(10, 4, torch.float32, seed=12), features(30, 4, torch.float32, seed=13)
    s = torch.tensor(10.0, requires_grad=True)
    out = OPS.siglip_forward(rows, cols, s.detach(), None, 0, None, None, False, False, 1 << 20)
    assert all(g.numel() == 0 for g in out[1:])
    with_grad = OPS.siglip_forward(rows, cols, s.detach(), None, 0, None, None, False, True, 1 << 20)
    assert abs(out[0].item() - with_grad[0].item()) <= 1e-6 * with_grad[0].item()
    with torch.no_grad():
        assert not siglip_sum(rows, cols, s).requires_grad
    loss = OPS.siglip_forward(rows, cols, s, None, 0, None, None, False, False, 1 << 20)[0]
    with pytest.raises(RuntimeError, match="with_grad=False"):
        loss.backward()


def test_deterministic():
    rows, cols = features(600, 32, torch.float32, seed=20), features(900, 32, torch.float32, seed=21)
    results = []
    for _ in range(2):
        r, c = rows.clone().requires_grad_(), cols.clone().requires_grad_()
        s, b = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        loss = siglip_sum(r, c, s, b, pos_offset=100, workspace_bytes=1)
        loss.backward()
        results.append((loss.detach(), r.grad, c.grad, s.grad, b.grad))
    for x, y in zip(*results):
        assert torch.equal(x, y)


_ISA_SCRIPT = """
import sys, torch, clipshard
g = torch.Generator().manual_seed(0)
rows = torch.nn.functional.normalize(torch.randn(70, 24, generator=g, dtype=torch.float64), dim=1).float()
cols = torch.nn.functional.normalize(torch.randn(333, 24, generator=g, dtype=torch.float64), dim=1).float()
s, b = torch.tensor(30.0), torch.tensor(-5.0)
with_grad = torch.ops.clipshard.siglip_forward(rows, cols, s, b, 250, None, None, False, True, 1)
loss_only = torch.ops.clipshard.siglip_forward(rows, cols, s, b, 250, None, None, False, False, 1)[0]
torch.save([rows, cols, loss_only, *with_grad], sys.argv[1])
"""


def test_every_cpu_code_path(tmp_path):
    """The AVX-512, AVX2 and baseline loops (those the CPU has) against the fp64 reference."""
    results = run_under_each_isa(_ISA_SCRIPT, tmp_path)
    assert set(results) == set(ISA_CHOICES)
    for isa, (rows, cols, loss_only, loss, grad_rows, grad_cols, grad_scale, grad_bias) in results.items():
        leaves = [x.double().requires_grad_() for x in (rows, cols, torch.tensor(30.0), torch.tensor(-5.0))]
        ref = siglip_sum_reference(*leaves, pos_offset=250)
        ref_grads = torch.autograd.grad(ref, leaves)
        assert abs(loss_only.item() - ref.item()) <= loss_tol(torch.float32, 30.0) * ref.item(), isa
        assert abs(loss.item() - ref.item()) <= loss_tol(torch.float32, 30.0) * ref.item(), isa
        for got, want in zip((grad_rows, grad_cols, grad_scale, grad_bias), ref_grads):
            assert rel_error(got, want) <= grad_tol(torch.float32, 30.0), isa


BAD_WRAPPER_CASES = [
    # (args, kwargs, exception, message fragment)
    ((torch.ones(3), torch.ones(3, 2), 1.0), {}, ValueError, "rows must be 2-D"),
    ((torch.ones(3, 2), torch.ones(3, 2, dtype=torch.float64), 1.0), {}, TypeError, "same dtype"),
    ((torch.ones(3, 2, dtype=torch.int32), torch.ones(3, 2, dtype=torch.int32), 1.0), {}, TypeError, "float32"),
    ((torch.ones(3, 2), torch.ones(3, 4), 1.0), {}, ValueError, "same feature size D"),
    ((torch.ones(0, 2), torch.ones(3, 2), 1.0), {}, ValueError, "empty inputs"),
    ((torch.ones(3, 2), torch.ones(3, 2), torch.ones(2)), {}, ValueError, "scale must be a one-element tensor"),
    ((torch.ones(3, 2), torch.ones(3, 2), torch.tensor(1)), {}, TypeError, "floating-point"),
    ((torch.ones(3, 2), torch.ones(3, 2), "1.0"), {}, TypeError, "scale must be a float"),
    ((torch.ones(3, 2), torch.ones(3, 2), 1.0, torch.ones(2, 1)), {}, ValueError, "bias must be a one-element tensor"),
    ((torch.ones(3, 2), torch.ones(4, 2), 1.0, None, 2), {}, ValueError, "pos_offset must satisfy"),
    ((torch.ones(3, 2), torch.ones(4, 2), 1.0, None, 1.0), {}, TypeError, "pos_offset must be an int or None"),
    ((torch.ones(3, 2), torch.ones(4, 2), 1.0), {"workspace_bytes": 0}, ValueError, "workspace_bytes"),
]


@pytest.mark.parametrize("case", BAD_WRAPPER_CASES, ids=lambda c: c[3])
def test_bad_input_wrapper(case):
    args, kwargs, error, message = case
    with pytest.raises(error, match=message):
        siglip_sum(*args, **kwargs)


def test_bad_input_op():
    """The C++ op checks its arguments itself (it is public through torch.ops)."""
    fwd, ok, s = OPS.siglip_forward, torch.ones(3, 2), torch.tensor(1.0)
    cases = [
        ((torch.ones(3), ok, s, None, 0, None, None, False, True, 1), "rows must be 2-D"),
        ((ok, ok.double(), s, None, 0, None, None, False, True, 1), "same dtype"),
        ((ok, torch.ones(3, 5), s, None, 0, None, None, False, True, 1), "same feature size D"),
        ((ok.int(), ok.int(), s, None, 0, None, None, False, True, 1), "float32, float16, bfloat16 or float64"),
        ((ok[:0], ok, s, None, 0, None, None, False, True, 1), "empty inputs"),
        ((ok, ok, torch.ones(1), None, 0, None, None, False, True, 1), "scale must be a 0-dim"),
        ((ok, ok, s, torch.tensor(1), 0, None, None, False, True, 1), "bias must be a floating-point"),
        ((ok, ok, s, None, 1, None, None, False, True, 1), "pos_offset"),
        ((ok, ok, s, None, -1, None, None, False, True, 1), "pos_offset"),
        ((ok, ok, s, None, 0, None, None, False, True, 0), "workspace_bytes"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            fwd(*args)


def test_loss_bad_input():
    img = torch.ones(4, 3)
    with pytest.raises(ValueError, match="same shape"):
        siglip_loss(img, torch.ones(5, 3), 1.0)
    with pytest.raises(TypeError, match="same dtype"):
        siglip_loss(img, img.double(), 1.0)
    with pytest.raises(ValueError, match="must not be empty"):
        siglip_loss(img[:0], img[:0], 1.0)
    with pytest.raises(ValueError, match="logit_scale must be a tensor with one element"):
        siglip_loss(img, img, torch.ones(2))
    with pytest.raises(ValueError, match="logit_bias must be None or a tensor with one element"):
        siglip_loss(img, img, 1.0, torch.ones(3))
    with pytest.raises(TypeError, match="siglip_loss: image_features must be a tensor, got list"):
        siglip_loss([[1.0]], img, 1.0)
    with pytest.raises(ValueError, match="dist_impl must be one of 'bidir', 'shift', 'reduce', 'gather'"):
        SigLipLoss(dist_impl="ring")
    with pytest.raises(RuntimeError, match="not initialised"):
        SigLipLoss(world_size=2)(img, img, 1.0, None)
    with pytest.raises(TypeError, match="cache_labels must be True or False"):
        SigLipLoss(cache_labels="no")
    with pytest.raises(TypeError, match="rank must be an int"):
        SigLipLoss(rank=1.0)
    with pytest.raises(ValueError, match="world_size must be >= 1"):
        SigLipLoss(world_size=0)
    with pytest.raises(TypeError, match="output_dict must be True or False"):
        SigLipLoss()(img, img, 1.0, None, output_dict=1)


@pytest.mark.parametrize("dist_impl", [None, "bidir", "shift", "reduce", "gather"])
def test_every_dist_impl_on_one_process(dist_impl):
    img, txt = features(30, 8, torch.float32, seed=24), features(30, 8, torch.float32, seed=25)
    s, b = torch.tensor(10.0), torch.tensor(-10.0)
    loss = SigLipLoss(dist_impl=dist_impl)
    assert loss.dist_impl == (dist_impl or "bidir")
    out = loss(img, txt, s, b, output_dict=True)
    assert set(out) == {"contrastive_loss"}
    assert torch.equal(out["contrastive_loss"], siglip_loss(img, txt, s, b))


def test_public_exports():
    for name in ("SigLipLoss", "siglip_loss", "siglip_sum"):
        assert name in clipshard.__all__ and hasattr(clipshard, name)
