"""The first-use check of the compiled CUDA kernels (clipshard/ops/first_use.py, docs/first_use.md).

On the CPU the check is switched on for CPU tensors (CHECKED_DEVICE_TYPES) and a probe's compiled
function is replaced by a wrong one, so that every hook (each op wrapper, stochastic rounding, the
AdamW step) is seen to warn once, to fall back for that (kernel, device, dtypes) only, to check
each key once, to stay off under CLIPSHARD_FIRST_USE_CHECK=0, and to work under torch.compile, fake
tensors, inference_mode and autograd. The real probes must agree on the CPU kernels (no false
alarm). The tests marked cuda run the real probes on every visible GPU and the hooks there."""
import contextlib
import dataclasses
import pathlib
import re
import time
import warnings

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.utils._python_dispatch import _get_current_dispatch_mode

import clipshard
from clipshard.ops import contrastive_lse as lse_module
from clipshard.ops import distill_lse as distill_module
from clipshard.ops import first_use
from clipshard.ops import siglip_sum as siglip_module
from clipshard.ops.contrastive_lse import contrastive_lse_backward
from clipshard.ops.distill_lse import distill_lse, distill_lse_backward
from clipshard.ops.siglip_sum import siglip_block
from clipshard.optim import AdamW

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")


@pytest.fixture
def checked(monkeypatch):
    """The check on for CPU tensors, with no verdicts yet."""
    monkeypatch.delenv(first_use.ENV_VAR, raising=False)
    monkeypatch.setattr(first_use, "CHECKED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(first_use, "_verdicts", {})


class Calls:
    """Wraps a function and records the calls' arguments."""

    def __init__(self, fn):
        self.fn, self.calls = fn, []

    def __call__(self, *args, **kwargs):
        self.calls.append(args)
        return self.fn(*args, **kwargs)


def break_probe(monkeypatch, name, wrong_for=None, raises=None):
    """PROBES[name]'s compiled function, recorded, returning zeros (or raising `raises`) for the
    dtypes `wrong_for` (None: every dtype). Returns the recorder."""
    probe = first_use.PROBES[name]

    def compiled(algorithm, dtypes, *inputs):
        recorder.contexts.append((torch.is_grad_enabled(), _get_current_dispatch_mode(),
                                  any(is_fake(t) or t.requires_grad for t in inputs)))
        outputs = probe.compiled(algorithm, dtypes, *inputs)
        if wrong_for is not None and dtypes != wrong_for:
            return outputs
        if raises is not None:
            raise raises
        return [torch.zeros_like(o) for o in outputs]

    recorder = Calls(compiled)
    recorder.contexts = []  # (grad mode, dispatch mode, any fake or grad-requiring input) per call
    monkeypatch.setitem(first_use.PROBES, name, dataclasses.replace(probe, compiled=recorder))
    return recorder


def spy(monkeypatch, module, name):
    recorder = Calls(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    return recorder


def spy_fallback(monkeypatch, name):
    probe, op, fallback = first_use.KERNELS[name]
    recorder = Calls(fallback)
    monkeypatch.setitem(first_use.KERNELS, name, (probe, op, recorder))
    return recorder


def features(n, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.nn.functional.normalize(torch.randn(n, d, dtype=torch.float64, generator=g), dim=1).to(dtype)


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# --- the warning, once per key, the fallback for that key only -------------------------------------

def test_a_wrong_kernel_warns_once_and_its_key_falls_back_to_the_torch_path(checked, monkeypatch):
    probe = break_probe(monkeypatch, "contrastive_lse", wrong_for=(torch.float32,))
    torch_path = spy(monkeypatch, lse_module, "contrastive_lse_torch")
    rows, cols = features(9, 8, seed=1), features(20, 8, seed=2)
    with pytest.warns(UserWarning) as record:
        got = clipshard.contrastive_lse(rows, cols, 10.0)
    message = str(record[0].message)
    assert len(record) == 1
    for part in ("compiled CUDA kernel contrastive_lse (algorithm 'fused')", "first-use check on cpu for float32",
                 "error 1 against the torch path in fp64", "uses the torch path", "`python -m clipshard`",
                 "CLIPSHARD_FIRST_USE_CHECK=0 turns this check off"):
        assert part in message, (part, message)
    assert len(torch_path.calls) == 1 and len(probe.calls) == 1
    for g, w in zip(got, torch_path.fn(rows, cols, torch.tensor(10.0), None, 0, True, 32 << 20)):
        assert torch.equal(g, w)
    with no_warnings():  # the same key again: no second warning, no second check, the fallback
        clipshard.contrastive_lse(rows, cols, 10.0)
        clipshard.clip_loss(rows, cols[:9], 10.0)
    assert len(torch_path.calls) == 3 and len(probe.calls) == 1
    with no_warnings():  # another dtype: checked once (it agrees), and the compiled kernel runs
        clipshard.contrastive_lse(rows.bfloat16(), cols.bfloat16(), 10.0)
        clipshard.contrastive_lse(rows.bfloat16(), cols.bfloat16(), 10.0)
    assert len(torch_path.calls) == 3 and len(probe.calls) == 2
    assert first_use._verdicts == {("contrastive_lse", "fused", CPU, (torch.float32,)): False,
                                   ("contrastive_lse", "fused", CPU, (torch.bfloat16,)): True}


def test_each_key_is_checked_once_and_a_passing_kernel_keeps_running(checked, monkeypatch):
    probe = break_probe(monkeypatch, "siglip_sum", wrong_for=())  # never wrong: only recorded
    torch_path = spy(monkeypatch, siglip_module, "siglip_sum_torch")
    rows, cols = features(9, 8, seed=3), features(20, 8, seed=4)
    with no_warnings():
        for _ in range(3):
            clipshard.siglip_sum(rows, cols, 10.0, -1.0)
            clipshard.siglip_loss(rows, cols[:9], 10.0, -1.0)
    assert len(probe.calls) == 1 and not torch_path.calls
    inputs = probe.calls[0][2:]
    assert all(t.device == CPU and not t.requires_grad for t in inputs)


def test_an_explicit_algorithm_runs_unchecked(checked, monkeypatch):
    probe = break_probe(monkeypatch, "contrastive_lse")
    rows, cols = features(9, 8, seed=5), features(20, 8, seed=6)
    with no_warnings():
        clipshard.contrastive_lse(rows, cols, 10.0, algorithm="chunked")
        clipshard.contrastive_lse(rows, cols, 10.0, algorithm="torch")
    assert not probe.calls and not first_use._verdicts


def test_a_kernel_that_raises_fails_its_check(checked, monkeypatch):
    break_probe(monkeypatch, "siglip_sum", raises=RuntimeError("CUDA error: no kernel image is available\nmore"))
    torch_path = spy(monkeypatch, siglip_module, "siglip_sum_torch")
    with pytest.warns(UserWarning, match=r"siglip_sum \(algorithm 'chunked'\) failed its first-use check on cpu for "
                                         r"float32: it raised RuntimeError: CUDA error: no kernel image is "
                                         r"available\."):
        clipshard.siglip_sum(features(9, 8), features(20, 8), 10.0)
    assert len(torch_path.calls) == 1


def test_out_of_memory_in_the_check_is_raised_not_a_verdict(checked, monkeypatch):
    break_probe(monkeypatch, "siglip_sum", raises=torch.OutOfMemoryError("out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        clipshard.siglip_sum(features(9, 8), features(20, 8), 10.0)
    assert not first_use._verdicts


# --- every entry point --------------------------------------------------------------------------

def _lse_backward_call():
    rows, cols = features(9, 8, seed=7), features(20, 8, seed=8)
    scale, bias = torch.tensor(10.0), torch.tensor(0.5)
    row_lse, _, col_lse = clipshard.contrastive_lse(rows, cols, scale, bias, algorithm="torch")
    g = torch.full((9,), 0.05)
    contrastive_lse_backward(g, g, torch.full((20,), 0.05), rows, cols, scale, bias, 0, row_lse, col_lse)


def _siglip_block_call():
    siglip_block(features(9, 8), features(20, 8), torch.tensor(10.0), torch.tensor(-1.0), None, True)


def _distill_inputs():
    g = torch.Generator().manual_seed(9)
    teachers = [torch.randn(2, n, 5, generator=g).bfloat16() for n in (9, 20)]
    return features(9, 8, seed=10), features(20, 8, seed=11), *teachers, torch.tensor(10.0), torch.tensor([9.0, 12.0])


def _distill_backward_call():
    rows, cols, t_rows, t_cols, scale, t_scale = _distill_inputs()
    outs = distill_lse(rows, cols, t_rows, t_cols, scale, t_scale, algorithm="torch")
    grads = [torch.full_like(o, 0.05) for o in outs]
    distill_lse_backward(grads, rows, cols, t_rows, t_cols, scale, t_scale, 0, outs[:1] + outs[2:], True)


LOSS_HOOKS = [  # (probe, algorithm, dtypes, call, module, torch-path function the wrapper falls back to)
    ("contrastive_lse", "fused", (torch.float32,), _lse_backward_call, lse_module, "contrastive_lse_backward_torch"),
    ("siglip_sum", "chunked", (torch.float32,), _siglip_block_call, siglip_module, "siglip_block_torch"),
    ("distill_lse", "compiled", (torch.float32, torch.bfloat16), lambda: distill_lse(*_distill_inputs()),
     distill_module, "distill_lse_torch"),
    ("distill_lse", "compiled", (torch.float32, torch.bfloat16), _distill_backward_call, distill_module,
     "distill_lse_backward_torch"),
]


@pytest.mark.parametrize("probe,algorithm,dtypes,call,module,name", LOSS_HOOKS,
                         ids=["contrastive_lse_backward", "siglip_block", "distill_lse", "distill_lse_backward"])
def test_every_loss_entry_point_falls_back(checked, monkeypatch, probe, algorithm, dtypes, call, module, name):
    break_probe(monkeypatch, probe)
    torch_path = spy(monkeypatch, module, name)
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    with pytest.warns(UserWarning, match=rf"{probe} \(algorithm '{algorithm}'\) failed its first-use check on cpu for "
                                         rf"{names}"):
        call()
    assert torch_path.calls and first_use._verdicts == {(probe, algorithm, CPU, dtypes): False}


def _round(dtype):
    return lambda x: clipshard.stochastic_round(x, dtype, seed=3, offset=4)


def _round_into(dtype):
    return lambda x: clipshard.stochastic_round_(torch.empty(x.shape, dtype=dtype), x, seed=3, offset=4)


def _round_with_grad(dtype):
    return lambda x: clipshard.stochastic_round_(torch.empty(x.shape, dtype=dtype), x.requires_grad_(), seed=3,
                                                 offset=4)


@pytest.mark.parametrize("make,kernel", [(_round, "stochastic_round"), (_round_into, "stochastic_round_into"),
                                         (_round_with_grad, "stochastic_round")],
                         ids=["stochastic_round", "stochastic_round_", "stochastic_round_ with grad"])
def test_stochastic_rounding_falls_back_to_the_cpu_kernel_on_host_copies(checked, monkeypatch, make, kernel):
    probe = break_probe(monkeypatch, "stochastic_round", wrong_for=(torch.bfloat16,))
    fallback = spy_fallback(monkeypatch, kernel)
    x = torch.randn(5, 7) * 3
    want = torch.ops.clipshard.stochastic_round(x, torch.bfloat16, 3, 4, False)
    with pytest.warns(UserWarning, match=r"stochastic_round failed its first-use check on cpu for bfloat16: \d+ of its "
                                         r"stored values differ"):
        make(torch.bfloat16)(x.clone())
    assert first_use._verdicts == {("stochastic_round", None, CPU, (torch.bfloat16,)): False}
    with no_warnings():
        got = make(torch.bfloat16)(x.clone())
        make(torch.float16)(x.clone())  # another dtype: checked, agrees, the kernel runs
    assert torch.equal(got.view(torch.int16), want.view(torch.int16)) and len(fallback.calls) == 2
    assert len(probe.calls) == 2


def test_the_adamw_step_falls_back_per_dtype_pair(checked, monkeypatch):
    probe = break_probe(monkeypatch, "adamw_step_", wrong_for=(torch.bfloat16, torch.bfloat16))
    fallback = spy_fallback(monkeypatch, "adamw_step_")
    params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (3, 40)]
    other = [torch.nn.Parameter(torch.randn(6))]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, t in zip(params, twins):
        p.grad = t.grad = torch.randn(p.shape).bfloat16()
    other[0].grad = torch.randn(6)
    optimizer = AdamW([{"params": params}, {"params": other}], lr=1e-2, generator=torch.Generator().manual_seed(1))
    twin = AdamW([{"params": twins}], lr=1e-2, generator=torch.Generator().manual_seed(1))
    with pytest.warns(UserWarning, match=r"adamw_step_ failed its first-use check on cpu for bfloat16, bfloat16: "
                                         r"\d+ of its stored values differ from the CPU kernel's\. This process uses "
                                         r"the CPU kernel on host copies"):
        optimizer.step()
    with no_warnings():
        twin.step()  # the same key: the fallback again, unchecked
    assert len(fallback.calls) == 2 and len(probe.calls) == 2  # bf16/bf16 (wrong) and fp32/fp32 (agrees)
    for p, t in zip(params, twins):  # the fallback's bits are the kernel's
        assert torch.equal(p.view(torch.int16), t.view(torch.int16))


def test_every_compiled_cuda_operator_has_a_probe():
    """COVERED (probe -> operators) names every operator with a CUDA kernel in csrc, and only those."""
    registered = set()
    for path in (ROOT / "csrc" / "cuda").glob("*.cu"):
        for block in re.findall(r"TORCH_LIBRARY_IMPL\(clipshard, CUDA, m\)\s*\{(.*?)\n?\}", path.read_text(), re.S):
            registered.update(re.findall(r'm\.impl\("(\w+)"', block))
    covered = {op for ops in first_use.COVERED.values() for op in ops}
    assert registered and covered == registered
    assert set(first_use.COVERED) == set(first_use.PROBES)
    assert {probe for probe, _, _ in first_use.KERNELS.values()} <= set(first_use.PROBES)


# --- the switch ---------------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["0", "off", "FALSE", "no"])
def test_the_environment_variable_turns_the_check_off(checked, monkeypatch, value):
    monkeypatch.setenv(first_use.ENV_VAR, value)
    probe = break_probe(monkeypatch, "contrastive_lse")
    torch_path = spy(monkeypatch, lse_module, "contrastive_lse_torch")
    with no_warnings():
        clipshard.contrastive_lse(features(9, 8), features(20, 8), 10.0)
    assert not probe.calls and not torch_path.calls and not first_use._verdicts


def test_a_bad_value_of_the_variable_names_it(checked, monkeypatch):
    monkeypatch.setenv(first_use.ENV_VAR, "sometimes")
    with pytest.raises(ValueError, match=r"clipshard: the environment variable CLIPSHARD_FIRST_USE_CHECK must be one "
                                         r"of 1, true, on, yes, 0, false, off, no \(or unset\), got 'sometimes'"):
        clipshard.contrastive_lse(features(9, 8), features(20, 8), 10.0)


def test_the_self_check_report_knows_the_variable():
    from clipshard.ops.env_vars import VARIABLES
    assert "first-use check" in VARIABLES[first_use.ENV_VAR].meaning


def test_no_check_on_devices_that_are_not_listed(monkeypatch):
    """CPU kernels are not checked (the default CHECKED_DEVICE_TYPES), nor the meta device."""
    monkeypatch.delenv(first_use.ENV_VAR, raising=False)
    monkeypatch.setattr(first_use, "_verdicts", {})
    probe = break_probe(monkeypatch, "contrastive_lse")
    assert first_use.CHECKED_DEVICE_TYPES == ("cuda",)
    with no_warnings():
        clipshard.contrastive_lse(features(9, 8), features(20, 8), 10.0)
        clipshard.stochastic_round(torch.randn(4), torch.bfloat16)
    assert not probe.calls and not first_use._verdicts


def test_no_check_while_a_cuda_graph_is_captured_or_no_gpu_can_run_it(checked, monkeypatch):
    probe = break_probe(monkeypatch, "contrastive_lse")
    monkeypatch.setattr(first_use, "_can_run_now", lambda device: False)
    with no_warnings():
        clipshard.contrastive_lse(features(9, 8), features(20, 8), 10.0)
    assert not probe.calls and not first_use._verdicts  # tried again on the next call outside a capture
    monkeypatch.setattr(first_use, "_can_run_now", lambda device: True)
    with pytest.warns(UserWarning, match="first-use check"):
        clipshard.contrastive_lse(features(9, 8), features(20, 8), 10.0)


def test_no_gpu_to_run_the_check_means_no_verdict(monkeypatch):
    """Fake CUDA tensors traced on a machine without a GPU: nothing can run, so nothing is decided."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not first_use._can_run_now(torch.device("cuda", 0)) and first_use._can_run_now(CPU)


# --- the caller's context -----------------------------------------------------------------------

def test_under_torch_compile_the_check_runs_at_trace_time_without_a_graph_break(checked, monkeypatch):
    probe = break_probe(monkeypatch, "contrastive_lse", wrong_for=(torch.float32,))
    rows, cols = features(9, 8, seed=12).requires_grad_(), features(9, 8, seed=13)
    compiled = torch.compile(lambda r, c: clipshard.clip_loss(r, c, 10.0), backend="aot_eager",
                             fullgraph=True)  # fullgraph: a graph break would raise
    with pytest.warns(UserWarning, match="first-use check"):
        got = compiled(rows, cols)
    got.backward()
    grad, rows.grad = rows.grad, None
    want = clipshard.clip_loss(rows, cols, 10.0, algorithm="torch")  # the graph holds the fallback
    want.backward()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad, rows.grad, rtol=1e-5, atol=1e-7)
    assert probe.contexts == [(False, None, False)]  # eager, real tensors, no grad, outside the trace
    with no_warnings():
        compiled(rows, cols)
    assert len(probe.calls) == 1


def test_under_torch_compile_a_passing_kernel_is_in_the_graph(checked, monkeypatch):
    probe = break_probe(monkeypatch, "siglip_sum", wrong_for=())
    torch_path = spy(monkeypatch, siglip_module, "siglip_sum_torch")
    rows, cols = features(9, 8, seed=14), features(9, 8, seed=15)
    compiled = torch.compile(lambda r, c: clipshard.siglip_loss(r, c, 10.0, -1.0), backend="aot_eager",
                             fullgraph=True)
    with no_warnings():
        got = compiled(rows, cols)
    torch.testing.assert_close(got, clipshard.siglip_loss(rows, cols, 10.0, -1.0), rtol=1e-6, atol=1e-7)
    assert len(probe.calls) == 1 and not torch_path.calls


def test_under_torch_compile_the_rounding_fallback_is_traced(checked, monkeypatch):
    break_probe(monkeypatch, "stochastic_round")
    x = torch.randn(33) * 5
    compiled = torch.compile(lambda x: clipshard.stochastic_round(x, torch.bfloat16, seed=5, offset=6),
                             backend="aot_eager", fullgraph=True)
    with pytest.warns(UserWarning, match="first-use check"):
        got = compiled(x)
    want = torch.ops.clipshard.stochastic_round(x, torch.bfloat16, 5, 6, False)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_under_fake_tensors_the_check_runs_on_real_ones(checked, monkeypatch):
    probe = break_probe(monkeypatch, "contrastive_lse")
    with FakeTensorMode():
        rows, cols = torch.empty(9, 8), torch.empty(20, 8)
        with pytest.warns(UserWarning, match="first-use check"):
            row_lse, _, col_lse = clipshard.contrastive_lse(rows, cols, 10.0)
        assert is_fake(row_lse) and row_lse.shape == (9,) and col_lse.shape == (20,)
    assert probe.contexts == [(False, None, False)]


def test_under_inference_mode_and_autograd_the_callers_graph_is_untouched(checked, monkeypatch):
    probe = break_probe(monkeypatch, "siglip_sum", wrong_for=(torch.bfloat16,))
    rows, cols = features(9, 8, torch.bfloat16, seed=16), features(20, 8, torch.bfloat16, seed=17)
    with torch.inference_mode():
        with pytest.warns(UserWarning, match="first-use check"):
            value = clipshard.siglip_sum(rows, cols, 10.0)
    torch.testing.assert_close(value, clipshard.siglip_sum(rows, cols, 10.0, algorithm="torch"), rtol=0, atol=0)
    leaves = [t.clone().requires_grad_() for t in (rows, cols)]
    loss = clipshard.siglip_sum(*leaves, 10.0)  # the fallback now, with autograd
    loss.backward()
    torch.testing.assert_close(loss, value, rtol=0, atol=0)
    assert all(t.grad is not None for t in leaves) and probe.contexts == [(False, None, False)]
    probe.contexts.clear()
    leaves = [t.float().requires_grad_() for t in (rows, cols)]
    loss = clipshard.siglip_sum(*leaves, 10.0)  # fp32: checked now, in the middle of building a graph
    loss.backward()
    assert probe.contexts == [(False, None, False)] and all(t.grad is not None for t in leaves)


# --- the real probes: no false alarm -------------------------------------------------------------

def _cases(device):
    """(probe, algorithm, dtypes) for every kernel family and dtype combination the device's kernels take."""
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    lse_algorithms = ("chunked",) if device.type == "cuda" else ("fused", "chunked")
    return ([("contrastive_lse", a, (d,)) for a in lse_algorithms for d in dtypes]
            + [("siglip_sum", "chunked", (d,)) for d in dtypes]
            + [("distill_lse", "compiled", (s, t)) for s in dtypes for t in dtypes]
            + [("stochastic_round", None, (d,)) for d in (torch.float16, torch.bfloat16)]
            + [("adamw_step_", None, (p, s)) for p in dtypes for s in dtypes])


@pytest.mark.parametrize("probe,algorithm,dtypes", _cases(CPU))
def test_the_real_probes_agree_on_the_cpu_kernels(probe, algorithm, dtypes):
    error, tolerance = first_use._measure(first_use.PROBES[probe], algorithm, dtypes, CPU)
    assert error <= tolerance


# --- on a GPU ------------------------------------------------------------------------------------

def _cuda_devices():
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


@pytest.mark.cuda
def test_every_probe_passes_on_every_gpu(monkeypatch):
    """What a user's first calls run: each probe through _check, no warning; prints each one's time."""
    monkeypatch.delenv(first_use.ENV_VAR, raising=False)
    for device in _cuda_devices():
        for probe, algorithm, dtypes in _cases(device):
            first_use._measure(first_use.PROBES[probe], algorithm, dtypes, device)  # cuBLAS and JIT warm-up
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            with no_warnings():
                assert first_use._check(probe, algorithm, device, dtypes)
            milliseconds, names = 1e3 * (time.perf_counter() - start), "/".join(map(str, dtypes))
            print(f"\nfirst-use check {milliseconds:.2f} ms: {probe} {algorithm} {device} {names}")


@pytest.mark.cuda
def test_on_a_gpu_a_wrong_kernel_falls_back_and_the_warning_names_the_gpu(monkeypatch):
    monkeypatch.delenv(first_use.ENV_VAR, raising=False)
    monkeypatch.setattr(first_use, "_verdicts", {})
    break_probe(monkeypatch, "contrastive_lse", wrong_for=(torch.bfloat16,))
    rows, cols = features(67, 40, torch.bfloat16).cuda(), features(300, 40, torch.bfloat16, seed=1).cuda()
    major, minor = torch.cuda.get_device_capability(0)
    with pytest.warns(UserWarning, match=rf"contrastive_lse \(algorithm 'chunked'\) failed its first-use check on "
                                         rf"cuda:0 \(.*, sm_{major}{minor}\) for bfloat16"):
        got = clipshard.contrastive_lse(rows, cols, 10.0)
    for g, w in zip(got, clipshard.contrastive_lse(rows, cols, 10.0, algorithm="torch")):
        assert torch.equal(g, w)


@pytest.mark.cuda
def test_on_a_gpu_no_host_synchronisation_after_the_first_call(monkeypatch):
    """The calls after the first synchronise exactly as often as with the check off."""
    monkeypatch.delenv(first_use.ENV_VAR, raising=False)
    monkeypatch.setattr(first_use, "_verdicts", {})
    rows, cols = features(67, 40).cuda(), features(300, 40, seed=1).cuda()
    scale, x = torch.tensor(10.0, device="cuda"), torch.randn(1000, device="cuda")
    param = torch.nn.Parameter(torch.randn(100, device="cuda").bfloat16())
    param.grad = torch.randn(100, device="cuda").bfloat16()
    optimizer = AdamW([param])

    def calls():
        clipshard.contrastive_lse(rows, cols, scale)
        clipshard.siglip_sum(rows, cols, scale)
        clipshard.stochastic_round(x, torch.bfloat16)
        optimizer.step()

    def synchronisations():
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as record:
                warnings.simplefilter("always")
                calls()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return sum("synchroniz" in str(w.message) for w in record)

    calls()  # the first calls: the checks
    assert len(first_use._verdicts) == 4 and all(first_use._verdicts.values())
    checked = synchronisations()
    monkeypatch.setenv(first_use.ENV_VAR, "0")
    assert checked == synchronisations()
