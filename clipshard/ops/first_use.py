"""The first-use check of the compiled CUDA kernels (docs/first_use.md).

No GPU had run clipshard's CUDA kernels when they were written, and a GPU newer than the build's
architectures runs them through a PTX JIT that nothing else has exercised. So the first time a
process is about to run a compiled CUDA kernel variant on a device for given dtypes, this module
runs that variant once on a small problem (clipshard/ops/first_use_probes.py) and compares it
with its reference on the same device: the torch path (the losses; error normalised by an fp64
run of the torch path, within the larger of a floor and twice the torch path's own error in the
same dtype, the self-check's rule) or the CPU kernel on copies, bit for bit (stochastic rounding,
AdamW). If they disagree, or the kernel raises, it warns once, naming the kernel, its variant, the
device and `python -m clipshard`, and that (kernel, device, dtypes, variant) runs its fallback for
the rest of the process: the torch path, or the CPU kernel on host copies.

A variant is every choice that selects a different compiled path: sample ids and their targets,
positives or none (hard negatives), the column direction, gradients or none, and the launch
choices of the host code (rows per CTA, teachers per launch), which the launchers' own rules give
(clipshard/ops/launch_variants.py). If a kernel raises and the device then fails to synchronise
(an illegal address kills the CUDA context), no fallback could run: the kernel's error is raised,
with a note naming what was checked, and no verdict is kept. The verdicts are cached, so after
the first call a lookup costs no GPU work and no host synchronisation.
CLIPSHARD_FIRST_USE_CHECK=0 turns the check off.

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

import torch
from torch.utils._python_dispatch import _disable_current_modes

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)
from clipshard.ops import _algorithm, env_vars
from clipshard.ops.compile_marks import constant_under_compile
from clipshard.ops.first_use_probes import PROBES, describe

ENV_VAR = "CLIPSHARD_FIRST_USE_CHECK"
CHECKED_DEVICE_TYPES = ("cuda",)
FLOOR = {torch.float32: 2e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float64: 1e-10}


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

_verdicts = {}  # (probe, algorithm, device, dtypes, variant) -> True (agreed) or False (failed: use the fallback)
_lock = threading.Lock()


def rows_of(t):
    """t's number of rows for a path; None while torch.compile traces (a graph may serve other sizes,
    and a symbolic size is no constant): the verdict then covers every number of rows."""
    return None if torch.compiler.is_compiling() else t.shape[0]


def resolve(op, algorithm, device, names, *dtypes, paths=((),)):
    """_algorithm.resolve for op's inputs of `dtypes` (the compiled kernel must take each), then, when "auto"
    picked a compiled kernel, "torch" instead if a variant that the call's `paths` run (one per kernel
    call it makes; first_use_probes.py) failed its first-use check here."""
    picked = _algorithm.resolve(op, algorithm, device, names, *dtypes)
    if algorithm != "auto" or picked == "torch":
        return picked
    return picked if _agrees(op, picked, device, dtypes, paths) else "torch"


def kernel(name, device, *dtypes):
    """The operator torch.ops.clipshard.<name> (a key of KERNELS) for tensors on `device` of `dtypes`,
    or its fallback if the kernel failed its first-use check there."""
    probe, op, fallback = KERNELS[name]
    return op if _agrees(probe, None, device, dtypes) else fallback


@constant_under_compile
def _agrees(probe, algorithm, device, dtypes, paths=((),)):
    """The verdict on the compiled kernel's variants that `paths` run, for (probe, algorithm, device,
    dtypes): False if any failed. The first call for a (variant, device, dtypes) of a device type
    that is checked runs its check; a dictionary lookup afterwards (and the launch rules' answers)."""
    device = torch.device(device)
    # the variable is read only where a check applies (a refused value raises there; the self-check names it)
    if device.type not in CHECKED_DEVICE_TYPES or not env_vars.flag(ENV_VAR, True):
        return True
    variants = [v for path in paths for v in PROBES[probe].variants(device, path)]
    verdicts = [_verdicts.get((probe, algorithm, device, tuple(dtypes), v)) for v in variants]
    if all(verdicts):
        return True
    return all(_first_verdict((probe, algorithm, device, tuple(dtypes), v)) if verdict is None else verdict
               for v, verdict in zip(variants, verdicts))


def _first_verdict(key):
    probe, algorithm, device, dtypes, variant = key
    supported = _algorithm._COMPILED_DTYPES.get(device.type)
    if supported is not None and any(d not in supported for d in dtypes):
        return True  # no compiled kernel takes these dtypes: it raises its own error
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


def _synchronise(device):
    """Waits for the device's work; raises if the device no longer works (a lost CUDA context)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _what(probe_name, algorithm, device, dtypes, variant):
    """The kernel, variant, device and dtypes of a check, for its messages."""
    details = ([f"algorithm {algorithm!r}"] if algorithm else []) + ([describe(variant)] if variant else [])
    names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
    kernel_name = probe_name + (f" ({'; '.join(details)})" if details else "")
    return f"the compiled CUDA kernel {kernel_name}", f"on {_describe(device)} for {names}"


def _check(probe_name, algorithm, device, dtypes, variant=()):
    """Runs the probe of one variant; warns and returns False when the kernel disagrees with its
    reference or raises. Raises, without a verdict, when the device is out of memory, or when the
    kernel raised and the device then fails to synchronise (no fallback can run on a lost context)."""
    probe = PROBES[probe_name]
    kernel_name, where = _what(probe_name, algorithm, device, dtypes, variant)
    try:
        with _disable_current_modes(), torch.no_grad(), torch.autocast(device.type, enabled=False), \
                (torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()):
            error, tolerance = _measure(probe, algorithm, dtypes, device, variant)
        problem = None if error <= tolerance else (
            f"{int(error)} of its stored values differ from the CPU kernel's" if probe.exact
            else f"error {error:.3g} against the torch path in fp64, tolerance {tolerance:.3g}")
    except torch.OutOfMemoryError:
        raise
    except RuntimeError as error:
        _raise_if_the_device_is_lost(error, device, kernel_name, where)
        problem = f"it raised {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    if problem is not None:
        warnings.warn(
            f"clipshard: {kernel_name} failed its first-use check {where}: {problem}. This process uses "
            f"{probe.fallback} for it from now on. Please run `python -m clipshard` on this machine and report its "
            f"output as an issue (docs/self_check.md); {ENV_VAR}=0 turns this check off.", stacklevel=2)
    return problem is None


def _raise_if_the_device_is_lost(error, device, kernel_name, where):
    """After a kernel raised: synchronise the device, and if that fails too (an illegal address kills
    the CUDA context, and every later call on it fails), raise the kernel's error with a note naming
    what was checked, instead of falling back to a path that cannot run either."""
    try:
        _synchronise(device)
    except RuntimeError as lost:
        error.add_note(
            f"clipshard: {kernel_name} raised this error during its first-use check {where}, and the device no "
            f"longer works (synchronising it raised {type(lost).__name__}: {str(lost).splitlines()[0]}): no "
            f"fallback can run in this process. Please run `python -m clipshard` in a new process and report its "
            f"output as an issue (docs/self_check.md); {ENV_VAR}=0 turns this check off.")
        raise error from None
def _measure(probe, algorithm, dtypes, device, variant=()):
    """(error, tolerance) of the compiled kernel's variant on `device`; one host synchronisation."""
    host = probe.inputs(dtypes, variant, device)
    inputs = [t.to(device, copy=True) for t in host]
    with probe.reaching(variant):
        got = probe.compiled(algorithm, dtypes, variant, *inputs)
    if probe.exact:
        want = [t.to(device) for t in probe.reference(dtypes, variant, *host)]
        return sum((_bits(a) != _bits(b)).sum() for a, b in zip(got, want)).item(), 0
    want = probe.reference(dtypes, variant, *inputs)
    exact = probe.reference(dtypes, variant, *[t.double() if t.is_floating_point() else t for t in inputs])
    error, baseline = torch.stack([_worst(got, exact), _worst(want, exact)]).tolist()
    return error, max(max(FLOOR[d] for d in dtypes), 2 * baseline)


def _bits(t):
    return t.view(torch.int32 if t.element_size() == 4 else torch.int16)


def _worst(outputs, references):
    """max over outputs of max|out - ref| / max|ref| (NaN where an output is NaN and its reference is not)."""
    return torch.stack([(o.double() - r).abs().max() / r.abs().max().clamp_min(1e-30)
                        for o, r in zip(outputs, references) if r is not None and r.numel()]).max()


def _describe(device):
    if device.type != "cuda":
        return str(device)
    major, minor = torch.cuda.get_device_capability(device)
    return f"{device} ({torch.cuda.get_device_name(device)}, sm_{major}{minor})"
