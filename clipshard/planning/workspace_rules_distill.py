"""Workspace rules of clipshard::distill_lse and distill_lse_backward
(clipshard/planning/kernel_workspaces.py).

CPU (csrc/cpu/distill_lse.cpp): features_in makes fp32 (fp64) contiguous copies of the student's and
the teachers' features where they are not so already, kept for the whole call. The forward and the
backward run a parallel loop over min(threads, ceil(M / 128)) chunks of row blocks, each with its
own Scratch of six 128 x 512 tiles and two 512-vectors, counted alive at once (the kernel's peak
when its threads run together; on a busy machine a late thread may start after another freed its
tiles, and the real peak is lower). The backward adds fp32 (fp64) gradient accumulators (the outputs themselves where the
features are already in the accumulation dtype), and per-thread column-gradient accumulators for
every chunk but the first, kc columns wide by the driver's rule (chunk_columns) over
workspace_bytes. Host vectors (the forward's column states, the per-thread std::vector scratch) are
outside torch's allocator: neither counted here nor seen by measured_peak_bytes.

CUDA (csrc/cuda/distill_lse.cu): fp32 chunks of similarities of the student and each teacher read,
kc columns by chunk_columns with the bytes per logit the kernel passes, and (backward) the 16-bit
or fp32 logit gradients and one chunk driver GradientAccumulator per student / teacher. This rule
assumes that torch's addmm takes an fp32 accumulator with 16-bit factors
(addmm_accepts_fp32_accumulator, newer torch): then no GradientAccumulator holds an M x D
rows_buffer_. The forward's partial row states depend on the GPU's SM count (column splits): the
current CUDA device's, else the contrastive rules' assumed one (workspace_rules_contrastive).
"""
import torch

from clipshard.ops import chunk_columns
from clipshard.ops.inputs import accumulate_dtype
from clipshard.ops.launch_variants import column_buffer_rows
from clipshard.planning.workspace_rules_contrastive import cuda_multiprocessors
from clipshard.planning.workspace_timeline import at_peak, conversions, converted_copy_bytes, dtype_name, nbytes, \
    per_device

# Mirrored C++ constants (the tests pin each to its source).
CPU_ROW_BLOCK = 128  # kRowBlock, csrc/cpu/distill_lse.cpp: rows of a CPU tile
CPU_COL_BLOCK = 512  # kColBlock: columns of a CPU tile
CPU_SCRATCH_TILES = 6  # Scratch: student, teacher, exps, weighted, dlogits, teacher_dlogits (+ two kColBlock vectors)
CUDA_ROWS_PER_CTA = 16  # kForwardRows, csrc/cuda/distill_lse_kernels.cuh
CUDA_THREADS = 256  # kThreads, csrc/cuda/contrastive_lse_chunked_kernels.cuh (the distill kernels' too)
CUDA_LAUNCH_TEACHERS = 2  # kDistillMaxLaunchTeachers, csrc/include/clipshard/launch_rules.h
CUDA_MAX_GRID_Y = 65535  # kMaxGridY, the same file
_GRADIENTS = ("grad_row_lse", "grad_pos_logit", "grad_teacher_row_lse", "grad_row_cross", "grad_col_lse",
              "grad_teacher_col_lse", "grad_col_cross")
_STATISTICS = ("row_lse", "teacher_row_lse", "row_cross", "col_lse", "teacher_col_lse", "col_cross")


