"""The first-use check of the compiled CUDA kernels (docs/first_use.md).

No GPU had run clipshard's CUDA kernels when they were written, and a GPU newer than the build's
architectures runs them through a PTX JIT that nothing else has exercised. So the first time a
process is about to run a compiled CUDA kernel on a device for given dtypes, this module runs that
kernel once on a small problem and compares it with its reference on the same device: the torch
path (the losses; error normalised by an fp64 run of the torch path, within the larger of a floor
and twice the torch path's own error in the same dtype, the self-check's rule) or the CPU kernel
on copies, bit for bit (stochastic rounding, AdamW). If they disagree, or the kernel raises, it
warns once, naming the kernel, the device and `python -m clipshard`, and that (kernel, device,
dtypes) runs its fallback for the rest of the process: the torch path, or the CPU kernel on host
copies. The verdict is cached, so after the first call a lookup costs no GPU work and no host
synchronisation. CLIPSHARD_FIRST_USE_CHECK=0 turns the check off.

Only "auto" is checked: an explicit algorithm= runs the kernel it names (the self-check and the
CUDA tests rely on that to see the kernels themselves). CPU kernels are not checked: the test suite
runs each of their code paths, and they are the same machine code on every CPU.

Under torch.compile the verdict is taken while tracing (torch.compiler.assume_constant_result, as
for the "auto" rule): the check runs eagerly then, outside the graph, and the graph holds the path
it chose; no graph break. The check itself runs on fresh tensors, under no_grad, without autocast
and with every Python dispatch mode (fake tensors, tracing) set aside, so it neither sees nor
records anything of the caller's; it is skipped (and tried again on the next call) while a CUDA
graph is being captured, and where no GPU is there to run it (fake CUDA tensors on a CPU machine).
"""
import contextlib
import threading
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops import env_vars
from clipshard.ops.seeds import as_int64
from clipshard.ops import _algorithm
from clipshard.ops.compile_marks import constant_under_compile
from clipshard.ops.portable_distill import distill_lse_backward_torch, distill_lse_torch
from clipshard.ops.portable_lse import contrastive_lse_backward_torch, contrastive_lse_torch
from clipshard.ops.portable_siglip import siglip_block_torch

ENV_VAR = "CLIPSHARD_FIRST_USE_CHECK"
CHECKED_DEVICE_TYPES = ("cuda",)

# The small problem: odd sizes, 300 columns in 3 chunks of the narrowest width (a 1-byte workspace).
M, K, D, POS_OFFSET, TEACHERS, TEACHER_D = 67, 300, 40, 41, 2, 24
WORKSPACE = 1
SCALE, BIAS, TEACHER_SCALES = 14.3, -2.5, (11.0, 23.0)
FLOOR = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-10}
SEED, OFFSET = as_int64(0xC11F_5EED_9ABC_DEF0), 77  # a Philox key with its high bit set


@dataclass(frozen=True)
class Probe:
    """One kernel family's first-use problem. inputs(dtypes) -> CPU tensors; compiled(algorithm,
    dtypes, *inputs) and reference(dtypes, *inputs) -> lists of output tensors. exact: the reference
    runs on CPU copies and the bits must match; else it runs on the device, in the dtypes and in fp64."""
    inputs: Callable
    compiled: Callable
    reference: Callable
    exact: bool
    fallback: str  # what runs after a failed check, for the warning


def _features(n, dtype, generator, *lead):
    """Unit-norm rows (CLIP's features are normalised), drawn in fp64 on the CPU."""
    x = torch.randn(*lead, n, D if not lead else TEACHER_D, dtype=torch.float64, generator=generator, device="cpu")
    return (x / x.norm(dim=-1, keepdim=True)).to(dtype)


def _upstream(generator, *shapes):
    """Gradients of about 0.5 / M, as a mean over the batch gives."""
    return [(0.5 / M) * (torch.rand(s, dtype=torch.float64, generator=generator, device="cpu") + 0.5).float()
            for s in shapes]


def _scalar(value):
    return torch.tensor(value, dtype=torch.float32, device="cpu")


def _lse_inputs(dtypes):
    g = torch.Generator(device="cpu").manual_seed(1)
    return (_features(M, dtypes[0], g), _features(K, dtypes[0], g), _scalar(SCALE), _scalar(BIAS),
            *_upstream(g, M, M, K))


def _lse_compiled(algorithm, dtypes, rows, cols, scale, bias, g_row, g_pos, g_col):
    outs = torch.ops.clipshard.contrastive_lse_forward(rows, cols, scale, bias, POS_OFFSET, None, None, True, algorithm,
                                                       WORKSPACE)
    grads = torch.ops.clipshard.contrastive_lse_backward(g_row, g_pos, g_col, rows, cols, scale, bias, POS_OFFSET,
                                                         None, None, outs[0], outs[2], algorithm, WORKSPACE)
    return [*outs, *grads]


