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
