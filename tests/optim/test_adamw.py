"""clipshard.optim.AdamW on CPU: torch.optim.AdamW equivalence in fp32, 16-bit results against the
fp64 step, unbiasedness, the stall that stochastic rounding prevents, the fp16 second-moment
encoding, state_dict round trips, reproducibility and errors."""
import io

import pytest
import torch

import clipshard  # noqa: F401
from clipshard.optim import AdamW, second_moment_key, to_half_precision_
from tests.isa_utils import assert_same_bits_on_every_isa, run_under_each_isa
from tests.optim.stall_problem import stall_regression
from tests.references.adamw import adamw_step_reference
from tests.references.rounding import half_neighbours, round_to_nearest_reference

HALF = (torch.float16, torch.bfloat16)
HYPER = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)


def _clone_params(params):
    return [p.detach().clone().requires_grad_() for p in params]


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(p.dtype).clone()


# --- fp32: the same trajectory as torch.optim.AdamW -------------------------------------------------

@pytest.mark.parametrize("maximize", [False, True])
def test_fp32_matches_torch_adamw_with_groups_and_scheduler(maximize):
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (33, 17), (1000,), (3, 5, 11)]
    ours = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    theirs = _clone_params(ours)

    def groups(ps):
        return [{"params": ps[:2]}, {"params": ps[2:], "lr": 1e-2, "weight_decay": 0.0, "betas": (0.8, 0.99)}]

    opt = AdamW(groups(ours), lr=3e-3, weight_decay=0.1, maximize=maximize)
    ref = torch.optim.AdamW(groups(theirs), lr=3e-3, weight_decay=0.1, maximize=maximize, foreach=False)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=10, gamma=0.5)
    for _ in range(50):
        grads = [torch.randn(s, generator=gen) * 10 ** torch.randint(-3, 2, (1,), generator=gen).item()
                 for s in shapes]
        _set_grads(ours, grads)
        _set_grads(theirs, grads)
        opt.step()
        ref.step()
        sched.step()
        ref_sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-3 * 0.5 ** 5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        sa, sb = opt.state[a], ref.state[b]
        assert sa["step"].item() == sb["step"].item() == 50
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=1e-5, atol=1e-10)


def test_params_without_grad_are_skipped_and_empty_tensors_work():
    a, b, empty = (torch.randn(5, requires_grad=True), torch.randn(5, requires_grad=True),
                   torch.randn(0, requires_grad=True))
    before = b.detach().clone()
    opt = AdamW([a, b, empty], lr=0.1)
    a.grad, empty.grad = torch.randn(5), torch.randn(0)
    opt.step()
    assert torch.equal(b.detach(), before) and len(opt.state[b]) == 0
    assert opt.state[a]["step"].item() == 1 and opt.state[empty]["step"].item() == 1


def test_zero_grad_semantics_unchanged():
    p = torch.randn(4, requires_grad=True)
    opt = AdamW([p])
    p.grad = torch.randn(4)
    opt.zero_grad(set_to_none=False)
    assert torch.equal(p.grad, torch.zeros(4))
    opt.zero_grad()
    assert p.grad is None


# --- 16-bit storage: one step against the fp64 step ----------------------------------------------

def _random_inputs(n, param_dtype, state_dtype, gen):
    """Random parameter/gradient/moments covering several magnitudes (never zeros)."""
    scale = 10.0 ** torch.randint(-4, 3, (n,), generator=gen).double()
    p = (torch.randn(n, generator=gen, dtype=torch.float64) + 1.5).to(param_dtype)
    g = (torch.randn(n, generator=gen, dtype=torch.float64) * scale).to(param_dtype)
    m = (torch.randn(n, generator=gen, dtype=torch.float64) * scale * 0.5).to(state_dtype)
    v = (g.double() ** 2 * (0.5 + torch.rand(n, generator=gen, dtype=torch.float64)))
    stored_v = v.sqrt().sqrt().to(state_dtype) if state_dtype == torch.float16 else v.to(state_dtype)
    return p, g, m, stored_v


