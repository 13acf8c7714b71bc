"""`python -m clipshard` (clipshard/diagnostics): the report and the kernel checks run and pass on
this machine, --json gives the same results, and a kernel whose results are broken (its CPU kernel
replaced through torch.library in a child process: no hook ships in the package) makes the command
exit non-zero and name it. The known answers of the bit-exact checks are those of the fp64 / numpy
references; a CLIPSHARD_* value clipshard refuses is named as such (exit 2), not blamed on a kernel;
checking nothing is not a pass."""
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import clipshard
from clipshard.diagnostics import bit_checks, self_check
from clipshard.diagnostics.environment import has_cuda_kernels
from clipshard.diagnostics.kernel_checks import CHECKS
from clipshard.diagnostics.self_check import FALLBACK, exit_status, format_results, main
from tests.references.adamw import adamw_step_fp32_reference, philox_words_at
from tests.references.stochastic_round import philox_stream_reference, stochastic_round_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args=(), script=None, env=None):
    command = [sys.executable] + (["-c", script] if script else ["-m", "clipshard"]) + list(args)
    environ = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=environ, cwd=ROOT)
    return done, time.perf_counter() - start


def test_command_reports_checks_and_exits_zero():
    done, seconds = _run(env={"CLIPSHARD_ALGORITHM": "", "CLIPSHARD_SELF_CHECK_PROBE": "x"})
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert f"clipshard {clipshard.__version__}, torch {torch.__version__}" in out
    assert "extension: " + ("CUDA" if has_cuda_kernels() else "CPU only") in out
    assert f"built with torch {torch.__version__}, CUDA " in out  # the library's own record, beside the running torch
    if not torch.cuda.is_available():
        assert "no GPU is visible" in out
    assert "cpu contrastive_lse float32: fused" in out and "cpu siglip_sum float32: chunked" in out
    assert "CLIPSHARD_SELF_CHECK_PROBE=x: not a variable clipshard reads" in out
    for check in CHECKS:
        assert f"\n{check.name} " in out, check.name
    assert "FAILED" not in out and FALLBACK not in out
    # The time is reported, not asserted: on the shared 2-core machine it follows the load
    # (22 s at a load average of 100, 120 s at 500; docs/self_check.md).
    assert re.search(r"\n(\d+) of \1 checks passed in [0-9.]+ s\n", out), out[-500:]
    print(f"python -m clipshard: {seconds:.1f} s")


WITHOUT_NUMPY = textwrap.dedent("""
    import sys
    sys.modules["numpy"] = None  # any `import numpy` raises ImportError from here on
    import warnings
    warnings.simplefilter("ignore")  # torch warns that it runs without numpy
    from clipshard.diagnostics.self_check import main
    sys.exit(main())
""")


def test_the_command_needs_no_numpy():
    """The package does not declare numpy: the self-check must run and pass without it."""
    done, _ = _run(script=WITHOUT_NUMPY)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"\n(\d+) of \1 checks passed in", done.stdout)


def test_self_check_returns_results_and_json_matches(capsys):
    report = self_check(devices=[torch.device("cpu")])
    assert report["passed"] and report["seconds"] > 0
    assert {r["check"] for r in report["results"]} == {c.name for c in CHECKS}
    cases = {(r["check"], r["case"]) for r in report["results"]}
    for algorithm in ("fused", "chunked"):  # the CPU's compiled algorithms, each dtype, both passes
        assert ("contrastive_lse", f"{algorithm} bfloat16 backward") in cases
    assert ("siglip_sum", "chunked float32 no positives") in cases
    assert sum(check == "adamw_step_" for check, _ in cases) == 9  # every storage pair
    for r in report["results"]:
        assert 0 <= r["error"] <= r["tolerance"], r
    assert main(["--json"]) == 0
    parsed = json.loads(capsys.readouterr().out)
    assert parsed["passed"] and [(r["check"], r["case"]) for r in parsed["results"]][:len(cases)] == \
        [(r["check"], r["case"]) for r in report["results"]]


