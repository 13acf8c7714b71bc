"""The workspace rules of siglip_forward, distill_lse(_backward) and the rounding ops against the
peaks of the real CPU kernels (clipshard.planning.measured_peak), and through plan_memory against
real forward + backward passes; the CUDA rules' arithmetic pinned for one shape each."""
import pathlib
import re

import pytest
import torch

import clipshard
from clipshard.planning import kernel_workspaces, plan_memory, workspace_rules_distill
from clipshard.planning.loss_plan import CUDA_ROUNDING
from clipshard.planning.measured_peak import measured_peak_bytes
from clipshard.planning.workspace_rules_distill import (distill_lse_backward_cpu, distill_lse_backward_cuda,
                                                        distill_lse_cpu, distill_lse_cuda)
from clipshard.planning.workspace_rules_rounding import stochastic_round, stochastic_round_into
from clipshard.planning.workspace_rules_siglip import siglip_forward_cpu, siglip_forward_cuda
from clipshard.planning.workspace_timeline import at_peak, converted_copy_bytes

M, K, D, DT = 300, 1000, 96, 64  # odd sizes; teachers' feature size differs from the student's
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
SMALL_BUDGET = 200_000  # several column chunks instead of one


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    saved = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(saved)


def _bytes(outputs):
    """Bytes of an op's outputs: a tensor, a tuple of them, or None (an in-place op)."""
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs or ()
    return sum(t.untyped_storage().nbytes() for t in outputs)


def _check_rule(op, args, rule, thread_tiles=0, slack=32 << 10, tolerance=0.05):
    """The op's measured peak against its outputs' bytes + the rule's temporaries.

    thread_tiles: the bytes one thread of the kernel's parallel loop allocates for itself. The rule
    counts every thread's alive at once, the kernel's peak when its threads run together; on a busy
    machine a thread may get a core only after another has freed (some of) its tiles. With several
    threads the largest of up to three measurements is kept, and must lie between the rule's peak
    less the tiles of all threads but one and the rule's peak (each up to the tolerance)."""
    late_tiles = (torch.get_num_threads() - 1) * thread_tiles
    measured = 0
    for _ in range(3 if late_tiles else 1):
        results = []
        measured = max(measured, measured_peak_bytes(lambda: results.append(op(*args)), "cpu"))
        planned = _bytes(results[0]) + sum(n for _, n in rule(*args))
        allowed = tolerance * measured + slack
        if abs(planned - measured) <= allowed:
            break
    assert planned - late_tiles - allowed <= measured <= planned + allowed, (planned, measured, rule(*args))
    return results[0]


def _distill_thread_tiles(dtype):
    """A CPU distill thread's Scratch (csrc/cpu/distill_lse.cpp): six 128 x 512 tiles, two 512-vectors."""
    return (6 * 128 * 512 + 2 * 512) * (8 if dtype == torch.float64 else 4)


def _features(shape, dtype, transposed=False, scale=0.1):
    if transposed:
        return (torch.randn(tuple(reversed(shape)), dtype=torch.float64) * scale).to(dtype).t()
    return (torch.randn(shape, dtype=torch.float64) * scale).to(dtype)


# ------------------------------------------------------------------------------------------ SigLIP


