"""Workspace rules of clipshard::contrastive_lse_forward / _backward (clipshard/planning/kernel_workspaces.py).

Each rule lists the temporaries the compiled kernel holds at its own peak besides its outputs (the
tracker counts the outputs itself), read off the C++ of every path: the CPU tile kernels
(csrc/cpu/contrastive_lse.cpp, algorithm "fused"), the CPU chunked kernels
(csrc/cpu/contrastive_lse_chunked.cpp on csrc/chunked/chunk_driver.h), the CUDA chunked kernels
(csrc/cuda/contrastive_lse_chunked.cu on the same driver) and the CUDA tile kernels
(csrc/cuda/contrastive_lse.cu, "fused"). Chunk widths come from clipshard.ops.chunk_columns,
the twin of the driver's own rule, with the bytes per logit each kernel passes it.

The CPU tile kernels hold one pair of tiles per thread, all at once: the threads are those of
torch.get_num_threads() when the plan is made (set it as the training run will). What is counted
is what torch's allocator hands out (what measured_peak_bytes sees): not the CPU kernels'
std::vector state (online log-sum-exp states, per-row sums: O(M + threads x K) host bytes), nor
cuBLAS's workspace or the CUDA caching allocator's reserve.

Temporaries that live one after another count as the larger of the moments they make ("phases").
The backward's gradient accumulators need care: an fp32 accumulator of a 16-bit gradient becomes
its output only at the end, so while the tiles or chunks are alive the output does not exist yet
(the accumulator counts as its excess over the output), and at the end both exist.
"""
import math

import torch

from clipshard.ops import launch_variants
from clipshard.ops import chunk_columns
from clipshard.ops.inputs import accumulate_dtype

# Mirrored C++ constants (the test pins each to its source line).
CPU_ROW_BLOCK = 128  # kRowBlock, csrc/cpu/contrastive_lse.cpp: rows of a CPU tile
CPU_COL_BLOCK = 512  # kColBlock: columns of a CPU tile
CPU_COL_GRAD_BYTES_PER_THREAD = 8 << 20  # kColGradBytesPerThread: a backward thread's column-gradient budget
CUDA_FORWARD_BYTES_PER_LOGIT = 5  # kForwardBytesPerLogit, csrc/cuda/contrastive_lse_chunked.cu
CUDA_CHUNK_THREADS = 256  # kThreads, csrc/cuda/contrastive_lse_chunked_kernels.cuh
CUDA_GRAD_ROWS_PER_CTA = 32  # kRowsPerCta, the same file: rows per CTA of chunk_grad_kernel
CUDA_CHUNK_GROUP = 64  # kChunkGroup, contrastive_lse_chunked.cu: chunks whose per-CTA sums are kept at once
CUDA_FUSED_TILE = 64  # kTile, csrc/cuda/contrastive_lse_kernels.cuh: rows per CTA of the tile kernels
# The SM count planned for when no GPU is visible (an H100 SXM's); it only sizes the chunked
# kernels' per-CTA partial sums (about 3 x SMs x 32 rows x 8 bytes: 100 KiB on an H100).
ASSUMED_MULTIPROCESSORS = 132

_F32 = torch.float32


def _nbytes(dtype, *shape):
    return math.prod(shape) * dtype.itemsize


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def _copy(what, tensor, dtype):
    """(what, bytes) of tensor.to(dtype).contiguous(): 0 when the tensor already is that (no copy)."""
    if tensor is None or (tensor.dtype == dtype and tensor.is_contiguous()):
        return (what, 0)
    return (what, _nbytes(dtype, tensor.numel()))


def _accumulator(what, shape, acc, out, output_made):
    """(what, bytes) of a gradient accumulator in dtype `acc` that the kernel returns as
    accumulator.to(out) at its end: nothing when that is the accumulator itself (counted with the
    outputs), all of it once its output exists, else its excess over the output (which the tracker
    counts although it does not exist yet)."""
    label = f"{_name(acc)} accumulator of {what}"
    if acc == out:
        return (label, 0)
    if output_made:
        return (label, _nbytes(acc, *shape))
    return (f"{label}, beyond the {_name(out)} output made from it at the end",
            _nbytes(acc, *shape) - _nbytes(out, *shape))


