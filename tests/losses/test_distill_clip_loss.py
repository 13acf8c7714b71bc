"""The distillation op (clipshard/ops/distill_lse.py, torch path) against the fp64 block reference,
and clipshard.DistillClipLoss on one device against open_clip's DistillClipLoss and the fp64 loss
reference (single teachers, ensembles, 16-bit inputs); bad inputs; the workspace bound on memory.
Multi-rank runs: tests/parallel/test_distill_distributed.py."""
import os
import sys

import pytest
import torch

import clipshard
from clipshard.ops import _portable_chunks
from clipshard.ops.distill_lse import OUTPUTS, distill_lse
from tests.parallel.test_clip_loss_distributed import _open_clip_loss_class
from tests.references.distill import distill_clip_loss_reference, distill_lse_reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from _measure import peak_memory_bytes  # noqa: E402

FEATURE_NAMES = ("rows", "cols", "teacher_rows", "teacher_cols", "scale", "teacher_scale")


def _unit(gen, *shape, dtype=torch.float64):
    return torch.nn.functional.normalize(torch.randn(*shape, generator=gen, dtype=torch.float64), dim=-1).to(dtype)


def _rel(got, want, floor=1e-30):
    return ((got.double() - want.double()).abs().max() / want.double().abs().max().clamp_min(floor)).item()


# (dtype, tolerance on the outputs, on the gradients), relative to the largest reference value
OP_CASES = [(torch.float64, 1e-12, 1e-12), (torch.float32, 2e-5, 1e-4)]


@pytest.mark.parametrize("dtype,out_tol,grad_tol", OP_CASES)
@pytest.mark.parametrize("want_columns", [True, False])
def test_op_matches_block_reference(dtype, out_tol, grad_tol, want_columns):
    """Odd sizes, three chunks (a tiny workspace), two teachers of scale 50 and 100 (student 100),
    a positive offset, and upstream gradients of a mean loss's size (0.5 / M, random signs)."""
    gen = torch.Generator().manual_seed(5)
    m, k, d, dt, offset = 37, 301, 13, 9, 7
    inputs = [_unit(gen, m, d), _unit(gen, k, d), _unit(gen, 2, m, dt), _unit(gen, 2, k, dt),
              torch.tensor(100.0, dtype=torch.float64), torch.tensor([50.0, 100.0], dtype=torch.float64)]
    leaves = [t.to(dtype).requires_grad_() for t in inputs]
    got = distill_lse(*leaves, pos_offset=offset, want_columns=want_columns, algorithm="torch", workspace_bytes=1)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    want = distill_lse_reference(*ref_leaves, pos_offset=offset, want_columns=want_columns)
    upstream = [torch.randn(w.shape, generator=gen, dtype=torch.float64) * 0.5 / m for w in want]
    for name, g, w in zip(OUTPUTS, got, want):
        assert g.shape == w.shape and g.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), name
        if w.numel():
            assert _rel(g, w) <= out_tol, name
    sum((g * u.to(g.dtype)).sum() for g, u in zip(got, upstream)).backward()
    sum((w * u).sum() for w, u in zip(want, upstream)).backward()
    for name, leaf, ref in zip(FEATURE_NAMES, leaves, ref_leaves):
        # the logit scales' gradients sum terms that cancel to ~1e-3 of their size: 10x the room
        tolerance = grad_tol * (10 if "scale" in name else 1)
        assert _rel(leaf.grad, ref.grad) <= tolerance, name


def test_op_extreme_scale_and_unused_outputs():
    """Scale 100 on unnormalised features (logits up to ~300: exponents far beyond fp32's range
    without the running maxima), and a loss that uses some outputs only (the others hand back None)."""
    gen = torch.Generator().manual_seed(6)
    m, k = 19, 150
    rows, cols = torch.randn(m, 5, generator=gen) * 1.7, torch.randn(k, 5, generator=gen) * 1.7
    teacher_rows, teacher_cols = torch.randn(1, m, 3, generator=gen) * 1.7, torch.randn(1, k, 3, generator=gen) * 1.7
    leaves = [t.clone().requires_grad_() for t in (rows, cols)]
    got = distill_lse(*leaves, teacher_rows, teacher_cols, 100.0, torch.tensor([100.0]), 0, True, algorithm="torch",
                      workspace_bytes=1)
    want_leaves = [t.double().requires_grad_() for t in (rows, cols)]
    want = distill_lse_reference(*want_leaves, teacher_rows.double(), teacher_cols.double(),
                                 torch.tensor(100.0), torch.tensor([100.0]), 0, True)
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and _rel(g, w) <= 2e-5
    (got[0] - got[3][0]).sum().backward()
    (want[0] - want[3][0]).sum().backward()
    for leaf, ref in zip(leaves, want_leaves):
        assert _rel(leaf.grad, ref.grad) <= 1e-4


