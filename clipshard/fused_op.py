"""The fused contrastive log-sum-exp op: fake (shape) kernels, autograd, and the typed wrapper.

`contrastive_lse(rows, cols, scale)` computes, for S = scale * rows @ cols^T (+ bias), the row
log-sum-exps, the positive logits S[i, pos_offset + i] and the column log-sum-exps over these rows,
without ever materialising S (docs/fused_loss.md).

Two algorithms (docs/fused_loss_cuda.md): "fused" tile kernels that never leave a tile (the CPU
default; on CUDA the hand-written FMA / mma.sync kernels), and "chunked": per chunk of Kc columns a
cuBLAS GEMM into a bounded fp32 workspace, then one fused elementwise kernel (the CUDA default).
"""
import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard._checks import check_feature_pair, check_flags
from clipshard._workspace import workspace_bytes as _workspace_bytes

ALGORITHMS = ("auto", "fused", "chunked")

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _acc_dtype(dtype):
    """Outputs and accumulation: fp64 for fp64 inputs, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("clipshard::contrastive_lse_forward")
def _forward_fake(rows, cols, scale, bias, pos_offset, want_col_lse, algorithm, workspace_bytes, deterministic):
    torch._check(rows.dim() == 2 and cols.dim() == 2, lambda: "contrastive_lse_forward: rows and cols must be 2-D")
    torch._check(rows.shape[1] == cols.shape[1],
                 lambda: "contrastive_lse_forward: rows and cols must have the same feature size D")
    acc = _acc_dtype(rows.dtype)
    m, k = rows.shape[0], cols.shape[0]
    return (rows.new_empty(m, dtype=acc), rows.new_empty(m, dtype=acc),
            rows.new_empty(k if want_col_lse else 0, dtype=acc))


@torch.library.register_fake("clipshard::contrastive_lse_backward")
def _backward_fake(grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, pos_offset, row_lse,
                   col_lse, algorithm, workspace_bytes, deterministic):
    grad_bias = bias.new_empty(()) if bias is not None else scale.new_empty(())
    return rows.new_empty(rows.shape), cols.new_empty(cols.shape), scale.new_empty(()), grad_bias


def _setup_context(ctx, inputs, output):
    rows, cols, scale, bias, pos_offset, want_col_lse, algorithm, workspace_bytes, deterministic = inputs
    row_lse, _, col_lse = output
    ctx.save_for_backward(rows, cols, scale, bias, row_lse, col_lse if want_col_lse else None)
    ctx.pos_offset = pos_offset
    ctx.want_col_lse = want_col_lse
    ctx.algorithm = algorithm
    ctx.workspace_bytes = workspace_bytes
    ctx.deterministic = deterministic or torch.are_deterministic_algorithms_enabled()


def _backward(ctx, grad_row_lse, grad_pos_logit, grad_col_lse):
    rows, cols, scale, bias, row_lse, col_lse = ctx.saved_tensors
    # Outputs that did not take part in the loss may hand back None (or zeros, which are harmless).
    if grad_row_lse is None:
        grad_row_lse = torch.zeros_like(row_lse)
    if grad_pos_logit is None:
        grad_pos_logit = torch.zeros_like(row_lse)
    if not ctx.want_col_lse:
        grad_col_lse = None
    grad_rows, grad_cols, grad_scale, grad_bias = torch.ops.clipshard.contrastive_lse_backward(
        grad_row_lse, grad_pos_logit, grad_col_lse, rows, cols, scale, bias, ctx.pos_offset, row_lse,
        col_lse, ctx.algorithm, ctx.workspace_bytes, ctx.deterministic)
    return grad_rows, grad_cols, grad_scale, grad_bias if bias is not None else None, None, None, None, None, None


torch.library.register_autograd("clipshard::contrastive_lse_forward", _backward, setup_context=_setup_context)


def _check_scalar(name, value, rows):
    """A Python number becomes a 0-dim tensor; a one-element tensor of any shape (open_clip's
    nonscalar_logit_scale uses shape (1,)) is viewed as 0-dim, so its gradient keeps its shape."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"contrastive_lse: {name} must be a float or a one-element tensor, got "
                            f"{type(value).__name__}")
        return torch.tensor(float(value), dtype=_acc_dtype(rows.dtype), device=rows.device)
    if value.numel() != 1:
        raise ValueError(f"contrastive_lse: {name} must be a one-element tensor, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"contrastive_lse: {name} must be a floating-point tensor, got {value.dtype}")
    if value.device != rows.device:
        raise ValueError(f"contrastive_lse: {name} must be on the same device as rows ({rows.device}), "
                         f"got {value.device}")
    return value.reshape(())


def _check_features(rows, cols, pos_offset):
    check_feature_pair("contrastive_lse", ("rows", "cols"), rows, cols, ("M x D", "K x D"))
    if rows.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"contrastive_lse: rows must be float32, float16, bfloat16 or float64, got {rows.dtype}")
    if rows.shape[1] != cols.shape[1]:
        raise ValueError(f"contrastive_lse: rows and cols must have the same feature size D, got "
                         f"{rows.shape[1]} and {cols.shape[1]}")
    m, k = rows.shape[0], cols.shape[0]
    if m == 0 or k == 0 or rows.shape[1] == 0:
        raise ValueError(f"contrastive_lse: empty inputs are not supported (need M, K, D >= 1), got rows "
                         f"{tuple(rows.shape)} and cols {tuple(cols.shape)}")
    if isinstance(pos_offset, bool) or not isinstance(pos_offset, int):
        raise TypeError(f"contrastive_lse: pos_offset must be an int, got {type(pos_offset).__name__}")
    if pos_offset < 0 or pos_offset + m > k:
        raise ValueError(f"contrastive_lse: pos_offset must satisfy 0 <= pos_offset and pos_offset + M <= K "
                         f"(M = {m}, K = {k}), got {pos_offset}")