def _lse_torch(dtypes, rows, cols, scale, bias, g_row, g_pos, g_col):
    outs = contrastive_lse_torch(rows, cols, scale, bias, POS_OFFSET, True, WORKSPACE)
    grads = contrastive_lse_backward_torch(g_row, g_pos, g_col, rows, cols, scale, bias, POS_OFFSET, outs[0], outs[2],
                                           WORKSPACE)
    return [*outs, *grads]


def _siglip_inputs(dtypes):
    """Features, scale, bias and sample ids with repeats (the rows' ids those of their positives)."""
    g = torch.Generator(device="cpu").manual_seed(2)
    col_ids = torch.randint(0, K // 3, (K,), generator=g, device="cpu")
    return (_features(M, dtypes[0], g), _features(K, dtypes[0], g), _scalar(SCALE), _scalar(BIAS),
            col_ids[POS_OFFSET:POS_OFFSET + M].clone(), col_ids)


def _siglip_compiled(algorithm, dtypes, rows, cols, scale, bias, row_ids, col_ids):
    """Without ids (the kernel of most calls) and with ids, same-id pairs dropped (the kernel with ids)."""
    op = torch.ops.clipshard.siglip_forward
    return (list(op(rows, cols, scale, bias, POS_OFFSET, None, None, False, True, WORKSPACE))
            + list(op(rows, cols, scale, bias, POS_OFFSET, row_ids, col_ids, True, True, WORKSPACE)))


def _siglip_torch(dtypes, rows, cols, scale, bias, row_ids, col_ids):
    # the torch path keeps the sum's gradients in fp32 here: a reference a little more exact than
    # the op's own 16-bit ones, well within the 16-bit floors
    return (list(siglip_block_torch(rows, cols, scale, bias, POS_OFFSET, True, WORKSPACE, torch.float32))
            + list(siglip_block_torch(rows, cols, scale, bias, POS_OFFSET, True, WORKSPACE, torch.float32, row_ids,
                                      col_ids, True)))


def _distill_inputs(dtypes):
    student, teacher = dtypes
    g = torch.Generator(device="cpu").manual_seed(3)
    return (_features(M, student, g), _features(K, student, g), _features(M, teacher, g, TEACHERS),
            _features(K, teacher, g, TEACHERS), _scalar(SCALE), _scalar(TEACHER_SCALES),
            *_upstream(g, M, M, (TEACHERS, M), (TEACHERS, M), K, (TEACHERS, K), (TEACHERS, K)))


def _distill_compiled(algorithm, dtypes, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, *upstream):
    outs = torch.ops.clipshard.distill_lse(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, POS_OFFSET,
                                           True, WORKSPACE)
    stats = outs[:1] + outs[2:]
    grads = torch.ops.clipshard.distill_lse_backward(*upstream, rows, cols, teacher_rows, teacher_cols, scale,
                                                     teacher_scale, POS_OFFSET, *stats, True, WORKSPACE)
    return [*outs, *grads]


def _distill_torch(dtypes, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, *upstream):
    outs = distill_lse_torch(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, POS_OFFSET, True, WORKSPACE)
    stats = outs[:1] + outs[2:]
    grads = distill_lse_backward_torch(upstream, rows, cols, teacher_rows, teacher_cols, scale, teacher_scale,
                                       POS_OFFSET, stats, True, WORKSPACE)
    return [*outs, *grads]


def _rounding_inputs(dtypes):
    """fp32 values over the whole range and the special ones (NaN, infinities, zeros, fp16
    overflow, subnormals), as 3 x 337."""
    g = torch.Generator(device="cpu").manual_seed(4)
    x = torch.randn(1001, dtype=torch.float64, generator=g, device="cpu")
    x = x * 10.0 ** torch.randint(-8, 5, (1001,), generator=g, device="cpu")
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 3e-6, -4e-8, 65519.0, 65520.0,
                             1e-39], dtype=torch.float32, device="cpu")
    return (torch.cat([specials, x.float()]).reshape(3, 337),)


def _rounding(algorithm, dtypes, x):
    """Both entry points: stochastic_round (not saturating, saturating) and stochastic_round_into a
    transposed (strided) destination."""
    (dtype,) = dtypes
    into = torch.empty(337, 3, dtype=dtype, device=x.device).t()
    torch.ops.clipshard.stochastic_round_into(into, x, SEED, OFFSET, False)
    return [torch.ops.clipshard.stochastic_round(x, dtype, SEED, OFFSET, saturate) for saturate in (False, True)] + [
        into]