def _loss_inputs(gen, batch, dim, teacher_dims, dtype):
    return ([_unit(gen, batch, dim, dtype=dtype), _unit(gen, batch, dim, dtype=dtype),
             torch.tensor(30.0)],
            [_unit(gen, batch, d, dtype=dtype) for d in teacher_dims],
            [_unit(gen, batch, d, dtype=dtype) for d in teacher_dims],
            [torch.tensor(100.0 - 40 * n) for n in range(len(teacher_dims))])


def test_single_device_matches_open_clip():
    """fp32, one teacher, every input requiring grad; the student's values and gradients within
    1e-5 of open_clip's; output_dict."""
    gen = torch.Generator().manual_seed(7)
    student, images, texts, scales = _loss_inputs(gen, 45, 16, (24,), torch.float32)
    inputs = student + [images[0], texts[0], scales[0]]

    def run(loss):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = loss(*leaves, output_dict=True)
        (0.5 * out["contrastive_loss"] + 1.5 * out["distill_loss"]).backward()
        return [out["contrastive_loss"], out["distill_loss"]] + [t.grad for t in leaves]

    ours = run(clipshard.DistillClipLoss(algorithm="torch"))
    theirs = run(_open_clip_loss_class("DistillClipLoss")())
    for name, a, b in zip(("contrastive", "distill", "image", "text", "scale"), ours[:5], theirs[:5]):
        assert _rel(a, b) <= 1e-5, name
    for name, a, b in zip(("teacher image", "teacher text"), ours[5:7], theirs[5:7]):
        assert _rel(a, b, floor=1.0) <= 1e-4, name


@pytest.mark.parametrize("dtype,tolerance", [(torch.bfloat16, 2e-2), (torch.float16, 5e-3), (torch.float32, 1e-5)])
@pytest.mark.parametrize("average_after_softmax", [True, False])
def test_ensembles_and_16_bit_against_fp64(dtype, tolerance, average_after_softmax):
    """Two teachers of different dims (the smaller zero-padded), 16-bit student and teachers, against
    the fp64 reference on the same rounded inputs: the losses and the student's gradients."""
    gen = torch.Generator().manual_seed(8)
    student, images, texts, scales = _loss_inputs(gen, 33, 16, (24, 11), dtype)
    leaves = [t.clone().requires_grad_() for t in student]
    contrastive, distill = clipshard.DistillClipLoss(algorithm="torch", average_after_softmax=average_after_softmax)(
        *leaves, images, texts, scales)
    assert contrastive.dtype == torch.float32
    (contrastive + 2 * distill).backward()
    ref = [t.double().requires_grad_() for t in student]
    want = distill_clip_loss_reference(*ref, [t.double() for t in images], [t.double() for t in texts], scales,
                                       average_after_softmax)
    (want[0] + 2 * want[1]).backward()
    assert _rel(torch.stack([contrastive, distill]), want) <= tolerance / 10
    for name, leaf, r in zip(("image", "text", "scale"), leaves, ref):
        assert _rel(leaf.grad, r.grad) <= tolerance, name