def _decode_v(stored):
    return stored.double() ** 4 if stored.dtype == torch.float16 else stored.double()


def _assert_between_neighbours(result, exact, scale, name):
    """Each 16-bit result is one of the two neighbours of the exact value, the exact value widened
    by 1e-6 * scale for the fp32 arithmetic (scale: the magnitude of the operands, which bounds the
    fp32 rounding errors even where they cancel); fp32 results equal it within that tolerance."""
    slack = 1e-6 * scale
    if result.dtype == torch.float32:
        assert ((result.double() - exact).abs() <= slack).all(), name
        return
    lo, _ = half_neighbours(exact - slack, result.dtype)
    _, hi = half_neighbours(exact + slack, result.dtype)
    ok = (result.double() >= lo.double()) & (result.double() <= hi.double())
    assert ok.all(), f"{name}: {(~ok).sum().item()} results outside the neighbours of the exact value"


@pytest.mark.parametrize("stochastic", [True, False])
@pytest.mark.parametrize("param_dtype,state_dtype", [
    (p, s) for p in (torch.float32,) + HALF for s in (torch.float32,) + HALF
    if (p, s) != (torch.float32, torch.float32)])
def test_one_step_16bit_is_a_neighbour_of_exact(param_dtype, state_dtype, stochastic):
    gen = torch.Generator().manual_seed(1)
    n = 4099
    p, g, m, v = _random_inputs(n, param_dtype, state_dtype, gen)
    p_old, g_old, m_old = p.double(), g.double(), m.double()
    exact = adamw_step_reference(p, g, m, _decode_v(v), step=7, lr=HYPER["lr"], beta1=HYPER["beta1"],
                                 beta2=HYPER["beta2"], eps=HYPER["eps"], weight_decay=HYPER["weight_decay"])
    torch.ops.clipshard.adamw_step_([p], [g], [m], [v], [7], HYPER["lr"], HYPER["beta1"], HYPER["beta2"],
                                    HYPER["eps"], HYPER["weight_decay"], False, stochastic, 1234, 5678)
    stored_exact_v = exact[2].sqrt().sqrt() if state_dtype == torch.float16 else exact[2]
    _assert_between_neighbours(p, exact[0], p_old.abs() + exact[0].abs() + (exact[0] - p_old).abs(), "param")
    _assert_between_neighbours(m, exact[1], m_old.abs() + g_old.abs(), "exp_avg")
    _assert_between_neighbours(v, stored_exact_v, stored_exact_v, "exp_avg_sq")
    if not stochastic and param_dtype in HALF:  # round to nearest: the nearest neighbour
        nearest = round_to_nearest_reference(exact[0], param_dtype)
        assert (p != nearest).float().mean() < 1e-3  # ties / fp32-vs-fp64 disagreements only


@pytest.mark.parametrize("dtype", (torch.float32,) + HALF)
def test_vector_body_and_scalar_tail_agree(dtype):
    """The CPU kernel updates 4 lanes at a time and the tail element by element: with round to
    nearest, the same inputs give the same bits wherever they sit."""
    gen = torch.Generator().manual_seed(4)
    n = 259  # 64 groups of 4 lanes and a tail of 3
    p, g, m, v = (torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e-2,
                  torch.randn(n, generator=gen) * 1e-3, torch.rand(n, generator=gen) * 1e-4)
    for t in (p, g, m, v):
        t[-3:] = t[:3]
    p, g, m, v = (t.to(dtype) for t in (p, g, m, v))
    for maximize in (False, True):
        torch.ops.clipshard.adamw_step_([p], [g], [m], [v], [5], 1e-2, 0.9, 0.99, 1e-8, 0.1, maximize,
                                        False, 0, 0)
    for t in (p, m, v):
        assert torch.equal(t[:3], t[-3:]) and not torch.equal(t[:3], t[3:6])


