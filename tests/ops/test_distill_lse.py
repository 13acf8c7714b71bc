"""The compiled distillation op, torch.ops.clipshard.distill_lse / distill_lse_backward, called
directly (no Python front), against the fp64 reference of the op's formulas (csrc/clipshard.cpp,
tests/references/distill.py): the forward's seven statistics materialised in fp64, and their exact
vector-Jacobian product from fp64 autograd through that reference.

CPU tests run everywhere; the tests marked `cuda` run the same cases on a GPU (skipped here)."""
import pytest
import torch

from tests.references.distill import distill_lse_reference

OPS = torch.ops.clipshard
# (M, K, D, T, Dt, pos_offset): odd sizes around the CPU's 128 x 512 tile, T = 1 and 2, Dt != D.
SHAPES = [(1, 1, 1, 1, 1, 0), (5, 17, 3, 2, 7, 9), (130, 601, 24, 2, 40, 333), (37, 37, 16, 1, 9, 0)]
OUTPUTS = ("row_lse", "pos_logit", "teacher_row_lse", "row_cross", "col_lse", "teacher_col_lse", "col_cross")
BIG = 1 << 30  # a workspace that holds everything in one chunk


def make_inputs(m, k, d, t, dt, dtype=torch.float32, teacher_dtype=None, scale=14.3, teacher_scale=None,
                seed=0, device="cpu"):
    """Unit-norm random features (as CLIP's), scale fp32 0-dim, teacher_scale fp32 (T,)."""
    g = torch.Generator().manual_seed(seed)

    def feats(*shape):
        return torch.nn.functional.normalize(torch.randn(*shape, generator=g, dtype=torch.float64), dim=-1)

    teacher_dtype = teacher_dtype or dtype
    teacher_scale = teacher_scale or [10.0 + 7.0 * i for i in range(t)]
    return dict(rows=feats(m, d).to(device, dtype), cols=feats(k, d).to(device, dtype),
                teacher_rows=feats(t, m, dt).to(device, teacher_dtype),
                teacher_cols=feats(t, k, dt).to(device, teacher_dtype),
                scale=torch.tensor(scale, dtype=torch.float32, device=device),
                teacher_scale=torch.tensor(teacher_scale, dtype=torch.float32, device=device))


def upstream_gradients(m, k, t, realistic, seed=1):
    """Random upstream gradients of the seven outputs, fp64: N(0, 1), or a real loss's 0.5 / M."""
    g = torch.Generator().manual_seed(seed)
    shapes = [(m,), (m,), (t, m), (t, m), (k,), (t, k), (t, k)]
    if realistic:
        return [0.5 / m * (0.5 + torch.rand(s, generator=g, dtype=torch.float64)) for s in shapes]
    return [torch.randn(s, generator=g, dtype=torch.float64) for s in shapes]


def reference_run(inputs, pos_offset, want_columns, grads, teacher_grad=True):
    """Reference outputs and the gradients of (rows, cols, teacher_rows, teacher_cols, scale,
    teacher_scale) for upstream gradients `grads` (None entries = no gradient)."""
    leaves = {n: x.detach().double().requires_grad_() for n, x in inputs.items()}
    out = distill_lse_reference(**leaves, pos_offset=pos_offset, want_columns=want_columns)
    pairs = [(o, g) for o, g in zip(out, grads) if g is not None and o.numel()]
    names = ["rows", "cols", "scale"] + (["teacher_rows", "teacher_cols", "teacher_scale"] if teacher_grad else [])
    ref_grads = torch.autograd.grad([o for o, _ in pairs], [leaves[n] for n in names], [g for _, g in pairs],
                                    allow_unused=True)
    return [o.detach() for o in out], {n: (gr if gr is not None else torch.zeros_like(leaves[n]))
                                       for n, gr in zip(names, ref_grads)}


