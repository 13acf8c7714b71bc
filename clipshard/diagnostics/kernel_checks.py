"""The kernel checks of `python -m clipshard`: one named function per compiled kernel.

Each check runs one kernel on a small random problem with odd sizes on one device and yields
Measurement rows: the worst error against a reference and the tolerance it must stay within.
Floating-point results are compared with fp64 references (clipshard/reference.py), as a normalised
error max|got - ref| / max|ref| per output; the tolerance is the larger of a floor for the dtype and
twice the error of the portable torch path on the same problem (a compiled kernel may not be much
worse than PyTorch's own arithmetic). Stochastic rounding and AdamW promise the same bits on every
device: on the CPU they are compared bit for bit with independent numpy references, on a GPU with
the CPU kernel; their error is the number of elements whose bits differ (tolerance 0), NaNs
included (every NaN is stored as the canonical NaN).

Adding a kernel is one entry in CHECKS: a name, the function, and the device types it runs on.
"""
import os
from dataclasses import dataclass

import numpy as np
import torch

import clipshard
from clipshard import reference
from clipshard.ops.seeds import as_int64
from clipshard.ops import has_compiled_kernel
from clipshard.ops.contrastive_lse import contrastive_lse_backward
from clipshard.ops.distill_lse import distill_lse


@dataclass
class Measurement:
    case: str          # what ran, e.g. "chunked bf16 backward"
    error: float       # the worst error (normalised, or a count of differing elements)
    tolerance: float
    note: str = ""

    @property
    def passed(self):
        return bool(self.error <= self.tolerance)  # False for a NaN error


@dataclass(frozen=True)
class Check:
    name: str
    run: object        # run(device) -> iterable of Measurement
    device_types: tuple = ("cpu", "cuda")


M, K, D, POS_OFFSET = 67, 300, 40, 41  # odd sizes; 300 columns are 3 chunks of the smallest width
SMALL_WORKSPACE = 1                     # the narrowest chunk (128 columns): several chunks per problem
SCALE, BIAS = 14.3, -2.5
FLOOR = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-10}


def _dtypes(device):
    """fp16 is served by the tensor-core kernels on CUDA; the CPU check keeps to fp32 and bf16."""
    if device.type == "cuda":
        return (torch.float32, torch.bfloat16, torch.float16)
    return (torch.float32, torch.bfloat16)


def _features(n, dtype, device, generator):
    """n x D unit-norm-ish features (CLIP's are normalised), drawn in fp64 on the CPU."""
    x = torch.randn(n, D, dtype=torch.float64, generator=generator)
    return (x / x.norm(dim=1, keepdim=True)).to(dtype).to(device)


def _error(got, ref):
    got, ref = got.detach().double().cpu(), ref.detach().double().cpu()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _worst(gots, refs):
    return max(_error(g, r) for g, r in zip(gots, refs))


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


def _lse_reference(rows, cols, scale, bias, upstream):
    leaves = [t.detach().double().cpu().requires_grad_() for t in (rows, cols, scale, bias)]
    outs = reference.contrastive_lse_reference(*leaves, pos_offset=POS_OFFSET)
    objective = sum((o * g.double().cpu()).sum() for o, g in zip(outs, upstream))
    grads = torch.autograd.grad(objective, leaves)
    return [o.detach() for o in outs], list(grads)


def _lse_run(rows, cols, scale, bias, upstream, algorithm):
    outs = clipshard.contrastive_lse(rows, cols, scale, bias, POS_OFFSET, algorithm=algorithm,
                                     workspace_bytes=SMALL_WORKSPACE)
    grads = contrastive_lse_backward(*upstream, rows, cols, scale, bias, POS_OFFSET, outs[0], outs[2],
                                     algorithm=algorithm, workspace_bytes=SMALL_WORKSPACE)
    return outs, grads


def _compiled_lse_algorithms(device):
    """The compiled algorithms of contrastive_lse registered for the device ("fused" and "chunked")."""
    if not has_compiled_kernel("clipshard::contrastive_lse_forward", device.type):
        return ()
    return ("fused", "chunked")