def _explicit_normal(n, gen):
    """About N(0, 1), made from integers (the sum of 12 uniforms minus 6, exact in fp64): the same
    values on every CPU, which torch.randn's vectorised float32 path does not promise."""
    return (torch.randint(0, 1 << 16, (n, 12), generator=gen).sum(1) - 6 * (1 << 16)).double() / (1 << 16)


def _explicit_uniform(n, gen):
    """Uniform on [0, 1) in steps of 2^-24, made from integers."""
    return torch.randint(0, 1 << 24, (n,), generator=gen).double() / (1 << 24)


def _fp32_sqrt(t):
    """The correctly rounded fp32 square root of fp32 values, computed in fp64: the fp64 root is
    within an fp64 ulp of the exact one, and the exact root of an fp32 value is never that close to
    an fp32 rounding boundary, so rounding it to fp32 is exact. (torch's fp32 CPU sqrt is not
    correctly rounded on every CPU.)"""
    return t.double().sqrt().float()


def _fp32_step_of(p, g, m, v, step, maximize):
    """The same step on fp32 copies through the fp32 kernel: the values the 16-bit kernel rounds
    (fp16 second moments decoded from q = v^(1/4) first, as the kernel does: (q * q) * (q * q),
    exact in fp64 and rounded once to fp32; both kernels then compute in fp32)."""
    p32, g32, m32 = p.float(), g.float(), m.float()
    q = v.double()
    v32 = ((q * q) * (q * q)).float() if v.dtype == torch.float16 else v.float()
    torch.ops.clipshard.adamw_step_([p32], [g32], [m32], [v32], [step], 1e-2, 0.9, 0.99, 1e-8, 0.1, maximize,
                                    False, 0, 0)
    return p32, m32, v32


# Sizes around the CPU kernel's boundaries: 16 / 8 Philox blocks per vector, 512 elements per inner
# block, 16,384 per parallel chunk; tails of 1 to 3 elements.
BOUNDARY_SIZES = (1, 3, 61, 64, 67, 511, 513, 2047, 16384 + 515)


@pytest.mark.parametrize("dtype", HALF)
def test_16bit_results_are_the_fp32_update_rounded(dtype):
    """Every element, wherever it sits (vector bodies, tails, block and chunk boundaries), gets the
    fp32 kernel's update rounded: stochastically with the words of stochastic_round for the same
    (seed, offset) for the parameter (stream 0), to nearest even for all three. Inputs are made
    from integers and the rounding references are computed in fp64 (no torch fp32 kernel), so that
    the test passes on any x86-64 CPU."""
    gen = torch.Generator().manual_seed(6)
    for n in BOUNDARY_SIZES:
        p = (_explicit_normal(n, gen) + 1.5).to(dtype)
        g = (_explicit_normal(n, gen) * 1e-2).to(dtype)
        m = (_explicit_normal(n, gen) * 1e-3).to(dtype)
        v = _explicit_uniform(n, gen) * 1e-4 + 1e-6
        v = (v.sqrt().sqrt() if dtype == torch.float16 else v).to(dtype)
        for maximize in (False, True):
            p32, m32, v32 = _fp32_step_of(p, g, m, v, 5, maximize)
            stored_v = _fp32_sqrt(_fp32_sqrt(v32)) if dtype == torch.float16 else v32
            sr_p, sr_g, sr_m, sr_v = (t.clone() for t in (p, g, m, v))
            torch.ops.clipshard.adamw_step_([sr_p], [sr_g], [sr_m], [sr_v], [5], 1e-2, 0.9, 0.99, 1e-8, 0.1,
                                            maximize, True, 77, 91)
            assert torch.equal(sr_p, torch.ops.clipshard.stochastic_round(p32, dtype, 77, 91, False)), n
            rn_p, rn_g, rn_m, rn_v = (t.clone() for t in (p, g, m, v))
            torch.ops.clipshard.adamw_step_([rn_p], [rn_g], [rn_m], [rn_v], [5], 1e-2, 0.9, 0.99, 1e-8, 0.1,
                                            maximize, False, 0, 0)
            for name, got, exact in (("param", rn_p, p32), ("exp_avg", rn_m, m32), ("exp_avg_sq", rn_v, stored_v)):
                assert torch.equal(got, round_to_nearest_reference(exact, dtype)), (name, n)
            # stochastic moments: one of the two neighbours of the fp32 value, not all the nearest
            for stored, exact in ((sr_m, m32), (sr_v, stored_v)):
                lo, hi = half_neighbours(exact.double(), dtype)
                assert ((stored.double() == lo.double()) | (stored.double() == hi.double())).all(), n


