"""The first-use check of the compiled CUDA kernels (clipshard/ops/first_use.py, docs/first_use.md).

On the CPU the check is switched on for CPU tensors (CHECKED_DEVICE_TYPES) and a probe's compiled
function is replaced by a wrong one, so that every hook (each op wrapper, stochastic rounding, the
AdamW step) is seen to warn once, to fall back for that (kernel, device, dtypes) only, to check
each key once, to stay off under CLIPSHARD_FIRST_USE_CHECK=0, and to work under torch.compile, fake
tensors, inference_mode and autograd. The real probes must agree on the CPU kernels (no false
alarm). The tests marked cuda run the real probes on every visible GPU and the hooks there."""
import contextlib
import dataclasses
import os
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
from clipshard.ops import first_use, first_use_probes, launch_variants
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


def break_probe(monkeypatch, name, wrong_for=None, raises=None, when=None):
    """PROBES[name]'s compiled function, recorded, returning zeros (or raising `raises`) for the
    dtypes `wrong_for` (None: every dtype) and when `when(variant as a dict, *inputs)` holds (None:
    always): a stand-in kernel broken in one variant. Returns the recorder."""
    probe = first_use.PROBES[name]

    def compiled(algorithm, dtypes, variant, *inputs):
        recorder.contexts.append((torch.is_grad_enabled(), _get_current_dispatch_mode(),
                                  any(is_fake(t) or t.requires_grad for t in inputs)))
        recorder.variants.append(dict(variant))
        outputs = probe.compiled(algorithm, dtypes, variant, *inputs)
        if (wrong_for is not None and dtypes != wrong_for) or (when is not None and not when(dict(variant), *inputs)):
            return outputs
        if raises is not None:
            raise raises
        return [torch.zeros_like(o) for o in outputs]

    recorder = Calls(compiled)
    recorder.contexts = []  # (grad mode, dispatch mode, any fake or grad-requiring input) per call
    recorder.variants = []  # the variant of each call, as a dict
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


