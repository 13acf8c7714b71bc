"""The CUDA kernels of the fused contrastive log-sum-exp, run on the CPU.

tests/cuda_emulation compiles the kernels' .cuh files as host C++ with one fiber per CUDA thread,
barriers for __syncthreads, and host versions of the warp shuffles, ldmatrix and mma.sync written
from the PTX fragment layouts, then compares every output with a double-precision reference:

- emulate_contrastive_lse.cpp: the "fused" tile kernels, FMA (fp32) and tensor-core (bf16, fp16),
  with positives and without (pos_offset -1, through the op's own rule in launch_rules.h, which a
  broken copy of that rule shows);
- emulate_chunked_lse.cpp: the "chunked" path's elementwise kernels (fp32, bf16, fp16; with and
  without sample ids, with and without positives), driven
  chunk by chunk as contrastive_lse_chunked.cu drives them on an H200 (132 SMs: min(ceil(396 / gy),
  steps) column splits, up to 8 here; the costly realistic-gradient case keeps 2), with the GEMMs
  done on the host; both variants of its
  forward kernel (32 and 16 rows per CTA); and the fp16 pre-scale kernel, whose result must equal
  the host's exactly.

Both include realistic upstream gradients (0.5 / 65536) and a negative control: fp16 without the
gradient pre-scale, which must fail (it loses the negative pairs' gradients to underflow). A copy of
the chunked forward kernel whose column stride assumes at most two splits fails too. This checks
indexing, masking, fragment bookkeeping, reductions and rounding without a GPU; it cannot check
what only hardware shows (memory ordering, real ldmatrix/mma behaviour, speed): the
@pytest.mark.cuda tests in test_contrastive_lse_cuda.py do that on a GPU."""
import subprocess

import pytest

from tests.cuda_emulation.emulation_utils import (HARNESSES, INCLUDE, broken_copy, build_real_and_broken, finish_builds,
                                                  start_build)

STRIDE = ("row_state[r] = Lse::empty();\n\n  for (int64_t j0 = static_cast<int64_t>(blockIdx.x) * kThreads; "
          "j0 < p.width;\n       j0 += static_cast<int64_t>(gridDim.x) * kThreads) {")


def _run(exe):
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    return run


# contrastive_lse.cu's pos_offset rule with -1 taken as 0 (the diagonal a positive) instead of K:
# the harness must catch it, since it calls the op's rule.
POS_RULE = ("return pos_offset == -1 ? K : pos_offset;", "return pos_offset == -1 ? 0 : pos_offset;")


@pytest.fixture(scope="module")
def fused_harnesses(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fused_emulation")
    rules = tmp / "broken_rules"
    broken_copy("launch_rules.h", rules / "clipshard", *POS_RULE, kernels=INCLUDE / "clipshard")
    source = HARNESSES / "emulate_contrastive_lse.cpp"
    finish_builds({"real": start_build(source, tmp / "real"), "broken": start_build(source, tmp / "broken", rules)})
    return tmp / "real", tmp / "broken"


def test_fused_kernels_match_double_reference_in_host_emulation(fused_harnesses):
    out = _run(fused_harnesses[0]).stdout
    assert out.count("ok fma fp32") == 9 and out.count("ok mma bf16") == 8
    assert out.count("ok mma fp16") == 5
    # pos_offset -1 (no own positives; hard-negative columns): two FMA cases, one tensor-core case in bf16 and fp16
    assert out.count("pos=-1 ") == 4, out
    assert "ok control: fp16 without the pre-scale loses" in out


def test_fused_emulation_runs_the_ops_pos_offset_rule(fused_harnesses):
    run = subprocess.run([str(fused_harnesses[1])], capture_output=True, text=True, timeout=900)
    assert run.returncode != 0 and "FAILED fma fp32 M=40 K=90 D=24 pos=-1" in run.stdout, run.stdout
    assert "ok fma fp32 M=65 K=130 D=33 pos=1 " in run.stdout  # the cases with positives are unaffected


@pytest.fixture(scope="module")
def chunked_harnesses(tmp_path_factory):
    return build_real_and_broken(tmp_path_factory.mktemp("chunked_emulation"), HARNESSES / "emulate_chunked_lse.cpp",
                                 "contrastive_lse_chunked_kernels.cuh", STRIDE,
                                 STRIDE.replace("gridDim.x) * kThreads", "gridDim.x < 2 ? gridDim.x : 2u) * kThreads"))


def test_chunked_kernels_match_double_reference_in_host_emulation(chunked_harnesses):
    out = _run(chunked_harnesses[0]).stdout
    for dtype in ("fp32", "bf16", "fp16"):
        assert out.count(f"ok chunked {dtype} forward-rows=32") == 13, out
    assert out.count("ok chunked fp32 forward-rows=16") == 12, out
    # the sample-id cases (kIds kernels): duplicates, all equal, and without positives (pos=-1)
    assert out.count("ids=duplicates") == 3 * 4 and out.count("ids=equal") == 2 * 4, out
    assert out.count("pos=-1 ") == 2 * 4, out
    assert out.count("realistic-gradients") == 4  # three dtypes and the failing control
    assert "ok control: fp16 without the pre-scale loses" in out
    assert "splits<=8" in out  # more column splits than two, as on an H200


def test_chunked_emulation_catches_a_forward_kernel_that_assumes_two_splits(chunked_harnesses):
    few_rows = "6"  # the case index in emulate_chunked_lse.cpp: 8 column splits
    run = subprocess.run([str(chunked_harnesses[1]), few_rows], capture_output=True, text=True, timeout=600)
    assert run.returncode != 0 and "FAILED chunked fp32 forward-rows=32 M=20" in run.stdout, run.stdout
    assert "splits<=8" in run.stdout