_ISA_RUN = """
import sys, torch, clipshard
gen = torch.Generator().manual_seed(8)
dtypes, out = (torch.float32, torch.float16, torch.bfloat16), []
for pd in dtypes:
    for sd in dtypes:
        for stochastic in (True, False):
            sizes = (3, 67, 513, 16384 + 515)
            ps = [(torch.randn(n, generator=gen) * 10.0 ** torch.randint(-3, 2, (n,), generator=gen)).to(pd) for n in sizes]
            gs = [(torch.randn(n, generator=gen) * 1e-2).to(pd) for n in sizes]
            ms = [(torch.randn(n, generator=gen) * 1e-3).to(sd) for n in sizes]
            vs = [(torch.rand(n, generator=gen) * 1e-2).to(sd) for n in sizes]
            torch.ops.clipshard.adamw_step_(ps, gs, ms, vs, [4] * len(sizes), 1e-2, 0.9, 0.99, 1e-8, 0.1, False,
                                            stochastic, 5, 6)
            # again as shards of larger parameters: index bases of every residue mod 4
            torch.ops.clipshard.adamw_step_(ps, gs, ms, vs, [5] * len(sizes), 1e-2, 0.9, 0.99, 1e-8, 0.1, False,
                                            stochastic, 7, 8, [7, 2, 9, 4], [1, 6, 3, 16387])
            out += ps + ms + vs
torch.save(out, sys.argv[1])
"""


def test_every_cpu_instruction_set_gives_the_same_bits(tmp_path):
    """The AVX-512, AVX2 and baseline code paths (CLIPSHARD_CPU_ISA narrows the choice; a CPU
    without AVX-512 runs its best path twice) give the same bits for every storage pair."""
    results = run_under_each_isa(_ISA_RUN, tmp_path)
    assert_same_bits_on_every_isa(results)


@pytest.mark.parametrize("dtype", HALF)
def test_stochastic_rounding_is_unbiased(dtype):
    """A sub-ulp update: the mean over 200k elements equals the exact update; both neighbours occur."""
    n = 200_003
    p = torch.full((n,), 1.0, dtype=dtype)
    g = torch.full((n,), 0.5, dtype=dtype)
    m = torch.zeros(n, dtype=dtype)
    v = torch.zeros(n, dtype=dtype)
    lr = 1e-3  # first Adam step moves by ~lr: far below half an ulp at 1.0 for both dtypes
    exact = adamw_step_reference(p, g, m, _decode_v(v), 1, lr, 0.9, 0.999, 1e-8, 0.0)
    torch.ops.clipshard.adamw_step_([p], [g], [m], [v], [1], lr, 0.9, 0.999, 1e-8, 0.0, False, True, 7, 0)
    lo, hi = half_neighbours(exact[0][:1], dtype)
    assert set(p.unique().double().tolist()) == {lo.double().item(), hi.double().item()}
    p_up = (exact[0][0] - lo.double()) / (hi.double() - lo.double())
    sd = (p_up * (1 - p_up) / n) ** 0.5 * (hi.double() - lo.double())
    assert abs(p.double().mean() - exact[0][0]) < 5 * sd
    # exp_avg = 0.05 exactly-ish; its stored mean must equal it too
    assert abs(m.double().mean() - exact[1][0]) < 5 * m.double().std() / n ** 0.5 + 1e-12


