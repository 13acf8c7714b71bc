"""The CUDA kernels of the fused contrastive log-sum-exp, run on the CPU.

tests/cuda_emulation compiles the kernels' .cuh files as host C++ with one thread per CUDA thread,
barriers for __syncthreads, and host versions of the warp shuffles, ldmatrix and mma.sync written
from the PTX fragment layouts, then compares every output with a double-precision reference:

- emulate_contrastive_lse.cpp: the "fused" tile kernels, FMA (fp32) and tensor-core (bf16, fp16);
- emulate_chunked_lse.cpp: the "chunked" path's elementwise kernels (fp32, bf16, fp16), driven
  chunk by chunk as contrastive_lse_chunked.cu drives them, with the GEMMs done on the host; both
  variants of its forward kernel (32 and 16 rows per CTA).

Both include realistic upstream gradients (0.5 / 65536) and a negative control: fp16 without the
gradient pre-scale, which must fail (it loses the negative pairs' gradients to underflow). This
checks indexing, masking, fragment bookkeeping, reductions and rounding without a GPU; it cannot
check what only hardware shows (memory ordering, real ldmatrix/mma behaviour, speed): the
@pytest.mark.cuda tests in test_contrastive_lse_cuda.py do that on a GPU."""
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
HARNESSES = ROOT / "tests" / "cuda_emulation"


def _build_and_run(tmp_path, source):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (set CXX)")
    exe = tmp_path / source.stem
    torch_include = pathlib.Path(torch.__file__).parent / "include"
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", f"-I{ROOT / 'csrc' / 'cuda'}",
         f"-I{ROOT / 'csrc' / 'include'}", f"-I{torch_include}", str(source), "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, f"emulation build failed:\n{build.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    return run.stdout


def test_fused_kernels_match_double_reference_in_host_emulation(tmp_path):
    out = _build_and_run(tmp_path, HARNESSES / "emulate_contrastive_lse.cpp")
    assert out.count("ok fma fp32") == 7 and out.count("ok mma bf16") == 7
    assert out.count("ok mma fp16") == 4
    assert "ok control: fp16 without the pre-scale loses" in out


def test_chunked_kernels_match_double_reference_in_host_emulation(tmp_path):
    out = _build_and_run(tmp_path, HARNESSES / "emulate_chunked_lse.cpp")
    for dtype in ("fp32", "bf16", "fp16"):
        assert out.count(f"ok chunked {dtype} forward-rows=32") == 7, out
    assert out.count("ok chunked fp32 forward-rows=16") == 6, out
    assert out.count("realistic-gradients") == 4  # three dtypes and the failing control
    assert "ok control: fp16 without the pre-scale loses" in out
