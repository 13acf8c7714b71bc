"""The CUDA kernel of the chunked SigLIP loss (csrc/cuda/siglip_kernels.cuh), run on the CPU.

tests/cuda_emulation/emulate_siglip.cpp compiles the kernel as host C++ with one thread per CUDA
thread (tests/cuda_emulation/emulate_cuda.h) and compares the per-row sums and the logit gradients
(fp32, bf16, and fp16 with the power-of-two prescale) of several column chunks with a double
reference, with positives and without (the ring's blocks from other ranks). This checks the kernel's
indexing, positives, reductions and prescale without a GPU; what only hardware shows (speed, the
real GEMMs around it) is left to tests/ops/test_siglip_cuda.py. A copy of the kernel that keeps the
positive's column in 32 bits (which turns the no-positives marker into a positive per row) fails."""
import subprocess

import pytest

from tests.cuda_emulation.emulation_utils import HARNESSES, build_real_and_broken

PATHS = ("loss fp32", "grad fp32", "grad bf16", "grad fp16")


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    return build_real_and_broken(
        tmp_path_factory.mktemp("siglip_emulation"), HARNESSES / "emulate_siglip.cpp", "siglip_kernels.cuh",
        "const int64_t pos = p.pos_offset + i - p.begin;", "const int pos = static_cast<int>(p.pos_offset + i - p.begin);")


def test_siglip_cuda_kernel_matches_double_reference_in_host_emulation(harnesses):
    run = subprocess.run([str(harnesses[0])], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    for path in PATHS:
        assert run.stdout.count(f"ok {path}") == 5, path
    assert run.stdout.count("no-positives") == 4


def test_siglip_emulation_catches_a_kernel_that_breaks_the_no_positives_mode(harnesses):
    no_positives = "4"  # the case index in emulate_siglip.cpp
    run = subprocess.run([str(harnesses[1]), no_positives], capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "MISMATCH" in run.stdout and "no-positives" not in run.stdout, run.stdout
    # the same case passes with the real kernel
    run = subprocess.run([str(harnesses[0]), no_positives], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.count("no-positives") == 4, run.stdout