def test_streams_of_roles_and_tensors_are_independent():
    """Param, exp_avg and exp_avg_sq of one tensor, and two identical tensors, round differently."""
    n = 4096
    tensors = []
    for _ in range(2):
        p = torch.full((n,), 1.0, dtype=torch.bfloat16)
        g = torch.full((n,), 1e-3, dtype=torch.bfloat16)
        tensors.append((p, g, torch.full((n,), 1.0, dtype=torch.bfloat16), torch.full((n,), 1.0, dtype=torch.bfloat16)))
    ps, gs, ms, vs = (list(x) for x in zip(*tensors))
    torch.ops.clipshard.adamw_step_(ps, gs, ms, vs, [3, 3], 1e-3, 0.9, 0.999, 1e-8, 0.0, False, True, 11, 22)
    up_p0 = ps[0] != 1.0
    up_p1 = ps[1] != 1.0
    assert 0.01 < up_p0.float().mean() < 0.99
    assert not torch.equal(up_p0, up_p1)
    assert not torch.equal(ms[0] != ms[0].min(), vs[0] != vs[0].min())


# --- the stall that stochastic rounding prevents (the problem benchmarks/plot_optim_stall.py plots)

def test_stall_round_to_nearest_vs_stochastic_rounding():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # 1200 tiny matmuls: thread start-up would dominate on a busy machine
    try:
        fp32, _ = stall_regression(torch.float32, stochastic_rounding=True)
        sr, _ = stall_regression(torch.bfloat16, stochastic_rounding=True)
        rn, w_rn = stall_regression(torch.bfloat16, stochastic_rounding=False)
    finally:
        torch.set_num_threads(threads)
    start = fp32[0]
    # round to nearest: every update (~lr = 1e-3) is below half an ulp of bf16 at 1.0 (2^-8): no
    # weight ever moves and the loss stays where it started
    assert torch.equal(w_rn, torch.ones(64, dtype=torch.bfloat16))
    assert rn[-1] == pytest.approx(start, rel=1e-6)
    # stochastic rounding follows fp32 training down by more than 100x (to bf16's quantisation
    # floor: weights near 1 are multiples of 2^-7, worth ~4e-4 of loss here) and tracks its curve
    assert fp32[-1] < 2e-3 * start
    assert sr[-1] < 5e-3 * start
    for i in (50, 100, 200, len(sr) - 1):
        assert sr[i] < 1.5 * fp32[i] + 1e-3 * start, (i, sr[i], fp32[i])


# --- fp16 second moments --------------------------------------------------------------------------

def test_fp16_second_moment_survives_gradients_from_1e_minus_8_to_1e4():
    gen = torch.Generator().manual_seed(5)
    scales = (1e-8, 1e-6, 1e-4, 1.0, 1e2, 1e4)
    params = [torch.randn(2048, generator=gen).requires_grad_() for _ in scales]
    opt = AdamW(params, lr=1e-4, state_dtype=torch.float16, generator=torch.Generator().manual_seed(6))
    exact = [torch.zeros(2048, dtype=torch.float64) for _ in scales]
    for t in range(300):
        for p, s, v in zip(params, scales, exact):
            p.grad = s * torch.randn(2048, generator=gen)
            v.mul_(0.999).add_(0.001 * p.grad.double() ** 2)
        opt.step()
    for p, s, v in zip(params, scales, exact):
        stored = opt.state[p]["exp_avg_sq_fourth_root"]
        assert stored.dtype == torch.float16 and "exp_avg_sq" not in opt.state[p]
        decoded = _decode_v(stored)
        assert torch.isfinite(decoded).all() and (decoded > 0).all(), f"scale {s}: zeros or Inf"
        rel = (decoded.sqrt() / v.sqrt() - 1).abs()
        assert rel.median() < 0.02 and rel.max() < 0.2, f"scale {s}: sqrt(v) error {rel.median():.3g}"


# --- state_dict, reproducibility ------------------------------------------------------------------

