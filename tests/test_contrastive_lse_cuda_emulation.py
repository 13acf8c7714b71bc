"""The CUDA kernels of the fused contrastive log-sum-exp, run on the CPU.

tests/cuda_emulation compiles csrc/cuda/contrastive_lse_{kernels,mma}.cuh as host C++ with one
thread per CUDA thread, barriers for __syncthreads, and host versions of the warp shuffles,
ldmatrix and mma.sync written from the PTX fragment layouts, then compares the FMA kernels (fp32)
and the tensor-core kernels (bf16, fp16) with a double-precision reference. This checks the
kernels' indexing, masking, fragment bookkeeping and reductions without a GPU; it cannot check
what only hardware shows (memory ordering, real ldmatrix/mma behaviour, speed): the
@pytest.mark.cuda tests in test_contrastive_lse_cuda.py do that on a GPU."""
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "cuda_emulation" / "emulate_contrastive_lse.cpp"


def test_cuda_kernels_match_double_reference_in_host_emulation(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (set CXX)")
    exe = tmp_path / "emulate_contrastive_lse"
    torch_include = pathlib.Path(torch.__file__).parent / "include"
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas",
         f"-I{ROOT / 'csrc' / 'cuda'}", f"-I{torch_include}", str(SOURCE), "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, f"emulation build failed:\n{build.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("ok fma fp32") == 7 and run.stdout.count("ok mma bf16") == 6
    assert run.stdout.count("ok mma fp16") == 3
