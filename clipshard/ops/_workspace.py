"""Workspace budget of the chunked kernels (csrc/chunked/chunk_driver.h).

The chunked losses process the columns in chunks of Kc, keeping one M x Kc block of similarities
(and, in the gradient pass, its gradient) at a time. Kc is the largest multiple of 128 whose
workspace fits the budget (at least 128 columns, at most K), so the extra memory is bounded by the
budget whatever the batch size. The defaults: 256 MiB on CUDA (at M = 8192 rows and bf16 features
that is chunks of about 5000 columns, large enough for cuBLAS to run near its peak), 32 MiB on the
CPU (BLAS needs far smaller blocks there, and the cache rewards them). Other devices (which run
algorithm="torch": ROCm, XPU, MPS, ...) are accelerators with GPU-sized GEMMs and get CUDA's.
"""
import torch

from clipshard.ops.planned_device import rules_device

DEFAULT_WORKSPACE_BYTES = {"cuda": 256 << 20, "cpu": 32 << 20}
_ACCELERATOR_WORKSPACE_BYTES = DEFAULT_WORKSPACE_BYTES["cuda"]


def workspace_bytes(fn, device, requested=None):
    """The budget in bytes for a chunked kernel on `device`: `requested` when given (an int >= 1),
    else the device type's default (an accelerator without an entry gets CUDA's; while a memory plan
    traces, the planned device's: clipshard/ops/planned_device.py)."""
    if requested is None:
        return DEFAULT_WORKSPACE_BYTES.get(rules_device(device).type, _ACCELERATOR_WORKSPACE_BYTES)
    if isinstance(requested, bool) or not isinstance(requested, int):
        raise TypeError(f"{fn}: workspace_bytes must be an int (bytes) or None, got {type(requested).__name__}")
    if requested < 1:
        raise ValueError(f"{fn}: workspace_bytes must be at least 1, got {requested}")
    return requested


COLUMN_QUANTUM = 128  # chunk widths are multiples of this (or K itself when K is smaller)


def chunk_columns(m, k, bytes_per_logit, budget_bytes):
    """Columns per chunk: the largest multiple of COLUMN_QUANTUM with m * kc * bytes_per_logit <=
    budget_bytes, at least COLUMN_QUANTUM (a huge m may then exceed the budget) and at most k.
    The Python twin of chunk_columns in csrc/chunked/chunk_driver.h (used by algorithm="torch")."""
    fit = budget_bytes // bytes_per_logit // m
    return min(k, max(fit // COLUMN_QUANTUM * COLUMN_QUANTUM, COLUMN_QUANTUM))
