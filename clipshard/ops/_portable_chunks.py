"""What the two algorithm="torch" ops share (docs/portable.md): the column chunks, their GEMMs with
fp32 (fp64) results, the gradient GEMMs and the fp16 pre-scale. PyTorch operations only, and no
line that depends on the device type: the same code runs on the CPU, CUDA, ROCm, XPU, MPS and the
`meta` device (shapes only).

The chunk machinery is that of csrc/chunked/chunk_driver.h: the K columns go through in chunks of
Kc (clipshard.ops._workspace.chunk_columns), one M x Kc block of similarities at a time, never an M x K
matrix; the gradient pass turns each chunk's logit gradients into grad_rows (an M x D accumulator)
and its rows of grad_cols with two GEMMs.
"""
import torch

from clipshard.ops.inputs import accumulate_dtype
from clipshard.ops._workspace import COLUMN_QUANTUM, chunk_columns

# (device type, dtype) -> whether torch.mm takes out_dtype=fp32 for 16-bit factors there.
_FP32_OUTPUT_GEMM = {}


def _has_fp32_output_gemm(device, dtype):
    """Whether torch.mm(a, b, out_dtype=torch.float32) works for `dtype` factors on `device`'s type
    (recent torch on CUDA; not every torch has it everywhere). Probed once with a 1 x 1 product."""
    key = (device.type, dtype)
    if key not in _FP32_OUTPUT_GEMM:
        one = torch.ones(1, 1, dtype=dtype, device=device)
        try:
            works = torch.mm(one, one, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):  # TypeError: a torch without out_dtype
            works = False
        _FP32_OUTPUT_GEMM[key] = works
    return _FP32_OUTPUT_GEMM[key]


def _mm_with_output_dtype(a, b, dtype):
    """a @ b for 16-bit a and b, with a `dtype` (fp32) result: exact products, fp32 sums."""
    return torch.mm(a, b, out_dtype=dtype)


def fp16_prescale(bound):
    """2^floor(log2(2^14 / bound)) as a 0-dim fp32 tensor (clamped to 2^[-60, 60]; 1 when bound is
    0, Inf or NaN), computed on the device without a host synchronisation: logit gradients bounded
    by `bound`, multiplied by it, stay below 2^15 while the small ones (~1e-8 for a mean loss's
    0.5 / M upstream gradient) reach fp16's normal range (csrc/cuda/fp16_prescale.cuh)."""
    bound = bound.float()
    exponent = torch.floor(torch.log2(16384.0 / bound)).clamp(-60.0, 60.0)
    usable = (bound > 0) & torch.isfinite(bound)
    return torch.where(usable, torch.exp2(exponent), torch.ones_like(bound))


