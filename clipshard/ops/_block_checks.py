"""Checks of the fused block ops' arguments (contrastive_lse, siglip_sum): a rows x cols block of
features, the column of row 0's positive, and the logit scale / bias. Errors name the op, the
argument, what was expected and what came."""
import torch

from clipshard._checks import check_feature_pair

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def accumulate_dtype(dtype):
    """Outputs and accumulation: fp64 for fp64 inputs, fp32 for everything else."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_block_features(fn, rows, cols, pos_offset, none_allowed=False):
    """rows M x D and cols K x D, and pos_offset placing the M positives among the K columns (or
    None where `none_allowed`: a block without positives, siglip_sum only)."""
    check_feature_pair(fn, ("rows", "cols"), rows, cols, ("M x D", "K x D"))
    if rows.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: rows must be float32, float16, bfloat16 or float64, got {rows.dtype}")
    if rows.shape[1] != cols.shape[1]:
        raise ValueError(f"{fn}: rows and cols must have the same feature size D, got {rows.shape[1]} and "
                         f"{cols.shape[1]}")
    m, k = rows.shape[0], cols.shape[0]
    if m == 0 or k == 0 or rows.shape[1] == 0:
        raise ValueError(f"{fn}: empty inputs are not supported (need M, K, D >= 1), got rows {tuple(rows.shape)} "
                         f"and cols {tuple(cols.shape)}")
    if pos_offset is None and none_allowed:
        return
    if isinstance(pos_offset, bool) or not isinstance(pos_offset, int):
        expected = "an int or None" if none_allowed else "an int"
        raise TypeError(f"{fn}: pos_offset must be {expected}, got {type(pos_offset).__name__}")
    if pos_offset < 0 or pos_offset + m > k:
        raise ValueError(f"{fn}: pos_offset must satisfy 0 <= pos_offset and pos_offset + M <= K (M = {m}, K = {k}), "
                         f"got {pos_offset}")


def check_logit_scalar(fn, name, value, rows):
    """A Python number becomes a 0-dim tensor; a one-element tensor of any shape (open_clip's
    nonscalar_logit_scale uses shape (1,)) is viewed as 0-dim, so its gradient keeps its shape."""
    if not isinstance(value, torch.Tensor):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{fn}: {name} must be a float or a one-element tensor, got {type(value).__name__}")
        return torch.tensor(float(value), dtype=accumulate_dtype(rows.dtype), device=rows.device)
    if value.numel() != 1:
        raise ValueError(f"{fn}: {name} must be a one-element tensor, got shape {tuple(value.shape)}")
    if not value.is_floating_point():
        raise TypeError(f"{fn}: {name} must be a floating-point tensor, got {value.dtype}")
    if value.device != rows.device:
        raise ValueError(f"{fn}: {name} must be on the same device as rows ({rows.device}), got {value.device}")
    return value.reshape(())
