"""The CUDA kernels of the chunked SigLIP loss (csrc/cuda/siglip_kernels.cuh), run on the CPU.

tests/cuda_emulation/emulate_siglip.cpp compiles the kernels as host C++ with one thread per CUDA
thread (tests/cuda_emulation/emulate_cuda.h) and compares the per-row sums and the logit gradients
(fp32, bf16, and fp16 with the power-of-two prescale) of several column chunks with a double
reference, with positives and without (the ring's blocks from other ranks), and with labels by
sample id (siglip_ids_chunk_kernel: same-id pairs +1, or dropped with mask_same_ids; ids that match
only at the positives must give the bits of the kernel without ids). This checks the kernels'
indexing, positives, labels, reductions and prescale without a GPU; what only hardware shows (speed,
the real GEMMs around them) is left to tests/ops/test_siglip_cuda.py and test_siglip_ids.py. Broken
copies fail: one that keeps the positive's column in 32 bits (which turns the no-positives marker
into a positive per row), one without the +1 label of same-id pairs, one that never drops them, one
that adds a dropped pair's 0 * dot to d scale (NaN for an Inf or NaN similarity there)."""
import subprocess

import pytest

from tests.cuda_emulation.emulation_utils import HARNESSES, broken_copy, finish_builds, start_build

PATHS = ("loss fp32", "grad fp32", "grad bf16", "grad fp16")
SOURCE = HARNESSES / "emulate_siglip.cpp"
KERNEL = "siglip_kernels.cuh"
# name: (right text, wrong text) of each broken copy of the kernel
BROKEN = {
    "int32_positive": ("const int64_t pos = p.pos_offset + i - p.begin;",
                       "const int pos = static_cast<int>(p.pos_offset + i - p.begin);"),
    "no_same_id_label": ("const float z = positive || same ? 1.0f : -1.0f;", "const float z = positive ? 1.0f : -1.0f;"),
    "no_mask": ("q.mask_same_ids;  // no term", "false;  // no term"),
    "dropped_dot": ("sums[3 * r + 1] += dropped ? 0.0f : dl * dot;", "sums[3 * r + 1] += dl * dot;"),
}
# case indices in emulate_siglip.cpp
NO_POSITIVES, IDS_MULTI, IDS_MASK, IDS_MASK_NON_FINITE = "4", "5", "6", "7"


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("siglip_emulation")
    builds = {"real": start_build(SOURCE, tmp / "real")}
    for name, (right, wrong) in BROKEN.items():
        builds[name] = start_build(SOURCE, tmp / name, broken_copy(KERNEL, tmp / f"{name}_kernel", right, wrong))
    finish_builds(builds)
    return {name: tmp / name for name in builds}


def run(exe, *case):
    return subprocess.run([str(exe), *case], capture_output=True, text=True, timeout=600)


def test_siglip_cuda_kernel_matches_double_reference_in_host_emulation(harnesses):
    out = run(harnesses["real"])
    assert out.returncode == 0 and "ALL OK" in out.stdout, out.stdout + out.stderr
    for path in PATHS:
        assert out.stdout.count(f"ok {path} M=") == 10, path
        assert out.stdout.count(f"ok {path} distinct ids bit-equal to no ids") == 2, path
    assert out.stdout.count("no-positives") == 8
    assert out.stdout.count("ids-multi") == 8 and out.stdout.count("ids-mask") == 12


@pytest.mark.parametrize("broken, case, mark, still_ok", [("int32_positive", NO_POSITIVES, "no-positives", 0),
                                                          ("no_same_id_label", IDS_MULTI, "ids-multi", 0),
                                                          ("no_mask", IDS_MASK, "ids-mask", 0),
                                                          # the loss-only pass has no d scale
                                                          ("dropped_dot", IDS_MASK_NON_FINITE, "ids-mask", 1)])
def test_siglip_emulation_catches_a_broken_kernel(harnesses, broken, case, mark, still_ok):
    out = run(harnesses[broken], case)
    assert out.returncode != 0 and "MISMATCH" in out.stdout and out.stdout.count(mark) == still_ok, out.stdout
    # the same case passes with the real kernel
    out = run(harnesses["real"], case)
    assert out.returncode == 0 and out.stdout.count(mark) == 4, out.stdout
