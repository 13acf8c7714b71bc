"""The loss kernels' checks of `python -m clipshard`: contrastive_lse (both compiled algorithms and
the two branches of the chunked backward), siglip_sum and distill_lse.

Each runs the op on a small random problem with odd sizes, forward and backward under realistic
upstream gradients (about 0.5 / M), with the device's compiled kernel and with the portable torch
path (algorithm="torch") in the same dtype, and compares both with the torch path run in fp64 on
the CPU: the normalised error max|got - want| / max|want| per output, the worst over the outputs.
The torch path's own error there is its dtype's rounding (it is checked against independent fp64
references in the tests); the compiled kernel's tolerance is the larger of a floor for the dtype
and twice that error, so a compiled kernel may not be much worse than PyTorch's own arithmetic.
"""
import os

import torch

import clipshard
from clipshard.diagnostics.measurement import Measurement
from clipshard.ops import has_compiled_kernel
from clipshard.ops.contrastive_lse import contrastive_lse_backward
from clipshard.ops.distill_lse import distill_lse

M, K, D, POS_OFFSET = 67, 300, 40, 41  # odd sizes; 300 columns are 3 chunks of the smallest width
SMALL_WORKSPACE = 1                     # the narrowest chunk (128 columns): several chunks per problem
SCALE, BIAS = 14.3, -2.5
FLOOR = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-10}
FP64_CPU = dict(device="cpu", dtype=torch.float64)  # where the fp64 torch path, the yardstick, runs


def _dtypes(device):
    """fp16 is served by the tensor-core kernels on CUDA; the CPU check keeps to fp32 and bf16."""
    if device.type == "cuda":
        return (torch.float32, torch.bfloat16, torch.float16)
    return (torch.float32, torch.bfloat16)


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def _features(n, dtype, device, generator):
    """n x D unit-norm-ish features (CLIP's are normalised), drawn in fp64 on the CPU."""
    x = torch.randn(n, D, dtype=torch.float64, generator=generator)
    return (x / x.norm(dim=1, keepdim=True)).to(dtype).to(device)


def _fp64(tensors):
    """fp64 CPU copies (leaves that require grad) of the inputs, for the yardstick run."""
    return [t.detach().to(**FP64_CPU).requires_grad_() for t in tensors]


