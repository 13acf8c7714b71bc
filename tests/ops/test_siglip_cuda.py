"""CUDA tests of the fused SigLIP op and loss (skipped without a GPU): against the fp64 reference, the
CPU kernel and open_clip's SigLipLoss on the same device, for fp32, bf16 and fp16 features."""
import pytest
import torch

from clipshard import SigLipLoss, siglip_sum
from tests.references.siglip import siglip_sum_reference

pytestmark = pytest.mark.cuda
OPS = torch.ops.clipshard


def features(n, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=g, dtype=torch.float64), dim=1).to(dtype)


def rel_error(actual, expected):
    return ((actual.double().cpu() - expected.double().cpu()).abs().max() / expected.double().abs().max()).item()


# (loss, gradients) relative to the largest reference value.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-5, 1e-2), torch.float16: (1e-5, 2e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("shape", [(1, 1, 1, 0), (129, 1000, 17, 871), (300, 2000, 64, 1700), (1000, 1000, 768, 0)])
@pytest.mark.parametrize("workspace_bytes", [1, 1 << 28])
def test_matches_fp64_reference(dtype, shape, workspace_bytes):
    m, k, d, pos_offset = shape
    rows, cols = features(m, d, dtype, 1).cuda(), features(k, d, dtype, 2).cuda()
    leaves = [rows.requires_grad_(), cols.requires_grad_(), torch.tensor(10.0, device="cuda", requires_grad=True),
              torch.tensor(-10.0, device="cuda", requires_grad=True)]
    loss = siglip_sum(*leaves, pos_offset, workspace_bytes=workspace_bytes)
    grads = torch.autograd.grad(loss * (0.5 / m), leaves)
    ref_leaves = [x.detach().cpu().double().requires_grad_() for x in leaves]
    ref = siglip_sum_reference(*ref_leaves, pos_offset)
    ref_grads = torch.autograd.grad(ref * (0.5 / m), ref_leaves)
    loss_tol, grad_tol = TOL[dtype]
    assert rel_error(loss, ref) <= loss_tol
    for name, got, want, x in zip(("rows", "cols", "scale", "bias"), grads, ref_grads, leaves):
        assert got.dtype == x.dtype and got.shape == x.shape and got.is_cuda, name
        assert rel_error(got, want) <= (grad_tol if name in ("rows", "cols") else 1e-4), name
    without_grad = OPS.siglip_forward(*[x.detach() for x in leaves], pos_offset, None, None, False, False,
                                      workspace_bytes)
    assert rel_error(without_grad[0], ref) <= loss_tol and all(g.numel() == 0 for g in without_grad[1:])


def test_tiny_gradients_survive_in_fp16():
    """Realistic upstream gradients (0.5 / M) on a large batch with SigLIP's initial bias: most logit
    gradients are ~1e-9 / M; the fp16 prescale keeps them, so fp16 features get the fp32 result."""
    m, d = 2048, 64
    img, txt = features(m, d, torch.float16, 3).cuda(), features(m, d, torch.float16, 4).cuda()
    s, b = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    half = [img.clone().requires_grad_(), txt.clone().requires_grad_()]
    full = [img.float().requires_grad_(), txt.float().requires_grad_()]
    grads_half = torch.autograd.grad(siglip_sum(*half, s, b) * (0.5 / m), half)
    grads_full = torch.autograd.grad(siglip_sum(*full, s, b) * (0.5 / m), full)
    for got, want in zip(grads_half, grads_full):
        assert rel_error(got, want) <= 2e-3


def test_matches_cpu_kernel_and_open_clip():
    open_clip_loss = pytest.importorskip("open_clip.loss")
    img, txt = features(512, 128, torch.float32, 5), features(512, 128, torch.float32, 6)
    results = {}
    for device, impl in (("cuda", SigLipLoss()), ("cpu", SigLipLoss()), ("open_clip", open_clip_loss.SigLipLoss())):
        dev = "cuda" if device != "cpu" else "cpu"
        leaves = [x.to(dev).requires_grad_() for x in (img, txt, torch.tensor(10.0), torch.tensor(-10.0))]
        loss = impl(*leaves)
        results[device] = [loss] + list(torch.autograd.grad(loss, leaves))
    for other in ("cpu", "open_clip"):
        for got, want in zip(results["cuda"], results[other]):
            assert rel_error(got, want) <= 1e-5, other


