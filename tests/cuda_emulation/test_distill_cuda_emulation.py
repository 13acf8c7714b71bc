"""The distillation op's CUDA kernels (csrc/cuda/distill_lse_kernels.cuh), run on the CPU.

tests/cuda_emulation/emulate_distill.cpp compiles the kernels as host C++ through emulate_cuda.h
(one fiber per CUDA thread, barriers for __syncthreads, host warp shuffles), drives them chunk
by chunk as csrc/cuda/distill_lse.cu does, and compares the forward's seven statistics and the
backward's dS and dT^k with a double-precision reference of the op's formulas: fp32, bf16 and fp16
dlogits, T = 1 and 2, scales up to 100, realistic upstream gradients (0.5 / 65536), and a negative
control (fp16 without the gradient pre-scale must fail). A second test builds the harness against
a deliberately broken copy of the kernels and checks that it fails. Hardware-only behaviour
(memory ordering, speed) needs the @pytest.mark.cuda tests of test_distill_lse.py on a GPU."""
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tests" / "cuda_emulation" / "emulate_distill.cpp"
KERNELS = ROOT / "csrc" / "cuda" / "distill_lse_kernels.cuh"


def _build_and_run(tmp_path, *args, first_include=None):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (set CXX)")
    exe = tmp_path / "emulate_distill"
    includes = ([f"-I{first_include}"] if first_include else []) + [
        f"-I{ROOT / 'csrc' / 'cuda'}", f"-I{ROOT / 'csrc' / 'include'}",
        f"-I{pathlib.Path(torch.__file__).parent / 'include'}"]
    build = subprocess.run([compiler, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", *includes,
                            str(HARNESS), "-o", str(exe)], capture_output=True, text=True)
    assert build.returncode == 0, f"emulation build failed:\n{build.stderr[-4000:]}"
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=900)


def test_distill_kernels_match_double_reference_in_host_emulation(tmp_path):
    run = _build_and_run(tmp_path)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    for dtype, cases in (("fp32", 4), ("bf16", 2), ("fp16", 3)):
        assert run.stdout.count(f"ok distill {dtype} ") == cases, run.stdout
    assert "ok control: fp16 without the pre-scale loses" in run.stdout


def test_emulation_fails_on_a_broken_kernel(tmp_path):
    """The teachers' column statistics weighted by the teacher's own logit instead of the
    student's: a plausible slip that the harness must catch."""
    broken = tmp_path / "broken"
    broken.mkdir()
    source = KERNELS.read_text()
    assert source.count("teacher_col.add(t, s);") == 1
    (broken / KERNELS.name).write_text(source.replace("teacher_col.add(t, s);", "teacher_col.add(t, t);"))
    run = _build_and_run(tmp_path, "--quick", first_include=broken)
    assert run.returncode != 0 and "SOME FAILED" in run.stdout, run.stdout + run.stderr
    assert "MISMATCH col_cross" in run.stdout, run.stdout