BREAK_KERNELS = textwrap.dedent("""
    import sys, warnings
    import torch
    import clipshard
    from clipshard.ops.portable_lse import contrastive_lse_torch
    warnings.simplefilter("ignore")  # torch warns that a registered kernel is overridden
    library = torch.library.Library("clipshard", "IMPL")

    def round_to_nearest(src, dtype, seed, offset, saturate):  # not stochastic: the bits differ
        return src.to(dtype)

    def shifted_forward(rows, cols, scale, bias, pos_offset, row_ids, col_ids, want_col_lse, algorithm,
                        workspace_bytes):  # the schema's arguments; pos_offset -1: no positives
        row_lse, pos_logit, col_lse = contrastive_lse_torch(rows, cols, scale, bias, None if pos_offset == -1 else
                                                            pos_offset, want_col_lse, workspace_bytes, row_ids,
                                                            col_ids)
        return row_lse + 1e-3, pos_logit, col_lse  # a small error in one output

    library.impl("stochastic_round", round_to_nearest, "CPU")
    library.impl("contrastive_lse_forward", shifted_forward, "CPU")
    from clipshard.diagnostics.self_check import main
    sys.exit(main())
""")


def test_a_broken_kernel_fails_the_command_and_is_named():
    done, _ = _run(script=BREAK_KERNELS)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    failed_line = next(line for line in out.splitlines() if line.startswith("FAILED: "))
    for case in ("stochastic_round float16 bits vs neighbours, known answer on cpu",
                 "stochastic_round bfloat16 bits vs neighbours, known answer on cpu",
                 "contrastive_lse fused float32 forward on cpu", "contrastive_lse chunked bfloat16 forward on cpu"):
        assert case in failed_line, failed_line
    assert "adamw_step_" not in failed_line and "siglip_sum" not in failed_line  # the others still pass
    assert FALLBACK in out and "CLIPSHARD_ALGORITHM=torch" in FALLBACK


def test_a_raising_kernel_is_a_failed_row_not_a_crash():
    from clipshard.diagnostics.kernel_checks import Check
    from clipshard.diagnostics.self_check import run_checks

    def explode(device):
        raise RuntimeError("kernel launch failed")
        yield  # a generator, like the real checks

    rows = run_checks([torch.device("cpu")], (Check("exploding", explode),))
    assert [(r["check"], r["passed"]) for r in rows] == [("exploding", False)]
    assert "RuntimeError: kernel launch failed" in rows[0]["note"]


# --- the known answers of the bit-exact checks, from the tests' references ------------------------

def _canonical_nans(x, stored):
    nan = torch.tensor(bit_checks._CANONICAL_NAN_BITS[stored.dtype], dtype=torch.int32).to(torch.int16)
    return torch.where(torch.isnan(x), nan.view(stored.dtype), stored)


def _stochastic_round_reference(x, dtype):
    words = philox_stream_reference(bit_checks._SR_SEED, bit_checks._SR_OFFSET, x.numel())
    return _canonical_nans(x, stochastic_round_reference(x, words, dtype))


def _store(values, dtype, number, role, index_base):
    """fp32 numpy values as the kernels store them: canonical NaNs, 16-bit by stochastic rounding."""
    x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if dtype == torch.float32:
        return torch.where(torch.isnan(x), float("nan"), x)  # torch's NaN is the canonical NaN
    words = philox_words_at(bit_checks._ADAMW_SEED, bit_checks._ADAMW_OFFSET, 3 * number + role,
                                      index_base + np.arange(x.numel()))
    return _canonical_nans(x, stochastic_round_reference(x, words, dtype))


def _adamw_reference(tensors, state_dtype):
    """The stored tensors after one step: the numpy float32 update in the kernels' order, then the rounding rule."""
    out = []
    for (p, g, m, v), number, base in zip(tensors, bit_checks._ADAMW_NUMBERS, bit_checks._ADAMW_INDEX_BASES):
        v32 = v.float().numpy()
        if state_dtype == torch.float16:
            v32 = (v32 * v32) * (v32 * v32)  # decode v^(1/4) in the kernels' order
        p1, m1, v1 = adamw_step_fp32_reference(p.float().numpy(), g.float().numpy(), m.float().numpy(),
                                                         v32, bit_checks._ADAMW_STEP, **bit_checks._ADAMW)
        if state_dtype == torch.float16:
            v1 = np.sqrt(np.sqrt(v1))
        out.append([_store(p1, p.dtype, number, 0, base), g, _store(m1, m.dtype, number, 1, base),
                    _store(v1, v.dtype, number, 2, base)])
    return out


