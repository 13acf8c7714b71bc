"""Workspace rules of clipshard::siglip_forward (clipshard/planning/kernel_workspaces.py).

Both kernels run the chunk driver (csrc/chunked/chunk_driver.h): one M x kc block of similarities
at a time (for_each_chunk's workspace) and, with with_grad, a block of logit gradients
(chunked_gradients' grad_workspace) and the GradientAccumulator's fp32 row gradient. kc comes from
the driver's rule (clipshard.ops.chunk_columns) with the bytes per logit each kernel
passes it.

CPU (csrc/cpu/siglip.cpp, siglip_forward_cpu): the driver gets fp32 (fp64) contiguous copies of
16-bit or strided features, kept for the whole call; everything is accumulated in that dtype, so
the accumulators are the outputs themselves for fp32 / fp64 and fp16 (whose saved gradients are
fp32), and fp32 temporaries for bf16, which get their bf16 outputs after the chunk workspaces are
freed. The per-row sums (std::vector<double>) and the sample-id tables (IdTables) are host vectors
outside torch's allocator: neither counted here nor seen by measured_peak_bytes.

CUDA (csrc/cuda/siglip.cu, siglip_forward_cuda): the features are used as they are (contiguous
copies when strided); fp32 similarities (also for 16-bit features, ATen's out_dtype GEMM), logit
gradients in the features' dtype, a 3 x M fp64 array of per-row accumulators. This rule assumes
that torch's addmm takes an fp32 accumulator with 16-bit factors (addmm_accepts_fp32_accumulator,
newer torch): then the GradientAccumulator holds no M x D rows_buffer_. With older torch a 16-bit
call holds one more fp32 M x D buffer than planned.
"""
import torch

from clipshard.ops import chunk_columns
from clipshard.ops.inputs import accumulate_dtype
from clipshard.ops.launch_variants import column_buffer_rows
from clipshard.planning.workspace_timeline import at_peak, contiguous_copy_bytes, conversions, converted_copy_bytes, \
    dtype_name, nbytes, per_device


def _saved_grad_dtype(dtype):
    """siglip_saved_grad_dtype (csrc/siglip_args.h): fp16 features keep fp32 gradients of the sum."""
    return torch.float32 if dtype == torch.float16 else dtype


def _gradient_outputs(rows, cols):
    """Bytes of grad_rows and grad_cols as the op returns them (the 0-dim outputs, a few bytes, are
    left out of the phase bookkeeping)."""
    M, D = rows.shape
    K = cols.shape[0]
    return nbytes((M + K) * D, _saved_grad_dtype(rows.dtype))


def siglip_forward_cpu(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids, with_grad,
                       workspace_bytes):
    M, D = rows.shape
    K = cols.shape[0]
    acc = accumulate_dtype(rows.dtype)
    acc_name = dtype_name(acc)
    copies, converting = conversions([(f"rows as contiguous {acc_name}", rows, acc),
                                      (f"cols as contiguous {acc_name}", cols, acc)])
    # logit_bytes in siglip_forward_cpu: dots (+ dlogits), both in the accumulation dtype
    kc = chunk_columns(M, K, acc.itemsize * (2 if with_grad else 1), workspace_bytes)
    chunk = nbytes(M * kc, acc)
    outputs = _gradient_outputs(rows, cols) if with_grad else 0
    phases = [(temporaries, 0, outputs) for temporaries in converting]
    if not with_grad:
        phases.append(([*copies, (f"similarity chunk {M} x {kc} {acc_name}", chunk)], 0, 0))
        return at_peak(phases)
    # GradientAccumulator: grad_rows_ (zeros) and grad_cols_ in acc; they are the outputs unless the
    # saved gradients are bf16 (converted by grads.first / second .to(bf16) after the loop)
    outputs_are_accumulators = _saved_grad_dtype(rows.dtype) == acc
    accumulators = [] if outputs_are_accumulators else [
        (f"row gradient accumulator {M} x {D} {acc_name}", nbytes(M * D, acc)),
        (f"column gradient accumulator {K} x {D} {acc_name}", nbytes(K * D, acc))]
    loop = [*copies, *accumulators, (f"similarity chunk {M} x {kc} {acc_name}", chunk),
            (f"logit-gradient chunk {M} x {kc} {acc_name}", chunk)]
    phases.append((loop, outputs if outputs_are_accumulators else 0, outputs))
    phases.append(([*copies, *accumulators], outputs, outputs))  # the outputs made, workspaces freed
    return at_peak(phases)


def siglip_forward_cuda(rows, cols, scale, bias, pos_offset, row_ids, col_ids, mask_same_ids, with_grad,
                        workspace_bytes):
    M, D = rows.shape
    K = cols.shape[0]
    f32 = torch.float32
    base = [("rows as contiguous", contiguous_copy_bytes(rows)), ("cols as contiguous", contiguous_copy_bytes(cols)),
            ("scale as float32", converted_copy_bytes(scale, f32)[0]),
            ("bias as float32", converted_copy_bytes(bias, f32)[0] if bias is not None else 0),
            ("row_ids as contiguous", contiguous_copy_bytes(row_ids) if row_ids is not None else 0),
            ("col_ids as contiguous", contiguous_copy_bytes(col_ids) if col_ids is not None else 0),
            (f"per-row accumulators 3 x {M} float64", nbytes(3 * M, torch.float64))]
    totals = ("accumulator totals (3,) float64", nbytes(3, torch.float64))
    grad_dtype = rows.dtype
    kc = chunk_columns(M, K, 4 + (grad_dtype.itemsize if with_grad else 0), workspace_bytes)
    dots = (f"similarity chunk {M} x {kc} float32", nbytes(M * kc, f32))
    if not with_grad:
        return at_peak([([*base, dots], 0, 0), ([*base, totals], 0, 0)])
    saved = _saved_grad_dtype(grad_dtype)
    outputs = _gradient_outputs(rows, cols)
    fp16 = grad_dtype == torch.float16
    if fp16:  # fp16_prescale: (prescale, unscale) kept; its ones / zeros inputs freed on return
        base.append(("fp16 gradient prescale (2,) float32", nbytes(2, f32)))
    # GradientAccumulator(rows, cols, kc, grad_dtype, unscale, saved): grad_rows_ fp32 zeros (the
    # output when saved is fp32), grad_cols_ in saved (the output), an fp32 column buffer of
    # column_buffer_rows(M, kc) x D (the driver's own rule) unless fp32 without prescale (direct_)
    grad_rows_is_output = saved == f32
    accumulators = [] if grad_rows_is_output else [(f"row gradient accumulator {M} x {D} float32",
                                                    nbytes(M * D, f32))]
    if grad_dtype != f32:
        buffer_rows = column_buffer_rows(M, kc)
        accumulators.append((f"column gradient buffer {buffer_rows} x {D} float32", nbytes(buffer_rows * D, f32)))
    grad_workspace = (f"logit-gradient chunk {M} x {kc} {dtype_name(grad_dtype)}", nbytes(M * kc, grad_dtype))
    grad_cols_bytes = nbytes(K * D, saved)
    loop_outputs = grad_cols_bytes + (nbytes(M * D, saved) if grad_rows_is_output else 0)
    return at_peak([
        ([*base, *accumulators, grad_workspace, dots], loop_outputs, outputs),
        ([*base, *accumulators, grad_workspace], outputs, outputs),  # finish(): grad_rows_.to(saved)
        ([*base, totals], outputs, outputs),
    ])


RULES = {"clipshard::siglip_forward": per_device(cpu=siglip_forward_cpu, cuda=siglip_forward_cuda)}