def test_bad_inputs_name_the_argument():
    gen = torch.Generator().manual_seed(9)
    student, images, texts, scales = _loss_inputs(gen, 6, 8, (5, 5), torch.float32)
    loss = clipshard.DistillClipLoss()
    with pytest.raises(ValueError, match="lists of the same length >= 1, got 2, 1 and 2 teachers"):
        loss(*student, images, texts[:1], scales)
    with pytest.raises(ValueError, match="teacher 1: dist_image_features and dist_text_features must have the same"):
        loss(*student, images, [texts[0], texts[1][:, :3]], scales)
    with pytest.raises(ValueError, match=r"the teacher's batch must be the student's \(6 rows\), got 4"):
        loss(*student, images[0][:4], texts[0][:4], scales[0])
    with pytest.raises(TypeError, match="must have one dtype"):
        loss(*student, [images[0], images[1].double()], [texts[0], texts[1].double()], scales)
    with pytest.raises(TypeError, match="dist_logit_scale must be a float or a one-element"):
        loss(*student, images[0], texts[0], torch.ones(2))
    with pytest.raises(ValueError, match="mode='ring' cannot reproduce open_clip's"):
        clipshard.DistillClipLoss(local_loss=True, mode="ring")
    with pytest.raises(ValueError, match="algorithm must be one of 'auto', 'compiled', 'torch'"):
        clipshard.DistillClipLoss(algorithm="fused")
    with pytest.raises(TypeError, match="average_after_softmax must be True or False"):
        clipshard.DistillClipLoss(average_after_softmax="yes")
    rows, cols = student[0], student[1]
    teacher = images[0].unsqueeze(0)
    with pytest.raises(ValueError, match="teacher_rows and teacher_cols must have shapes"):
        distill_lse(rows, cols, teacher, teacher[:, :3], 10.0, torch.ones(1))
    with pytest.raises(ValueError, match=r"teacher_scale must have T = 1 elements"):
        distill_lse(rows, cols, teacher, teacher, 10.0, torch.ones(2))
    with pytest.raises(ValueError, match="pos_offset must satisfy"):
        distill_lse(rows, cols, teacher, teacher, 10.0, torch.ones(1), pos_offset=1)


def test_peak_memory_within_workspace_bound():
    """Forward + backward of the op at M = 256, K = 2048 (one M x K fp32 matrix is 2 MiB) with a
    64 KiB workspace: the extra memory stays within the workspace plus O((M + K) (D + T)) outputs,
    inputs' gradients and per-row vectors, far below one M x K matrix."""
    gen = torch.Generator().manual_seed(10)
    m, k, d, dt, budget = 256, 2048, 8, 12, 64 << 10
    rows, cols = _unit(gen, m, d, dtype=torch.float32), _unit(gen, k, d, dtype=torch.float32)
    teacher_rows, teacher_cols = _unit(gen, 1, m, dt, dtype=torch.float32), _unit(gen, 1, k, dt, dtype=torch.float32)

    def step():
        leaves = [t.clone().requires_grad_() for t in (rows, cols)]
        out = distill_lse(*leaves, teacher_rows, teacher_cols, 30.0, torch.tensor([100.0]), 0, True,
                          algorithm="torch", workspace_bytes=budget)
        (out[0].sum() + out[4].sum() - out[3].sum() - out[6].sum()).backward()

    peak = peak_memory_bytes(step, "cpu")
    kc = _portable_chunks.Chunks(rows, cols, budget, 9, False).width
    vectors = 4 * (2 * (m + k) * (d + 1) + 12 * (m + k))  # clones, gradients, the statistics and their gradients
    # the chunk buffers (budget) plus the temporaries of torch's reductions over one chunk
    allowance = budget + 4 * m * kc * 3 + vectors
    assert peak <= allowance, (peak, allowance)
    assert peak < 4 * m * k / 2


def test_auto_picks_the_compiled_kernel_only_where_registered():
    """"auto" runs the compiled op where this build registered it for the CPU, else the torch path
    (same results); algorithm="compiled" without a kernel is an error that says so."""
    from clipshard.ops import _algorithm
    compiled = _algorithm.has_compiled_kernel("clipshard::distill_lse", "cpu")
    assert _algorithm.resolve("distill_lse", "auto", torch.device("cpu"), ("auto", "compiled", "torch")) == (
        "compiled" if compiled else "torch")
    gen = torch.Generator().manual_seed(11)
    rows, cols = _unit(gen, 9, 4, dtype=torch.float32), _unit(gen, 20, 4, dtype=torch.float32)
    teacher = _unit(gen, 1, 20, 3, dtype=torch.float32)
    args = (rows, cols, teacher[:, :9], teacher, 10.0, torch.tensor([20.0]))
    torch_path = distill_lse(*args, algorithm="torch")
    if compiled:
        for got, want in zip(distill_lse(*args), torch_path):
            assert _rel(got, want) <= 1e-5
    else:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for got, want in zip(distill_lse(*args), torch_path):
                assert torch.equal(got, want)
        with pytest.raises(RuntimeError, match="algorithm='compiled' needs the extension's distill_lse kernel"):
            distill_lse(*args, algorithm="compiled")


