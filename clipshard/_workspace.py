"""Workspace budget of the chunked kernels (csrc/chunked/chunk_driver.h).

The chunked losses process the columns in chunks of Kc, keeping one M x Kc block of similarities
(and, in the gradient pass, its gradient) at a time. Kc is the largest multiple of 128 whose
workspace fits the budget (at least 128 columns, at most K), so the extra memory is bounded by the
budget whatever the batch size. The defaults: 256 MiB on CUDA (at M = 8192 rows and bf16 features
that is chunks of about 5000 columns, large enough for cuBLAS to run near its peak), 32 MiB on the
CPU (BLAS needs far smaller blocks there, and the cache rewards them).
"""
import torch

DEFAULT_WORKSPACE_BYTES = {"cuda": 256 << 20, "cpu": 32 << 20}


def workspace_bytes(fn, device, requested=None):
    """The budget in bytes for a chunked kernel on `device`: `requested` when given (an int >= 1),
    else the device type's default."""
    if requested is None:
        return DEFAULT_WORKSPACE_BYTES.get(torch.device(device).type, DEFAULT_WORKSPACE_BYTES["cpu"])
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise TypeError(f"{fn}: workspace_bytes must be an int (bytes) or None, got {type(requested).__name__}")
    if requested < 1:
        raise ValueError(f"{fn}: workspace_bytes must be at least 1, got {requested}")
    return requested
