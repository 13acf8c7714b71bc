"""torch.library.opcheck for every op registered in torch.ops.clipshard (and the test-only
torch.ops.clipshard_testing): the schema (aliasing and
mutation as declared), the autograd registration, the fake (meta) kernel against the real one, and
AOT dispatch with dynamic shapes. The ops are listed from the dispatcher, so an op added without a
case here fails test_every_registered_op_has_an_opcheck; each case runs on the CPU (fp32 and fp64,
small odd sizes, random data) and, where the op has a CUDA kernel, on a GPU (fp32 and bf16, marked
`cuda`)."""
import pytest
import torch

import clipshard  # noqa: F401  (the ops, their fake kernels and autograd formulas)
import clipshard.optim  # noqa: F401  (adamw_step_'s fake kernel)

NAMESPACES = ("clipshard", "clipshard_testing")
WS = 1 << 12  # a workspace budget that splits the chunked algorithms into several chunks


def _registered():
    """The qualified names ("clipshard::op") of the ops of NAMESPACES (the dispatcher's list, not a
    hand-kept one)."""
    return {name for name in torch._C._dispatch_get_all_op_names() if name.split("::")[0] in NAMESPACES}


def _features(n, d, dtype, device, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, generator=gen, dtype=torch.float64), dim=-1).to(device, dtype)


def _scalar(value, dtype, device):
    """A 0-dim logit scale or bias for features of `dtype`: fp64 for fp64 features, else fp32."""
    return torch.tensor(value, dtype=torch.float64 if dtype == torch.float64 else torch.float32, device=device)