def rows_per_block(d, budget):
    """Rows of an n x d tensor per block of elementwise work whose temporaries (two, up to 8 bytes
    per element) fit `budget` bytes; at least COLUMN_QUANTUM."""
    return max(COLUMN_QUANTUM, budget // (16 * d))


class Chunks:
    """The column chunks of rows (M x D) against cols (K x D) and their GEMMs, in the accumulation
    dtype `acc` (fp32; fp64 for fp64 features).

    16-bit features: where torch.mm has an fp32-output form for them on this device, the GEMMs read
    them as they are and the logit gradients go to the gradient GEMMs in the features' dtype (fp16
    with the pre-scale). Elsewhere (the CPU) rows are upcast once (M x D) and each column chunk when
    it is used (Kc x D), and the gradients stay in fp32: O((M + Kc) D) extra, never a K x D copy.

    acc_buffers: how many M x Kc buffers in acc the caller holds at once per chunk; one more 16-bit
    buffer is counted when with_grad_gemms and the logit gradients are rounded to 16 bits, and
    `extra_bytes` more per logit for the caller's other buffers (the sample ids' boolean masks).
    The chunk width is the widest multiple of 128 whose buffers fit `budget` bytes.
    """

    def __init__(self, rows, cols, budget, acc_buffers, with_grad_gemms, extra_bytes=0):
        self.acc = accumulate_dtype(rows.dtype)
        self.native = rows.dtype == self.acc or _has_fp32_output_gemm(rows.device, rows.dtype)
        self.rows = rows if self.native else rows.to(self.acc)
        self.cols = cols
        self.grad_dtype = rows.dtype if self.native else self.acc  # dtype of the logit gradients' GEMMs
        bytes_per_logit = acc_buffers * torch.finfo(self.acc).bits // 8
        if with_grad_gemms and self.grad_dtype != self.acc:
            bytes_per_logit += rows.element_size()
        bytes_per_logit += extra_bytes
        self.m, self.k = rows.shape[0], cols.shape[0]
        self.width = chunk_columns(self.m, self.k, bytes_per_logit, budget)

    def __iter__(self):
        """(begin, width) of every chunk, in column order."""
        return ((begin, min(self.width, self.k - begin)) for begin in range(0, self.k, self.width))

    def cols_chunk(self, begin, width):
        chunk = self.cols.narrow(0, begin, width)
        return chunk if self.native else chunk.to(self.acc)

    def mm(self, a, b):
        """a @ b with an `acc` result (16-bit factors are multiplied exactly, summed in fp32)."""
        return torch.mm(a, b) if a.dtype == self.acc else _mm_with_output_dtype(a, b, self.acc)

    def dots(self, begin, width):
        """rows @ cols[begin : begin + width]^T, M x width in acc, no scale and no bias."""
        return self.mm(self.rows, self.cols_chunk(begin, width).t())

    def positives(self, block, begin, pos_offset):
        """(first, last, diagonal): rows first..last-1 have their positive column pos_offset + i in
        the chunk starting at `begin`; `diagonal` is the view of block's entries at those positives
        (empty when the chunk holds none)."""
        width = block.shape[1]
        first, last = max(begin - pos_offset, 0), min(begin + width - pos_offset, self.m)
        if first >= last:
            first = last = 0
        column = first + pos_offset - begin if last > first else 0
        return first, last, block.narrow(0, first, last - first).narrow(1, column, last - first).diagonal()


    def other_same_ids(self, row_ids, col_ids, begin, width, pos_offset):
        """M x width bool: the chunk's pairs (i, j) with row_ids[i] == col_ids[j] other than the own
        pair j == pos_offset + i (every same-id pair when pos_offset is None)."""
        same = row_ids.unsqueeze(1) == col_ids.narrow(0, begin, width).unsqueeze(0)
        if pos_offset is not None:
            self.positives(same, begin, pos_offset)[2].fill_(False)
        return same


class GradientGemms:
    """grad_rows = scale * sum over chunks of ds @ cols_chunk and grad_cols[chunk] = scale * ds^T @
    rows, for the gradients ds (M x width, acc) of the loss with respect to every chunk's logits.
    The logit scale multiplies the M x D and Kc x D results, not the M x Kc chunk.

    `prescale` (0-dim fp32, fp16 features only): ds is multiplied by it before it is rounded to
    fp16, and the fp32 GEMM results by its inverse (exact: a power of two). The outputs are rounded
    once, to out_dtype. want_rows / want_cols skip a GEMM whose result nobody needs.
    """

    def __init__(self, chunks, scale, out_dtype, prescale=None, want_rows=True, want_cols=True):
        self.chunks = chunks
        self.prescale = prescale
        self.factor = scale if prescale is None else scale / prescale
        m, d = chunks.rows.shape
        like = chunks.rows
        self.grad_rows = like.new_zeros((m, d), dtype=chunks.acc) if want_rows else None
        self.grad_cols = like.new_empty((chunks.k, d), dtype=out_dtype) if want_cols else None
        self.out_dtype = out_dtype

    def add(self, ds, begin, width):
        chunks = self.chunks
        if chunks.grad_dtype != chunks.acc:
            if self.prescale is not None:
                ds = ds.mul_(self.prescale)
            ds = ds.to(chunks.grad_dtype)
        if self.grad_rows is not None:
            cols_chunk = chunks.cols_chunk(begin, width)
            if ds.dtype == chunks.acc:
                self.grad_rows.addmm_(ds, cols_chunk)
            else:
                self.grad_rows.add_(chunks.mm(ds, cols_chunk))
        if self.grad_cols is not None:
            part = chunks.mm(ds.t(), chunks.rows).mul_(self.factor)
            self.grad_cols.narrow(0, begin, width).copy_(part)

    def results(self):
        """(grad_rows, grad_cols) in out_dtype (None for a skipped one)."""
        grad_rows = self.grad_rows
        if grad_rows is not None:
            grad_rows = grad_rows.mul_(self.factor).to(self.out_dtype)
        return grad_rows, self.grad_cols