def kernel_run(inputs, pos_offset, want_columns, grads, teacher_grad=True, workspace_bytes=BIG, stats=None):
    """The compiled op's outputs and gradients; `stats` replaces the forward's outputs as the
    backward's statistics."""
    args = [inputs[n] for n in ("rows", "cols", "teacher_rows", "teacher_cols", "scale", "teacher_scale")]
    out = OPS.distill_lse(*args, pos_offset, want_columns, workspace_bytes)
    acc = out[0].dtype
    g = [None if x is None else x.to(inputs["rows"].device, acc) for x in grads]
    st = stats if stats is not None else out
    back = OPS.distill_lse_backward(*g, *args, pos_offset, st[0], st[2], st[3], st[4], st[5], st[6], teacher_grad,
                                    workspace_bytes)
    names = ("rows", "cols", "teacher_rows", "teacher_cols", "scale", "teacher_scale")
    return out, dict(zip(names, back))


def assert_close(got, want, tol, what, scale=0.0):
    """Max error <= tol * max(max |want|, scale)."""
    got, want = got.detach().double().cpu(), want.double().cpu()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not want.numel():
        return
    err = (got - want).abs().max().item()
    bound = tol * max(want.abs().max().item(), scale, 1e-30)
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e} (max |reference| {want.abs().max().item():.3e})"


