"""algorithm="auto" with fp64 inputs on CUDA: the compiled CUDA kernels take fp32, fp16 and bf16
only, so "auto" runs the torch path there (torch.autograd.gradcheck works on CUDA), with one
warning. Checked on the CPU by making the dispatcher answer that CUDA kernels are registered."""
import warnings

import pytest
import torch

from clipshard.ops import _algorithm
from clipshard.ops.contrastive_lse import ALGORITHMS as LSE_ALGORITHMS
from clipshard.ops.siglip_sum import ALGORITHMS as SIGLIP_ALGORITHMS


def test_auto_runs_fp64_on_cuda_through_the_torch_path_with_one_warning(cuda_kernels_registered):
    cuda = torch.device("cuda")
    with pytest.warns(UserWarning, match="compiled 'cuda' kernels take float32, float16, bfloat16, not float64"):
        assert _algorithm.resolve("contrastive_lse", "auto", cuda, LSE_ALGORITHMS, torch.float64) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per (device type, dtype)
        assert _algorithm.resolve("siglip_sum", "auto", cuda, SIGLIP_ALGORITHMS, torch.float64) == "torch"
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert _algorithm.resolve("contrastive_lse", "auto", cuda, LSE_ALGORITHMS, dtype) == "chunked"
            assert _algorithm.resolve("siglip_sum", "auto", cuda, SIGLIP_ALGORITHMS, dtype) == "chunked"
        # the CPU kernels take fp64; an explicit algorithm is never overridden
        assert _algorithm.resolve("contrastive_lse", "auto", torch.device("cpu"), LSE_ALGORITHMS, torch.float64) == "fused"
        assert _algorithm.resolve("siglip_sum", "auto", torch.device("cpu"), SIGLIP_ALGORITHMS, torch.float64) == "chunked"
        assert _algorithm.resolve("contrastive_lse", "chunked", cuda, LSE_ALGORITHMS, torch.float64) == "chunked"


def test_explain_auto_gives_the_reason(cuda_kernels_registered, monkeypatch):
    assert _algorithm.explain_auto("contrastive_lse", "cuda", torch.float64)[:2] == (
        "torch", "the compiled 'cuda' kernels take float32, float16, bfloat16, not float64")
    assert _algorithm.explain_auto("siglip_sum", "xpu")[0] == "torch"
    monkeypatch.setenv(_algorithm.ENV_VAR, "torch")
    assert _algorithm.explain_auto("contrastive_lse", "cpu")[:2] == ("torch", "CLIPSHARD_ALGORITHM=torch is set")


def test_auto_decides_distill_lse_on_every_input_dtype(cuda_kernels_registered, monkeypatch):
    """distill_lse's "auto" looks at the teachers' dtype too: fp64 teachers beside a 16-bit or fp32
    student (DistillClipLoss and the CPU kernel take them) run the torch path on CUDA, where the
    compiled kernel would refuse them, instead of raising. The op's own call is observed with the
    device taken for CUDA (its inputs stay on the CPU, where the torch path then runs)."""
    from clipshard.ops import distill_lse as op
    cuda, picks = torch.device("cuda"), []
    resolve = _algorithm.resolve

    def resolve_for_cuda(fn, algorithm, device, names, *dtypes):
        picks.append(resolve(fn, algorithm, cuda, names, *dtypes))
        return picks[-1]

    monkeypatch.setattr(_algorithm, "resolve", resolve_for_cuda)
    gen = torch.Generator().manual_seed(3)
    rows, cols = torch.randn(5, 4, generator=gen).bfloat16(), torch.randn(9, 4, generator=gen).bfloat16()
    teacher_rows, teacher_cols = torch.randn(2, 5, 3, generator=gen).double(), torch.randn(2, 9, 3, generator=gen).double()
    with pytest.warns(UserWarning, match="compiled 'cuda' kernels take float32, float16, bfloat16, not float64"):
        op.distill_lse(rows, cols, teacher_rows, teacher_cols, 2.0, torch.tensor([3.0, 4.0]))
    assert picks == ["torch"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve("distill_lse", "auto", cuda, op.ALGORITHMS, torch.float64, torch.float32) == "torch"
        assert resolve("distill_lse", "auto", cuda, op.ALGORITHMS, torch.bfloat16, torch.float16) == "compiled"
        assert resolve("distill_lse", "auto", torch.device("cpu"), op.ALGORITHMS, torch.bfloat16,
                       torch.float64) == "compiled"
