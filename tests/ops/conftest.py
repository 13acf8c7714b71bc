"""Fixtures of the op tests: what the dispatcher and the 16-bit GEMM path answer, faked on the CPU so
that the CPU checks the choices a GPU makes."""
import pytest
import torch

import clipshard  # noqa: F401  (registers torch.ops.clipshard_testing.*)
from clipshard.ops import _algorithm, _portable_chunks


@torch.library.register_fake("clipshard_testing::chunked_gradients")
def _chunked_gradients_fake(rows, cols, dlogits, unscale, out_dtype, chunk_columns):
    """The test op's outputs (csrc/chunked/gradient_accumulator_testing_op.cpp): M x D and K x D in
    out_dtype, else the features' dtype."""
    dtype = out_dtype or rows.dtype
    return rows.new_empty(rows.shape, dtype=dtype), cols.new_empty(cols.shape, dtype=dtype)


@pytest.fixture
def cuda_kernels_registered(monkeypatch):
    monkeypatch.setattr(_algorithm, "_warned_device_types", set())
    monkeypatch.delenv(_algorithm.ENV_VAR, raising=False)
    monkeypatch.setattr(_algorithm, "has_compiled_kernel", lambda operator, device_type: device_type in ("cpu", "cuda"))


def _emulated_fp32_output_gemm(a, b, dtype):
    """What torch.mm(a, b, out_dtype=fp32) computes for 16-bit a, b: exact products, fp32 sums."""
    return torch.mm(a.to(dtype), b.to(dtype))


@pytest.fixture
def gpu_style_gemms(monkeypatch):
    """The 16-bit GEMM path GPUs take (16-bit factors, fp32 results, 16-bit logit gradients with the
    fp16 pre-scale), on the CPU through an exact emulation of the fp32-output GEMM."""
    monkeypatch.setattr(_portable_chunks, "_has_fp32_output_gemm", lambda device, dtype: True)
    monkeypatch.setattr(_portable_chunks, "_mm_with_output_dtype", _emulated_fp32_output_gemm)