def lse_variant(ids=False, positives=True, col_lse=True, forward_rows=32):
    return (("forward_rows", forward_rows), ("ids", ids), ("positives", positives), ("col_lse", col_lse))


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
    for part in ("compiled CUDA kernel contrastive_lse (algorithm 'fused'; forward_rows=32, ids=False, positives=True, "
                 "col_lse=True)", "first-use check on cpu for float32",
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
    assert first_use._verdicts == {("contrastive_lse", "fused", CPU, (torch.float32,), lse_variant()): False,
                                   ("contrastive_lse", "fused", CPU, (torch.bfloat16,), lse_variant()): True}


def test_each_key_is_checked_once_and_a_passing_kernel_keeps_running(checked, monkeypatch):
    probe = break_probe(monkeypatch, "siglip_sum", wrong_for=())  # never wrong: only recorded
    torch_path = spy(monkeypatch, siglip_module, "siglip_sum_torch")
    rows, cols = features(9, 8, seed=3), features(20, 8, seed=4)
    with no_warnings():
        for _ in range(3):
            clipshard.siglip_sum(rows, cols, 10.0, -1.0)
            clipshard.siglip_loss(rows, cols[:9], 10.0, -1.0)
    assert len(probe.calls) == 1 and not torch_path.calls
    inputs = probe.calls[0][3:]
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
    with pytest.warns(UserWarning, match=r"siglip_sum \(algorithm 'chunked'; ids=None, rows_per_cta=None, "
                                         r"positives=True, with_grad=False\) failed its first-use check on cpu for "
                                         r"float32: it raised RuntimeError: CUDA error: no kernel image is "
                                         r"available\."):
        clipshard.siglip_sum(features(9, 8), features(20, 8), 10.0)
    assert len(torch_path.calls) == 1


def test_out_of_memory_in_the_check_is_raised_not_a_verdict(checked, monkeypatch):
    break_probe(monkeypatch, "siglip_sum", raises=torch.OutOfMemoryError("out of memory"))
    with pytest.raises(torch.OutOfMemoryError):
        clipshard.siglip_sum(features(9, 8), features(20, 8), 10.0)
    assert not first_use._verdicts


# --- every kernel variant: keyed, checked on its first use ---------------------------------------

def ignoring_ids(monkeypatch, name, ids_at):
    """PROBES[name]'s compiled function replaced by a stand-in kernel that ignores the sample ids (the
    inputs from position `ids_at` on), as a kernel wrong only with ids would. Returns a recorder."""
    probe = first_use.PROBES[name]

    def compiled(algorithm, dtypes, variant, *inputs):
        recorder.variants.append(dict(variant))
        if not dict(variant)["ids"]:
            return probe.compiled(algorithm, dtypes, variant, *inputs)
        without = tuple((key, False if key == "ids" else value) for key, value in variant)
        return probe.compiled(algorithm, dtypes, without, *inputs[:ids_at])

    recorder = Calls(compiled)
    recorder.variants = []
    monkeypatch.setitem(first_use.PROBES, name, dataclasses.replace(probe, compiled=recorder))
    return recorder


def _ids(n, seed, groups=4):
    return torch.randint(0, groups, (n,), generator=torch.Generator().manual_seed(seed))


def test_a_contrastive_kernel_wrong_only_with_ids_falls_back_for_calls_with_ids(checked, monkeypatch):
    probe = ignoring_ids(monkeypatch, "contrastive_lse", ids_at=7)
    torch_path = spy(monkeypatch, lse_module, "contrastive_lse_torch")
    rows, cols = features(9, 8, seed=40), features(20, 8, seed=41)
    col_ids = _ids(20, 1)
    row_ids = col_ids[:9].clone()
    with no_warnings():  # without ids, and "multi" (the kernel without ids and same-id sums): compiled
        clipshard.contrastive_lse(rows, cols, 10.0)
        clipshard.contrastive_lse(rows, cols, 10.0, row_ids=row_ids, col_ids=col_ids, targets="multi")
    assert not torch_path.calls
    with pytest.warns(UserWarning, match=r"contrastive_lse \(algorithm 'fused'; forward_rows=32, ids=True, "
                                         r"positives=True, col_lse=True\) failed its first-use check on cpu"):
        got = clipshard.contrastive_lse(rows, cols, 10.0, row_ids=row_ids, col_ids=col_ids, targets="mask")
    want = clipshard.contrastive_lse(rows, cols, 10.0, row_ids=row_ids, col_ids=col_ids, targets="mask",
                                     algorithm="torch")
    assert len(torch_path.calls) == 2 and all(torch.equal(g, w) for g, w in zip(got, want))
    assert [v["ids"] for v in probe.variants] == [False, True]
    assert first_use._verdicts == {("contrastive_lse", "fused", CPU, (torch.float32,), lse_variant()): True,
                                   ("contrastive_lse", "fused", CPU, (torch.float32,), lse_variant(ids=True)): False}


def test_the_ring_backward_with_ids_is_checked_with_ids(checked, monkeypatch):
    ignoring_ids(monkeypatch, "contrastive_lse", ids_at=7)
    torch_path = spy(monkeypatch, lse_module, "contrastive_lse_backward_torch")
    rows, cols = features(9, 8, seed=42), features(20, 8, seed=43)
    col_ids = _ids(20, 2)
    scale, bias = torch.tensor(10.0), torch.tensor(0.5)
    row_lse, _, col_lse = clipshard.contrastive_lse(rows, cols, scale, bias, algorithm="torch", row_ids=col_ids[:9],
                                                    col_ids=col_ids, targets="mask")
    g = torch.full((9,), 0.05)
    with pytest.warns(UserWarning, match="ids=True"):
        contrastive_lse_backward(g, g, None, rows, cols, scale, bias, 0, row_lse, None, row_ids=col_ids[:9],
                                 col_ids=col_ids)
    assert len(torch_path.calls) == 1
    assert list(first_use._verdicts) == [("contrastive_lse", "fused", CPU, (torch.float32,),
                                          lse_variant(ids=True, col_lse=False))]


def test_hard_negatives_no_positives_and_one_direction_are_their_own_variants(checked, monkeypatch):
    """A stand-in wrong only without positives (pos_offset -1): the extra columns' block of a call with
    hard negatives and a call with pos_offset None fall back; the plain call and one without column
    LSEs keep the kernel."""
    probe = break_probe(monkeypatch, "contrastive_lse", when=lambda v, *inputs: not v["positives"])
    torch_path = spy(monkeypatch, lse_module, "contrastive_lse_torch")
    rows, cols, extra = features(9, 8, seed=44), features(20, 8, seed=45), features(5, 8, seed=46)
    with no_warnings():
        clipshard.contrastive_lse(rows, cols, 10.0)
        clipshard.contrastive_lse(rows, cols, 10.0, want_col_lse=False)
    assert not torch_path.calls
    with pytest.warns(UserWarning, match=r"positives=False, col_lse=False\) failed"):
        got = clipshard.contrastive_lse(rows, cols, 10.0, extra_cols=extra)
    want = clipshard.contrastive_lse(rows, cols, 10.0, extra_cols=extra, algorithm="torch")
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    with pytest.warns(UserWarning, match=r"positives=False, col_lse=True\) failed"):
        clipshard.contrastive_lse(rows, cols, 10.0, pos_offset=None)
    assert [(v["positives"], v["col_lse"]) for v in probe.variants] == [(True, True), (True, False), (False, False),
                                                                        (False, True)]
    assert sorted(first_use._verdicts.values()) == [False, False, True, True]


def _forward_rows_of_the_launch(v, rows, *inputs):
    """What the launch rule picks for the probe's rows, while the probe runs."""
    return launch_variants.chunked_forward_rows(rows.shape[0]) == 16


def test_the_chunked_forward_rows_per_cta_is_keyed_and_reached(checked, monkeypatch):
    """A stand-in wrong in the 16-row forward variant (as the launch rule picks it for the probe):
    the default (32) passes; with CLIPSHARD_CHUNKED_FORWARD_ROWS=16 the call's variant is checked
    and falls back; and each variant's probe reaches its variant whatever the variable says."""
    probe = break_probe(monkeypatch, "contrastive_lse", when=_forward_rows_of_the_launch)
    rows, cols = features(9, 8, seed=47), features(20, 8, seed=48)
    with no_warnings():
        clipshard.contrastive_lse(rows, cols, 10.0)
    monkeypatch.setenv(launch_variants.FORWARD_ROWS_VARIABLE, "16")
    with pytest.warns(UserWarning, match=r"forward_rows=16, ids=False"):
        clipshard.contrastive_lse(rows, cols, 10.0)
    assert first_use._verdicts == {("contrastive_lse", "fused", CPU, (torch.float32,), lse_variant()): True,
                                   ("contrastive_lse", "fused", CPU, (torch.float32,), lse_variant(forward_rows=16)):
                                       False}
    # the 32-row variant (what M > 65535 x 16 runs under "16") is reached with the variable at 16
    with no_warnings():
        assert first_use._check("contrastive_lse", "fused", CPU, (torch.bfloat16,), lse_variant(forward_rows=32))
    monkeypatch.delenv(launch_variants.FORWARD_ROWS_VARIABLE)
    with pytest.warns(UserWarning, match="forward_rows=16"):
        assert not first_use._check("contrastive_lse", "fused", CPU, (torch.bfloat16,), lse_variant(forward_rows=16))
    assert launch_variants.FORWARD_ROWS_VARIABLE not in os.environ  # restored
    assert len(probe.calls) == 4


def _eight_rows_per_cta(v, rows, cols, scale, bias, *ids):
    """The launch rule gives 8 rows per CTA for the probe's rows on the device (2 SMs here)."""
    multiprocessors = launch_variants.multiprocessors(rows.device)
    return bool(ids) and launch_variants.siglip_ids_rows(rows.shape[0], multiprocessors) == 8


@pytest.fixture
def two_sms(monkeypatch):
    """The CPU as a GPU of 2 SMs for SigLIP's rule: 8 rows per CTA from M = 57 on, 1 up to M = 14."""
    monkeypatch.setattr(launch_variants, "multiprocessors", lambda device: 2)


def test_siglip_rows_per_cta_are_keyed_and_each_probe_reaches_its_variant(checked, monkeypatch, two_sms):
    probe = break_probe(monkeypatch, "siglip_sum", when=_eight_rows_per_cta)
    torch_path = spy(monkeypatch, siglip_module, "siglip_sum_torch")
    small, large, cols = features(9, 8, seed=50), features(67, 8, seed=51), features(120, 8, seed=52)
    col_ids = _ids(120, 3, groups=30)
    with no_warnings():  # 9 rows: one row per CTA; 67 rows without ids: the kernel without ids
        clipshard.siglip_sum(small, cols, 10.0, row_ids=col_ids[:9], col_ids=col_ids)
        clipshard.siglip_sum(large, cols, 10.0)
    assert not torch_path.calls
    with pytest.warns(UserWarning, match=r"siglip_sum \(algorithm 'chunked'; ids=multi, rows_per_cta=8, "
                                         r"positives=True, with_grad=False\) failed"):
        clipshard.siglip_sum(large, cols, 10.0, row_ids=col_ids[:67], col_ids=col_ids)
    assert len(torch_path.calls) == 1
    probe_rows = [(v["rows_per_cta"], call[3].shape[0]) for v, call in zip(probe.variants, probe.calls)]
    assert probe_rows == [(1, 14), (None, 67), (8, 67)]  # the probe's M: the nearest to 67 with that variant
    for rows_per_cta in (2, 4):  # the other variants: probes of 15 .. 28 and 29 .. 56 rows, passing
        variant = (("ids", "mask"), ("rows_per_cta", rows_per_cta), ("positives", False), ("with_grad", True))
        with no_warnings():
            assert first_use._check("siglip_sum", "chunked", CPU, (torch.float32,), variant)
    assert [call[3].shape[0] for call in probe.calls[3:]] == [28, 56]


def test_siglip_targets_and_with_grad_are_their_own_variants(checked, monkeypatch):
    """A stand-in that ignores mask_same_ids ("mask" run as "multi"), and one wrong only without
    gradients (siglip_chunk_kernel<DL, false>)."""
    probe = first_use.PROBES["siglip_sum"]

    def mask_as_multi(algorithm, dtypes, variant, *inputs):
        as_multi = tuple((k, "multi" if k == "ids" and value == "mask" else value) for k, value in variant)
        return probe.compiled(algorithm, dtypes, as_multi, *inputs)

    monkeypatch.setitem(first_use.PROBES, "siglip_sum", dataclasses.replace(probe, compiled=mask_as_multi))
    rows, cols = features(9, 8, seed=53).requires_grad_(), features(20, 8, seed=54)
    col_ids = _ids(20, 4)
    with no_warnings():
        clipshard.siglip_sum(rows, cols, 10.0, row_ids=col_ids[:9], col_ids=col_ids, targets="multi")
    with pytest.warns(UserWarning, match=r"ids=mask, rows_per_cta=None, positives=True, with_grad=True\) failed"):
        loss = clipshard.siglip_sum(rows, cols, 10.0, row_ids=col_ids[:9], col_ids=col_ids, targets="mask")
    want = clipshard.siglip_sum(rows, cols, 10.0, row_ids=col_ids[:9], col_ids=col_ids, targets="mask",
                                algorithm="torch")
    assert torch.equal(loss, want)

    monkeypatch.setitem(first_use.PROBES, "siglip_sum", probe)
    break_probe(monkeypatch, "siglip_sum", when=lambda v, *inputs: not v["with_grad"])
    with no_warnings():
        clipshard.siglip_sum(rows, cols, 10.0)
    with torch.no_grad(), pytest.warns(UserWarning, match=r"with_grad=False\) failed"):
        clipshard.siglip_sum(rows, cols, 10.0)


def _one_teacher_launch(v, rows, cols, teacher_rows, *rest):
    """distill_forward_kernel<1> runs for the probe's teachers (the launch rule)."""
    return 1 in launch_variants.distill_launch_teachers(teacher_rows.shape[0])


def test_distillation_with_one_or_three_teachers_checks_the_one_teacher_kernel(checked, monkeypatch):
    probe = break_probe(monkeypatch, "distill_lse", when=_one_teacher_launch)
    torch_path = spy(monkeypatch, distill_module, "distill_lse_torch")
    rows, cols = features(9, 8, seed=55), features(20, 8, seed=56)

    def teachers(n, seed):
        g = torch.Generator().manual_seed(seed)
        return [torch.randn(n, m, 5, generator=g) for m in (9, 20)] + [torch.linspace(9.0, 12.0, n)]

    with no_warnings():
        t_rows, t_cols, t_scale = teachers(2, 57)
        distill_lse(rows, cols, t_rows, t_cols, 10.0, t_scale)
    for n, launches in ((1, r"\(1,\)"), (3, r"\(2, 1\)")):
        t_rows, t_cols, t_scale = teachers(n, 57 + n)
        with pytest.warns(UserWarning, match=rf"teachers_per_launch={launches}, want_columns=True, "
                                             rf"teacher_grad=False\) failed"):
            distill_lse(rows, cols, t_rows, t_cols, 10.0, t_scale)
    assert [call[5].shape[0] for call in probe.calls] == [2, 1, 3]  # the probes' teachers
    assert len(torch_path.calls) == 2


def test_under_torch_compile_every_rows_variant_is_checked_while_tracing(checked, monkeypatch, two_sms):
    """A compiled graph may serve other batch sizes (dynamic shapes): tracing checks every rows-per-CTA
    variant of the call (on 2 SMs: 1, 2, 4, 8 for SigLIP with ids), without a graph break."""
    probe = break_probe(monkeypatch, "siglip_sum", wrong_for=())
    compiled = torch.compile(lambda r, c, ids: clipshard.siglip_sum(r, c, 10.0, row_ids=ids[:r.shape[0]], col_ids=ids,
                                                                    targets="mask"),
                             backend="aot_eager", dynamic=True, fullgraph=True)
    cols, col_ids = features(60, 8, seed=60), _ids(60, 5, groups=10)
    with no_warnings():
        for m in (9, 40):
            rows = features(m, 8, seed=61 + m)
            want = clipshard.siglip_sum(rows, cols, 10.0, row_ids=col_ids[:m], col_ids=col_ids, targets="mask",
                                        algorithm="torch")
            torch.testing.assert_close(compiled(rows, cols, col_ids), want, rtol=1e-5, atol=1e-5)
    assert sorted(v["rows_per_cta"] for v in probe.variants) == [1, 2, 4, 8]


# --- a kernel that kills the device -----------------------------------------------------------------

ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


def test_a_kernel_that_kills_the_device_raises_its_error_naming_the_check_not_a_fallback(checked, monkeypatch):
    """The kernel raises, and the synchronisation after it fails as on a lost CUDA context: the
    kernel's own error is raised with a note naming what was checked; no fallback, no verdict."""
    break_probe(monkeypatch, "contrastive_lse", raises=RuntimeError(ILLEGAL_ADDRESS))
    synchronise = Calls(lambda device: (_ for _ in ()).throw(RuntimeError(ILLEGAL_ADDRESS + " (again)")))
    monkeypatch.setattr(first_use, "_synchronise", synchronise)
    torch_path = spy(monkeypatch, lse_module, "contrastive_lse_torch")
    with no_warnings(), pytest.raises(RuntimeError, match=ILLEGAL_ADDRESS) as raised:
        clipshard.contrastive_lse(features(9, 8), features(20, 8), 10.0)
    note = " ".join(getattr(raised.value, "__notes__", []))
    for part in ("the compiled CUDA kernel contrastive_lse (algorithm 'fused'; forward_rows=32, ids=False",
                 "during its first-use check on cpu for float32", "the device no longer works",
                 "(again)", "no fallback can run in this process", "`python -m clipshard`"):
        assert part in note, (part, note)
    assert str(raised.value) == ILLEGAL_ADDRESS  # the kernel's own error
    assert synchronise.calls == [(CPU,)] and not torch_path.calls and not first_use._verdicts


def test_a_kernel_that_raises_on_a_working_device_falls_back_after_synchronising(checked, monkeypatch):
    break_probe(monkeypatch, "contrastive_lse", raises=RuntimeError("CUDA error: no kernel image is available"))
    synchronise = spy(monkeypatch, first_use, "_synchronise")
    with pytest.warns(UserWarning, match="it raised RuntimeError: CUDA error: no kernel image"):
        clipshard.contrastive_lse(features(9, 8), features(20, 8), 10.0)
    assert synchronise.calls == [(CPU,)] and list(first_use._verdicts.values()) == [False]


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
    with pytest.warns(UserWarning, match=rf"{probe} \(algorithm '{algorithm}'; .*\) failed its first-use check on cpu "
                                         rf"for {names}"):
        call()
    assert torch_path.calls and {key[:4] for key in first_use._verdicts} == {(probe, algorithm, CPU, dtypes)}
    assert not any(first_use._verdicts.values())


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
    assert first_use._verdicts == {("stochastic_round", None, CPU, (torch.bfloat16,), ()): False}
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
    with pytest.warns(UserWarning, match="with_grad=True"):  # its own variant, checked: the fallback, with autograd
        loss = clipshard.siglip_sum(*leaves, 10.0)
    loss.backward()
    torch.testing.assert_close(loss, value, rtol=0, atol=0)
    assert all(t.grad is not None for t in leaves) and probe.contexts == [(False, None, False)] * 2
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


# The path of a plain call (rows, ids, positives, col_lse / with_grad; teachers, columns, teacher_grad)
_PLAIN_PATHS = {"contrastive_lse": (67, False, True, True), "siglip_sum": (67, None, True, True),
                "distill_lse": (2, True, True)}


def _variant_cases(device, every_dtype):
    """(probe, algorithm, dtypes, variant): every variant of the device in the first dtype of each
    family (or in every dtype), the plain call's variant in the others."""
    cases = []
    for probe, algorithm, dtypes in _cases(device):
        family = first_use.PROBES[probe]
        first = dtypes == (torch.float32,) * len(dtypes)
        variants = (family.every_variant(device) if every_dtype or first or probe not in _PLAIN_PATHS
                    else family.variants(device, _PLAIN_PATHS[probe]))
        cases += [(probe, algorithm, dtypes, variant) for variant in variants]
    return cases


def _case_id(case):
    probe, algorithm, dtypes, variant = case
    names = "/".join(str(d).removeprefix("torch.") for d in dtypes)
    return f"{probe}-{algorithm}-{names}-{first_use_probes.describe(variant)}"


@pytest.mark.parametrize("case", _variant_cases(CPU, every_dtype=False), ids=_case_id)
def test_the_real_probes_agree_on_the_cpu_kernels(case):
    probe, algorithm, dtypes, variant = case
    error, tolerance = first_use._measure(first_use.PROBES[probe], algorithm, dtypes, CPU, variant)
    assert error <= tolerance


def test_the_real_siglip_probes_reach_and_pass_every_rows_per_cta(monkeypatch):
    """The CPU taken as a GPU of 8 SMs: the probes of 1, 2, 4 and 8 rows per CTA take 62, 67, 125
    and 249 rows (the last with more columns than 300 for its positives, in wider chunks)."""
    monkeypatch.setattr(launch_variants, "multiprocessors", lambda device: 8)
    probe = first_use.PROBES["siglip_sum"]
    variants = [v for v in probe.every_variant(CPU) if dict(v)["ids"] == "mask" and dict(v)["with_grad"]
                and dict(v)["positives"]]
    sizes = [first_use_probes._siglip_size(dict(v), CPU) for v in variants]
    assert [(dict(v)["rows_per_cta"], m) for v, (m, _, _) in zip(variants, sizes)] == [(1, 62), (2, 67), (4, 125),
                                                                                         (8, 249)]
    assert sizes[-1][1] == 310 and sizes[-1][2] > first_use_probes.WORKSPACE
    for variant in variants:
        error, tolerance = first_use._measure(probe, "chunked", (torch.bfloat16,), CPU, variant)
        assert error <= tolerance, first_use_probes.describe(variant)


# --- on a GPU ------------------------------------------------------------------------------------

def _cuda_devices():
    return [torch.device("cuda", i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []


@pytest.mark.cuda
def test_every_probe_passes_on_every_gpu(monkeypatch):
    """What a user's first calls run: each probe through _check, no warning; prints each one's time."""
    monkeypatch.delenv(first_use.ENV_VAR, raising=False)
    for device in _cuda_devices():
        for probe, algorithm, dtypes, variant in _variant_cases(device, every_dtype=True):
            first_use._measure(first_use.PROBES[probe], algorithm, dtypes, device, variant)  # cuBLAS, JIT warm-up
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            with no_warnings():
                assert first_use._check(probe, algorithm, device, dtypes, variant)
            milliseconds, names = 1e3 * (time.perf_counter() - start), "/".join(map(str, dtypes))
            print(f"\nfirst-use check {milliseconds:.2f} ms: {probe} {algorithm} {device} {names} "
                  f"[{first_use_probes.describe(variant)}]")


@pytest.mark.cuda
def test_on_a_gpu_a_wrong_kernel_falls_back_and_the_warning_names_the_gpu(monkeypatch):
    monkeypatch.delenv(first_use.ENV_VAR, raising=False)
    monkeypatch.setattr(first_use, "_verdicts", {})
    break_probe(monkeypatch, "contrastive_lse", wrong_for=(torch.bfloat16,))
    rows, cols = features(67, 40, torch.bfloat16).cuda(), features(300, 40, torch.bfloat16, seed=1).cuda()
    major, minor = torch.cuda.get_device_capability(0)
    with pytest.warns(UserWarning, match=rf"contrastive_lse \(algorithm 'chunked'; [^)]*\) failed its first-use check "
                                         rf"on cuda:0 \(.*, sm_{major}{minor}\) for bfloat16"):
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