def resolve_algorithm(fn, algorithm, device):
    """"auto" is "chunked" on CUDA and "fused" elsewhere; anything else must be a known name."""
    if algorithm not in ALGORITHMS:
        raise ValueError(f"{fn}: algorithm must be one of {', '.join(map(repr, ALGORITHMS))}, got {algorithm!r}")
    if algorithm == "auto":
        return "chunked" if device.type == "cuda" else "fused"
    return algorithm


def contrastive_lse(rows, cols, scale, bias=None, pos_offset=0, want_col_lse=True, *, algorithm="auto",
                    workspace_bytes=None, deterministic=False):
    """Fused S = scale * rows @ cols^T (+ bias) reduced to log-sum-exps, never materialising S.

    Args:
        rows: M x D features (fp32, fp16, bf16 or fp64).
        cols: K x D features, same dtype and device.
        scale: logit scale, already exponentiated (a Python float or a one-element tensor;
            differentiable, its gradient has the tensor's shape).
        bias: optional logit bias added to every logit (float or one-element tensor; differentiable).
        pos_offset: row i's positive is column pos_offset + i (0 <= pos_offset, pos_offset + M <= K).
        want_col_lse: also return the column log-sum-exps over these M rows.
        algorithm: "auto" (default: "chunked" on CUDA, "fused" on the CPU), "fused" (tile kernels;
            on CUDA the hand-written FMA kernels, with tensor cores for fp16/bf16 when D % 8 == 0)
            or "chunked" (cuBLAS GEMMs over column chunks, fused elementwise kernels; on fp32 CUDA
            inputs TF32 follows torch.backends.cuda.matmul.allow_tf32).
        workspace_bytes: memory budget of the chunked algorithm's workspace (default 256 MiB on
            CUDA, 32 MiB on the CPU); its chunks are the widest multiple of 128 columns that fits.
        deterministic: kept for a future non-deterministic backward; every current path is
            deterministic (no float atomics, fixed reduction order).

    Returns:
        (row_lse [M], pos_logit [M], col_lse [K], or an empty tensor when not wanted), fp32 — fp64
        for fp64 inputs — whatever the input dtype. Gradients flow to rows, cols, scale and bias.
    """
    _check_features(rows, cols, pos_offset)
    check_flags("contrastive_lse", want_col_lse=want_col_lse, deterministic=deterministic)
    scale = _check_scalar("scale", scale, rows)
    if bias is not None:
        bias = _check_scalar("bias", bias, rows)
    algorithm = resolve_algorithm("contrastive_lse", algorithm, rows.device)
    budget = _workspace_bytes("contrastive_lse", rows.device, workspace_bytes)
    return torch.ops.clipshard.contrastive_lse_forward(rows, cols, scale, bias, pos_offset, want_col_lse,
                                                       algorithm, budget, deterministic)