def test_compile_and_deterministic():
    img, txt = features(256, 32, torch.bfloat16, 7).cuda(), features(256, 32, torch.bfloat16, 8).cuda()
    s, b = torch.tensor(10.0, device="cuda", requires_grad=True), torch.tensor(-10.0, device="cuda", requires_grad=True)
    loss_fn = SigLipLoss()
    compiled = torch.compile(loss_fn, fullgraph=True)
    runs = []
    for fn in (loss_fn, loss_fn, compiled):
        leaves = [img.clone().requires_grad_(), txt.clone().requires_grad_(), s, b]
        loss = fn(*leaves)
        runs.append([loss] + list(torch.autograd.grad(loss, leaves)))
    for x, y in zip(runs[0], runs[1]):
        assert torch.equal(x, y)  # deterministic
    for x, y in zip(runs[0], runs[2]):
        assert torch.equal(x, y)  # the compiled graph calls the same op


def loss_and_grads(rows, cols, scale, bias, pos_offset, **kwargs):
    leaves = [t.detach().clone().requires_grad_() for t in (rows, cols, scale, bias)]
    loss = siglip_sum(*leaves, pos_offset, **kwargs)
    return [loss.detach()] + list(torch.autograd.grad(loss * (0.5 / rows.shape[0]), leaves))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_torch_algorithm_matches_cuda_kernels_on_the_device(dtype):
    """algorithm="torch" (pure PyTorch, chunked) against the compiled CUDA op, same inputs on the GPU:
    both are checked against fp64 elsewhere, so they must agree within rounding."""
    m, k, d, pos = 300, 2000, 64, 1700
    rows, cols = features(m, d, dtype, 11).cuda(), features(k, d, dtype, 12).cuda()
    s, b = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    compiled = loss_and_grads(rows, cols, s, b, pos, workspace_bytes=1)
    portable = loss_and_grads(rows, cols, s, b, pos, algorithm="torch")
    loss_tol, grad_tol = TOL[dtype]
    for name, got, want in zip(("loss", "rows", "cols", "scale", "bias"), compiled, portable):
        tol = loss_tol if name == "loss" else 2 * grad_tol if name in ("rows", "cols") else 2e-4
        assert rel_error(got, want) <= tol, name


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("force_fallback", [False, True])
def test_both_rows_gradient_paths_match_fp64_reference(dtype, force_fallback, monkeypatch):
    """16-bit backward: grad_rows accumulates with addmm.dtype_out into fp32 where this torch accepts
    it (probed), else through an fp32 buffer; CLIPSHARD_ADDMM_FP32_ACCUMULATOR=0 forces the buffer."""
    if force_fallback:
        monkeypatch.setenv("CLIPSHARD_ADDMM_FP32_ACCUMULATOR", "0")
    m, k, d, pos = 129, 1000, 17, 871
    rows, cols = features(m, d, dtype, 13).cuda(), features(k, d, dtype, 14).cuda()
    s, b = torch.tensor(10.0, device="cuda"), torch.tensor(-10.0, device="cuda")
    got = loss_and_grads(rows, cols, s, b, pos, workspace_bytes=1)
    ref_leaves = [x.detach().cpu().double().requires_grad_() for x in (rows, cols, s, b)]
    ref = siglip_sum_reference(*ref_leaves, pos)
    ref_grads = torch.autograd.grad(ref * (0.5 / m), ref_leaves)
    for name, g, want in zip(("rows", "cols"), got[1:3], ref_grads[:2]):
        assert rel_error(g, want) <= TOL[dtype][1], name
