"""algorithm="torch", the portable PyTorch path of contrastive_lse and siglip_sum (docs/portable.md),
on the CPU: values and gradients against the fp64 references for chunk widths smaller and larger
than M, 16-bit inputs with a mean loss's upstream gradients, bias and scale 100; the 16-bit GEMM
path that GPUs take (emulated here, since CPU torch has no fp32-output 16-bit GEMM) with its fp16
pre-scale and a control without it; gradcheck; its peak memory against the workspace bound; the
`meta` device (shapes, no compiled kernel); the "auto" rule, its warning and CLIPSHARD_ALGORITHM;
the losses. The distributed tests (test_clip_loss_distributed.py, test_siglip_distributed.py) run every
mode and dist_impl with it too."""
import functools
import os
import sys
import warnings

import pytest
import torch

import clipshard
from clipshard import contrastive_lse, siglip_sum
from clipshard.ops import _algorithm, _portable_chunks, portable_lse
from clipshard.ops.contrastive_lse import ALGORITHMS as LSE_ALGORITHMS
from clipshard.ops.siglip_sum import ALGORITHMS as SIGLIP_ALGORITHMS
from tests.ops.test_contrastive_lse import BAD_INPUTS
from tests.references.contrastive import clip_loss_reference, contrastive_lse_reference
from tests.references.siglip import siglip_loss_reference, siglip_sum_reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
import _measure  # noqa: E402

DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]
# M, K, D, pos_offset, scale, bias, workspace_bytes. The torch path counts 8 bytes per fp32 logit in
# the forward and 12 in the backward (two and three M x Kc buffers), so workspace_bytes=1 gives the
# minimum chunks of 128 columns.
CASES = [
    (1, 1, 1, 0, 1.0, None, None),               # one column, the default budget
    (37, 301, 19, 11, 14.3, 0.75, 1),            # 128-column chunks wider than M; K not a multiple of 128
    (300, 700, 24, 100, 100.0, 5.0, 1),          # chunks narrower than M, scale 100 with a bias
    (50, 1000, 16, 950, 14.3, -2.0, 50 * 12 * 384),  # 384 columns backward, 512 forward; positives in the last
    (64, 500, 32, 0, 14.3, None, 1 << 30),       # one chunk holds everything
]
GRAD_TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def features(n, d, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=1).to(dtype)


def scalars(scale, bias, dtype):
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return torch.tensor(scale, dtype=acc), None if bias is None else torch.tensor(bias, dtype=acc)


def leaves_of(*tensors):
    return [None if t is None else t.detach().clone().requires_grad_() for t in tensors]


def lse_values_and_grads(fn, rows, cols, s, b, pos, weights):
    """contrastive_lse's outputs and the gradients of sum(g_row * row_lse + g_pos * pos + g_col * col_lse)."""
    leaves = leaves_of(rows, cols, s, b)
    out = fn(*leaves, pos)
    loss = sum((o.double() * w).sum() for o, w in zip(out, weights))
    wanted = [t for t in leaves if t is not None]
    return out, torch.autograd.grad(loss, wanted)


def mean_loss_weights(m, k):
    """A mean loss's upstream gradients: 0.5 / M on each LSE, -1 / M on the positives."""
    return (torch.full((m,), 0.5 / m, dtype=torch.float64), torch.full((m,), -1.0 / m, dtype=torch.float64),
            torch.full((k,), 0.5 / m, dtype=torch.float64))


def assert_grads_close(got_grads, ref_grads, tol, case):
    for name, got, ref in zip(("rows", "cols", "scale", "bias"), got_grads, ref_grads):
        atol = tol * max(ref.abs().max().item(), 1e-12)
        torch.testing.assert_close(got.double(), ref, rtol=tol, atol=atol, msg=lambda m, n=name: f"{case} {n}: {m}")