def test_fp16_prescale_bounds_the_sum_over_teachers(monkeypatch):
    """The torch path's fp16 dS pre-scale on the 16-bit GEMM path GPUs take (its fp32-output GEMM
    emulated exactly on the CPU) is bounded by each row's sum of row_cross gradients over the
    teachers, as the CUDA path's is: five teachers that agree on a peaked softmax give each positive
    dS ~ 5 g, which the bound of the largest single gradient (g) lifted past fp16's 65504 (inf)."""
    monkeypatch.setattr(_portable_chunks, "_has_fp32_output_gemm", lambda device, dtype: True)
    monkeypatch.setattr(_portable_chunks, "_mm_with_output_dtype", lambda a, b, dtype: torch.mm(a.to(dtype), b.to(dtype)))
    gen = torch.Generator().manual_seed(31)
    m, d, dt, n_teachers = 19, 8, 6, 5
    inputs = [_unit(gen, m, d), _unit(gen, m, d), _unit(gen, 1, m, dt).expand(n_teachers, m, dt).contiguous(),
              torch.tensor(10.0, dtype=torch.float64), torch.full((n_teachers,), 100.0, dtype=torch.float64)]
    rows, cols, teacher, scale, teacher_scale = inputs
    leaves = [rows.half().requires_grad_(), cols.half().requires_grad_()]
    refs = [x.detach().double().requires_grad_() for x in leaves]
    g = 2.0 ** -12  # a power of two: the pre-scale lifts g exactly to 2^14
    row_cross = distill_lse(*leaves, teacher.half(), teacher.half(), scale.float(), teacher_scale.float(),
                            algorithm="torch")[3]
    (row_cross.sum() * g).backward()
    (distill_lse_reference(*refs, teacher, teacher, scale, teacher_scale)[3].sum() * g).backward()
    for leaf, ref in zip(leaves, refs):
        assert torch.isfinite(leaf.grad).all()
        assert _rel(leaf.grad, ref.grad) <= 5e-3


class _BackwardCalls(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the seven upstream gradients of every compiled distill_lse_backward call."""

    def __init__(self):
        super().__init__()
        self.grads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._overloadpacket == torch.ops.clipshard.distill_lse_backward:
            self.grads.append(args[:7])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_backward_gets_none_for_unused_outputs(device):
    """The compiled op's autograd hands the kernel None, not zeros, for the outputs a loss leaves
    out (as the torch path does), so a loss of the student's statistics alone runs no teacher term
    and no teacher GEMM in any backward chunk (distill_args.h: needs_teacher); the gradients are
    the torch path's."""
    gen = torch.Generator().manual_seed(12)
    inputs = [_unit(gen, 9, 6), _unit(gen, 30, 6), _unit(gen, 2, 9, 5), _unit(gen, 2, 30, 5)]
    scales = (torch.tensor(14.0), torch.tensor([10.0, 20.0]))
    results = {}
    for algorithm in ("compiled", "torch"):
        leaves = [t.float().to(device).requires_grad_() for t in inputs]
        calls = _BackwardCalls()
        with calls:
            row_lse, pos_logit, *_ = distill_lse(*leaves, *(s.to(device) for s in scales), algorithm=algorithm,
                                                 workspace_bytes=1)
            (row_lse.mean() - pos_logit.mean()).backward()
        results[algorithm] = [leaf.grad for leaf in leaves], calls.grads
    (compiled, calls), (torch_path, _) = results["compiled"], results["torch"]
    assert len(calls) == 1 and calls[0][0] is not None and calls[0][1] is not None
    assert all(g is None for g in calls[0][2:]), [type(g) for g in calls[0]]
    for got, want in zip(compiled[:2], torch_path[:2]):
        assert _rel(got, want) <= 1e-5
    for grads in (compiled, torch_path):  # the teachers' gradients are zero
        assert all(g is None or not g.any() for g in grads[2:])