def _siglip_args(dtype, with_grad, transposed=False, ids=None, budget=32 << 20):
    rows, cols = _features((M, D), dtype, transposed), _features((K, D), dtype, transposed)
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)
    row_ids = col_ids = None
    if ids is not None:
        row_ids, col_ids = torch.randint(0, 40, (M,)), torch.randint(0, 40, (K,))
    return rows, cols, scale, bias, None, row_ids, col_ids, ids == "mask", with_grad, budget


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_grad", [False, True], ids=["loss", "grad"])
@pytest.mark.parametrize("transposed", [False, True], ids=["contiguous", "transposed"])
def test_siglip_forward_cpu_rule_matches_the_kernel(dtype, with_grad, transposed):
    _check_rule(torch.ops.clipshard.siglip_forward, _siglip_args(dtype, with_grad, transposed),
                siglip_forward_cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_siglip_forward_cpu_rule_on_several_threads(dtype, threads):
    """The row loop's threads allocate nothing of their own: the same peak on 1 and 2 threads."""
    _check_rule(torch.ops.clipshard.siglip_forward, _siglip_args(dtype, True), siglip_forward_cpu)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("ids", ["multi", "mask"])
def test_siglip_forward_cpu_rule_with_ids_and_several_chunks(dtype, ids):
    _check_rule(torch.ops.clipshard.siglip_forward, _siglip_args(dtype, True, ids=ids, budget=SMALL_BUDGET),
                siglip_forward_cpu)


def test_siglip_forward_cuda_rule_bf16_by_hand():
    """bf16 with_grad, M=300, K=1000, D=96, the default 256 MiB: one chunk of all 1000 columns. The
    chunk loop holds the per-row fp64 accumulators, the fp32 similarities, the bf16 logit
    gradients, the GradientAccumulator's fp32 row gradient and fp32 column buffer (blocks of 256
    columns: M = 300 rounded down to 128, not the chunk's 1000), and the bf16 grad_cols output; the
    bf16 grad_rows output is made after the loop (the planner counts it)."""
    args = _siglip_args(torch.bfloat16, True)[:-1] + (256 << 20,)
    loop = 3 * 300 * 8 + 300 * 1000 * 4 + 300 * 1000 * 2 + 300 * 96 * 4 + 256 * 96 * 4 + 1000 * 96 * 2
    outputs = (300 + 1000) * 96 * 2
    assert sum(n for _, n in siglip_forward_cuda(*args)) == loop - outputs


def test_siglip_forward_cuda_rule_fp16_by_hand():
    """fp16 with_grad, same shape: the saved gradients are fp32, so the accumulators are the outputs
    (alive in the loop); the fp16 logit gradients are prescaled, so the column buffer (256 columns)
    is used too."""
    args = _siglip_args(torch.float16, True)[:-1] + (256 << 20,)
    loop = 3 * 300 * 8 + 2 * 4 + 300 * 1000 * 4 + 300 * 1000 * 2 + 256 * 96 * 4  # (prescale, unscale): 2 x 4
    assert sum(n for _, n in siglip_forward_cuda(*args)) == loop


# ---------------------------------------------------------------------------------------- distillation


def _distill_args(dtype, teachers, want_columns, teacher_dtype=None, budget=32 << 20):
    teacher_dtype = teacher_dtype or dtype
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    return (_features((M, D), dtype), _features((K, D), dtype), _features((teachers, M, DT), teacher_dtype),
            _features((teachers, K, DT), teacher_dtype), torch.tensor(10.0, dtype=acc),
            torch.linspace(5.0, 8.0, teachers, dtype=acc), 0, want_columns, budget)


def _distill_backward_args(forward_args, stats, teacher_grad):
    """Upstream gradients of realistic size for every output (None for the empty column ones)."""
    grads = [torch.randn_like(s) * (0.5 / M) if s.numel() else None for s in stats]
    rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, _, budget = forward_args
    return (*grads, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, stats[0], *stats[2:],
            teacher_grad, budget)


def _check_distill_rules(dtype, teachers, want_columns, teacher_grad, teacher_dtype=None, budget=32 << 20):
    forward_args = _distill_args(dtype, teachers, want_columns, teacher_dtype, budget)
    tiles = _distill_thread_tiles(dtype)
    stats = _check_rule(torch.ops.clipshard.distill_lse, forward_args, distill_lse_cpu, tiles)
    _check_rule(torch.ops.clipshard.distill_lse_backward, _distill_backward_args(forward_args, stats, teacher_grad),
                distill_lse_backward_cpu, tiles)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("teachers", [1, 2])
@pytest.mark.parametrize("want_columns", [False, True], ids=["rows", "columns"])
@pytest.mark.parametrize("teacher_grad", [False, True], ids=["no_dT", "dT"])
def test_distill_cpu_rules_match_the_kernels(dtype, teachers, want_columns, teacher_grad):
    _check_distill_rules(dtype, teachers, want_columns, teacher_grad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("teacher_grad", [False, True], ids=["no_dT", "dT"])
def test_distill_cpu_rules_on_several_threads_and_column_chunks(dtype, teacher_grad, threads):
    """Per-thread tiles, and the backward's column-gradient accumulators of every thread but the
    first, several column chunks wide under a small budget."""
    _check_distill_rules(dtype, 2, True, teacher_grad, budget=SMALL_BUDGET)


def test_distill_cpu_rules_with_fp32_teachers_of_a_bf16_student(threads):
    _check_distill_rules(torch.bfloat16, 2, True, True, teacher_dtype=torch.float32)


def test_distill_lse_cuda_rule_by_hand(monkeypatch):
    """Forward, fp32, M=300, K=1000, T=2, columns wanted, 256 MiB: one chunk of 1000 columns, 19
    row blocks of 16 rows; on a GPU of 132 SMs ceil(3 x 132 / 19) = 21 column splits, capped at
    ceil(1000 / 256) = 4 column steps. The outputs exist before the chunk loop."""
    monkeypatch.setattr(workspace_rules_distill, "cuda_multiprocessors", lambda: 132)
    args = _distill_args(torch.float32, 2, True)[:-1] + (256 << 20,)
    expected = (300 * 1000 * 4 + 2 * 300 * 1000 * 4  # student's and teachers' similarity chunks
                + 300 * 2 * 4 + 2 * 300 * 3 * 4  # running row states
                + 4 * 300 * 2 * 4 + 2 * 4 * 300 * 3 * 4  # partial row states
                + 19 * 1000 * 2 * 4 + 2 * 19 * 1000 * 3 * 4)  # partial column states
    assert sum(n for _, n in distill_lse_cuda(*args)) == expected


def test_distill_lse_backward_cuda_rule_by_hand():
    """Backward, bf16 student and teacher, T=1, every gradient given, teacher_grad, 256 MiB: one
    chunk of 1000 columns (12 bytes per logit). Everything the chunk loop allocates lives until the
    op returns; the peak is the student's return, with its fp32 scaled gradients and bf16 outputs."""
    forward_args = _distill_args(torch.bfloat16, 1, True)[:-1] + (256 << 20,)
    stats = tuple(torch.empty(s) for s in ((M,), (M,), (1, M), (1, M), (K,), (1, K), (1, K)))
    args = _distill_backward_args(forward_args, stats, True)
    base = (2 * 2 * 4  # unit prescales
            + 300 * 1000 * 4 * 2  # student's and teacher's fp32 similarity chunks
            + 300 * 1000 * 2 * 2  # their bf16 logit-gradient chunks
            + (300 * 96 + 1000 * 96 + 256 * 96) * 4  # student GradientAccumulator: rows, cols, column buffer
            + (300 * 64 + 1000 * 64 + 256 * 64) * 4)  # teacher's (buffers of M = 300 rounded down to 128 columns)
    student_return = base + (300 + 1000) * 96 * 4 + (300 + 1000) * 96 * 2  # fp32 products + bf16 outputs
    outputs = (300 + 1000) * 96 * 2 + (300 + 1000) * 64 * 2 + 4
    assert sum(n for _, n in distill_lse_backward_cuda(*args)) == student_return - outputs


def _rounded(n):
    return -(-n // CUDA_ROUNDING) * CUDA_ROUNDING


def _cuda_measured_and_ruled(op, args):
    """(the CUDA caching allocator's peak of one call after a warm-up, its outputs + the CUDA rule's
    temporaries, each block rounded as that allocator and the planner round them)."""
    outputs = op(*args)  # warm-up: cuBLAS's workspace, the addmm probe
    outputs = (outputs,) if isinstance(outputs, torch.Tensor) else outputs or ()
    ruled = sum(_rounded(t.untyped_storage().nbytes()) for t in outputs if t.untyped_storage().nbytes())
    ruled += sum(_rounded(n) for _, n in kernel_workspaces.internal_allocations(op.default, "cuda", args, {}))
    del outputs
    measured = max(measured_peak_bytes(lambda: op(*args), "cuda") for _ in range(2))
    return measured, ruled


def _on_cuda(args):
    return tuple(a.cuda() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cuda_rules_match_the_measured_peak(dtype):
    """On a GPU (the GPU check's CUDA tests run it): each op's peak against its outputs plus the CUDA
    rule, one chunk and several (a 4 MiB budget), with ids, strided features, 1 and 2 teachers."""
    cases = []
    for budget in (256 << 20, 4 << 20):
        for with_grad, transposed, ids in ((False, False, None), (True, False, None), (True, True, "mask")):
            args = _siglip_args(dtype, with_grad, transposed, ids, budget)
            cases.append((torch.ops.clipshard.siglip_forward, _on_cuda(args)))
        for teachers, teacher_grad in ((1, False), (2, True)):
            forward_args = _on_cuda(_distill_args(dtype, teachers, True, budget=budget))
            stats = torch.ops.clipshard.distill_lse(*forward_args)
            cases.append((torch.ops.clipshard.distill_lse, forward_args))
            cases.append((torch.ops.clipshard.distill_lse_backward,
                          _distill_backward_args(forward_args, stats, teacher_grad)))
    for op, args in cases:
        measured, ruled = _cuda_measured_and_ruled(op, args)
        print(f"workspace rule cuda {op} {dtype}: measured {measured}, ruled {ruled}")
        assert abs(measured - ruled) <= 0.05 * measured + (32 << 10), (op, measured, ruled)


CSRC = pathlib.Path(__file__).resolve().parents[2] / "csrc"


@pytest.mark.parametrize("constant, path, pattern", [
    ("CPU_ROW_BLOCK", "cpu/distill_lse.cpp", r"constexpr int64_t kRowBlock = (\d+);"),
    ("CPU_COL_BLOCK", "cpu/distill_lse.cpp", r"constexpr int64_t kColBlock = (\d+);"),
    ("CUDA_ROWS_PER_CTA", "cuda/distill_lse_kernels.cuh", r"constexpr int kForwardRows = (\d+);"),
    ("CUDA_THREADS", "cuda/contrastive_lse_chunked_kernels.cuh", r"constexpr int kThreads = (\d+);"),
    ("CUDA_LAUNCH_TEACHERS", "include/clipshard/launch_rules.h", r"constexpr int kDistillMaxLaunchTeachers = (\d+);"),
    ("CUDA_MAX_GRID_Y", "include/clipshard/launch_rules.h", r"constexpr int64_t kMaxGridY = (\d+);"),
])
def test_distill_rule_constants_are_the_kernels(constant, path, pattern):
    found = re.search(pattern, (CSRC / path).read_text())
    assert found and int(found.group(1)) == getattr(workspace_rules_distill, constant)


def test_distill_cpu_scratch_has_the_tiles_the_rule_counts():
    tiles = re.search(r"for \(Tensor\* t : \{([^}]*)\}\)\s*\*t = at::empty\(\{kRowBlock \* kColBlock\}",
                      (CSRC / "cpu/distill_lse.cpp").read_text())
    assert tiles and len(tiles.group(1).split(",")) == workspace_rules_distill.CPU_SCRATCH_TILES


# ---------------------------------------------------------------------------------------------- rounding


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_rounding_rules_match_the_kernels_for_strided_tensors(dtype):
    src = _features((K, D), torch.float32, transposed=True, scale=3.0)
    args = (src, dtype, 7, 0, False)
    _check_rule(torch.ops.clipshard.stochastic_round, args, lambda *a: stochastic_round("cpu", *a))
    dst = torch.empty((D, K), dtype=dtype).t()
    args = (dst, src, 7, 0, False)
    _check_rule(torch.ops.clipshard.stochastic_round_into, args, lambda *a: stochastic_round_into("cpu", *a))


# --------------------------------------------------------------------------------------------- helpers


def test_converted_copy_counts_the_second_copy_of_a_transposed_conversion():
    rows = torch.empty(D, M, dtype=torch.bfloat16).t()
    assert converted_copy_bytes(rows, torch.float32) == (M * D * 4, M * D * 4)
    assert converted_copy_bytes(rows.float(), torch.float32) == (M * D * 4, 0)
    assert converted_copy_bytes(torch.empty(M).expand(3, M), torch.float64) == (3 * M * 8, 0)  # overlapping
    assert converted_copy_bytes(torch.empty(M, D), torch.float32) == (0, 0)


def test_at_peak_leaves_out_the_outputs_made_after_the_peak():
    # phase 1: 100 bytes of workspace, no output yet; phase 2: 30 bytes of accumulators and 40 of outputs
    answer = at_peak([([("workspace", 100)], 0, 40), ([("accumulators", 30)], 40, 40)])
    assert sum(n for _, n in answer) == 100 - 40
    assert "outputs made after it is freed" in answer[0][0]


# ---------------------------------------------------------------------------------------------- planner


def _measured_loss_peak(loss, dtype):
    torch.manual_seed(0)
    image, text = (_features((M, D), dtype).requires_grad_() for _ in range(2))
    scale = torch.tensor(10.0, requires_grad=True)
    if isinstance(loss, clipshard.DistillClipLoss):
        teacher = (_features((M, DT), dtype), _features((M, DT), dtype), torch.tensor(20.0))
        return measured_peak_bytes(lambda: sum(loss(image, text, scale, *teacher)).backward(), "cpu")
    bias = torch.tensor(-10.0, requires_grad=True)
    return measured_peak_bytes(lambda: loss(image, text, scale, bias).backward(), "cpu")


@pytest.mark.parametrize("loss", [clipshard.SigLipLoss(), clipshard.DistillClipLoss()],
                         ids=["SigLipLoss", "DistillClipLoss"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_plan_memory_matches_the_real_forward_and_backward(loss, dtype):
    saved = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread's tiles: a measurement that does not depend on scheduling
    try:
        measured = _measured_loss_peak(loss, dtype)
        planned = plan_memory(loss, world_size=1, batch_size=M, dim=D, dtype=dtype, device="cpu",
                              teacher_dim=DT).peak_bytes
    finally:
        torch.set_num_threads(saved)
    assert abs(planned - measured) <= 0.10 * measured + (256 << 10), (planned, measured)
