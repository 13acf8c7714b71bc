"""The distillation op's CUDA kernels (csrc/cuda/distill_lse_kernels.cuh), run on the CPU.

tests/cuda_emulation/emulate_distill.cpp compiles the kernels as host C++ through emulate_cuda.h
(one fiber per CUDA thread, barriers for __syncthreads, host warp shuffles), launches them chunk
by chunk through the op's own launch code (csrc/cuda/distill_launch.h: grids, teachers two per
forward launch, every pointer offset; the fp16 pre-scales and the teachers read only when a
teacher term is wanted as distill_lse.cu decides them), and compares the forward's seven statistics
and the backward's dS and dT^k with a double-precision reference of the op's formulas: fp32, bf16
and fp16 dlogits and mixed student / teacher dtypes, T = 1, 2 and 3, several column splits with
several column steps per CTA, fewer CTA rows than row blocks (the kernels' row-block loop),
want_columns=false, absent upstream gradients, teacher_grad=false, no teacher term (no teacher
logit read), NaN and +Inf logits (reaching only their own row's and column's statistics), scales
up to 300, realistic upstream gradients (0.5 / 65536), and a negative control (fp16 without the
gradient pre-scale must fail). Other tests build the harness against deliberately broken copies
of the kernels and of the launch code and check that it fails. Hardware-only behaviour (memory
ordering, speed) needs the @pytest.mark.cuda tests of test_distill_lse.py on a GPU."""
import subprocess

import pytest

from tests.cuda_emulation.emulation_utils import HARNESSES, KERNELS, finish_builds, start_build

HARNESS = HARNESSES / "emulate_distill.cpp"


@pytest.fixture(scope="module")
def harnesses(tmp_path_factory):
    """(the harness, the harness built against one broken copy of the kernels holding every bug of
    BROKEN), built side by side."""
    folder = tmp_path_factory.mktemp("distill_emulation")
    (folder / "kernel").mkdir()
    # Both headers go into the broken folder: distill_launch.h includes the kernels from its own folder.
    for header in ("distill_lse_kernels.cuh", "distill_launch.h"):
        source = (KERNELS / header).read_text()
        for _, file, right, wrong, _, _ in BROKEN:
            if file == header:
                assert source.count(right) == 1, right
                source = source.replace(right, wrong)
        (folder / "kernel" / header).write_text(source)
    finish_builds({"real": start_build(HARNESS, folder / "real"),
                   "broken": start_build(HARNESS, folder / "broken", folder / "kernel")})
    return folder / "real", folder / "broken"


def test_distill_kernels_match_double_reference_in_host_emulation(harnesses):
    run = subprocess.run([str(harnesses[0])], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
    assert run.stdout.count("ok distill ") == 19 and run.stdout.count("FAILED distill") == 1, run.stdout  # the control
    for pair, cases in (("fp32/fp32", 8), ("bf16/bf16", 2), ("fp16/fp16", 5), ("fp16/bf16", 1), ("bf16/fp16", 1),
                        ("fp16/fp32", 1), ("fp32/bf16", 1)):
        assert run.stdout.count(f"ok distill {pair} ") == cases, (pair, run.stdout)
    for feature in ("T=3 kc=1280 pos=40 scale=14.3 splits=3 grid_rows=1", "scale=300 splits=2", "nan-inf",
                    "no-columns", "no-teacher-grad given=37", "no-teacher-grad given=72", "given=19", "given=14"):
        assert f"{feature}" in run.stdout, feature
    assert "ok control: fp16 without the pre-scale loses" in run.stdout


# Plausible slips the harness must catch: (what, the file, its text, its broken replacement, the
# harness case that must catch it, the mismatch it reports). One broken copy holds them all, each
# switched on by the harness's g_broken, so that one extra build serves every slip. The slips in
# distill_launch.h show that the harness runs the op's own launch code, not a copy of it.
BROKEN = [
    ("the teachers' column statistics weighted by the teacher's own logit instead of the student's",
     "distill_lse_kernels.cuh", "teacher_col[q].add(t, s);", "teacher_col[q].add(t, g_broken == 1 ? t : s);", 1,
     "MISMATCH col_cross"),
    ("a launch's second teacher reading the first one's logits", "distill_lse_kernels.cuh",
     "t_column[q * p.teacher_stride + r * p.width]", "t_column[(g_broken == 2 ? 0 : q) * p.teacher_stride + r * p.width]",
     1, "MISMATCH teacher_row_lse"),
    ("the forward's row blocks past gridDim.y left out (the old 65535-row-block limit)", "distill_lse_kernels.cuh",
     "block < n_blocks; block += gridDim.y) {\n    const int64_t i0 = block * kForwardRows;",
     "block < (g_broken == 3 ? gridDim.y : n_blocks); block += gridDim.y) {\n    const int64_t i0 = block * kForwardRows;",
     4, "MISMATCH row_lse"),
    ("each column's teacher statistics in the gradient taken from teacher 0", "distill_lse_kernels.cuh",
     "const int64_t kj = k * p.K + col;", "const int64_t kj = (g_broken == 4 ? 0 : k) * p.K + col;", 1, "MISMATCH dS"),
    ("launch code: the second forward launch given the first launch's teacher scales", "distill_launch.h",
     "b.scale, b.teacher_scale + t0,", "b.scale, b.teacher_scale + (g_broken == 5 ? 0 : t0),", 4,
     "MISMATCH teacher_row_lse"),
    ("launch code: a launch's second teacher merged from the first one's row partials", "distill_launch.h",
     "b.teacher_row_partial + q * gx * M", "b.teacher_row_partial + (g_broken == 6 ? 0 : q) * gx * M", 1,
     "MISMATCH teacher_row_lse"),
    ("launch code: the student's column partials merged over the grid's rows, not the row blocks",
     "distill_launch.h", "static_cast<int>(n_blocks), begin, b.col_lse);",
     "static_cast<int>(g_broken == 7 ? gy : n_blocks), begin, b.col_lse);", 4, "MISMATCH col_lse"),
]


@pytest.mark.parametrize("bug", range(len(BROKEN)), ids=[b[0][:40] for b in BROKEN])
def test_emulation_fails_on_a_broken_kernel(harnesses, bug):
    what, _, _, _, case, mismatch = BROKEN[bug]
    run = subprocess.run([str(harnesses[1]), "--quick", str(case), str(bug + 1)], capture_output=True, text=True,
                         timeout=900)
    assert run.returncode != 0 and "SOME FAILED" in run.stdout, (what, run.stdout + run.stderr)
    assert mismatch in run.stdout, (what, run.stdout)


def test_the_broken_copy_without_its_bugs_passes(harnesses):
    """Bug 0 switches none on: the broken copy is otherwise the real kernel (each failure above is its bug's)."""
    run = subprocess.run([str(harnesses[1]), "--quick", "4", "0"], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "ALL OK" in run.stdout, run.stdout + run.stderr
