"""CUDA's autocast rules for the ops where CPU autocast differs, while a plan for CUDA traces
(clipshard/planning/step_plan.py, docs/grad_cache.md).

A plan's fake tensors are CPU tensors (clipshard/ops/planned_device.py), so under autocast it is
CPU autocast that decides which ops run in 16 bits. The two agree on the matrix products (16 bits)
but not on layer_norm: CUDA's autocast runs it in fp32 (it casts the input, weight and bias up,
and the fp32 copy of the input is what the backward keeps), CPU's leaves it in its input's dtype.
In a transformer that is a sizeable part of the activations (a ViT-B/16 GradCache step in
micro-batches of 256 peaks 1.9 GiB higher with CUDA's rule). Within `cuda_autocast_rules()`, CPU autocast runs layer_norm as CUDA's does; the
kernel is registered for the block only and removed afterwards.
"""
import contextlib

import torch

_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _layer_norm_in_fp32(input, normalized_shape, weight=None, bias=None, eps=1e-5, cudnn_enable=True):
    """aten::layer_norm under autocast as CUDA runs it: every floating-point argument in fp32."""
    def up(tensor):
        return None if tensor is None else tensor.float()

    with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
        return torch.ops.aten.layer_norm(up(input), normalized_shape, up(weight), up(bias), eps, cudnn_enable)


@contextlib.contextmanager
def cuda_autocast_rules():
    """Within the block, CPU autocast runs layer_norm in fp32, as CUDA autocast does."""
    library = torch.library.Library("aten", "IMPL")
    try:
        library.impl("layer_norm", _layer_norm_in_fp32, "AutocastCPU")
        yield
    finally:
        library._destroy()