def check_contrastive_lse(device):
    for index, dtype in enumerate(_dtypes(device)):
        rows, cols, scale, bias, upstream = _problem(dtype, device, seed=10 + index)
        ref_outs, ref_grads = _lse_reference(rows, cols, scale, bias, upstream)
        name = str(dtype).removeprefix("torch.")
        torch_outs, torch_grads = _lse_run(rows, cols, scale, bias, upstream, "torch")
        baseline_fwd, baseline_bwd = _worst(torch_outs, ref_outs), _worst(torch_grads, ref_grads)
        yield Measurement(f"torch {name} forward", baseline_fwd, FLOOR[torch.float32])
        yield Measurement(f"torch {name} backward", baseline_bwd, FLOOR[dtype])
        for algorithm in _compiled_lse_algorithms(device):
            outs, grads = _lse_run(rows, cols, scale, bias, upstream, algorithm)
            yield Measurement(f"{algorithm} {name} forward", _worst(outs, ref_outs),
                              max(FLOOR[torch.float32], 2 * baseline_fwd))
            yield Measurement(f"{algorithm} {name} backward", _worst(grads, ref_grads),
                              max(FLOOR[dtype], 2 * baseline_bwd))


def check_chunked_addmm_branches(device):
    """The chunked backward of 16-bit features accumulates d rows either through addmm with an fp32
    accumulator (where torch accepts one) or through an fp32 M x D buffer; both branches run."""
    if not has_compiled_kernel("clipshard::contrastive_lse_forward", device.type):
        return
    dtype = torch.bfloat16
    rows, cols, scale, bias, upstream = _problem(dtype, device, seed=20)
    ref_outs, ref_grads = _lse_reference(rows, cols, scale, bias, upstream)
    torch_grads = _lse_run(rows, cols, scale, bias, upstream, "torch")[1]
    tolerance = max(FLOOR[dtype], 2 * _worst(torch_grads, ref_grads))
    natural = torch.ops.clipshard._addmm_accepts_fp32_accumulator(device, dtype)
    variable = "CLIPSHARD_ADDMM_FP32_ACCUMULATOR"
    saved = os.environ.get(variable)
    try:
        for forced_off in (False, True):
            if forced_off:
                os.environ[variable] = "0"
            branch = "fp32 accumulator" if natural and not forced_off else "fp32 buffer"
            grads = _lse_run(rows, cols, scale, bias, upstream, "chunked")[1]
            yield Measurement(f"bfloat16 backward, {branch}", _worst(grads, ref_grads), tolerance,
                              "torch's addmm takes an fp32 accumulator" if natural else "")
            if not natural:
                break  # the buffer branch is the only one this torch takes
    finally:
        if saved is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = saved


def check_siglip(device):
    for index, dtype in enumerate(_dtypes(device)):
        name = str(dtype).removeprefix("torch.")
        rows, cols, scale, bias, _ = _problem(dtype, device, seed=30 + index)
        for pos_offset, label in ((POS_OFFSET, "positives"), (None, "no positives")):
            leaves = [t.detach().double().cpu().requires_grad_() for t in (rows, cols, scale, bias)]
            ref_loss = reference.siglip_sum_reference(*leaves, pos_offset=pos_offset)
            ref_grads = torch.autograd.grad(ref_loss / M, leaves)
            results = {}
            for algorithm in ("torch", "chunked"):
                if algorithm == "chunked" and not has_compiled_kernel("clipshard::siglip_forward",
                                                                                 device.type):
                    continue
                inputs = [t.detach().clone().requires_grad_() for t in (rows, cols, scale, bias)]
                loss = clipshard.siglip_sum(*inputs, pos_offset=pos_offset, algorithm=algorithm,
                                            workspace_bytes=SMALL_WORKSPACE)
                grads = torch.autograd.grad(loss / M, inputs)  # the 1/M of the mean over the batch
                results[algorithm] = max(_error(loss, ref_loss), _worst(grads, ref_grads))
            yield Measurement(f"torch {name} {label}", results["torch"], FLOOR[dtype])
            if "chunked" in results:
                yield Measurement(f"chunked {name} {label}", results["chunked"],
                                  max(FLOOR[dtype], 2 * results["torch"]))


TEACHERS, TEACHER_D = 2, 24  # an ensemble of two teachers whose features are narrower than the student's