def _at_peak(*phases):
    """The phase (a list of (what, bytes)) with the most bytes."""
    return max(phases, key=lambda phase: sum(n for _, n in phase))


def cuda_multiprocessors():
    """The SM count of the current GPU, ASSUMED_MULTIPROCESSORS when none is visible."""
    if not torch.cuda.is_available():
        return ASSUMED_MULTIPROCESSORS
    return launch_variants.multiprocessors(torch.device("cuda", torch.cuda.current_device()))


def _column_splits(width, row_blocks, multiprocessors):
    """CTAs per chunk row: launch_rules::chunk_column_splits (csrc/include/clipshard/launch_rules.h),
    about three CTAs per SM, at least 1, at most one per CUDA_CHUNK_THREADS columns."""
    steps = -(-width // CUDA_CHUNK_THREADS)
    wanted = -(-3 * multiprocessors // max(row_blocks, 1))
    return min(max(wanted, 1), max(steps, 1))


# ------------------------------------------------------------------------------------------- CPU

def _cpu_threads(m):
    """Threads ("chunks") of the tile kernels: min(at::get_num_threads(), row blocks); each runs one
    at::parallel_for task and holds its own tiles."""
    return min(torch.get_num_threads(), -(-m // CPU_ROW_BLOCK))


def _cpu_tiles(threads, acc, forward):
    """forward_impl / backward_impl's per-thread scratch: the 128 x 512 similarity tile and its
    exponentials (and, forward, a row and a column vector), in every thread at once."""
    per_thread = 2 * CPU_ROW_BLOCK * CPU_COL_BLOCK + (CPU_ROW_BLOCK + CPU_COL_BLOCK if forward else 0)
    return (f"per-thread similarity and exponential tiles ({threads} threads x 2 x {CPU_ROW_BLOCK} x "
            f"{CPU_COL_BLOCK})", _nbytes(acc, threads, per_thread))


def _cpu_feature_copies(rows, cols, acc):
    """A = rows.to(acc).contiguous(), B = cols.to(acc).contiguous(): alive through the whole call."""
    return [_copy(f"{_name(acc)} copy of the rows (M x D)", rows, acc),
            _copy(f"{_name(acc)} copy of the columns (K x D)", cols, acc)]


def _cpu_forward(rows, cols, scale, bias, pos_offset, row_ids, col_ids, want_col_lse, algorithm, workspace_bytes):
    acc = accumulate_dtype(rows.dtype)
    m, k = rows.shape[0], cols.shape[0]
    held = _cpu_feature_copies(rows, cols, acc)
    if algorithm == "chunked":  # for_each_chunk's workspace, kc from chunk_columns(M, K, sizeof(acc), budget)
        kc = chunk_columns(m, k, acc.itemsize, workspace_bytes)
        return held + [(f"chunk of raw similarities (M x {kc} {_name(acc)})", _nbytes(acc, m, kc))]
    return held + [_cpu_tiles(_cpu_threads(m), acc, forward=True)]


def _cpu_backward(grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, pos_offset, row_ids, col_ids,
                  row_lse, col_lse, algorithm, workspace_bytes):
    acc = accumulate_dtype(rows.dtype)
    m, k, d = rows.shape[0], cols.shape[0], rows.shape[1]
    with_col = grad_col_lse is not None
    held = _cpu_feature_copies(rows, cols, acc) + [
        _copy("copy of grad_row_lse", grad_row_lse, acc), _copy("copy of grad_pos_logit", grad_pos_logit, acc),
        _copy("copy of row_lse", row_lse, acc)]
    if with_col:
        held += [_copy("copy of grad_col_lse", grad_col_lse, acc), _copy("copy of col_lse", col_lse, acc)]
    if bias is not None:  # r_lse - b, c_lse - b
        held.append(("log-sum-exps without the bias", _nbytes(acc, m + (k if with_col else 0))))

    def gradients(output_made):  # G (M x D), Gc (K x D), returned as G.to(rows' dtype), Gc.to(cols')
        return [_accumulator("the rows' gradient (M x D)", (m, d), acc, rows.dtype, output_made),
                _accumulator("the columns' gradient (K x D)", (k, d), acc, cols.dtype, output_made)]

    if algorithm == "chunked":  # chunked_gradients: dlogits and the for_each_chunk similarities
        kc = chunk_columns(m, k, 2 * acc.itemsize, workspace_bytes)
        chunks = [(f"chunk of raw similarities (M x {kc} {_name(acc)})", _nbytes(acc, m, kc)),
                  (f"chunk of logit gradients (M x {kc} {_name(acc)})", _nbytes(acc, m, kc))]
    else:  # backward_impl: the other threads' column-gradient partials of a super-block, and the tiles
        threads = _cpu_threads(m)
        super_cols = min(k, max(CPU_COL_BLOCK, CPU_COL_GRAD_BYTES_PER_THREAD // (d * acc.itemsize)
                                // CPU_COL_BLOCK * CPU_COL_BLOCK))
        chunks = [(f"column-gradient partials of every thread but the first ({threads - 1} x {super_cols} x D)",
                   _nbytes(acc, threads - 1, super_cols, d)),
                  _cpu_tiles(threads, acc, forward=False)]
    return _at_peak(held + gradients(False) + chunks, held + gradients(True))


# ------------------------------------------------------------------------------------------ CUDA

def _cuda_scalars(scale, bias):
    """scale.to(fp32), bias->to(fp32)."""
    return [_copy("fp32 copy of scale", scale, _F32), _copy("fp32 copy of bias", bias, _F32)]


def _cuda_forward(rows, cols, scale, bias, pos_offset, row_ids, col_ids, want_col_lse, algorithm, workspace_bytes):
    m, k = rows.shape[0], cols.shape[0]
    held = _cuda_scalars(scale, bias)
    if algorithm == "fused":  # fused_forward(rows.contiguous(), cols.contiguous(), ...): outputs only
        return held + [_copy("contiguous copy of the rows", rows, rows.dtype),
                       _copy("contiguous copy of the columns", cols, cols.dtype)]
    kc = chunk_columns(m, k, CUDA_FORWARD_BYTES_PER_LOGIT, workspace_bytes)
    row_blocks = -(-m // launch_variants.chunked_forward_rows(m))
    splits = _column_splits(kc, row_blocks, cuda_multiprocessors())
    return held + [
        ("running (max, sum) of every row (M x 2 fp32)", _nbytes(_F32, m, 2)),
        (f"per-CTA row partials ({splits} column splits x M x 2 fp32)", _nbytes(_F32, splits, m, 2)),
        (f"per-CTA column partials ({row_blocks} row blocks x {kc} x 2 fp32)",
         _nbytes(_F32, row_blocks, kc, 2) if want_col_lse else 0),
        (f"chunk of raw similarities (M x {kc} fp32)", _nbytes(_F32, m, kc))]


def _cuda_backward(grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, pos_offset, row_ids, col_ids,
                   row_lse, col_lse, algorithm, workspace_bytes):
    m, k, d = rows.shape[0], cols.shape[0], rows.shape[1]
    dtype = rows.dtype
    with_col = grad_col_lse is not None and grad_col_lse.numel() > 0  # an empty one: no column term
    held = _cuda_scalars(scale, bias) + [  # float_vector copies
        _copy("fp32 copy of grad_row_lse", grad_row_lse, _F32),
        _copy("fp32 copy of grad_pos_logit", grad_pos_logit, _F32),
        _copy("fp32 copy of row_lse", row_lse, _F32)]
    if with_col:
        held += [_copy("fp32 copy of grad_col_lse", grad_col_lse, _F32), _copy("fp32 copy of col_lse", col_lse, _F32)]

    if algorithm == "fused":
        # fused_backward: grad_rows_f / grad_cols_f fp32 zeros, returned as .to(features' dtype);
        # partial sums 2 x row blocks and their 2 sums; the fp16 pre-scale (tensor-core kernels:
        # D % 8 == 0, assuming 16-byte aligned features on sm_80+)
        def gradients(output_made):
            return [_accumulator("the rows' gradient (M x D)", (m, d), _F32, dtype, output_made),
                    _accumulator("the columns' gradient (K x D)", (k, d), _F32, dtype, output_made)]
        fixed = held + [
            _copy("contiguous copy of the rows", rows, dtype), _copy("contiguous copy of the columns", cols, dtype),
            ("per-CTA partial sums of d scale and d bias", _nbytes(_F32, 2, -(-m // CUDA_FUSED_TILE))),
            ("their two sums", _nbytes(_F32, 2)),
            ("fp16 gradient pre-scale", _nbytes(_F32, 2) if dtype == torch.float16 and d % 8 == 0 else 0)]
        return _at_peak(fixed + gradients(False), fixed + gradients(True))

    if bias is not None:  # lse_row - bias_f, lse_col - bias_f
        held.append(("log-sum-exps without the bias", _nbytes(_F32, m + (k if with_col else 0))))
    kc = chunk_columns(m, k, 4 + dtype.itemsize, workspace_bytes)
    row_blocks = -(-m // CUDA_GRAD_ROWS_PER_CTA)
    slots = row_blocks * _column_splits(kc, row_blocks, cuda_multiprocessors())
    chunks = min(-(-k // kc), CUDA_CHUNK_GROUP)
    # chunked_gradients with grad_dtype = the features' dtype: GradientAccumulator's grad_rows_ (fp32
    # zeros, returned as .to(dtype)), grad_cols_ (the output itself) and, unless fp32 (direct_),
    # its fp32 buffer of grad_cols, column_buffer_rows(M, kc) columns (the driver's own rule);
    # rows_buffer_ is assumed absent (addmm.dtype_out takes an fp32 accumulator with 16-bit factors
    # on CUDA: addmm_accepts_fp32_accumulator).
    buffer_rows = launch_variants.column_buffer_rows(m, kc)
    fixed = held + [
        ("fp16 gradient pre-scale", _nbytes(_F32, 2) if dtype == torch.float16 else 0),
        (f"per-CTA partial sums of d scale and d bias ({chunks} chunks x {slots} CTAs x 2)",
         _nbytes(_F32, 2, chunks, slots)),
        ("fp64 totals of d scale and d bias", 2 * _nbytes(torch.float64, 1)),
        (f"chunk of logit gradients (M x {kc} {_name(dtype)})", _nbytes(dtype, m, kc)),
        (f"fp32 buffer of the columns' gradient ({buffer_rows} x D)",
         0 if dtype == _F32 else _nbytes(_F32, buffer_rows, d))]
    similarities = (f"chunk of raw similarities (M x {kc} fp32)", _nbytes(_F32, m, kc))  # for_each_chunk's
    def rows_gradient(output_made):
        return _accumulator("the rows' gradient (M x D)", (m, d), _F32, dtype, output_made)

    return _at_peak(fixed + [rows_gradient(False), similarities], fixed + [rows_gradient(True)])


def _by_device(**rules):
    """rule(device_type, *op_args) of the kernels compiled for "cpu" and "cuda"."""
    return lambda device_type, *op_args: rules[device_type](*op_args)


RULES = {
    "clipshard::contrastive_lse_forward": _by_device(cpu=_cpu_forward, cuda=_cuda_forward),
    "clipshard::contrastive_lse_backward": _by_device(cpu=_cpu_backward, cuda=_cuda_backward),
}
