"""The CUDA kernel of the chunked SigLIP loss (csrc/cuda/siglip_kernels.cuh), run on the CPU.

tests/cuda_emulation/emulate_siglip.cpp compiles the kernel as host C++ with one thread per CUDA
thread (tests/cuda_emulation/emulate_cuda.h) and compares the per-row sums and the logit gradients
(fp32, bf16, and fp16 with the power-of-two prescale) of several column chunks with a double
reference. This checks the kernel's indexing, positives, reductions and prescale without a GPU; what
only hardware shows (speed, the real GEMMs around it) is left to tests/test_siglip_cuda.py."""
import os
import pathlib
import shutil
import subprocess

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests" / "cuda_emulation" / "emulate_siglip.cpp"


def test_siglip_cuda_kernel_matches_double_reference_in_host_emulation(tmp_path):
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None:
        pytest.skip("no C++ compiler (set CXX)")
    exe = tmp_path / "emulate_siglip"
    torch_include = pathlib.Path(torch.__file__).parent / "include"
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-pthread", "-Wno-unknown-pragmas", f"-I{ROOT / 'csrc' / 'cuda'}",
         f"-I{ROOT / 'csrc' / 'include'}", f"-I{ROOT / 'tests' / 'cuda_emulation'}", f"-I{torch_include}",
         str(SOURCE), "-o", str(exe)],
        capture_output=True, text=True)
    assert build.returncode == 0, f"emulation build failed:\n{build.stderr[-4000:]}"
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    for path in ("loss fp32", "grad fp32", "grad bf16", "grad fp16"):
        assert run.stdout.count(f"ok {path}") == 4, path