def _model_params(gen):
    return [torch.randn(37, 5, generator=gen).to(torch.bfloat16).requires_grad_(),
            torch.randn(101, generator=gen).to(torch.float16).requires_grad_(),
            torch.randn(64, generator=gen).to(torch.bfloat16).requires_grad_(),
            torch.randn(9, generator=gen).requires_grad_()]


def _make_opt(params):
    return AdamW([{"params": params[:2]},
                  {"params": params[2:3], "state_dtype": torch.float32},
                  {"params": params[3:], "state_dtype": torch.float16, "lr": 1e-2}], lr=1e-3)


def _run(params, opt, grads_gen, steps):
    for _ in range(steps):
        _set_grads(params, [torch.randn(p.shape, generator=grads_gen) for p in params])
        opt.step()


def test_state_dict_round_trip_and_fresh_optimizer_continue_bitwise():
    params = _model_params(torch.Generator().manual_seed(7))
    opt = _make_opt(params)
    torch.manual_seed(0)
    _run(params, opt, torch.Generator().manual_seed(8), 5)
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    copies = _clone_params(params)
    fresh = _make_opt(copies)
    buffer.seek(0)
    fresh.load_state_dict(torch.load(buffer))
    for p, q in zip(params, copies):
        for key, value in opt.state[p].items():
            assert fresh.state[q][key].dtype == value.dtype, key
            assert torch.equal(fresh.state[q][key], value), key
    assert opt.state[params[2]]["exp_avg"].dtype == torch.float32
    assert second_moment_key(torch.float16) in opt.state[params[3]]
    torch.manual_seed(1)
    _run(params, opt, torch.Generator().manual_seed(9), 5)
    torch.manual_seed(1)
    _run(copies, fresh, torch.Generator().manual_seed(9), 5)
    for p, q in zip(params, copies):
        assert torch.equal(p, q)


def test_loads_a_torch_adamw_state_dict_and_continues_its_trajectory():
    gen = torch.Generator().manual_seed(10)
    theirs = [torch.randn(n, generator=gen).requires_grad_() for n in (5, 300)]
    ref = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    _run(theirs, ref, torch.Generator().manual_seed(11), 3)
    ours = _clone_params(theirs)
    opt = AdamW(ours, lr=1e-2)
    opt.load_state_dict(ref.state_dict())
    _run(theirs, ref, torch.Generator().manual_seed(12), 5)
    _run(ours, opt, torch.Generator().manual_seed(12), 5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use_generator", [False, True])
def test_reproducible_under_seed(use_generator):
    def trajectory(seed):
        params = _model_params(torch.Generator().manual_seed(7))
        gen = torch.Generator().manual_seed(seed) if use_generator else None
        opt = AdamW(params, lr=1e-3, generator=gen)
        torch.manual_seed(seed)
        _run(params, opt, torch.Generator().manual_seed(8), 3)
        return [p.detach().clone() for p in params]

    a, b, c = trajectory(0), trajectory(0), trajectory(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


# --- errors ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("kwargs,error,match", [
    (dict(amsgrad=True), NotImplementedError, "amsgrad"),
    (dict(lr=-1.0), ValueError, "lr"),
    (dict(lr=torch.tensor(1e-3)), TypeError, "tensor lr"),
    (dict(eps=-1e-8), ValueError, "eps"),
    (dict(betas=(0.9, 1.0)), ValueError, "betas"),
    (dict(betas=(-0.1, 0.9)), ValueError, "betas"),
    (dict(weight_decay=-0.1), ValueError, "weight_decay"),
    (dict(state_dtype=torch.float64), ValueError, "state_dtype"),
])
def test_bad_hyperparameters(kwargs, error, match):
    with pytest.raises(error, match=match):
        AdamW([torch.randn(3, requires_grad=True)], **kwargs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.complex64])
def test_unsupported_param_dtypes(dtype):
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        AdamW([torch.randn(3, dtype=dtype, requires_grad=True)])