def _ceil_div(a, b):
    return -(-a // b)


def _forward_outputs(M, K, T, want_columns, dtype):
    """Bytes of distill_lse's seven outputs."""
    columns = K if want_columns else 0
    return nbytes(2 * M + 2 * T * M + columns + 2 * T * columns, dtype)


def _backward_outputs(rows, cols, teacher_rows, teacher_cols, teacher_scale, teacher_grad):
    """Bytes of distill_lse_backward's gradient outputs (the 0-dim grad_scale, a few bytes, left out)."""
    total = nbytes(rows.numel(), rows.dtype) + nbytes(cols.numel(), cols.dtype)
    if teacher_grad:
        total += nbytes(teacher_rows.numel() + teacher_cols.numel(), teacher_rows.dtype)
        total += nbytes(teacher_scale.numel(), teacher_scale.dtype)
    return total


def _cpu_parallel_chunks(M):
    """The chunks of the CPU kernels' parallel loop: one per thread, at most one per row block."""
    return min(torch.get_num_threads(), _ceil_div(M, CPU_ROW_BLOCK))


def _cpu_scratch(M, acc):
    chunks = _cpu_parallel_chunks(M)
    per_thread = nbytes(CPU_SCRATCH_TILES * CPU_ROW_BLOCK * CPU_COL_BLOCK + 2 * CPU_COL_BLOCK, acc)
    tiles = f"{CPU_SCRATCH_TILES} x {CPU_ROW_BLOCK} x {CPU_COL_BLOCK} + 2 x {CPU_COL_BLOCK}"
    return f"per-thread tiles: {chunks} x ({tiles}) {dtype_name(acc)}", chunks * per_thread


def _cpu_features(rows, cols, teacher_rows, teacher_cols, acc, before=()):
    """features_in: the copies (kept) and their conversion phases."""
    steps = [("rows", rows), ("cols", cols), ("teacher_rows", teacher_rows), ("teacher_cols", teacher_cols)]
    return conversions([(f"{name} as contiguous {dtype_name(acc)}", tensor, acc) for name, tensor in steps], before)


def _backward_inputs(grads, stats, teacher_grad, acc):
    """distill_backward_inputs (csrc/distill_args.cpp): the upstream gradients that count (given, not
    empty; the teacher LSEs' only with teacher_grad) and the statistics they need, converted to acc
    and contiguous: (kept copies [(what, bytes)], the names of the gradients that count)."""
    given = {name: g for name, g in zip(_GRADIENTS, grads) if g is not None and g.numel() > 0}
    if not teacher_grad:  # these reach only dT, which is not formed
        given.pop("grad_teacher_row_lse", None)
        given.pop("grad_teacher_col_lse", None)
    stat = dict(zip(_STATISTICS, stats))
    needed = []
    if "grad_row_lse" in given:
        needed.append("row_lse")
    if "grad_row_cross" in given or "grad_teacher_row_lse" in given:
        needed += ["teacher_row_lse"] + (["row_cross"] if teacher_grad and "grad_row_cross" in given else [])
    if "grad_col_lse" in given:
        needed.append("col_lse")
    if "grad_col_cross" in given or "grad_teacher_col_lse" in given:
        needed += ["teacher_col_lse"] + (["col_cross"] if teacher_grad and "grad_col_cross" in given else [])
    converted = [*given.items(), *((name, stat[name]) for name in needed)]
    copies = [(f"{name} as contiguous {dtype_name(acc)}", converted_copy_bytes(tensor, acc)[0])
              for name, tensor in converted]
    return copies, set(given)


def _needs_teacher(given, teacher_grad):
    """DistillBackwardInputs::needs_teacher: whether any teacher statistic enters dS or dT."""
    return bool({"grad_row_cross", "grad_col_cross"} & given) or (
        teacher_grad and bool({"grad_teacher_row_lse", "grad_teacher_col_lse"} & given))


# ------------------------------------------------------------------------------------------- CPU


def distill_lse_cpu(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns,
                    workspace_bytes):
    M, K, T = rows.shape[0], cols.shape[0], teacher_rows.shape[0]
    acc = accumulate_dtype(rows.dtype)
    outputs = _forward_outputs(M, K, T, want_columns, acc)
    copies, converting = _cpu_features(rows, cols, teacher_rows, teacher_cols, acc)
    # the outputs are made before the parallel loop, whose Scratch tiles are the peak
    return at_peak([*((phase, 0, outputs) for phase in converting),
                    ([*copies, _cpu_scratch(M, acc)], outputs, outputs)])


def distill_lse_backward_cpu(grad_row_lse, grad_pos_logit, grad_teacher_row_lse, grad_row_cross, grad_col_lse,
                             grad_teacher_col_lse, grad_col_cross, rows, cols, teacher_rows, teacher_cols, scale,
                             teacher_scale, pos_offset, row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse,
                             col_cross, teacher_grad, workspace_bytes):
    (M, D), K, (T, _, Dt) = rows.shape, cols.shape[0], teacher_rows.shape
    acc = accumulate_dtype(rows.dtype)
    outputs = _backward_outputs(rows, cols, teacher_rows, teacher_cols, teacher_scale, teacher_grad)
    grads = (grad_row_lse, grad_pos_logit, grad_teacher_row_lse, grad_row_cross, grad_col_lse, grad_teacher_col_lse,
             grad_col_cross)
    inputs, _ = _backward_inputs(grads, (row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross),
                                 teacher_grad, acc)
    features, converting = _cpu_features(rows, cols, teacher_rows, teacher_cols, acc, before=inputs)
    kept = [*inputs, *features]
    # Accumulators: acc.rows / acc.cols become the outputs when rows are already in acc (.to() is a
    # no-op); the teachers' are stacked into new outputs at the end
    student_is_output = rows.dtype == acc
    acc_name = dtype_name(acc)
    student = [] if student_is_output else [
        (f"row gradient accumulator {M} x {D} {acc_name}", nbytes(M * D, acc)),
        (f"column gradient accumulator {K} x {D} {acc_name}", nbytes(K * D, acc))]
    teachers = [(f"teacher gradient accumulators {T} x ({M} + {K}) x {Dt} {acc_name}",
                 nbytes(T * (M + K) * Dt, acc) if teacher_grad else 0)]
    # backward_impl: column-gradient accumulators of width D (+ T x Dt) for every chunk but the first
    chunks = _cpu_parallel_chunks(M)
    width = D + (T * Dt if teacher_grad else 0)
    kc = chunk_columns(max(chunks - 1, 1) * width, K, acc.itemsize, workspace_bytes)
    partial = (f"per-thread column-gradient accumulators {chunks - 1} x {kc} x {width} {acc_name}",
               nbytes((chunks - 1) * kc * width, acc))
    student_outputs = nbytes(rows.numel() + cols.numel(), acc) if student_is_output else 0
    phases = [*((phase, 0, outputs) for phase in converting),
              ([*kept, *student, *teachers, partial, _cpu_scratch(M, acc)], student_outputs, outputs)]
    # the return: at::stack of the teacher accumulators (then .to(teacher dtype) if that differs)
    stacked = [(f"stacked teacher gradients {T} x ({M} + {K}) x {Dt} {acc_name}",
                nbytes(T * (M + K) * Dt, acc) if teacher_grad and teacher_rows.dtype != acc else 0)]
    phases.append(([*kept, *student, *teachers, *stacked], outputs, outputs))
    return at_peak(phases)


# ------------------------------------------------------------------------------------------ CUDA


def _column_splits(width, row_blocks, multiprocessors):
    """launch_rules::chunk_column_splits: about three CTAs per SM, at least 1, at most one per
    column step of the CTA's threads."""
    steps = max(_ceil_div(width, CUDA_THREADS), 1)
    return min(max(_ceil_div(3 * multiprocessors, max(row_blocks, 1)), 1), steps)


def _float32_copy(name, tensor):
    return (f"{name} as float32", converted_copy_bytes(tensor, torch.float32)[0])


def distill_lse_cuda(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset, want_columns,
                     workspace_bytes):
    M, K, T = rows.shape[0], cols.shape[0], teacher_rows.shape[0]
    f32 = torch.float32
    # per logit: the student's and the teachers' fp32 chunks, plus partial column states
    kc = chunk_columns(M, K, 4 * (1 + T) + 2, workspace_bytes)
    row_blocks = _ceil_div(M, CUDA_ROWS_PER_CTA)
    grid_rows = min(row_blocks, CUDA_MAX_GRID_Y)
    splits = _column_splits(kc, grid_rows, cuda_multiprocessors())
    pair = min(T, CUDA_LAUNCH_TEACHERS)
    columns = 1 if want_columns else 0
    temporaries = [
        _float32_copy("scale", scale), _float32_copy("teacher_scale", teacher_scale),
        (f"student similarity chunk {M} x {kc} float32", nbytes(M * kc, f32)),
        (f"teacher similarity chunks {T} x {M} x {kc} float32", nbytes(T * M * kc, f32)),
        (f"running row states {M} x 2 float32", nbytes(M * 2, f32)),
        (f"teachers' running row states {T} x {M} x 3 float32", nbytes(T * M * 3, f32)),
        (f"partial row states {splits} x {M} x 2 float32", nbytes(splits * M * 2, f32)),
        (f"teachers' partial row states {pair} x {splits} x {M} x 3 float32", nbytes(pair * splits * M * 3, f32)),
        (f"partial column states {row_blocks} x {kc} x 2 float32", nbytes(columns * row_blocks * kc * 2, f32)),
        (f"teachers' partial column states {pair} x {row_blocks} x {kc} x 3 float32",
         nbytes(columns * pair * row_blocks * kc * 3, f32)),
    ]
    outputs = _forward_outputs(M, K, T, want_columns, f32)  # made before the chunk loop
    return at_peak([(temporaries, outputs, outputs)])


def _fp16_prescale_phase(rows, cols):
    """fp16_prescales' largest moment: the bound W = 2 |scale| max|rows_i| max|cols_j|, whose fp32
    copies of the features and their norms live to the end of the expression, next to the zeros
    and the first prescale."""
    (M, D), K = rows.shape, cols.shape[0]
    f32 = torch.float32
    return [(f"fp16 prescale: zeros {M} + {K} float32", nbytes(M + K + 1, f32)),
            ("fp16 prescale: the student's prescale (2,) float32", nbytes(2, f32)),
            _float32_copy("fp16 prescale: rows", rows), _float32_copy("fp16 prescale: cols", cols),
            (f"fp16 prescale: feature norms {M} + {K} float32", nbytes(M + K, f32))]


def _gradient_accumulator(name, M, K, D, kc, grad_dtype, prescaled):
    """chunked::GradientAccumulator with out_dtype float32: grad_rows_ and grad_cols_ in fp32, an
    fp32 column buffer of column_buffer_rows(M, kc) x D (the driver's own rule) unless the logit
    gradients are fp32 and not prescaled (direct_)."""
    f32 = torch.float32
    buffer_rows = column_buffer_rows(M, kc)
    buffer = nbytes(buffer_rows * D, f32) if grad_dtype != f32 or prescaled else 0
    return [(f"{name} row gradient accumulator {M} x {D} float32", nbytes(M * D, f32)),
            (f"{name} column gradient accumulator {K} x {D} float32", nbytes(K * D, f32)),
            (f"{name} column gradient buffer {buffer_rows} x {D} float32", buffer)]


def _scaled_gradients(name, M, K, D, dtype):
    """scaled_gradients (distill_lse.cu) for one set of features of `dtype`: d scale from
    (rows.to(fp32) * g_rows).sum(), then (g * scale).to(dtype) for the rows and the columns, the
    fp32 products temporaries unless the features are fp32. Returns (the temporaries of d scale,
    those of the return, its results (what, bytes))."""
    f32 = torch.float32
    d_scale = [(f"{name} rows as float32 for d scale", nbytes(M * D, f32) if dtype != f32 else 0),
               (f"{name} rows * gradient {M} x {D} float32", nbytes(M * D, f32))]
    products = [(f"{name} scaled fp32 gradients ({M} + {K}) x {D}", nbytes((M + K) * D, f32) if dtype != f32 else 0)]
    return d_scale, products, (f"{name} gradients ({M} + {K}) x {D} {dtype_name(dtype)}", nbytes((M + K) * D, dtype))


def distill_lse_backward_cuda(grad_row_lse, grad_pos_logit, grad_teacher_row_lse, grad_row_cross, grad_col_lse,
                              grad_teacher_col_lse, grad_col_cross, rows, cols, teacher_rows, teacher_cols, scale,
                              teacher_scale, pos_offset, row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse,
                              col_cross, teacher_grad, workspace_bytes):
    (M, D), K, (T, _, Dt) = rows.shape, cols.shape[0], teacher_rows.shape
    f32 = torch.float32
    s_dtype, t_dtype = rows.dtype, teacher_rows.dtype
    outputs = _backward_outputs(rows, cols, teacher_rows, teacher_cols, teacher_scale, teacher_grad)
    grads = (grad_row_lse, grad_pos_logit, grad_teacher_row_lse, grad_row_cross, grad_col_lse, grad_teacher_col_lse,
             grad_col_cross)
    inputs, given = _backward_inputs(grads, (row_lse, teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross),
                                     teacher_grad, f32)
    n_teachers = T if _needs_teacher(given, teacher_grad) else 0  # teachers whose logits the kernel reads
    dt_wanted = teacher_grad and n_teachers > 0
    inputs += [_float32_copy("scale", scale), _float32_copy("teacher_scale", teacher_scale)]
    per_logit = 4 + s_dtype.itemsize + n_teachers * (4 + (t_dtype.itemsize if dt_wanted else 0))
    kc = chunk_columns(M, K, per_logit, workspace_bytes)
    fp16 = s_dtype == torch.float16 or (dt_wanted and t_dtype == torch.float16)
    phases = [(inputs + _fp16_prescale_phase(rows, cols), 0, outputs)] if fp16 else []
    base = [*inputs, (f"prescales ({1 + T}, 2) float32", nbytes(2 * (1 + T), f32) if fp16 else 0),
            (f"unit prescales ({1 + T}, 2) float32", nbytes(2 * (1 + T), f32)),
            (f"student similarity chunk {M} x {kc} float32", nbytes(M * kc, f32)),
            (f"teacher similarity chunks {n_teachers} x {M} x {kc} float32", nbytes(n_teachers * M * kc, f32)),
            *_gradient_accumulator("student", M, K, D, kc, s_dtype, fp16),
            (f"student logit-gradient chunk {M} x {kc} {dtype_name(s_dtype)}", nbytes(M * kc, s_dtype)),
            (f"teacher logit-gradient chunks {T} x {M} x {kc} {dtype_name(t_dtype)}",
             nbytes(T * M * kc, t_dtype) if dt_wanted else 0)]
    for t in range(T if dt_wanted else 0):
        base += _gradient_accumulator(f"teacher {t}", M, K, Dt, kc, t_dtype, fp16)
    phases.append((base, 0, outputs))  # the chunk loop; every buffer lives until the op returns
    d_scale, products, (_, student_outputs) = _scaled_gradients("student", M, K, D, s_dtype)
    phases += [([*base, *d_scale], 0, outputs), ([*base, *products], student_outputs, outputs)]
    if not dt_wanted:  # the teachers' outputs are empty, or zeros made at the end
        phases.append((base, outputs, outputs))
        return at_peak(phases)
    made = []  # each teacher's gradients, kept in vectors until at::stack makes the outputs of them all
    for t in range(T):
        d_scale, products, results = _scaled_gradients(f"teacher {t}", M, K, Dt, t_dtype)
        phases += [([*base, *made, *d_scale], student_outputs, outputs),
                   ([*base, *made, *products, results], student_outputs, outputs)]
        made.append(results)
    phases.append(([*base, *made], outputs, outputs))
    return at_peak(phases)


RULES = {
    "clipshard::distill_lse": per_device(cpu=distill_lse_cpu, cuda=distill_lse_cuda),
    "clipshard::distill_lse_backward": per_device(cpu=distill_lse_backward_cpu, cuda=distill_lse_backward_cuda),
}
