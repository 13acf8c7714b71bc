"""The chunked algorithm on the CPU: the chunk driver that the CUDA default runs on (csrc/chunked),
with at::mm as its GEMM. Its bookkeeping (chunk offsets, running row LSE across chunks, the
columns' LSE within a chunk, gradient accumulation over chunks, workspace reuse, the chunk-width
rule) is checked against the fp64 reference for widths that make every case appear."""
import pytest
import torch

from clipshard import contrastive_lse
from tests.references.contrastive import contrastive_lse_reference

# M, K, D, pos_offset, scale, bias, workspace_bytes (4 bytes per logit forward, 8 backward, fp32).
CASES = [
    (1, 1, 1, 0, 1.0, None, 1),                # a single column; the minimum chunk
    (37, 301, 19, 11, 14.3, 0.75, 1),          # 128-column chunks: K not a multiple, chunks wider than M
    (300, 700, 24, 100, 100.0, 5.0, 1),        # chunks (128) narrower than M (300), scale 100 with bias
    (50, 1000, 16, 950, 14.3, -2.0, 50 * 8 * 384),  # 384-column chunks in the backward, 768 forward
    (64, 500, 32, 0, 14.3, None, 1 << 30),     # one chunk holds everything
]


def inputs(M, K, D, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows = torch.nn.functional.normalize(torch.randn(M, D, generator=gen, dtype=torch.float64), dim=1)
    cols = torch.nn.functional.normalize(torch.randn(K, D, generator=gen, dtype=torch.float64), dim=1)
    return rows.to(dtype), cols.to(dtype)


def loss_and_grads(rows, cols, scale, bias, pos, weights, fn):
    leaves = [rows.detach().requires_grad_(), cols.detach().requires_grad_(), scale.detach().requires_grad_()]
    if bias is not None:
        leaves.append(bias.detach().requires_grad_())
    row_lse, pos_logit, col_lse = fn(*leaves[:3], leaves[3] if bias is not None else None, pos)
    g_row, g_pos, g_col = weights
    loss = (row_lse.double() * g_row).sum() + (pos_logit.double() * g_pos).sum() + (col_lse.double() * g_col).sum()
    return (row_lse, pos_logit, col_lse), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}K{}D{}p{}s{}b{}w{}".format(*c))
def test_chunked_matches_fp64_reference(case, dtype):
    M, K, D, pos, scale, bias, workspace = case
    rows, cols = inputs(M, K, D, dtype, seed=M + K)
    s = torch.tensor(scale, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    b = None if bias is None else torch.tensor(bias, dtype=s.dtype)
    # A mean loss's upstream gradients (0.5 / M on each LSE), not O(1) ones.
    weights = (torch.full((M,), 0.5 / M, dtype=torch.float64), torch.full((M,), -1.0 / M, dtype=torch.float64),
               torch.full((K,), 0.5 / M, dtype=torch.float64))
    got_out, got_grads = loss_and_grads(
        rows, cols, s, b, pos, weights,
        lambda r, c, s_, b_, p: contrastive_lse(r, c, s_, b_, pos_offset=p, algorithm="chunked",
                                                workspace_bytes=workspace))
    ref_out, ref_grads = loss_and_grads(rows.double(), cols.double(), s.double(), None if b is None else b.double(),
                                        pos, weights, contrastive_lse_reference)
    tol = 1e-12 if dtype == torch.float64 else 2e-5 * (1 + scale)
    for name, got, ref in zip(("row_lse", "pos_logit", "col_lse"), got_out, ref_out):
        torch.testing.assert_close(got.double(), ref, rtol=1e-6 if dtype != torch.float64 else 1e-12, atol=tol,
                                   msg=lambda m, n=name: f"{n}: {m}")
    grad_tol = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 1.6e-2}[dtype]
    for name, got, ref in zip(("rows", "cols", "scale", "bias"), got_grads, ref_grads):
        assert got.dtype == (dtype if name in ("rows", "cols") else s.dtype), name
        atol = grad_tol * max(ref.abs().max().item(), 1e-12)
        torch.testing.assert_close(got.double(), ref, rtol=grad_tol, atol=atol, msg=lambda m, n=name: f"{n}: {m}")