def check_distill(device):
    """distill_lse (DistillClipLoss's op) with two teachers that require grad: the seven outputs and
    every input's gradient under realistic upstream weights, against fp64."""
    for index, dtype in enumerate(_dtypes(device)):
        name = str(dtype).removeprefix("torch.")
        rows, cols, scale, _, _ = _problem(dtype, device, seed=50 + index)
        generator = torch.Generator().manual_seed(60 + index)
        teachers = [torch.randn(TEACHERS, n, TEACHER_D, dtype=torch.float64, generator=generator) for n in (M, K)]
        teachers = [(t / t.norm(dim=2, keepdim=True)).to(dtype).to(device) for t in teachers]
        teacher_scale = torch.tensor([11.0, 23.0], device=device)
        inputs = (rows, cols, *teachers, scale, teacher_scale)
        weights = None
        results = {}
        for algorithm in ("reference", "torch", "compiled"):
            if algorithm == "compiled" and not has_compiled_kernel("clipshard::distill_lse", device.type):
                continue
            cast = (lambda t: t.detach().double().cpu()) if algorithm == "reference" else (lambda t: t.detach())
            leaves = [cast(t).requires_grad_() for t in inputs]
            if algorithm == "reference":
                outs = reference.distill_lse_reference(*leaves, pos_offset=POS_OFFSET)
            else:
                outs = distill_lse(*leaves, pos_offset=POS_OFFSET, algorithm=algorithm, workspace_bytes=SMALL_WORKSPACE)
            if weights is None:  # about 0.5 / M per output element, signed
                weights = [(0.5 / M) * (torch.rand(o.shape, dtype=torch.float64, generator=generator) - 0.3)
                           for o in outs]
            objective = sum((o.double().cpu() * w).sum() for o, w in zip(outs, weights))
            results[algorithm] = ([o.detach() for o in outs], torch.autograd.grad(objective, leaves))
        ref_outs, ref_grads = results.pop("reference")
        baseline = None
        for algorithm, (outs, grads) in results.items():
            fwd, bwd = _worst(outs, ref_outs), _worst(grads, ref_grads)
            if baseline is None:  # the torch path: the floor; the compiled kernel: within 2x of it
                baseline = fwd, bwd
                yield Measurement(f"torch {name} forward", fwd, FLOOR[torch.float32])
                yield Measurement(f"torch {name} backward", bwd, FLOOR[dtype])
            else:
                yield Measurement(f"{algorithm} {name} forward", fwd, max(FLOOR[torch.float32], 2 * baseline[0]))
                yield Measurement(f"{algorithm} {name} backward", bwd, max(FLOOR[dtype], 2 * baseline[1]))


def _rounding_input(generator):
    """fp32 values over the whole range, and every special value: NaNs of both signs and other
    payloads, infinities, zeros, fp16 subnormals and overflow, bf16 subnormals."""
    x = torch.randn(997, dtype=torch.float64, generator=generator) * 10.0 ** torch.randint(-8, 5, (997,),
                                                                                         generator=generator)
    x = x.float()
    nans = torch.from_numpy(np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF], dtype=np.uint32).view(np.float32))
    specials = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3e-6, -4e-8, 65519.0, 65520.0, 7e4, 1e-39],
                            dtype=torch.float32)
    return torch.cat([nans, specials, x])


_CANONICAL_NAN_BITS = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}


def _bits16(t):
    return t.detach().cpu().view(torch.int16).to(torch.int32) & 0xFFFF


def check_stochastic_round(device):
    generator = torch.Generator().manual_seed(40)
    x = _rounding_input(generator)
    seed, offset = 0x1234_5678_9ABC_DEF0, 77
    for dtype in (torch.float16, torch.bfloat16):
        got = torch.ops.clipshard.stochastic_round(x.to(device), dtype, as_int64(seed), offset, False)
        if device.type == "cpu":
            words = reference.philox_stream_reference(seed, offset, x.numel())
            want = reference.stochastic_round_reference(x, words, dtype)
            against = "numpy reference"
        else:
            want = torch.ops.clipshard.stochastic_round(x, dtype, as_int64(seed), offset, False)
            against = "CPU kernel"
        got_bits, want_bits = _bits16(got), _bits16(want)
        nan = torch.isnan(x)
        want_bits = torch.where(nan, _CANONICAL_NAN_BITS[dtype], want_bits)
        differing = (got_bits != want_bits).sum().item()
        yield Measurement(f"{str(dtype).removeprefix('torch.')} bits vs {against}", differing, 0,
                          f"{x.numel()} values, {int(nan.sum())} NaNs")


_STORAGE = (torch.float32, torch.float16, torch.bfloat16)
_ADAMW = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
_ADAMW_SIZES, _ADAMW_INDEX_BASES, _ADAMW_NUMBERS = (1, 37, 203), (0, 5, 1026), (0, 4, 9)
_ADAMW_STEP, _ADAMW_SEED, _ADAMW_OFFSET = 3, 0xC11F5, 12