# Max error relative to the largest |reference| entry: statistics are accumulated in fp32 (fp64)
# from the exact input values (their error scales with the largest logit scale: an fp32 logit of
# magnitude 100 carries an absolute error ~1e-5); feature gradients come back rounded to the
# features' dtype.
OUT_TOL = {torch.float64: 1e-12, torch.float32: 2e-6, torch.float16: 2e-6, torch.bfloat16: 2e-6}
GRAD_TOL = {torch.float64: 1e-11, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# d scale / d teacher_scale are sums of M x K terms of either sign: their error scales with the sum
# of the terms' magnitudes, bounded here by the summed |upstream gradient| times max |logit|.
SCALE_TOL = {torch.float64: 1e-11, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}


def check(inputs, pos_offset, want_columns, grads, teacher_grad=True, workspace_bytes=BIG, dtype=None):
    dtype = dtype or inputs["rows"].dtype
    out, got = kernel_run(inputs, pos_offset, want_columns, grads, teacher_grad, workspace_bytes)
    ref_out, want = reference_run(inputs, pos_offset, want_columns,
                                  [None if g is None else g.double() for g in grads], teacher_grad)
    acc = torch.float64 if inputs["rows"].dtype == torch.float64 else torch.float32
    max_logit = max(inputs["scale"].abs().max().item(), inputs["teacher_scale"].abs().max().item())
    for name, o, r in zip(OUTPUTS, out, ref_out):
        assert o.dtype == acc, f"{name}: dtype {o.dtype}, want {acc}"
        assert_close(o, r, OUT_TOL[dtype], name, scale=max_logit)
    total = sum(g.abs().sum().item() for g in grads if g is not None)
    for name, x in inputs.items():
        if name not in want:
            assert got[name].numel() == 0, f"teacher_grad=False: grad {name} should be empty, got {got[name].shape}"
            continue
        assert got[name].dtype == x.dtype, f"grad {name}: dtype {got[name].dtype}, want {x.dtype}"
        if name.endswith("scale"):
            # (plus the rounding of the result to the scales' dtype, fp32 here)
            bound = SCALE_TOL[dtype] * total * max_logit + 2 ** -23 * want[name].abs().max().item() + 1e-30
            err = (got[name].double().cpu() - want[name].cpu()).abs().max().item()
            assert got[name].shape == x.shape and err <= bound, f"grad {name}: error {err:.3e} > {bound:.3e}"
        else:
            assert_close(got[name], want[name], GRAD_TOL[dtype], f"grad {name}")
    return out, got


# ---------------------------------------------------------------------------------------- CPU

@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
def test_values_and_gradients_match_fp64_reference(shape, dtype):
    m, k, d, t, dt, pos = shape
    inputs = make_inputs(m, k, d, t, dt, dtype)
    check(inputs, pos, True, upstream_gradients(m, k, t, realistic=False))


@pytest.mark.parametrize("scale,teacher_scale", [(100.0, [100.0, 1.0]), (1.0, [100.0, 100.0]), (0.5, [0.01, 3.0])])
def test_extreme_scales(scale, teacher_scale):
    """Scales up to 100 (logits spanning 200: the tiles' two-exponential path) and tiny ones."""
    m, k = 70, 530
    inputs = make_inputs(m, k, 12, 2, 20, scale=scale, teacher_scale=teacher_scale, seed=3)
    check(inputs, 400, True, upstream_gradients(m, k, 2, realistic=True))


def test_realistic_upstream_gradients():
    """Gradients of a real loss, 0.5 / M per row and column, on every output."""
    m, k = 129, 700
    inputs = make_inputs(m, k, 32, 2, 48, seed=4)
    check(inputs, 0, True, upstream_gradients(m, k, 2, realistic=True))


# Which upstream gradients are given: each one alone (each reaches dS or dT through its own term),
# the student's alone, the teachers' alone, all.
GIVEN = [(i,) for i in range(7)] + [(0, 1, 4), (2, 3, 5, 6), tuple(range(7))]


@pytest.mark.parametrize("given", GIVEN, ids=lambda g: "+".join(OUTPUTS[i] for i in g))
@pytest.mark.parametrize("teacher_grad", [True, False], ids=["teacher_grad", "no_teacher_grad"])
def test_every_combination_of_absent_gradients(given, teacher_grad):
    """fp64, so that a missing or extra term shows far above rounding."""
    m, k, t = 9, 23, 2
    inputs = make_inputs(m, k, 5, t, 6, torch.float64, seed=5)
    grads = upstream_gradients(m, k, t, realistic=False, seed=6)
    grads = [g if i in given else None for i, g in enumerate(grads)]
    check(inputs, 11, True, grads, teacher_grad=teacher_grad)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_16_bit_inputs(dtype):
    """16-bit student, teacher of another dtype (fp32 / bf16), realistic gradients; the reference
    takes the same 16-bit values in fp64."""
    m, k = 131, 517
    teacher_dtype = torch.float32 if dtype == torch.float16 else torch.bfloat16
    inputs = make_inputs(m, k, 24, 2, 33, dtype, teacher_dtype, seed=7)
    check(inputs, 100, True, upstream_gradients(m, k, 2, realistic=True), dtype=dtype)


def test_want_columns_false_gives_empty_columns_and_the_same_rows():
    m, k, t = 40, 90, 2
    inputs = make_inputs(m, k, 8, t, 10, seed=8)
    grads = upstream_gradients(m, k, t, realistic=False)
    grads[4:] = [None, None, None]
    out, got = check(inputs, 3, False, grads)
    assert [tuple(o.shape) for o in out[4:]] == [(0,), (t, 0), (t, 0)]
    full, got_full = kernel_run(inputs, 3, True, grads)
    for name, a, b in zip(OUTPUTS[:4], out, full):
        assert torch.equal(a, b), name
    for name in got:
        assert torch.equal(got[name], got_full[name]), name


def test_small_workspace_gives_many_chunks_and_the_same_result():
    """A 1-byte budget makes the backward's column chunks 128 wide (601 columns: 5 chunks, the last
    partial); the result equals the single-chunk run up to summation order, and the reference."""
    m, k, t = 130, 601, 2
    inputs = make_inputs(m, k, 16, t, 24, seed=9)
    grads = upstream_gradients(m, k, t, realistic=False)
    _, small = check(inputs, 5, True, grads, workspace_bytes=1)
    _, big = kernel_run(inputs, 5, True, grads)
    for name in small:
        assert_close(small[name], big[name], 1e-5, name)


def test_backward_uses_the_statistics_it_is_given():
    """The statistics are inputs of the backward: fp64 reference statistics give the same
    gradients (they are the exact ones), and shifted ones change them."""
    m, k, t = 20, 50, 1
    inputs = make_inputs(m, k, 6, t, 8, torch.float64, seed=10)
    grads = upstream_gradients(m, k, t, realistic=False)
    ref_out, _ = reference_run(inputs, 4, True, grads)
    _, from_kernel = kernel_run(inputs, 4, True, grads)
    _, from_reference = kernel_run(inputs, 4, True, grads, stats=ref_out)
    for name in from_kernel:
        assert_close(from_reference[name], from_kernel[name], 1e-12, name)
    shifted = list(ref_out)
    shifted[2] = shifted[2] + 0.5
    _, from_shifted = kernel_run(inputs, 4, True, grads, stats=shifted)
    assert not torch.allclose(from_shifted["teacher_rows"], from_kernel["teacher_rows"])


def test_outputs_are_fresh_tensors():
    inputs = make_inputs(7, 9, 4, 1, 5)
    out, got = kernel_run(inputs, 0, False, upstream_gradients(7, 9, 1, False)[:4] + [None] * 3, teacher_grad=False)
    pointers = [x.data_ptr() for x in list(out) + list(got.values()) if x.numel()]
    assert len(pointers) == len(set(pointers))


# Bad arguments: (what, how to break the forward's arguments, expected message).
def _set(name, value):
    return lambda a: a.__setitem__(name, value(a))


BAD = [
    ("rows 1-D", _set("rows", lambda a: a["rows"][0]), "rows must be 2-D"),
    ("cols width", _set("cols", lambda a: a["cols"][:, :-1]), "same feature size D"),
    ("cols dtype", _set("cols", lambda a: a["cols"].double()), "rows and cols must have the same dtype"),
    ("int rows", _set("rows", lambda a: a["rows"].int()), "rows must be float32, float16, bfloat16 or float64"),
    ("teacher 2-D", _set("teacher_rows", lambda a: a["teacher_rows"][0]), "teacher_rows must be 3-D"),
    ("teacher M", _set("teacher_rows", lambda a: a["teacher_rows"][:, 1:]), r"teacher_rows must have shape \[T, M, Dt\]"),
    ("teacher K", _set("teacher_cols", lambda a: a["teacher_cols"][:, 1:]), "teacher_cols must have shape"),
    ("teacher Dt", _set("teacher_cols", lambda a: a["teacher_cols"][..., 1:]), "teacher_cols must have shape"),
    ("teacher T", _set("teacher_cols", lambda a: a["teacher_cols"][:1]), "teacher_cols must have shape"),
    ("teacher dtypes", _set("teacher_cols", lambda a: a["teacher_cols"].half()),
     "teacher_rows and teacher_cols must have the same dtype"),
    ("scale shape", _set("scale", lambda a: a["scale"].repeat(2)), "scale must be a 0-dim or 1-element"),
    ("int scale", _set("scale", lambda a: a["scale"].int()), "scale must be a floating-point"),
    ("teacher_scale shape", _set("teacher_scale", lambda a: a["teacher_scale"][:1]),
     r"teacher_scale must have shape \[2\]"),
    ("empty rows", _set("rows", lambda a: a["rows"][:0]), "empty inputs"),
]


@pytest.mark.parametrize("what,mutate,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_arguments_raise_clear_errors(what, mutate, pattern):
    args = make_inputs(6, 10, 4, 2, 5)
    mutate(args)
    ordered = [args[n] for n in ("rows", "cols", "teacher_rows", "teacher_cols", "scale", "teacher_scale")]
    with pytest.raises(RuntimeError, match=pattern):
        OPS.distill_lse(*ordered, 0, True, BIG)


@pytest.mark.parametrize("pos_offset", [-1, 5])
def test_bad_pos_offset(pos_offset):
    a = make_inputs(6, 10, 4, 2, 5)
    with pytest.raises(RuntimeError, match="pos_offset must satisfy"):
        OPS.distill_lse(*a.values(), pos_offset, True, BIG)


def test_bad_workspace():
    a = make_inputs(6, 10, 4, 2, 5)
    with pytest.raises(RuntimeError, match="workspace_bytes must be positive"):
        OPS.distill_lse(*a.values(), 0, True, 0)


def test_backward_bad_gradients_and_missing_statistics():
    m, k, t = 6, 10, 2
    a = make_inputs(m, k, 4, t, 5)
    args = list(a.values())
    out = OPS.distill_lse(*args, 0, False, BIG)  # no column statistics
    grads = [torch.ones(m), None, None, None, None, None, None]
    stats = (out[0], out[2], out[3], out[4], out[5], out[6])

    def backward(grads, stats=stats):
        return OPS.distill_lse_backward(*grads, *args, 0, *stats, True, BIG)

    with pytest.raises(RuntimeError, match=r"grad_row_lse must have shape \[6\]"):
        backward([torch.ones(m + 1)] + grads[1:])
    with pytest.raises(RuntimeError, match=r"grad_row_cross must have shape \[2, 6\]"):
        backward(grads[:3] + [torch.ones(m)] + grads[4:])
    with pytest.raises(RuntimeError, match=r"col_lse must have shape \[10\] \(it is needed because grad_col_lse"):
        backward(grads[:4] + [torch.ones(k)] + grads[5:])
    with pytest.raises(RuntimeError, match=r"teacher_col_lse must have shape \[2, 10\] .*grad_col_cross"):
        backward(grads[:6] + [torch.ones(t, k)])
    with pytest.raises(RuntimeError, match="row_cross must be a floating-point"):
        backward(grads[:3] + [torch.ones(t, m)] + grads[4:], (out[0], out[2], out[3].int(), *out[4:]))
    # Empty gradients (those of empty outputs) mean "none": the row term alone.
    got = backward(grads[:4] + [torch.ones(0), torch.ones(t, 0), torch.ones(t, 0)])
    want = backward(grads)
    for x, y in zip(got, want):
        assert torch.equal(x, y)


# --------------------------------------------------------------------------------------- CUDA

CUDA_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", CUDA_DTYPES, ids=str)
@pytest.mark.parametrize("workspace_bytes", [BIG, 1], ids=["one_chunk", "many_chunks"])
def test_cuda_matches_fp64_reference(dtype, workspace_bytes):
    """fp32 on CUDA follows torch's TF32 flag for its GEMMs (off by default)."""
    m, k, t = 300, 1100, 2
    inputs = make_inputs(m, k, 40, t, 72, dtype, seed=11, device="cuda")
    check(inputs, 700, True, upstream_gradients(m, k, t, realistic=True), workspace_bytes=workspace_bytes)


@pytest.mark.cuda
@pytest.mark.parametrize("given", GIVEN, ids=lambda g: "+".join(OUTPUTS[i] for i in g))
@pytest.mark.parametrize("teacher_grad", [True, False], ids=["teacher_grad", "no_teacher_grad"])
def test_cuda_every_combination_of_absent_gradients(given, teacher_grad):
    m, k, t = 33, 150, 2
    inputs = make_inputs(m, k, 8, t, 12, seed=12, device="cuda")
    grads = upstream_gradients(m, k, t, realistic=False, seed=6)
    grads = [g if i in given else None for i, g in enumerate(grads)]
    check(inputs, 11, True, grads, teacher_grad=teacher_grad)


@pytest.mark.cuda
@pytest.mark.parametrize("scale,teacher_scale", [(100.0, [100.0, 1.0]), (0.5, [0.01, 3.0])])
def test_cuda_extreme_scales_and_no_columns(scale, teacher_scale):
    m, k, t = 70, 530, 2
    inputs = make_inputs(m, k, 12, t, 20, scale=scale, teacher_scale=teacher_scale, seed=13, device="cuda")
    grads = upstream_gradients(m, k, t, realistic=True)
    check(inputs, 400, True, grads)
    check(inputs, 400, False, grads[:4] + [None, None, None])


@pytest.mark.cuda
def test_cuda_matches_cpu_kernel():
    m, k, t = 200, 700, 2
    cpu = make_inputs(m, k, 24, t, 40, seed=14)
    gpu = {n: x.cuda() for n, x in cpu.items()}
    grads = upstream_gradients(m, k, t, realistic=True)
    out_c, got_c = kernel_run(cpu, 100, True, grads)
    out_g, got_g = kernel_run(gpu, 100, True, grads)
    for name, a, b in zip(OUTPUTS, out_c, out_g):
        assert_close(b, a, 1e-5, name)
    for name in got_c:
        assert_close(got_g[name], got_c[name], 1e-4, name)


@pytest.mark.cuda
def test_cuda_memory_stays_bounded():
    """Peak extra memory of forward + backward with a 4 MiB workspace stays far below one M x K
    fp32 matrix (64 MiB at 4096 x 4096)."""
    m = k = 4096
    inputs = make_inputs(m, k, 64, 2, 96, torch.bfloat16, seed=15, device="cuda")
    grads = [g.cuda() for g in upstream_gradients(m, k, 2, realistic=True)]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    kernel_run(inputs, 0, True, grads, workspace_bytes=4 << 20)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 32 << 20, f"peak extra memory {extra / 2**20:.1f} MiB"


@pytest.mark.cuda
def test_cuda_bad_device_mix():
    a = make_inputs(6, 10, 4, 2, 5, device="cuda")
    a["teacher_rows"] = a["teacher_rows"].cpu()
    with pytest.raises(RuntimeError, match="teacher_rows must be on the same device as rows"):
        OPS.distill_lse(*a.values(), 0, True, BIG)
    a = make_inputs(6, 10, 4, 2, 5, torch.float64, device="cuda")
    with pytest.raises(RuntimeError, match="rows must be float32, float16 or bfloat16"):
        OPS.distill_lse(*a.values(), 0, True, BIG)


@pytest.mark.cuda
def test_cuda_three_teachers_of_another_dtype():
    """Teachers two per forward launch: three teachers take a launch of two, then one; bf16
    student beside fp16 teachers (each dlogits buffer with its own pre-scale), several chunks."""
    m, k, t = 150, 1300, 3
    inputs = make_inputs(m, k, 24, t, 40, torch.bfloat16, teacher_dtype=torch.float16, seed=16, device="cuda")
    check(inputs, 900, True, upstream_gradients(m, k, t, realistic=True), workspace_bytes=1 << 20)


@pytest.mark.cuda
def test_cuda_takes_rows_past_the_grid():
    """Issue 31 item 9: the forward refused M > 65535 * 16 = 1,048,560 rows (16-row CTAs) while the
    backward took twice that and the CPU kernel any M. Both kernels now loop over the row blocks
    past the grid's 65535: M = 65535 * 16 + 1 (past the forward's old limit; the size of the
    contrastive path's test, ~1e12 logits: M x M, as pos_offset + M <= K) runs forward and backward;
    the last rows, in the forward's block past the grid, match the fp64 reference. (The gradient
    kernel's loop, past 65535 * 32 rows, would take 4x the GPU check's time: the host emulation
    runs it with a capped grid.)"""
    m, d, dt = 65535 * 16 + 1, 8, 4
    inputs = make_inputs(m, m, d, 1, dt, torch.bfloat16, seed=17, device="cuda")
    args = [inputs[n] for n in ("rows", "cols", "teacher_rows", "teacher_cols", "scale", "teacher_scale")]
    out = OPS.distill_lse(*args, 0, False, 256 << 20)
    g_row = torch.full((m,), 0.5 / m, device="cuda")
    back = OPS.distill_lse_backward(g_row, None, None, g_row[None], None, None, None, *args, 0, out[0], out[2], out[3],
                                    out[4], out[5], out[6], False, 256 << 20)
    assert torch.isfinite(back[0].float()).all() and torch.isfinite(back[1].float()).all()
    tail = slice(m - 5, m)
    rows = inputs["rows"][tail].double().requires_grad_()
    want = reference(rows, inputs["cols"].double(), inputs["teacher_rows"][:, tail].double(),
                     inputs["teacher_cols"].double(), inputs["scale"].double(), inputs["teacher_scale"].double(),
                     m - 5, False)
    for name, got, w in ((OUTPUTS[0], out[0][tail], want[0]), (OUTPUTS[3], out[3][:, tail], want[3])):
        assert_close(got, w, 2e-6, name, scale=inputs["scale"].item())
    ((want[0] + want[3][0]) * (0.5 / m)).sum().backward()
    assert_close(back[0][tail], rows.grad, GRAD_TOL[torch.bfloat16], "grad rows")