_ADAMW_SIZES, _ADAMW_NUMBERS, _ADAMW_BASES = (1, 37, 203), [0, 4, 9], [0, 5, 1026]


def _adamw_inputs(dtypes):
    """Three tensors of (param, grad, exp_avg, second moment as stored); one gradient is a NaN."""
    param, state = dtypes
    g = torch.Generator(device="cpu").manual_seed(5)
    roles = [[], [], [], []]
    for n in _ADAMW_SIZES:
        values = [torch.randn(n, dtype=torch.float64, generator=g, device="cpu") * s for s in (1.0, 1e-2, 1e-3)]
        v = 1e-5 * torch.rand(n, dtype=torch.float64, generator=g, device="cpu")
        values.append(v ** 0.25 if state == torch.float16 else v)  # fp16 keeps v^(1/4)
        for role, value, dtype in zip(roles, values, (param, param, state, state)):
            role.append(value.to(dtype))
    roles[1][-1][7] = float("nan")
    return tuple(t for role in roles for t in role)


def _adamw(algorithm, dtypes, *tensors):
    """Two steps on copies: stochastic rounding, and round-to-nearest with maximize."""
    params, grads, exp_avgs, exp_avg_sqs = (list(tensors[i:i + 3]) for i in range(0, 12, 3))
    outs = []
    for stochastic, maximize in ((True, False), (False, True)):
        p, m, v = ([t.clone() for t in ts] for ts in (params, exp_avgs, exp_avg_sqs))
        torch.ops.clipshard.adamw_step_(p, grads, m, v, [3, 3, 3], 3e-3, 0.9, 0.999, 1e-8, 0.05, maximize, stochastic,
                                        SEED, OFFSET, _ADAMW_NUMBERS, _ADAMW_BASES)
        outs += p + m + v
    return outs


_TORCH_PATH = "the torch path (algorithm='torch': the same results, slower)"
_HOST_COPIES = "the CPU kernel on host copies (the same bits, much slower: a round trip to the host per call)"
PROBES = {
    "contrastive_lse": Probe(_lse_inputs, _lse_compiled, _lse_torch, False, _TORCH_PATH),
    "siglip_sum": Probe(_siglip_inputs, _siglip_compiled, _siglip_torch, False, _TORCH_PATH),
    "distill_lse": Probe(_distill_inputs, _distill_compiled, _distill_torch, False, _TORCH_PATH),
    "stochastic_round": Probe(_rounding_inputs, _rounding, lambda dtypes, *x: _rounding(None, dtypes, *x), True,
                              _HOST_COPIES),
    "adamw_step_": Probe(_adamw_inputs, _adamw, lambda dtypes, *x: _adamw(None, dtypes, *x), True, _HOST_COPIES),
}


def _round_on_host(src, dtype, seed, offset, saturate):
    return torch.ops.clipshard.stochastic_round(src.cpu(), dtype, seed, offset, saturate).to(src.device)


def _round_into_on_host(dst, src, seed, offset, saturate):
    dst.copy_(torch.ops.clipshard.stochastic_round(src.cpu(), dst.dtype, seed, offset, saturate))