def test_non_contiguous_param_and_sparse_grad_and_scheduler_tensor_lr():
    with pytest.raises(ValueError, match="contiguous"):
        AdamW([torch.nn.Parameter(torch.randn(4, 6).t())])
    p = torch.randn(5, requires_grad=True)
    opt = AdamW([p])
    p.grad = torch.randn(5).to_sparse()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
    p.grad = torch.randn(5)
    opt.param_groups[0]["lr"] = torch.tensor(0.1)
    with pytest.raises(TypeError, match="tensor lr"):
        opt.step()


def test_op_rejects_mismatched_inputs():
    p, g, m, v = (torch.randn(6) for _ in range(4))
    step = torch.ops.clipshard.adamw_step_
    args = (1e-3, 0.9, 0.999, 1e-8, 0.0, False, True, 0, 0)
    with pytest.raises(RuntimeError, match="adamw_step_: params, grads, exp_avgs, exp_avg_sqs and steps"):
        step([p], [g], [m], [v], [1, 1], *args)
    with pytest.raises(RuntimeError, match=r"adamw_step_: grads\[0\] must have dtype Float, got Half"):
        step([p], [g.half()], [m], [v], [1], *args)
    with pytest.raises(RuntimeError, match=r"adamw_step_: exp_avg_sqs\[0\] must have the shape"):
        step([p], [g], [m], [torch.randn(7)], [1], *args)
    with pytest.raises(RuntimeError, match=r"adamw_step_: exp_avgs\[0\] must be contiguous"):
        step([p.view(2, 3)], [g.view(2, 3)], [m.view(3, 2).t()], [v.view(2, 3)], [1], *args)
    with pytest.raises(RuntimeError, match=r"adamw_step_: steps\[0\] must be >= 1"):
        step([p], [g], [m], [v], [0], *args)
    with pytest.raises(RuntimeError, match="adamw_step_: params must be float32, float16 or bfloat16, got Double"):
        step([p.double()], [g.double()], [m], [v], [1], *args)


# --- to_half_precision_ ---------------------------------------------------------------------------

def _small_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(33, 65), torch.nn.BatchNorm1d(65), torch.nn.Linear(65, 7))


@pytest.mark.parametrize("dtype", HALF)
def test_to_half_precision_rounds_each_value_to_a_neighbour(dtype):
    model = _small_model(0)
    before = {n: t.detach().clone() for n, t in model.state_dict().items()}
    params = list(model.parameters())
    assert to_half_precision_(model, dtype, buffers=True, generator=torch.Generator().manual_seed(1)) is model
    assert all(a is b for a, b in zip(params, model.parameters()))
    for name, t in model.state_dict().items():
        if not before[name].is_floating_point():
            assert t.dtype == before[name].dtype  # num_batches_tracked stays an integer
            continue
        assert t.dtype == dtype, name
        lo, hi = half_neighbours(before[name].double(), dtype)
        assert ((t.double() == lo.double()) | (t.double() == hi.double())).all(), name
    both = torch.cat([t.double().flatten() != before[n].double().to(dtype).double().flatten()
                      for n, t in model.named_parameters()])
    assert 0.01 < both.float().mean() < 0.99  # stochastic: not all rounded to nearest
    opt = AdamW(model.parameters(), lr=1e-3)
    loss = model(torch.randn(8, 33).to(dtype)).float().square().mean()
    loss.backward()
    opt.step()
    assert all(p.dtype == dtype for p in model.parameters())


def test_to_half_precision_is_reproducible_and_checks_its_arguments():
    a = to_half_precision_(_small_model(0), generator=torch.Generator().manual_seed(2))
    b = to_half_precision_(_small_model(0), generator=torch.Generator().manual_seed(2))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert next(a.buffers()).dtype == torch.float32  # buffers only when asked
    with pytest.raises(ValueError, match="to_half_precision_: dtype must be"):
        to_half_precision_(_small_model(0), torch.float32)
    with pytest.raises(TypeError, match="to_half_precision_: parameter '0.weight' is torch.float64"):
        to_half_precision_(_small_model(0).double())