def _error(got, want):
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    return ((got - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def _worst(gots, wants):
    return max(_error(g, w) for g, w in zip(gots, wants))


def _problem(dtype, device, seed):
    generator = torch.Generator().manual_seed(seed)
    rows, cols = _features(M, dtype, device, generator), _features(K, dtype, device, generator)
    scale = torch.tensor(SCALE, device=device)
    bias = torch.tensor(BIAS, device=device)
    # Realistic upstream gradients: a mean over M rows makes them about 0.5 / M, not 1.
    g_row = (0.5 / M) * (1 + torch.rand(M, dtype=torch.float64, generator=generator))
    g_pos = -(0.5 / M) * torch.ones(M, dtype=torch.float64)
    g_col = (0.5 / M) * (1 + torch.rand(K, dtype=torch.float64, generator=generator))
    return rows, cols, scale, bias, [g.float().to(device) for g in (g_row, g_pos, g_col)]


def _lse_run(rows, cols, scale, bias, upstream, algorithm):
    outs = clipshard.contrastive_lse(rows, cols, scale, bias, POS_OFFSET, algorithm=algorithm,
                                     workspace_bytes=SMALL_WORKSPACE)
    upstream = [g.to(outs[0].dtype) for g in upstream]
    grads = contrastive_lse_backward(*upstream, rows, cols, scale, bias, POS_OFFSET, outs[0], outs[2],
                                     algorithm=algorithm, workspace_bytes=SMALL_WORKSPACE)
    return outs, grads


def _lse_yardstick(rows, cols, scale, bias, upstream):
    inputs = [t.detach().to(**FP64_CPU) for t in (rows, cols, scale, bias)]
    return _lse_run(*inputs, [g.cpu() for g in upstream], "torch")


def _compiled_lse_algorithms(device):
    """The compiled algorithms of contrastive_lse registered for the device ("fused" and "chunked")."""
    if not has_compiled_kernel("clipshard::contrastive_lse_forward", device.type):
        return ()
    return ("fused", "chunked")


def check_contrastive_lse(device):
    for index, dtype in enumerate(_dtypes(device)):
        rows, cols, scale, bias, upstream = _problem(dtype, device, seed=10 + index)
        want_outs, want_grads = _lse_yardstick(rows, cols, scale, bias, upstream)
        torch_outs, torch_grads = _lse_run(rows, cols, scale, bias, upstream, "torch")
        baseline_fwd, baseline_bwd = _worst(torch_outs, want_outs), _worst(torch_grads, want_grads)
        yield Measurement(f"torch {_name(dtype)} forward", baseline_fwd, FLOOR[torch.float32])
        yield Measurement(f"torch {_name(dtype)} backward", baseline_bwd, FLOOR[dtype])
        for algorithm in _compiled_lse_algorithms(device):
            outs, grads = _lse_run(rows, cols, scale, bias, upstream, algorithm)
            yield Measurement(f"{algorithm} {_name(dtype)} forward", _worst(outs, want_outs),
                              max(FLOOR[torch.float32], 2 * baseline_fwd))
            yield Measurement(f"{algorithm} {_name(dtype)} backward", _worst(grads, want_grads),
                              max(FLOOR[dtype], 2 * baseline_bwd))


def check_chunked_addmm_branches(device):
    """The chunked backward of 16-bit features accumulates d rows either through addmm with an fp32
    accumulator (where torch accepts one) or through an fp32 M x D buffer; both branches run."""
    if not has_compiled_kernel("clipshard::contrastive_lse_forward", device.type):
        return
    dtype = torch.bfloat16
    rows, cols, scale, bias, upstream = _problem(dtype, device, seed=20)
    want_grads = _lse_yardstick(rows, cols, scale, bias, upstream)[1]
    torch_grads = _lse_run(rows, cols, scale, bias, upstream, "torch")[1]
    tolerance = max(FLOOR[dtype], 2 * _worst(torch_grads, want_grads))
    natural = torch.ops.clipshard._addmm_accepts_fp32_accumulator(device, dtype)
    variable = "CLIPSHARD_ADDMM_FP32_ACCUMULATOR"
    saved = os.environ.get(variable)
    try:
        for forced_off in (False, True):
            if forced_off:
                os.environ[variable] = "0"
            branch = "fp32 accumulator" if natural and not forced_off else "fp32 buffer"
            grads = _lse_run(rows, cols, scale, bias, upstream, "chunked")[1]
            yield Measurement(f"bfloat16 backward, {branch}", _worst(grads, want_grads), tolerance,
                              "torch's addmm takes an fp32 accumulator" if natural else "")
            if not natural:
                break  # the buffer branch is the only one this torch takes
    finally:
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved


def _siglip_run(inputs, pos_offset, algorithm):
    """(loss, gradients of loss / M): the 1/M of the mean over the batch."""
    loss = clipshard.siglip_sum(*inputs, pos_offset=pos_offset, algorithm=algorithm, workspace_bytes=SMALL_WORKSPACE)
    return loss, torch.autograd.grad(loss / M, inputs)


def check_siglip(device):
    for index, dtype in enumerate(_dtypes(device)):
        rows, cols, scale, bias, _ = _problem(dtype, device, seed=30 + index)
        for pos_offset, label in ((POS_OFFSET, "positives"), (None, "no positives")):
            want_loss, want_grads = _siglip_run(_fp64((rows, cols, scale, bias)), pos_offset, "torch")
            results = {}
            for algorithm in ("torch", "chunked"):
                if algorithm == "chunked" and not has_compiled_kernel("clipshard::siglip_forward",
                                                                                 device.type):
                    continue
                inputs = [t.detach().clone().requires_grad_() for t in (rows, cols, scale, bias)]
                loss, grads = _siglip_run(inputs, pos_offset, algorithm)
                results[algorithm] = max(_error(loss, want_loss), _worst(grads, want_grads))
            yield Measurement(f"torch {_name(dtype)} {label}", results["torch"], FLOOR[dtype])
            if "chunked" in results:
                yield Measurement(f"chunked {_name(dtype)} {label}", results["chunked"],
                                  max(FLOOR[dtype], 2 * results["torch"]))


TEACHERS, TEACHER_D = 2, 24  # an ensemble of two teachers whose features are narrower than the student's


def _distill_run(leaves, algorithm, weights):
    """(the seven outputs, every input's gradient of sum(output * weight)); weights drawn on first use."""
    outs = distill_lse(*leaves, pos_offset=POS_OFFSET, algorithm=algorithm, workspace_bytes=SMALL_WORKSPACE)
    if not weights:  # about 0.5 / M per output element, signed
        generator = torch.Generator().manual_seed(70)
        weights += [(0.5 / M) * (torch.rand(o.shape, dtype=torch.float64, generator=generator) - 0.3) for o in outs]
    objective = sum((o.double().cpu() * w).sum() for o, w in zip(outs, weights))
    return [o.detach() for o in outs], torch.autograd.grad(objective, leaves)


def check_distill(device):
    """distill_lse (DistillClipLoss's op) with two teachers that require grad: the seven outputs and
    every input's gradient under realistic upstream weights."""
    for index, dtype in enumerate(_dtypes(device)):
        rows, cols, scale, _, _ = _problem(dtype, device, seed=50 + index)
        generator = torch.Generator().manual_seed(60 + index)
        teachers = [torch.randn(TEACHERS, n, TEACHER_D, dtype=torch.float64, generator=generator) for n in (M, K)]
        teachers = [(t / t.norm(dim=2, keepdim=True)).to(dtype).to(device) for t in teachers]
        inputs = (rows, cols, *teachers, scale, torch.tensor([11.0, 23.0], device=device))
        weights = []
        want_outs, want_grads = _distill_run(_fp64(inputs), "torch", weights)
        baseline = None
        for algorithm in ("torch", "compiled"):
            if algorithm == "compiled" and not has_compiled_kernel("clipshard::distill_lse", device.type):
                continue
            outs, grads = _distill_run([t.detach().requires_grad_() for t in inputs], algorithm, weights)
            fwd, bwd = _worst(outs, want_outs), _worst(grads, want_grads)
            if baseline is None:  # the torch path: the floor; the compiled kernel: within 2x of it
                baseline = fwd, bwd
                yield Measurement(f"torch {_name(dtype)} forward", fwd, FLOOR[torch.float32])
                yield Measurement(f"torch {_name(dtype)} backward", bwd, FLOOR[dtype])
            else:
                yield Measurement(f"{algorithm} {_name(dtype)} forward", fwd, max(FLOOR[torch.float32], 2 * baseline[0]))
                yield Measurement(f"{algorithm} {_name(dtype)} backward", bwd, max(FLOOR[dtype], 2 * baseline[1]))
