"""Hostile inputs in one process (issue 23): the CLIPSHARD_* environment variables of the compiled
extension (item 5): every known spelling honoured, anything else refused naming the variable. What
apply_to_transformers' report says about subclasses that override forward and about torch.compile'd
models (item 3) is tested in test_transformers_patch.py."""
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import clipshard

_PROBE = torch.ops.clipshard._addmm_accepts_fp32_accumulator


@pytest.mark.parametrize("value", ["0", "false", "False", "OFF", "no"])
def test_addmm_accumulator_variable_turns_the_accumulator_off_in_every_spelling(value, monkeypatch):
    """Item 5: CLIPSHARD_ADDMM_FP32_ACCUMULATOR=false (off, no) was ignored; only "0" worked. The
    probe's answer on the meta device (which accepts the accumulator) shows the variable's effect."""
    assert _PROBE(torch.device("meta"), torch.bfloat16) is True
    monkeypatch.setenv("CLIPSHARD_ADDMM_FP32_ACCUMULATOR", value)
    assert _PROBE(torch.device("meta"), torch.bfloat16) is False


@pytest.mark.parametrize("value", ["1", "true", "On", "yes", ""])
def test_addmm_accumulator_variable_on_or_empty_asks_torch(value, monkeypatch):
    monkeypatch.setenv("CLIPSHARD_ADDMM_FP32_ACCUMULATOR", value)
    assert _PROBE(torch.device("meta"), torch.float16) is True
    assert _PROBE(torch.device("cpu"), torch.float16) is False  # torch's CPU has no such kernel


@pytest.mark.parametrize("value", ["fasle", "2", "disabled"])
def test_addmm_accumulator_variable_refuses_unknown_values(value, monkeypatch):
    """Item 5: a value the variable does not know raises, naming the variable and its spellings."""
    monkeypatch.setenv("CLIPSHARD_ADDMM_FP32_ACCUMULATOR", value)
    with pytest.raises(ValueError, match=f"CLIPSHARD_ADDMM_FP32_ACCUMULATOR must be one of 1, true, on, yes, 0, "
                                         f"false, off, no .*got \"{value}\""):
        _PROBE(torch.device("meta"), torch.bfloat16)


def test_cpu_isa_variable_refuses_unknown_values():
    """Wider search (item 5's class): CLIPSHARD_CPU_ISA (read once per process, so in a child
    process) ignored a value it did not know, e.g. a misspelt "avx-2", and ran the widest path. It
    is read by the same helper as the variable above (spellings in any case)."""
    script = ("import torch, clipshard\n"
              "try:\n"
              "    clipshard.stochastic_round(torch.linspace(-3, 3, 101), torch.bfloat16, seed=1, offset=2)\n"
              "    print('no error')\n"
              "except ValueError as e:\n"
              "    print('ValueError', e)\n")
    env = dict(os.environ, CLIPSHARD_CPU_ISA="avx-2",
               PYTHONPATH=os.path.dirname(os.path.dirname(clipshard.__file__)))
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("ValueError") and "CLIPSHARD_CPU_ISA must be one of avx512, avx2, baseline " \
                                                   "(or unset), got \"avx-2\"" in run.stdout, run.stdout


def test_every_compiled_variable_is_read_through_the_one_parser():
    """Issue 31 item 13: CLIPSHARD_CHUNKED_FORWARD_ROWS was still read with getenv and its own error
    (a RuntimeError, case-sensitive). Every CLIPSHARD_* variable of csrc goes through env_vars.h's
    helpers (one set of spellings, one ValueError naming the variable): no other file calls getenv."""
    csrc = pathlib.Path(__file__).resolve().parents[2] / "csrc"
    sources = [p for p in csrc.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh")]
    assert len(sources) > 20
    assert [str(p.relative_to(csrc)) for p in sources if p.name != "env_vars.h" and "getenv" in p.read_text()] == []