def check_lse(dtype, case):
    m, k, d, pos, scale, bias, workspace = case
    rows, cols = features(m, d, dtype, seed=m + k), features(k, d, dtype, seed=m + k + 1)
    s, b = scalars(scale, bias, dtype)
    weights = mean_loss_weights(m, k)
    got_out, got_grads = lse_values_and_grads(
        lambda r, c, s_, b_, p: contrastive_lse(r, c, s_, b_, p, algorithm="torch", workspace_bytes=workspace),
        rows, cols, s, b, pos, weights)
    ref_out, ref_grads = lse_values_and_grads(contrastive_lse_reference, rows.double(), cols.double(), s.double(),
                                              None if b is None else b.double(), pos, weights)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    atol = 1e-12 if dtype == torch.float64 else 2e-5 * (1 + scale)
    for name, got, ref in zip(("row_lse", "pos_logit", "col_lse"), got_out, ref_out):
        assert got.dtype == acc, name
        torch.testing.assert_close(got.double(), ref, rtol=1e-6 if dtype != torch.float64 else 1e-12, atol=atol,
                                   msg=lambda msg, n=name: f"{dtype} {case} {n}: {msg}")
    for got, leaf in zip(got_grads, (rows, cols, s, b)):
        assert got.dtype == leaf.dtype and got.shape == leaf.shape
    assert_grads_close(got_grads, ref_grads, GRAD_TOL[dtype], f"{dtype} {case}")


def check_siglip(dtype, case):
    m, k, d, pos, scale, bias, workspace = case
    rows, cols = features(m, d, dtype, seed=m + k), features(k, d, dtype, seed=m + k + 1)
    s, b = scalars(scale, -10.0 if bias is None else bias, dtype)  # SigLIP's usual bias when a case has none
    upstream = 1.0 / m  # the mean over the rank's M images
    leaves = leaves_of(rows, cols, s, b)
    got = siglip_sum(*leaves, pos, algorithm="torch", workspace_bytes=workspace)
    got_grads = torch.autograd.grad(got * upstream, leaves)
    ref_leaves = [t.double() for t in leaves_of(rows, cols, s, b)]
    ref_leaves = leaves_of(*ref_leaves)
    ref = siglip_sum_reference(*ref_leaves, pos)
    ref_grads = torch.autograd.grad(ref * upstream, ref_leaves)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    rtol = 1e-10 if dtype == torch.float64 else 2e-6  # a sum of M x K terms
    torch.testing.assert_close(got.double(), ref, rtol=rtol, atol=0, msg=lambda msg: f"{dtype} {case} loss: {msg}")
    for got_grad, leaf in zip(got_grads, (rows, cols, s, b)):
        assert got_grad.dtype == leaf.dtype and got_grad.shape == leaf.shape
    assert_grads_close(got_grads, ref_grads, GRAD_TOL[dtype], f"{dtype} {case}")
    return got_grads, ref_grads


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}K{}D{}p{}s{}b{}w{}".format(*c))
def test_contrastive_lse_matches_fp64_reference(dtype, case):
    check_lse(dtype, case)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}K{}D{}p{}s{}b{}w{}".format(*c))
def test_siglip_sum_matches_fp64_reference(dtype, case):
    check_siglip(dtype, case)


