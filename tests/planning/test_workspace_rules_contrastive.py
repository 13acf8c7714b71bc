"""The workspace rules of the contrastive kernels (clipshard/planning/workspace_rules_contrastive.py):
on the CPU, the real op's measured peak against its outputs plus the rule, for every dtype, both
algorithms, odd and transposed shapes, with and without column LSEs, positives, ids and bias, on 1
and 2 threads; a memory plan of ClipLoss against the real loss; the CUDA rules' arithmetic pinned
for one shape (and measured on a GPU by the `cuda` test, which the GPU check runs); and the C++
constants that the rules mirror, pinned to their source lines."""
import contextlib
import pathlib
import re

import pytest
import torch

import clipshard
from clipshard.ops import launch_variants
from clipshard.planning import kernel_workspaces, plan_memory
from clipshard.planning import workspace_rules_contrastive as rules
from clipshard.planning.measured_peak import measured_peak_bytes

ROOT = pathlib.Path(__file__).resolve().parents[2]
FORWARD = torch.ops.clipshard.contrastive_lse_forward
BACKWARD = torch.ops.clipshard.contrastive_lse_backward
CUDA_ROUNDING = 512  # the CUDA caching allocator's block granularity (the tracker rounds to it too)


@contextlib.contextmanager
def threads(n):
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def op_arguments(device, dtype, m, k, d, algorithm, *, want_col_lse=True, pos_offset=0, ids=False, bias=False,
                 workspace_bytes=32 << 20):
    """(forward arguments, backward arguments) of one op call on random features of realistic size,
    upstream gradients of 0.5 / M, the backward's LSEs from the forward."""
    g = torch.Generator().manual_seed(m * 7 + k)
    rows = (torch.randn(m, d, generator=g) / d ** 0.5).to(device, dtype)
    cols = (torch.randn(k, d, generator=g) / d ** 0.5).to(device, dtype)
    scale = torch.tensor(14.0, device=device)
    bias_t = torch.tensor(-3.0, device=device) if bias else None
    row_ids = (torch.arange(m) % 5).to(device) if ids else None
    col_ids = (torch.arange(k) % 5).to(device) if ids else None
    forward = (rows, cols, scale, bias_t, pos_offset, row_ids, col_ids, want_col_lse, algorithm, workspace_bytes)
    row_lse, _, col_lse = FORWARD(*forward)
    acc = row_lse.dtype
    g_row = torch.full((m,), 0.5 / m, dtype=acc, device=device)
    g_col = torch.full((k,), 0.5 / k, dtype=acc, device=device) if want_col_lse else None
    backward = (g_row, -g_row, g_col, rows, cols, scale, bias_t, pos_offset, row_ids, col_ids, row_lse,
                col_lse if want_col_lse else None, algorithm, workspace_bytes)
    return forward, backward