def test_known_answers_are_the_references_bits_and_the_cpu_kernels():
    """The self-check's CRC-32s are those of the numpy references (independent of the C++), which
    the CPU kernels match bit for bit: no value differs."""
    x = bit_checks.rounding_input()
    for dtype in (torch.float16, torch.bfloat16):
        want = _stochastic_round_reference(x, dtype)
        assert bit_checks._digest([want]) == bit_checks._SR_KNOWN[dtype], dtype
        got = bit_checks._stochastic_round(x, dtype, torch.device("cpu"))
        assert torch.equal(bit_checks._bits(got), bit_checks._bits(want)), dtype
        assert bit_checks._rounding_violations(x, want, dtype) == 0
    for param_dtype in bit_checks._STORAGE:
        for state_dtype in bit_checks._STORAGE:
            tensors = bit_checks.adamw_state(param_dtype, state_dtype)
            want = _adamw_reference(tensors, state_dtype)
            assert bit_checks._digest([t for group in want for t in group]) == \
                bit_checks._ADAMW_KNOWN[(param_dtype, state_dtype)], (param_dtype, state_dtype)
            got = bit_checks.adamw_step(tensors, torch.device("cpu"))
            for a, b in zip((t for g in got for t in g), (t for g in want for t in g)):
                assert torch.equal(bit_checks._bits(a), bit_checks._bits(b)), (param_dtype, state_dtype)
            assert bit_checks._update_violations(tensors, want) == 0  # the reference keeps the invariants


def test_the_invariants_catch_a_wrong_update_and_a_value_off_its_neighbours():
    """Without the known answers: an AdamW step that forgets the weight decay breaks the fp64
    bounds; a rounding result one 16-bit step beyond its neighbours is counted, a NaN other than the
    canonical one too, and a zero whose sign flipped."""
    tensors = bit_checks.adamw_state(torch.float32, torch.float32)
    decayed = [[t.clone() for t in group] for group in tensors]
    for group in decayed:
        group[0].mul_(1 / (1 - bit_checks._ADAMW["lr"] * bit_checks._ADAMW["weight_decay"]))
    assert bit_checks._update_violations(tensors, bit_checks.adamw_step(decayed, torch.device("cpu"))) > 200
    x = bit_checks.rounding_input()
    for dtype in (torch.float16, torch.bfloat16):
        good = bit_checks._stochastic_round(x, dtype, torch.device("cpu"))
        finite = torch.isfinite(good) & (good != 0)
        beyond = torch.where(finite, bit_checks._step16(bit_checks._step16(good, up=True), up=True), good)
        assert bit_checks._rounding_violations(x, beyond, dtype) == int(finite.sum()), dtype
        other_nan = torch.where(torch.isnan(x), torch.tensor(0x7E01 if dtype == torch.float16 else 0x7FC1,
                                                             dtype=torch.int32).to(torch.int16).view(dtype), good)
        assert bit_checks._rounding_violations(x, other_nan, dtype) == int(torch.isnan(x).sum()), dtype
        zero = good == 0
        assert 2 <= int(zero.sum())  # +0 and -0 at least
        assert bit_checks._rounding_violations(x, torch.where(zero, -good, good), dtype) == int(zero.sum()), dtype


BREAK_ADAMW = textwrap.dedent("""
    import sys, warnings
    import torch
    warnings.simplefilter("ignore")  # torch warns that a registered kernel is overridden
    import clipshard
    library = torch.library.Library("clipshard", "IMPL")

    def round_to_nearest(params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps, weight_decay, maximize,
                         stochastic_rounding, seed, offset, numbers, index_bases):  # the update, stored to nearest
        for p, g, m, v, t in zip(params, grads, exp_avgs, exp_avg_sqs, steps):
            fp16_v = v.dtype == torch.float16
            g32, m32, v32 = g.float(), m.float(), v.float() ** 4 if fp16_v else v.float()
            m1 = m32 + (1 - beta1) * (g32 - m32)
            v1 = v32 * beta2 + (1 - beta2) * g32 * g32
            p.copy_(p.float() * (1 - lr * weight_decay)
                    - lr / (1 - beta1 ** t) * m1 / (v1.sqrt() / (1 - beta2 ** t) ** 0.5 + eps))
            m.copy_(m1)
            v.copy_(v1.sqrt().sqrt() if fp16_v else v1)

    library.impl("adamw_step_", round_to_nearest, "CPU")
    from clipshard.diagnostics.self_check import main
    sys.exit(main())
""")