def _adamw_state(param_dtype, state_dtype, generator):
    """Per tensor (param, grad, exp_avg, exp_avg_sq as stored), CPU tensors; one grad is a NaN."""
    tensors = []
    for n in _ADAMW_SIZES:
        p = torch.randn(n, dtype=torch.float64, generator=generator)
        g = 1e-2 * torch.randn(n, dtype=torch.float64, generator=generator)
        m = 1e-3 * torch.randn(n, dtype=torch.float64, generator=generator)
        v = 1e-5 * torch.rand(n, dtype=torch.float64, generator=generator)
        stored_v = v ** 0.25 if state_dtype == torch.float16 else v  # fp16 keeps v^(1/4)
        tensors.append([p.to(param_dtype), g.to(param_dtype), m.to(state_dtype), stored_v.to(state_dtype)])
    tensors[-1][1][7] = float("nan")
    return tensors


def _adamw_step(tensors, device):
    copies = [[t.clone().to(device) for t in group] for group in tensors]
    params, grads, exp_avgs, exp_avg_sqs = (list(role) for role in zip(*copies))
    a = _ADAMW
    torch.ops.clipshard.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, [_ADAMW_STEP] * len(params), a["lr"],
                                    a["beta1"], a["beta2"], a["eps"], a["weight_decay"], False, True,
                                    _ADAMW_SEED, _ADAMW_OFFSET, list(_ADAMW_NUMBERS), list(_ADAMW_INDEX_BASES))
    return [[t.cpu() for t in group] for group in copies]


def _stored_bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else _bits16(t)


def _store(values, dtype, number, role, index_base):
    """fp32 numpy values as the kernels store them: canonical NaNs, 16-bit by stochastic rounding."""
    x = torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
    if dtype == torch.float32:
        return torch.where(torch.isnan(x), float("nan"), x)  # torch's NaN is the canonical NaN
    stream = 3 * number + role
    words = reference.philox_words_at(_ADAMW_SEED, _ADAMW_OFFSET, stream, index_base + np.arange(x.numel()))
    stored = reference.stochastic_round_reference(x, words, dtype)
    nan_bits = torch.tensor(_CANONICAL_NAN_BITS[dtype], dtype=torch.int32).to(torch.int16).view(dtype)
    return torch.where(torch.isnan(x), nan_bits, stored)


def _adamw_reference(tensors, state_dtype):
    out = []
    for (p, g, m, v), number, base in zip(tensors, _ADAMW_NUMBERS, _ADAMW_INDEX_BASES):
        v32 = v.float().numpy()
        if state_dtype == torch.float16:
            v32 = (v32 * v32) * (v32 * v32)  # decode v^(1/4) in the kernels' order
        p1, m1, v1 = reference.adamw_step_fp32_reference(p.float().numpy(), g.float().numpy(), m.float().numpy(),
                                                         v32, _ADAMW_STEP, **_ADAMW)
        if state_dtype == torch.float16:
            v1 = np.sqrt(np.sqrt(v1))
        out.append([_store(p1, p.dtype, number, 0, base), g, _store(m1, m.dtype, number, 1, base),
                    _store(v1, v.dtype, number, 2, base)])
    return out


def check_adamw(device):
    generator = torch.Generator().manual_seed(50)
    for param_dtype in _STORAGE:
        for state_dtype in _STORAGE:
            tensors = _adamw_state(param_dtype, state_dtype, generator)
            got = _adamw_step(tensors, device)
            if device.type == "cpu":
                want, against = _adamw_reference(tensors, state_dtype), "numpy reference"
            else:
                want, against = _adamw_step(tensors, torch.device("cpu")), "CPU kernel"
            differing = sum((_stored_bits(a) != _stored_bits(b)).sum().item()
                            for ga, gb in zip(got, want) for a, b in zip(ga, gb))
            total = sum(3 * t[0].numel() for t in tensors)
            names = "/".join(str(d).removeprefix("torch.") for d in (param_dtype, state_dtype))
            yield Measurement(f"{names} bits vs {against}", differing, 0,
                              f"{total} stored values, index bases {_ADAMW_INDEX_BASES}, one NaN gradient")


CHECKS = (
    Check("contrastive_lse", check_contrastive_lse),
    Check("contrastive_lse chunked addmm", check_chunked_addmm_branches),
    Check("siglip_sum", check_siglip),
    Check("distill_lse", check_distill),
    Check("stochastic_round", check_stochastic_round),
    Check("adamw_step_", check_adamw),
)