def _rounded(n, rounding):
    return -(-n // rounding) * rounding


def largest_peak(call, device, runs, reaching):
    """The largest measured peak of up to `runs` calls, stopping at the first of at least `reaching`
    bytes. The CPU threads' tiles are alive together only while the threads run at the same time,
    which a busy machine does not always let them do: the kernel's peak is the largest seen."""
    peak = 0
    for _ in range(runs):
        peak = max(peak, measured_peak_bytes(call, device))
        if peak >= reaching:
            break
    return peak


def measured_and_ruled(op, device_type, args, runs=1):
    """(measured peak of one op call, its outputs' bytes + the rule's temporaries), both rounded as the
    device's allocator rounds; the measured peak is largest_peak's of up to `runs` calls."""
    rounding = CUDA_ROUNDING if device_type == "cuda" else 1
    device = next(a for a in args if torch.is_tensor(a)).device
    outputs = op(*args)  # also the warm-up (cuBLAS's workspace, the accumulator probe) before measuring
    ruled = sum(_rounded(t.untyped_storage().nbytes(), rounding) for t in outputs)
    ruled += sum(_rounded(n, rounding) for _, n in kernel_workspaces.internal_allocations(op.default, device_type,
                                                                                          args, {}))
    return largest_peak(lambda: op(*args), device, runs, reaching=ruled - allowance(ruled)), ruled


def allowance(measured, relative=0.05, slack=32 << 10):
    return relative * measured + slack


def assert_close(measured, ruled, what, relative=0.05, slack=32 << 10):
    assert abs(measured - ruled) <= allowance(measured, relative, slack), f"{what}: measured {measured}, ruled {ruled}"


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
ONE_THREAD_CASES = {  # (M, K, D, options)
    "wide, column LSEs": (300, 1000, 96, dict()),
    "transposed, no positives, ids, bias, small budget": (
        1000, 300, 96, dict(want_col_lse=False, pos_offset=-1, ids=True, bias=True, workspace_bytes=256 << 10)),
}


@pytest.mark.parametrize("algorithm", ["fused", "chunked"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", ONE_THREAD_CASES)
def test_cpu_rules_match_the_measured_peak_on_one_thread(case, dtype, algorithm):
    m, k, d, options = ONE_THREAD_CASES[case]
    with threads(1):
        forward, backward = op_arguments("cpu", dtype, m, k, d, algorithm, **options)
        for op, args in ((FORWARD, forward), (BACKWARD, backward)):
            measured, ruled = measured_and_ruled(op, "cpu", args)
            assert_close(measured, ruled, f"{op} {algorithm} {dtype} {case}")


@pytest.mark.parametrize("algorithm,dtype", [("fused", torch.float32), ("fused", torch.bfloat16),
                                             ("fused", torch.float16), ("fused", torch.float64),
                                             ("chunked", torch.bfloat16)], ids=str)
def test_cpu_rules_match_the_measured_peak_on_two_threads(algorithm, dtype):
    """5 row blocks over 2 threads (2 and 3 blocks), each with tens of ms of work: long enough for
    the second thread to start before the first is done."""
    with threads(2):
        forward, backward = op_arguments("cpu", dtype, 520, 6000, 256, algorithm, pos_offset=7)
        for op, args in ((FORWARD, forward), (BACKWARD, backward)):
            measured, ruled = measured_and_ruled(op, "cpu", args, runs=4)
            assert_close(measured, ruled, f"{op} {algorithm} {dtype}")


@pytest.mark.parametrize("algorithm", ["fused", "chunked"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cpu_rules_count_the_copies_of_strided_inputs(dtype, algorithm):
    """Column-major rows and the stride-0 upstream gradients of a sum are copied by the kernels."""
    with threads(1):
        forward, backward = op_arguments("cpu", dtype, 300, 1000, 96, algorithm)
        rows = forward[0].t().contiguous().t()
        g_row, g_col = torch.tensor(0.5 / 300).expand(300), torch.tensor(0.5 / 1000).expand(1000)
        forward = (rows, *forward[1:])
        backward = (g_row, backward[1], g_col, rows, *backward[4:])
        for op, args in ((FORWARD, forward), (BACKWARD, backward)):
            measured, ruled = measured_and_ruled(op, "cpu", args)
            assert_close(measured, ruled, f"{op} {algorithm} {dtype} strided")


def test_the_tiles_count_once_per_thread_that_has_row_blocks():
    """A thread per row block at most: 100 rows (1 block) on 2 threads hold one thread's tiles."""
    per_thread = (2 * 128 * 512 + 128 + 512) * 4  # tile, exponentials, a row and a column vector (fp32)
    cols = torch.empty(300, 8)
    with threads(2):
        for m, tiles in ((100, 1), (128, 1), (129, 2), (1000, 2)):
            args = (torch.empty(m, 8), cols, torch.tensor(1.0), None, -1, None, None, True, "fused", 1 << 20)
            ruled = rules.RULES["clipshard::contrastive_lse_forward"]("cpu", *args)
            assert sum(n for _, n in ruled) == tiles * per_thread


@pytest.mark.parametrize("dtype,batch,dim,n_threads", [(torch.float32, 300, 96, 1), (torch.bfloat16, 300, 96, 1),
                                                       (torch.float32, 1500, 384, 2)], ids=str)
def test_the_plan_of_a_clip_loss_matches_its_measured_peak(dtype, batch, dim, n_threads):
    with threads(n_threads):
        loss = clipshard.ClipLoss()
        planned = plan_memory(loss, world_size=1, batch_size=batch, dim=dim, dtype=dtype, device="cpu").peak_bytes
        g = torch.Generator().manual_seed(1)
        image = (torch.randn(batch, dim, generator=g) / dim ** 0.5).to(dtype).requires_grad_()
        text = (torch.randn(batch, dim, generator=g) / dim ** 0.5).to(dtype).requires_grad_()
        scale = torch.tensor(14.0, requires_grad=True)

        def call():
            loss(image, text, scale).backward()
            image.grad = text.grad = scale.grad = None

        call()
        measured = largest_peak(call, "cpu", 4, reaching=planned - allowance(planned, 0.10, 256 << 10))
    assert_close(measured, planned, f"ClipLoss M={batch} D={dim} {dtype} {n_threads} threads",
                 relative=0.10, slack=256 << 10)


# --------------------------------------------------------------------------------------------- CUDA

def cuda_rule(op, args):
    """The CUDA rule's temporaries for the op's arguments (CPU tensors stand in for the GPU's)."""
    return [n for _, n in kernel_workspaces.internal_allocations(op.default, "cuda", args, {})]


@pytest.fixture
def h100_launch_rules(monkeypatch):
    monkeypatch.setattr(rules, "cuda_multiprocessors", lambda: 132)
    monkeypatch.delenv(launch_variants.FORWARD_ROWS_VARIABLE, raising=False)


def test_cuda_chunked_rules_by_hand(h100_launch_rules):
    """M = 1000, K = 3000, D = 96, budget 8 MiB, 132 SMs."""
    m, k, d = 1000, 3000, 96
    forward, backward = op_arguments("cpu", torch.bfloat16, m, k, d, "chunked", workspace_bytes=8 << 20)
    # forward: kc = 8 MiB // 5 B // 1000 = 1677 -> 1664 columns; 32 rows per CTA: 32 row blocks;
    # column splits min(ceil(3 * 132 / 32) = 13, ceil(1664 / 256) = 7) = 7
    assert cuda_rule(FORWARD, forward) == [
        1000 * 2 * 4,  # running (max, sum) per row
        7 * 1000 * 2 * 4,  # row partials
        32 * 1664 * 2 * 4,  # column partials
        1000 * 1664 * 4]  # the fp32 similarity chunk
    # backward, bf16: kc = 8 MiB // 6 B // 1000 = 1398 -> 1280 columns, 3 chunks; 32 row blocks x
    # min(13, ceil(1280 / 256) = 5) CTAs; the similarity chunk (5.1 MB) outweighs the bf16 rows' gradient
    assert cuda_rule(BACKWARD, backward) == [
        2 * 3 * 160 * 4,  # partial sums of d scale, d bias
        2 * 8,  # their fp64 totals
        1000 * 1280 * 2,  # bf16 logit gradients
        896 * 96 * 4,  # fp32 buffer of the columns' gradient: 1000 rows -> blocks of 896 columns
        1000 * 96 * (4 - 2),  # fp32 rows' gradient beyond its bf16 output
        1000 * 1280 * 4]  # fp32 similarity chunk
    # fp32 with a bias, a narrow budget (kc = 128): no column buffer, the accumulator is the output;
    # the biased LSEs are taken back out
    forward, backward = op_arguments("cpu", torch.float32, m, k, d, "chunked", bias=True, workspace_bytes=1 << 20)
    assert cuda_rule(BACKWARD, backward) == [
        (1000 + 3000) * 4,  # LSEs without the bias
        2 * 24 * 32 * 1 * 4,  # 24 chunks x 32 row blocks x 1 split
        2 * 8,  # their fp64 totals
        1000 * 128 * 4,  # fp32 logit gradients
        1000 * 128 * 4]  # fp32 similarity chunk
    # fp16, a tiny budget (kc = 128) and wide rows: at the end the rows' fp32 accumulator (1000 x 768
    # x 4 B) sits beside its fp16 output, more than its excess over the output (x 2 B) plus the
    # similarity chunk (1000 x 128 x 4 B) while the chunks run
    forward, backward = op_arguments("cpu", torch.float16, m, 200, 768, "chunked", want_col_lse=False, pos_offset=-1,
                                     workspace_bytes=1)
    assert cuda_rule(BACKWARD, backward) == [
        2 * 4,  # fp16 gradient pre-scale
        2 * 2 * 32 * 1 * 4,  # 2 chunks of 128 columns
        2 * 8,  # fp64 totals
        1000 * 128 * 2,  # fp16 logit gradients
        128 * 768 * 4,  # fp32 buffer of the columns' gradient: the whole 128-column chunk
        1000 * 768 * 4]  # the whole fp32 rows' accumulator


def _column_buffer(args):
    return [n for what, n in kernel_workspaces.internal_allocations(BACKWARD.default, "cuda", args, {})
            if "buffer of the columns' gradient" in what]


@pytest.mark.parametrize("m,rows", [(300, 256), (100, 128)])
def test_cuda_column_gradient_buffer_is_bounded_by_the_rows(h100_launch_rules, m, rows):
    """A small M and a large K (exchange mode over many ranks): CUDA's 256 MiB budget makes one chunk
    of all K = 20000 columns, but the fp32 buffer of the columns' gradient holds blocks of M rounded
    down to 128 columns (at least 128), not the chunk's 20000 x D."""
    backward = op_arguments("cpu", torch.bfloat16, m, 20000, 64, "chunked", workspace_bytes=256 << 20)[1]
    assert _column_buffer(backward) == [rows * 64 * 4]
    assert launch_variants.column_buffer_rows(m, 20000) == rows
    assert launch_variants.column_buffer_rows(1000, 300) == 300  # never wider than a chunk


def test_cuda_chunked_partial_sums_are_bounded_by_the_chunk_group(h100_launch_rules):
    """More chunks than kChunkGroup: the per-CTA sums of one group of chunks at a time (before the
    grouping, 4096 chunks x 16384 CTAs x 2 floats were 512 MiB at M = K = 524288, D = 768, bf16)."""
    m, k = 1000, 128 * 100  # kc = 128 (budget 1 byte): 100 chunks
    backward = op_arguments("cpu", torch.float32, m, k, 64, "chunked", workspace_bytes=1)[1]
    sums = [n for what, n in kernel_workspaces.internal_allocations(BACKWARD.default, "cuda", backward, {})
            if what.startswith("per-CTA partial sums")]
    assert sums == [2 * 64 * 32 * 1 * 4]  # 64 chunks (the group) x 32 row blocks x 1 split


def test_cuda_fused_rules_by_hand(h100_launch_rules):
    m, k, d = 1000, 3000, 96
    forward, backward = op_arguments("cpu", torch.float16, m, k, d, "fused")
    assert cuda_rule(FORWARD, forward) == []  # contiguous features, an fp32 scale: outputs only
    # the fp32 accumulators of both gradients and the fp16 outputs exist together at the end
    assert cuda_rule(BACKWARD, backward) == [
        2 * 16 * 4, 2 * 4,  # partial sums over ceil(1000 / 64) row blocks, their sums
        2 * 4,  # the fp16 pre-scale (D % 8 == 0: tensor cores)
        1000 * 96 * 4, 3000 * 96 * 4]  # fp32 accumulators
    forward, backward = op_arguments("cpu", torch.float32, m, k, d, "fused")
    assert cuda_rule(BACKWARD, backward) == [2 * 16 * 4, 2 * 4]  # fp32: the accumulators are the outputs


CUDA_CASES = {  # (M, K, D, options, algorithms)
    "chunks of 1664 / 1280 columns": (1000, 3000, 96, dict(workspace_bytes=8 << 20), ("chunked", "fused")),
    "one chunk, no positives, bias": (777, 2000, 64, dict(want_col_lse=False, pos_offset=-1, bias=True),
                                      ("chunked", "fused")),
    "ids (chunked only)": (777, 2000, 64, dict(ids=True, pos_offset=5), ("chunked",)),
    "wide rows, 128-column chunks": (1000, 200, 768, dict(pos_offset=-1, workspace_bytes=1), ("chunked", "fused")),
}


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", CUDA_CASES)
def test_cuda_rules_match_the_measured_peak(case, dtype):
    """On a GPU (the GPU check runs it): each op's CUDA peak against its outputs plus the CUDA rule."""
    m, k, d, options, algorithms = CUDA_CASES[case]
    for algorithm in algorithms:
        forward, backward = op_arguments("cuda", dtype, m, k, d, algorithm, **options)
        for op, args in ((FORWARD, forward), (BACKWARD, backward)):
            measured, ruled = measured_and_ruled(op, "cuda", args, runs=2)
            print(f"workspace rule cuda {op} {algorithm} {dtype} M={m} K={k} D={d} {options}: measured {measured}, "
                  f"ruled {ruled}")
            assert_close(measured, ruled, f"{op} {algorithm} {dtype} {case}")


# ---------------------------------------------------------------------------- mirrored C++ constants

@pytest.mark.parametrize("source,line", [
    ("cpu/contrastive_lse.cpp", f"constexpr int64_t kRowBlock = {rules.CPU_ROW_BLOCK};"),
    ("cpu/contrastive_lse.cpp", f"constexpr int64_t kColBlock = {rules.CPU_COL_BLOCK};"),
    ("cpu/contrastive_lse.cpp",
     f"constexpr int64_t kColGradBytesPerThread = int64_t({rules.CPU_COL_GRAD_BYTES_PER_THREAD >> 20}) << 20;"),
    ("cuda/contrastive_lse_chunked.cu",
     f"constexpr int64_t kForwardBytesPerLogit = {rules.CUDA_FORWARD_BYTES_PER_LOGIT};"),
    ("cuda/contrastive_lse_chunked.cu",
     "chunked::chunk_columns(M, K, 4 + int64_t(rows.element_size()), workspace_bytes)"),
    ("cuda/contrastive_lse_chunked_kernels.cuh", f"constexpr int kThreads = {rules.CUDA_CHUNK_THREADS};"),
    ("cuda/contrastive_lse_chunked_kernels.cuh", f"constexpr int kRowsPerCta = {rules.CUDA_GRAD_ROWS_PER_CTA};"),
    ("cuda/contrastive_lse_kernels.cuh", f"constexpr int kTile = {rules.CUDA_FUSED_TILE};"),
    ("cuda/contrastive_lse_chunked.cu", f"constexpr int64_t kChunkGroup = {rules.CUDA_CHUNK_GROUP};"),
    ("cpu/contrastive_lse_chunked.cpp", "chunked::chunk_columns(M, K, sizeof(acc_t), workspace_bytes)"),
    ("cpu/contrastive_lse_chunked.cpp", "chunked::chunk_columns(M, K, 2 * sizeof(acc_t), workspace_bytes)"),
])
def test_the_mirrored_constants_are_the_kernels(source, line):
    assert line in (ROOT / "csrc" / source).read_text()


def test_the_column_splits_mirror_launch_rules():
    """_column_splits is launch_rules::chunk_column_splits in Python: pinned to its C++ body."""
    body = (ROOT / "csrc" / "include" / "clipshard" / "launch_rules.h").read_text()
    assert re.search(r"steps = ceil_div\(width, threads\);\s*"
                     r"const int64_t wanted = ceil_div\(3 \* sms, std::max<int64_t>\(n_row_blocks, 1\)\);\s*"
                     r"return static_cast<unsigned>\(std::clamp<int64_t>\(wanted, 1, "
                     r"std::max<int64_t>\(steps, 1\)\)\);",
                     body)
    assert [rules._column_splits(w, b, 132) for w, b in ((1, 1), (1664, 32), (1664, 1), (100000, 1000))] == [1, 7, 7, 1]