def test_an_adamw_kernel_that_rounds_to_nearest_fails_on_its_known_answers():
    done, _ = _run(script=BREAK_ADAMW)
    out = done.stdout
    assert done.returncode == 1, out + done.stderr
    failed_line = next(line for line in out.splitlines() if line.startswith("FAILED: "))
    for pair in ("float16/float16", "bfloat16/bfloat16", "float32/bfloat16", "bfloat16/float32"):
        assert f"adamw_step_ {pair} bits vs fp64 update, known answer on cpu" in failed_line, failed_line
    assert "the bits differ from the known answer" in out
    assert "contrastive_lse" not in failed_line and "stochastic_round" not in failed_line


# --- refused variables and checking nothing -----------------------------------------------------

@pytest.mark.parametrize("variable,value,accepted,blocked", [
    ("CLIPSHARD_ALGORITHM", "bogus", "it must be one of auto, torch (or unset)", None),  # read in Python
    ("CLIPSHARD_ADDMM_FP32_ACCUMULATOR", "maybe", "it must be one of 1, true, on, yes, 0, false, off, no (or unset)",
     "contrastive_lse chunked addmm on cpu"),  # read by the extension (csrc/env_vars.h)
])
def test_a_refused_variable_is_named_with_its_value_not_blamed_on_a_kernel(monkeypatch, capsys, variable, value,
                                                                         accepted, blocked):
    monkeypatch.setenv(variable, value)
    assert main([]) == 2
    out = capsys.readouterr().out
    assert f"PROBLEM: the environment variable {variable} is set to {value!r}, which clipshard does not accept: " \
           f"{accepted}\n" in out, out[-2000:]
    assert FALLBACK not in out and "FAILED: " not in out
    assert (f"Could not run: {blocked}" in out) if blocked else "Could not run" not in out
    assert "Unset the variable or give it an accepted value" in out


def test_checking_nothing_is_not_a_pass(monkeypatch):
    for devices, error, match in (([torch.device("meta")], ValueError, "no kernel check runs on meta devices"),
                                  ([], ValueError, "devices is empty"),
                                  ("cpu", TypeError, "devices must be a list of torch.device"),
                                  ([torch.device("cuda", torch.cuda.device_count())], ValueError,
                                   "CUDA devices are visible")):
        with pytest.raises(error, match=match):
            self_check(devices=devices)
    module = importlib.import_module("clipshard.diagnostics.self_check")  # (the package exports the function)
    monkeypatch.setattr(module, "run_checks", lambda devices: [])  # every check yields nothing
    report = self_check(devices=[torch.device("cpu")])
    assert not report["passed"] and report["problems"] == ["no kernel check ran"]
    assert exit_status(report) == 2
    assert "PROBLEM: no kernel check ran" in format_results(report)


def test_a_build_without_a_devices_bit_exact_kernels_has_nothing_to_check_there(monkeypatch):
    """A CPU-only (or ROCm) build on a GPU machine: stochastic rounding and AdamW have no kernel for
    the GPU, which is not a kernel that failed its check (it used to be a failed row, and the
    advice to report a kernel disagreeing)."""
    monkeypatch.setattr(bit_checks, "has_compiled_kernel", lambda operator, device_type: device_type == "cpu")
    gpu = torch.device("cuda", 0)
    assert list(bit_checks.check_stochastic_round(gpu)) == [] and list(bit_checks.check_adamw(gpu)) == []
    assert len(list(bit_checks.check_stochastic_round(torch.device("cpu")))) == 2


def test_the_kernel_variants_check_names_each_failing_variant(monkeypatch):
    """A SigLIP kernel that runs targets "mask" as "multi" fails only the "mask" variants (with and
    without positives and gradients), one named row each; the other families still pass."""
    from clipshard.diagnostics.variant_checks import check_every_variant
    from clipshard.ops import first_use_probes

    probe = first_use_probes.PROBES["siglip_sum"]

    def mask_as_multi(algorithm, dtypes, variant, *inputs):
        as_multi = tuple((k, "multi" if k == "ids" and value == "mask" else value) for k, value in variant)
        return probe.compiled(algorithm, dtypes, as_multi, *inputs)

    monkeypatch.setitem(first_use_probes.PROBES, "siglip_sum", dataclasses.replace(probe, compiled=mask_as_multi))
    rows = list(check_every_variant(torch.device("cpu")))
    failed = sorted(m.case for m in rows if not m.passed)
    assert len(failed) == 4 and all(case.startswith("siglip_sum chunked float32 [ids=mask") for case in failed)
    assert {m.case.split(":")[0] for m in rows if m.passed} == {
        "contrastive_lse fused float32", "distill_lse compiled float32/float32"}