def _adamw_step_on_host(params, grads, exp_avgs, exp_avg_sqs, *arguments):
    host = [[t.cpu() for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    torch.ops.clipshard.adamw_step_(*host, *arguments)
    for targets, results in zip((params, exp_avgs, exp_avg_sqs), (host[0], host[2], host[3])):
        for target, result in zip(targets, results):
            target.copy_(result)


# The operators without an algorithm argument: (probe, the operator, its fallback).
KERNELS = {
    "stochastic_round": ("stochastic_round", torch.ops.clipshard.stochastic_round, _round_on_host),
    "stochastic_round_into": ("stochastic_round", torch.ops.clipshard.stochastic_round_into, _round_into_on_host),
    "adamw_step_": ("adamw_step_", torch.ops.clipshard.adamw_step_, _adamw_step_on_host),
}
# Every operator with a CUDA kernel, by the probe that checks it (tests/ops/test_first_use_check.py
# compares this with the CUDA registrations in csrc).
COVERED = {"contrastive_lse": ("contrastive_lse_forward", "contrastive_lse_backward"),
           "siglip_sum": ("siglip_forward",), "distill_lse": ("distill_lse", "distill_lse_backward"),
           "stochastic_round": ("stochastic_round", "stochastic_round_into"), "adamw_step_": ("adamw_step_",)}

_verdicts = {}  # (probe, algorithm, device, dtypes) -> True (agreed) or False (failed: use the fallback)
_lock = threading.Lock()


def resolve(op, algorithm, device, names, *dtypes):
    """_algorithm.resolve for op's inputs of `dtypes` (the compiled kernel must take each), then, when "auto"
    picked a compiled kernel, "torch" instead if that kernel failed its first-use check here."""
    picked = _algorithm.resolve(op, algorithm, device, names, *dtypes)
    if algorithm != "auto" or picked == "torch":
        return picked
    return picked if _agrees(op, picked, device, dtypes) else "torch"


def kernel(name, device, *dtypes):
    """The operator torch.ops.clipshard.<name> (a key of KERNELS) for tensors on `device` of `dtypes`,
    or its fallback if the kernel failed its first-use check there."""
    probe, op, fallback = KERNELS[name]
    return op if _agrees(probe, None, device, dtypes) else fallback


@constant_under_compile
def _agrees(probe, algorithm, device, dtypes):
    """The verdict on the compiled kernel for (probe, algorithm, device, dtypes); the first call for a
    device type that is checked runs the check. A dictionary lookup afterwards."""
    device = torch.device(device)
    # the variable is read only where a check applies (a refused value raises there; the self-check names it)
    if device.type not in CHECKED_DEVICE_TYPES or not env_vars.flag(ENV_VAR, True):
        return True
    key = (probe, algorithm, device, tuple(dtypes))
    verdict = _verdicts.get(key)
    return _first_verdict(key) if verdict is None else verdict


def _first_verdict(key):
    probe, algorithm, device, dtypes = key
    supported = _algorithm._COMPILED_DTYPES.get(device.type)
    if device.type not in CHECKED_DEVICE_TYPES or (supported is not None and any(d not in supported for d in dtypes)):
        return True  # not checked here (or no compiled kernel takes these dtypes: it raises its own error)
    if not _can_run_now(device):
        return True  # no verdict yet: checked on the first call that can run it
    with _lock:
        if key not in _verdicts:
            _verdicts[key] = _check(*key)
        return _verdicts[key]


def _can_run_now(device):
    """False while a CUDA graph is being captured (the check synchronises) and where no CUDA device
    can run anything (fake CUDA tensors traced on a machine without a GPU)."""
    return device.type != "cuda" or (torch.cuda.is_available() and not torch.cuda.is_current_stream_capturing())


def _check(probe_name, algorithm, device, dtypes):
    """Runs the probe; warns and returns False when the kernel disagrees with its reference or raises."""
    probe = PROBES[probe_name]
    try:
        with _disable_current_modes(), torch.no_grad(), torch.autocast(device.type, enabled=False), \
                (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
            error, tolerance = _measure(probe, algorithm, dtypes, device)
        problem = None if error <= tolerance else (
            f"{int(error)} of its stored values differ from the CPU kernel's" if probe.exact
            else f"error {error:.3g} against the torch path in fp64, tolerance {tolerance:.3g}")
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        problem = f"it raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if problem is not None:
        kernel_name = probe_name + (f" (algorithm {algorithm!r})" if algorithm else "")
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        warnings.warn(
            f"clipshard: the compiled CUDA kernel {kernel_name} failed its first-use check on {_describe(device)} for "
            f"{names}: {problem}. This process uses {probe.fallback} for it from now on. Please run "
            f"`python -m clipshard` on this machine and report its output as an issue (docs/self_check.md); "
            f"{ENV_VAR}=0 turns this check off.", stacklevel=2)
    return problem is None


def _measure(probe, algorithm, dtypes, device):
    """(error, tolerance) of the compiled kernel on `device`; one host synchronisation."""
    host = probe.inputs(dtypes)
    inputs = [t.to(device, copy=True) for t in host]
    got = probe.compiled(algorithm, dtypes, *inputs)
    if probe.exact:
        want = [t.to(device) for t in probe.reference(dtypes, *host)]
        return sum((_bits(a) != _bits(b)).sum() for a, b in zip(got, want)).item(), 0
    want = probe.reference(dtypes, *inputs)
    exact = probe.reference(dtypes, *[t.double() if t.is_floating_point() else t for t in inputs])
    error, baseline = torch.stack([_worst(got, exact), _worst(want, exact)]).tolist()
    return error, max(max(FLOOR[d] for d in dtypes), 2 * baseline)


def _bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _worst(outputs, references):
    """max over outputs of max|out - ref| / max|ref| (NaN where an output is NaN and its reference is not)."""
    return torch.stack([(o.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)
                        for o, r in zip(outputs, references) if r.numel()]).max()


def _describe(device):
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