# SigLIP with a usual bias, at M = 64 against K = 4096 columns.
SIGLIP_16BIT = (64, 4096, 24, 1000, 30.0, -10.0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_16bit_gemm_path(gpu_style_gemms, dtype):
    check_lse(dtype, CASES[2])
    check_siglip(dtype, CASES[2])
    check_siglip(dtype, SIGLIP_16BIT)
    chunks = _portable_chunks.Chunks(torch.ones(3, 2, dtype=dtype), torch.ones(4, 2, dtype=dtype), 1, 3, True)
    assert chunks.native and chunks.grad_dtype == dtype  # the path under test is the 16-bit one


def _fp16_small_logit_gradient_error():
    """fp16 contrastive_lse in the local mode (row LSEs only) of a rank with 16 rows against 8192
    columns, with the upstream gradients of a 16384-pair mean loss (0.5 / 16384 on each row LSE and
    positive): each logit gradient s * g * p_ij (~5e-8, the columns in a cone as trained embeddings
    are, so the softmax is flat) lies below fp16's smallest subnormal (6e-8), while their sums, the
    rows' gradients (~1e-4), are normal fp16 numbers. Returns the rows' gradient error relative to
    its largest value."""
    m, k, d, pos = 16, 8192, 64, 100
    gen = torch.Generator().manual_seed(40)
    rows = features(m, d, torch.float16, seed=41)
    cone = torch.randn(k, d, generator=gen, dtype=torch.float64) + 3 * torch.randn(1, d, generator=gen, dtype=torch.float64)
    cols = torch.nn.functional.normalize(cone, dim=1).to(torch.float16)
    s = torch.tensor(14.3)
    g = 0.5 / 16384

    def grad_rows(fn, r, c, scale):
        r = r.detach().clone().requires_grad_()
        row_lse, pos_logit, _ = fn(r, c, scale, None, pos, False)
        ((row_lse.double() * g).sum() - (pos_logit.double() * g).sum()).backward()
        return r.grad.double()

    got = grad_rows(lambda *a: contrastive_lse(*a, algorithm="torch"), rows, cols, s)
    ref = grad_rows(contrastive_lse_reference, rows.double(), cols.double(), s.double())
    return ((got - ref).abs().max() / ref.abs().max()).item()


def test_fp16_prescale_keeps_small_gradients(gpu_style_gemms, monkeypatch):
    with_prescale = _fp16_small_logit_gradient_error()
    assert with_prescale < GRAD_TOL[torch.float16], with_prescale
    # control: without the pre-scale the same gradients underflow
    monkeypatch.setattr(portable_lse, "fp16_prescale", lambda bound: torch.ones_like(bound, dtype=torch.float32))
    without = _fp16_small_logit_gradient_error()
    assert without > 0.02, (without, with_prescale)


def test_fp16_prescale_values():
    bounds = torch.tensor([1.0, 3.0, 1e-20, 1e30, 0.0, float("inf"), float("nan")])
    got = [_portable_chunks.fp16_prescale(b).item() for b in bounds]
    assert got == [2.0 ** 14, 2.0 ** 12, 2.0 ** 60, 2.0 ** -60, 1.0, 1.0, 1.0]


def test_gradcheck_fp64():
    rows, cols = features(3, 2, torch.float64, seed=50), features(131, 2, torch.float64, seed=51)
    s, b = torch.tensor(7.0, dtype=torch.float64), torch.tensor(0.3, dtype=torch.float64)
    inputs = leaves_of(rows, cols, s, b)
    # workspace_bytes=1: two chunks (128 + 3 columns); the positives straddle them
    assert torch.autograd.gradcheck(
        lambda *x: contrastive_lse(*x, 127, algorithm="torch", workspace_bytes=1), inputs, fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda *x: siglip_sum(*x, 127, algorithm="torch", workspace_bytes=1), inputs, fast_mode=True)


def test_unused_outputs_and_no_grad():
    rows, cols = features(20, 8, torch.float32, seed=52), features(300, 8, torch.float32, seed=53)
    r, c = leaves_of(rows, cols)
    row_lse, pos, col_lse = contrastive_lse(r, c, 10.0, None, 7, algorithm="torch", workspace_bytes=1)
    (row_lse.sum() - pos.sum()).backward()  # col_lse takes no part: its term is skipped
    r2, c2 = leaves_of(rows, cols)
    out = contrastive_lse_reference(r2.double(), c2.double(), torch.tensor(10.0, dtype=torch.float64), None, 7)
    (out[0].sum() - out[1].sum()).backward()
    torch.testing.assert_close(r.grad.double(), r2.grad.double(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(c.grad.double(), c2.grad.double(), rtol=1e-4, atol=1e-5)
    with torch.no_grad():
        value = siglip_sum(rows, cols, 10.0, -5.0, 7, algorithm="torch")
    torch.testing.assert_close(value.double(), siglip_sum_reference(
        rows.double(), cols.double(), torch.tensor(10.0, dtype=torch.float64), torch.tensor(-5.0, dtype=torch.float64),
        7), rtol=2e-6, atol=0)


def test_matches_compiled_kernels_on_nan_and_inf():
    rows, cols = features(40, 6, torch.float32, seed=54), features(300, 6, torch.float32, seed=55)
    rows[2, 3] = float("nan")
    rows[5, 0] = float("inf")
    outs = [contrastive_lse(rows, cols, 14.3, 0.5, 3, algorithm=a, workspace_bytes=1) for a in ("fused", "torch")]
    for x, y in zip(*outs):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-4, equal_nan=True)
    outs = [siglip_sum(rows, cols, 14.3, 0.5, 3, algorithm=a, workspace_bytes=1) for a in ("chunked", "torch")]
    assert torch.isnan(outs[0]) and torch.isnan(outs[1])


@pytest.mark.parametrize("case", range(len(BAD_INPUTS)))
def test_bad_input_same_messages(case):
    make, exc, message = BAD_INPUTS[case]
    rows, cols = features(6, 8, torch.float32, seed=0), features(10, 8, torch.float32, seed=1)
    with pytest.raises(exc, match=message):
        contrastive_lse(*make(rows, cols), algorithm="torch")
    with pytest.raises(exc, match=message):
        siglip_sum(*make(rows, cols), algorithm="torch")


def test_bad_algorithm_names():
    rows = features(4, 3, torch.float32, seed=0)
    with pytest.raises(ValueError, match="contrastive_lse: algorithm must be one of 'auto', 'fused', 'chunked', "
                                         "'torch', got 'pytorch'"):
        contrastive_lse(rows, rows, 1.0, algorithm="pytorch")
    with pytest.raises(ValueError, match="siglip_sum: algorithm must be one of 'auto', 'chunked', 'torch', got "
                                         "'fused'"):
        siglip_sum(rows, rows, 1.0, algorithm="fused")
    with pytest.raises(ValueError, match="ClipLoss: algorithm must be one of"):
        clipshard.ClipLoss(algorithm="Torch")
    with pytest.raises(ValueError, match="SigLipLoss: algorithm must be one of 'auto', 'chunked', 'torch'"):
        clipshard.SigLipLoss(algorithm="fused")
    with pytest.raises(ValueError, match="clip_loss: algorithm must be one of"):
        clipshard.clip_loss(rows, rows, 1.0, algorithm=None)
    with pytest.raises(ValueError, match="siglip_loss: algorithm must be one of"):
        clipshard.siglip_loss(rows, rows, 1.0, algorithm="chunk")


def _peak_extra_bytes(fn):
    return _measure.peak_memory_bytes(fn, "cpu")


def test_peak_memory_within_workspace_bound():
    """The forwards in fp32 (where one more M x Kc buffer would show), forward + backward in bf16
    (where the CPU's fp32 copies of 16-bit features are made: a K x D one would show). Each
    profiled call costs seconds, hence four."""
    m, k, d, budget = 128, 8192, 8, 256 << 10
    bounds = {}
    for dtype in (torch.float32, torch.bfloat16):
        rows, cols = features(m, d, dtype, seed=60), features(k, d, dtype, seed=61)
        kc = _portable_chunks.Chunks(rows, cols, budget, 2, False).width  # the widest chunks (forward: 256)
        # what the calls must hold anyway: the outputs, the feature gradients (siglip_sum keeps those
        # of its sum from the forward to the backward, as the compiled op does)
        outputs, gradients = 3 * (m + k) * 4, (m + k) * d * rows.element_size()
        # O((M + Kc) D): fp32 copies of rows and of one column chunk (16-bit features on the CPU),
        # the fp32 grad_rows accumulator and the chunk's rows of grad_cols in fp32
        upcasts = accumulators = 2 * (m + kc) * d * 4
        # smaller than one more M x Kc buffer, or a K x D fp32 copy: the test would see either
        assert upcasts + accumulators < min(m * 128 * 4, k * d * 4)
        r, c = leaves_of(rows, cols)

        def lse_step(r=r, c=c, backward=True):
            out = contrastive_lse(r, c, 14.3, None, 100, algorithm="torch", workspace_bytes=budget)
            if backward:
                torch.autograd.backward(out, [torch.full_like(o, 0.5 / m) for o in out])

        def siglip_step(r=r, c=c, backward=True):
            loss = siglip_sum(r, c, 14.3, -10.0, 100, algorithm="torch", workspace_bytes=budget)
            if backward:
                (loss / m).backward()

        if dtype == torch.float32:
            bounds[f"contrastive_lse forward {dtype}"] = (functools.partial(lse_step, backward=False),
                                                          budget + outputs + upcasts)
            bounds[f"siglip_sum forward {dtype}"] = (functools.partial(siglip_step, backward=False),
                                                     budget + gradients + upcasts + accumulators)
        else:
            bounds[f"contrastive_lse forward+backward {dtype}"] = (
                lse_step, budget + outputs + gradients + upcasts + accumulators)
            bounds[f"siglip_sum forward+backward {dtype}"] = (
                siglip_step, budget + 2 * gradients + upcasts + accumulators)
    for name, (step, allowed) in bounds.items():
        peak = _peak_extra_bytes(step)
        assert peak <= allowed, f"{name}: peak {peak / 2**10:.0f} KiB > {allowed / 2**10:.0f} KiB"


def test_meta_device_shapes_and_auto_warning(monkeypatch):
    """The meta device has no compiled kernel: "auto" runs the torch path (with the warning, once),
    the same code that produces values on the CPU, and every output and gradient has its shape."""
    monkeypatch.setattr(_algorithm, "_warned_device_types", set())
    monkeypatch.delenv(_algorithm.ENV_VAR, raising=False)
    for dtype in (torch.float16, torch.float32):
        rows = torch.empty(300, 24, dtype=dtype, device="meta", requires_grad=True)
        cols = torch.empty(700, 24, dtype=dtype, device="meta", requires_grad=True)
        s = torch.empty((), device="meta", requires_grad=True)
        b = torch.empty((), device="meta", requires_grad=True)
        row_lse, pos, col_lse = contrastive_lse(rows, cols, s, b, 100, algorithm="torch", workspace_bytes=1)
        assert [t.shape for t in (row_lse, pos, col_lse)] == [(300,), (300,), (700,)]
        assert row_lse.dtype == torch.float32 and row_lse.device.type == "meta"
        grads = torch.autograd.grad(row_lse.sum() + col_lse.sum() - pos.sum(), (rows, cols, s, b))
        assert [(g.shape, g.dtype) for g in grads] == [(rows.shape, dtype), (cols.shape, dtype), ((), s.dtype),
                                                       ((), b.dtype)]
        loss = siglip_sum(rows, cols, s, b, 100, algorithm="torch", workspace_bytes=1)
        grads = torch.autograd.grad(loss, (rows, cols, s, b))
        assert loss.shape == () and [g.shape for g in grads] == [rows.shape, cols.shape, (), ()]
    image = torch.empty(6, 8, device="meta", requires_grad=True)
    text = torch.empty(6, 8, device="meta", requires_grad=True)
    with pytest.warns(UserWarning, match="no compiled clipshard kernel is registered for 'meta' tensors"):
        loss = clipshard.ClipLoss()(image, text, torch.empty((), device="meta"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per device type
        loss = loss + clipshard.SigLipLoss()(image, text, torch.empty((), device="meta"), None)
    loss.backward()
    assert image.grad.shape == image.shape and image.grad.device.type == "meta"


def test_auto_picks_torch_where_no_kernel_is_registered(monkeypatch):
    """Without a registered kernel (patched dispatcher check), "auto" on the CPU runs the torch path,
    warns once, and gives exactly its results."""
    monkeypatch.setattr(_algorithm, "_warned_device_types", set())
    monkeypatch.delenv(_algorithm.ENV_VAR, raising=False)
    monkeypatch.setattr(_algorithm, "has_compiled_kernel", lambda operator, device_type: False)
    rows, cols = features(30, 8, torch.float32, seed=70), features(200, 8, torch.float32, seed=71)
    with pytest.warns(UserWarning, match="'cpu' tensors, so the losses run algorithm='torch'"):
        auto = contrastive_lse(rows, cols, 14.3, pos_offset=5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        auto_siglip = siglip_sum(rows, cols, 14.3, pos_offset=5)
    for x, y in zip(auto, contrastive_lse(rows, cols, 14.3, pos_offset=5, algorithm="torch")):
        assert torch.equal(x, y)
    assert torch.equal(auto_siglip, siglip_sum(rows, cols, 14.3, pos_offset=5, algorithm="torch"))


def test_auto_rule_per_device_type(monkeypatch):
    monkeypatch.setattr(_algorithm, "_warned_device_types", set())
    monkeypatch.delenv(_algorithm.ENV_VAR, raising=False)
    cuda_built = torch._C._dispatch_has_kernel_for_dispatch_key("clipshard::contrastive_lse_forward", "CUDA")
    assert _algorithm.resolve("contrastive_lse", "auto", torch.device("cpu"), LSE_ALGORITHMS) == "fused"
    assert _algorithm.resolve("siglip_sum", "auto", torch.device("cpu"), SIGLIP_ALGORITHMS) == "chunked"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # a CUDA device (ROCm's too) without clipshard's CUDA kernels runs the torch path
        got = _algorithm.resolve("contrastive_lse", "auto", torch.device("cuda"), LSE_ALGORITHMS)
        assert got == ("chunked" if cuda_built else "torch")
        for device_type in ("xpu", "mps", "hpu"):
            assert _algorithm.resolve("siglip_sum", "auto", torch.device(device_type), SIGLIP_ALGORITHMS) == "torch"
            assert _algorithm.resolve("contrastive_lse", "auto", torch.device(device_type), LSE_ALGORITHMS) == "torch"
        assert _algorithm.resolve("contrastive_lse", "fused", torch.device("xpu"), LSE_ALGORITHMS) == "fused"
    assert [str(w.message).split("'")[1] for w in caught] == ([] if cuda_built else ["cuda"]) + ["xpu", "mps", "hpu"]


def test_environment_variable_forces_the_torch_path(monkeypatch):
    monkeypatch.setattr(_algorithm, "_warned_device_types", set())
    monkeypatch.setenv(_algorithm.ENV_VAR, "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked for: no warning
        assert _algorithm.resolve("contrastive_lse", "auto", torch.device("cpu"), LSE_ALGORITHMS) == "torch"
        assert _algorithm.resolve("siglip_sum", "auto", torch.device("cpu"), SIGLIP_ALGORITHMS) == "torch"
    # an explicit algorithm wins over the variable
    assert _algorithm.resolve("contrastive_lse", "fused", torch.device("cpu"), LSE_ALGORITHMS) == "fused"
    monkeypatch.setenv(_algorithm.ENV_VAR, "Torch")  # any case, as every CLIPSHARD_* variable (ops/env_vars.py)
    assert _algorithm.resolve("contrastive_lse", "auto", torch.device("cpu"), LSE_ALGORITHMS) == "torch"
    monkeypatch.setenv(_algorithm.ENV_VAR, "tourch")
    rows = features(4, 3, torch.float32, seed=0)
    with pytest.raises(ValueError, match="CLIPSHARD_ALGORITHM must be one of auto, torch \\(or unset\\), got 'tourch'"):
        contrastive_lse(rows, rows, 1.0)


def test_losses_with_the_torch_path():
    image, text = features(97, 33, torch.float32, seed=80), features(97, 33, torch.float32, seed=81)
    scale, bias = torch.tensor(31.4), torch.tensor(-2.0)
    for loss_fn, reference in ((clipshard.ClipLoss(algorithm="torch"), clip_loss_reference),
                               (clipshard.SigLipLoss(algorithm="torch"), siglip_loss_reference)):
        leaves = leaves_of(image, text, scale, bias)
        loss = loss_fn(*leaves)
        grads = torch.autograd.grad(loss, leaves)
        ref_leaves = leaves_of(*[t.double() for t in (image, text, scale, bias)])
        ref = reference(*ref_leaves)
        ref_grads = torch.autograd.grad(ref, ref_leaves)
        torch.testing.assert_close(loss.double(), ref, rtol=2e-6, atol=0)
        for got, want in zip(grads, ref_grads):
            # atol >= 1e-5: the softmax loss's bias gradient is exactly 0
            torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-5 * max(1.0, want.abs().max().item()))
    functional = clipshard.clip_loss(image, text, scale, bias, algorithm="torch")
    torch.testing.assert_close(functional, clipshard.ClipLoss(algorithm="torch")(image, text, scale, bias))
    functional = clipshard.siglip_loss(image, text, scale, bias, algorithm="torch")
    torch.testing.assert_close(functional, clipshard.SigLipLoss(algorithm="torch")(image, text, scale, bias))