def _grad(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def _wide(device):
    """The second feature dtype checked: fp64 on the CPU, bf16 on CUDA (whose kernels take no fp64)."""
    return torch.float64 if device == "cpu" else torch.bfloat16


def _stochastic_round(device):
    x = torch.randn(3, 67, generator=torch.Generator().manual_seed(1)).to(device)
    return [(x, half, 3, 4, False) for half in (torch.float16, torch.bfloat16)] + [
        (x.clone().requires_grad_(), torch.bfloat16, 5, 6, True)]


def _stochastic_round_into(device):
    x = torch.randn(3, 67, generator=torch.Generator().manual_seed(2)).to(device)
    return [(torch.empty(3, 67, dtype=half, device=device), x, 3, 4, True) for half in (torch.float16, torch.bfloat16)]


def _philox_words(device):
    return [(3, 4, 10), (2**63 - 1, -1, 9, 5, "header"), (7, 8, 13, 0, "aten")]


def _addmm_probe(device):
    return [(torch.device(device), torch.float16), (torch.device(device), torch.bfloat16)]


def _adamw_step(device):
    gen = torch.Generator().manual_seed(2)

    def tensors(param_dtype, state_dtype):
        out = [[torch.randn(n, generator=gen).to(device, d) for n in (5, 17)]
               for d in (param_dtype, param_dtype, state_dtype, state_dtype)]
        out[3] = [t.abs() for t in out[3]]
        return out
    hyper = (1e-3, 0.9, 0.999, 1e-8, 0.01, False)
    return [(*tensors(torch.bfloat16, torch.float32), [2, 2], *hyper, True, 3, 4),
            (*tensors(torch.float32, torch.float16), [1, 3], *hyper, False, 3, 4, [4, 7], [0, 9])]


def _contrastive_inputs(device, dtype, seed):
    return (_features(20, 6, dtype, device, seed), _features(45, 6, dtype, device, seed + 1),
            _scalar(14.3, dtype, device), _scalar(-1.0, dtype, device))


class NanOutputs(tuple):
    """Arguments whose outputs hold NaN by design (pos_offset -1: NaN positive logits): every check but
    the AOT-dispatch one, which compares outputs without equal_nan."""


def _ids(n, device, seed):
    """Sample ids with duplicates (about a third of them shared)."""
    return torch.randint(0, 2 * n // 3, (n,), generator=torch.Generator().manual_seed(seed)).to(device)


def _contrastive_lse_forward(device):
    rows, cols, s, b = _contrastive_inputs(device, torch.float32, 8)
    ids = (_ids(20, device, 1), _ids(45, device, 2))
    cases = [(rows, cols, s, None, 3, None, None, True, "fused", WS),
             (rows, cols, s, None, 3, None, None, True, "chunked", WS),
             (rows, cols, s, b, 0, None, None, False, "chunked", WS),
             (*_grad(rows, cols, s, b), 3, None, None, True, "chunked", WS),
             (*_grad(rows, cols, s, b), 3, *ids, True, "chunked", WS),
             NanOutputs((*_grad(rows, cols, s, b), -1, *ids, True, "chunked", WS))]  # no positives
    if device == "cpu":  # the fused CUDA kernels refuse ids
        cases += [(*_grad(rows, cols, s, b), 3, *ids, True, "fused", WS),
                  NanOutputs((*_grad(rows, cols, s, b), -1, *ids, False, "fused", WS))]
    return cases + [(*_grad(*_contrastive_inputs(device, _wide(device), 10)), 3, None, None, True, algorithm, WS)
                    for algorithm in ("fused", "chunked")]


def _contrastive_lse_backward(device):
    cases = []
    ids = (_ids(20, device, 1), _ids(45, device, 2))
    for dtype in (torch.float32, _wide(device)):
        rows, cols, s, b = _contrastive_inputs(device, dtype, 8)
        row_lse, _, col_lse = torch.ops.clipshard.contrastive_lse_forward(rows, cols, s, b, 3, None, None, True,
                                                                           "chunked", WS)
        masked_row, _, masked_col = torch.ops.clipshard.contrastive_lse_forward(rows, cols, s, b, -1, *ids, True,
                                                                                 "chunked", WS)
        gen = torch.Generator().manual_seed(12)
        g = [torch.randn(n, generator=gen, dtype=torch.float64).to(device, row_lse.dtype) for n in (20, 20, 45)]
        cases += [(*g, rows, cols, s, b, 3, None, None, row_lse, col_lse, "chunked", WS),
                  (g[0], g[1], None, rows, cols, s, None, 3, None, None, row_lse, None, "fused", WS),
                  (*g, rows, cols, s, b, -1, *ids, masked_row, masked_col, "chunked", WS)]
        if device == "cpu":
            cases.append((*g, rows, cols, s, b, -1, *ids, masked_row, masked_col, "fused", WS))
    return cases


def _siglip_forward(device):
    rows, cols = _features(20, 6, torch.float32, device, 8), _features(45, 6, torch.float32, device, 9)
    s, b = _scalar(10.0, torch.float32, device), _scalar(-10.0, torch.float32, device)
    grad_args = _grad(rows, cols, s, b)
    wide = _grad(rows.to(_wide(device)), cols.to(_wide(device)), _scalar(10.0, _wide(device), device))
    gen = torch.Generator().manual_seed(10)  # sample ids with repeats: same-id pairs off the positives
    row_ids, col_ids = (torch.randint(0, 12, (n,), generator=gen).to(device) for n in (20, 45))
    no_ids = (None, None, False)
    return [(rows, cols, s, None, 3, *no_ids, False, 1 << 20), (rows, cols, s, b, 0, *no_ids, True, 1 << 20),
            (*grad_args, 3, *no_ids, True, 1), (*wide, None, 25, *no_ids, True, 1 << 20),
            (*grad_args, None, *no_ids, True, 1),  # a block without positives
            (rows, cols, s, b, 3, row_ids, col_ids, True, False, 1 << 20),  # labels by id: masked, +1
            (*grad_args, 3, row_ids, col_ids, True, True, 1), (*grad_args, None, row_ids, col_ids, False, True, 1),
            (*wide, None, 25, row_ids, col_ids, False, True, 1 << 20)]


def _distill_inputs(device, dtype, seed):
    """rows (M x D), cols (K x D), teacher_rows (T x M x Dt), teacher_cols (T x K x Dt), scale, teacher_scale."""
    m, k, d, t, dt = 7, 19, 5, 2, 3
    teacher_rows = torch.stack([_features(m, dt, dtype, device, seed + 2 + i) for i in range(t)])
    teacher_cols = torch.stack([_features(k, dt, dtype, device, seed + 4 + i) for i in range(t)])
    return (_features(m, d, dtype, device, seed), _features(k, d, dtype, device, seed + 1), teacher_rows,
            teacher_cols, _scalar(14.3, torch.float32, device), torch.tensor([10.0, 17.0], device=device))


def _distill_lse(device):
    inputs = _distill_inputs(device, torch.float32, 20)
    student_only = (*_grad(*inputs[:2]), *inputs[2:4], *_grad(inputs[4]), inputs[5])
    return [(*inputs, 4, True, WS), (*inputs, 0, False, 1 << 20), (*_grad(*inputs), 4, True, WS),
            (*student_only, 0, True, WS), (*_grad(*_distill_inputs(device, _wide(device), 25)), 4, True, WS)]


def _distill_lse_backward(device):
    cases = []
    for dtype in (torch.float32, _wide(device)):
        inputs = _distill_inputs(device, dtype, 30)
        stats = torch.ops.clipshard.distill_lse(*inputs, 4, True, WS)
        gen = torch.Generator().manual_seed(31)
        grads = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(device, x.dtype) for x in stats]
        row_lse, _, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross = stats
        saved = (row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross)
        some = [grads[0], grads[1], None, grads[3], None, grads[5], None]
        cases += [(*grads, *inputs, 4, *saved, True, WS), (*some, *inputs, 4, *saved, False, WS)]
    return cases


def _chunked_gradients(device):
    rows, cols = _features(20, 6, torch.float32, device, 40), _features(300, 6, torch.float32, device, 41)
    dlogits = _features(20, 300, torch.float32, device, 42)
    return [(rows, cols, dlogits, torch.tensor(0.5, device=device), None, 128),
            (rows, cols, dlogits, None, torch.bfloat16, 300)]


# qualified op name: a function (device) -> the argument tuples to check
CASES = {
    "clipshard::stochastic_round": _stochastic_round,
    "clipshard::stochastic_round_into": _stochastic_round_into,
    "clipshard_testing::philox_words": _philox_words,
    "clipshard::_addmm_accepts_fp32_accumulator": _addmm_probe,
    # the launch rules the first-use check queries (sizes in, a variant out; no tensors, any device)
    "clipshard::_chunked_forward_rows_per_cta": lambda device: [(67,), (1 << 22,)],
    "clipshard::_siglip_ids_rows_per_cta": lambda device: [(67, 132), (4217, 132)],
    "clipshard::_distill_launch_teachers": lambda device: [(1,), (3,)],
    "clipshard::_column_buffer_rows": lambda device: [(300, 20000), (5, 100)],  # the chunk driver's sizing rule
    "clipshard_testing::chunked_gradients": _chunked_gradients,
    "clipshard::adamw_step_": _adamw_step,
    "clipshard::contrastive_lse_forward": _contrastive_lse_forward,
    "clipshard::contrastive_lse_backward": _contrastive_lse_backward,
    "clipshard::siglip_forward": _siglip_forward,
    "clipshard::distill_lse": _distill_lse,
    "clipshard::distill_lse_backward": _distill_lse_backward,
}
# philox_words and chunked_gradients are CPU test helpers; every other op has a CUDA kernel or (the
# addmm probe, the launch and sizing rules) a CUDA answer.
CUDA_CASES = sorted(set(CASES) - {"clipshard_testing::philox_words", "clipshard_testing::chunked_gradients"})


def _opcheck(name, device):
    namespace, op_name = name.split("::")
    op = getattr(getattr(torch.ops, namespace), op_name).default
    for args in CASES[name](device):
        if isinstance(args, NanOutputs):
            torch.library.opcheck(op, tuple(args), test_utils=("test_schema", "test_autograd_registration",
                                                               "test_faketensor"))
        else:
            torch.library.opcheck(op, args)


def test_every_registered_op_has_an_opcheck():
    registered = _registered()
    assert registered == set(CASES), (f"registered without an opcheck case: {sorted(registered - set(CASES))}; "
                                      f"cases of ops that are not registered: {sorted(set(CASES) - registered)}")


@pytest.mark.parametrize("name", sorted(CASES))
def test_opcheck_cpu(name):
    _opcheck(name, "cpu")


@pytest.mark.cuda
@pytest.mark.parametrize("name", CUDA_CASES)
def test_opcheck_cuda(name):
    _opcheck(name, "cuda")


@pytest.mark.cuda
def test_every_cuda_kernel_has_a_cuda_opcheck():
    with_kernel = {name for name in _registered()
                   if torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")}
    assert with_kernel and with_kernel <= set(CUDA_CASES), sorted(with_kernel - set(CUDA_CASES))