def test_chunk_width_does_not_change_results_beyond_rounding():
    rows, cols = inputs(200, 1100, 32, torch.float32, seed=3)
    results = []
    for workspace in (1, 200 * 8 * 256, 200 * 8 * 640, 1 << 30):  # 128, 256, 640 and all 1100 columns
        r, c = rows.clone().requires_grad_(), cols.clone().requires_grad_()
        out = contrastive_lse(r, c, 14.3, pos_offset=300, algorithm="chunked", workspace_bytes=workspace)
        (out[0].sum() * 0.3 + out[2].sum() * 0.2 - out[1].sum()).backward()
        results.append((*[o.detach() for o in out], r.grad, c.grad))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_chunked_and_fused_agree_and_nan_propagates():
    rows, cols = inputs(40, 300, 24, torch.float32, seed=5)
    rows[2, 3] = float("nan")
    chunked = contrastive_lse(rows, cols, 14.3, pos_offset=10, algorithm="chunked", workspace_bytes=1)
    fused = contrastive_lse(rows, cols, 14.3, pos_offset=10, algorithm="fused")
    assert torch.isnan(chunked[0][2]) and torch.isnan(chunked[1][2]) and torch.isnan(chunked[2]).all()
    for a, b in zip(chunked, fused):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_gradcheck_across_chunks():
    rows, cols = inputs(5, 300, 4, torch.float64, seed=7)
    args = (rows.requires_grad_(), cols.requires_grad_(), torch.tensor(3.0, dtype=torch.float64, requires_grad=True),
            torch.tensor(0.5, dtype=torch.float64, requires_grad=True))
    assert torch.autograd.gradcheck(
        lambda r, c, s, b: contrastive_lse(r, c, s, b, pos_offset=200, algorithm="chunked", workspace_bytes=1), args)


@pytest.mark.parametrize("bad, error, pattern", [
    (dict(algorithm="tiles"), ValueError, "algorithm must be one of"),
    (dict(workspace_bytes=0), ValueError, "workspace_bytes must be at least 1"),
    (dict(workspace_bytes=1.5), TypeError, "workspace_bytes must be an int"),
])
def test_bad_algorithm_arguments(bad, error, pattern):
    rows, cols = inputs(4, 8, 3, torch.float32, seed=1)
    with pytest.raises(error, match="contrastive_lse: " + pattern):
        contrastive_lse(rows, cols, 1.0, **bad)


def torch_accepts_fp32_accumulator(device, dtype):
    """What torch itself says: addmm with out_dtype=float32 into an fp32 accumulator, 16-bit factors."""
    acc = torch.zeros(1, 1, device=device)
    factor = torch.ones(1, 1, device=device, dtype=dtype)
    try:
        torch.addmm(acc, factor, factor, out_dtype=torch.float32, out=acc)
        return True
    except (RuntimeError, NotImplementedError):
        return False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_addmm_probe_gives_torchs_answer_and_can_be_forced_off(dtype, monkeypatch):
    """The chunk driver picks its 16-bit rows-gradient path by probing addmm.dtype_out once per device
    type (csrc/chunked/chunk_driver.h). On this torch the CPU refuses (no such kernel) and the meta
    device accepts: both answers are checked against torch's own, without an exception escaping."""
    probe = torch.ops.clipshard._addmm_accepts_fp32_accumulator
    answers = {}
    for device in ("cpu", "meta"):
        expected = torch_accepts_fp32_accumulator(device, dtype)
        answers[device] = probe(torch.device(device), dtype)
        assert answers[device] is expected, f"{device}: probe says {answers[device]}, torch says {expected}"
        assert probe(torch.device(device), dtype) is expected  # the cached answer
    assert set(answers.values()) == {True, False}, f"both branches should be seen here: {answers}"
    monkeypatch.setenv("CLIPSHARD_ADDMM_FP32_ACCUMULATOR", "0")
    assert probe(torch.device("meta"), dtype) is False
