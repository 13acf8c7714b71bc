"""Which implementation of a loss op runs: the rule behind algorithm="auto" (docs/portable.md).

Each op has compiled kernels for some device types (contrastive_lse: "fused" on the CPU, "chunked"
on CUDA; siglip_sum: "chunked" on both; distill_lse: "compiled" on both)
and the portable algorithm "torch", written with PyTorch
operations only, which runs on every device torch supports. "auto" picks the op's compiled kernel
when the tensors' device type has one AND the extension registered it with torch's dispatcher
(a CUDA machine whose extension was built CPU-only, or a ROCm build, which torch reports as
"cuda" but for which setup.py compiles no GPU kernels, has none), and "torch" everywhere else
(ROCm, XPU, MPS, any future device), saying so once per device type with a warning. The compiled
CUDA kernels take fp32, fp16 and bf16 only: when any input is fp64 on CUDA (torch.autograd.gradcheck,
or distill_lse's fp64 teachers beside a 16-bit student) the op runs "torch" too, with a warning once.

The environment variable CLIPSHARD_ALGORITHM=torch makes every "auto" pick "torch", so that a
user can fall back from a compiled kernel inside a trainer whose code they do not control. An
explicit `algorithm=` argument always wins over the variable.
"""
import warnings

import torch

from clipshard.ops import env_vars
from clipshard.ops.compile_marks import constant_under_compile
from clipshard.ops.planned_device import planned_device_type, rules_device

ENV_VAR = "CLIPSHARD_ALGORITHM"

# Per op: the registered operator, and the compiled algorithm "auto" picks per device type.
_COMPILED = {
    "contrastive_lse": ("clipshard::contrastive_lse_forward", {"cpu": "fused", "cuda": "chunked"}),
    "siglip_sum": ("clipshard::siglip_forward", {"cpu": "chunked", "cuda": "chunked"}),
    "distill_lse": ("clipshard::distill_lse", {"cpu": "compiled", "cuda": "compiled"}),
}
# The dtypes the compiled kernels of a device type take (every op alike); absent: all four.
_COMPILED_DTYPES = {"cuda": (torch.float32, torch.float16, torch.bfloat16)}
# The dispatch key of each device type that can have a compiled kernel.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}

_warned_device_types = set()  # device types, and (device type, dtype) pairs, already warned about


def has_compiled_kernel(operator, device_type):
    """Whether the extension registered a kernel of `operator` for tensors of `device_type`."""
    key = _DISPATCH_KEYS.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(operator, key)


def _forced():
    """True when CLIPSHARD_ALGORITHM asks every "auto" for the torch path."""
    return env_vars.value(ENV_VAR) == "torch"


def _warn_once(key, reason):
    if key in _warned_device_types:
        return
    _warned_device_types.add(key)
    warnings.warn(
        f"clipshard: {reason}, so the losses run algorithm='torch', the portable PyTorch implementation (same "
        "results and memory bound, slower than a compiled kernel). Pass algorithm='torch' to choose it "
        "explicitly; see docs/portable.md.",
        stacklevel=4)


def check_algorithm(fn, algorithm, names):
    """`algorithm` must be one of `names` (the op's accepted values)."""
    if not isinstance(algorithm, str) or algorithm not in names:
        raise ValueError(f"{fn}: algorithm must be one of {', '.join(map(repr, names))}, got {algorithm!r}")


def resolve(op, algorithm, device, names, *dtypes):
    """The algorithm that runs op ("contrastive_lse", "siglip_sum" or "distill_lse") on `device` for inputs of
    `dtypes` (every input's dtype: the compiled kernel must take each) when asked for `algorithm` (one of
    `names`); "auto" follows the module docstring's rule."""
    check_algorithm(op, algorithm, names)
    if algorithm == "compiled" and not has_compiled_kernel(_COMPILED[op][0], torch.device(device).type):
        raise RuntimeError(f"{op}: algorithm='compiled' needs the extension's {op} kernel for "
                           f"{torch.device(device).type!r} tensors, and this build has none; use 'auto' or 'torch'")
    if algorithm != "auto":
        return algorithm
    return _auto(op, rules_device(device).type, dtypes)


def explain_auto(op, device_type, *dtypes):
    """(algorithm, reason, warning key or None): what "auto" picks for op on `device_type` inputs of
    `dtypes` (none given: any dtype the kernels take) and why; a key when the pick deserves a warning."""
    if _forced():
        return "torch", f"{ENV_VAR}=torch is set", None
    operator, compiled = _COMPILED[op]
    # a memory plan for a device assumes the kernels that the build on that device registers
    registered = has_compiled_kernel(operator, device_type) or device_type == planned_device_type()
    if device_type not in compiled or not registered:
        return "torch", f"no compiled clipshard kernel is registered for {device_type!r} tensors", device_type
    supported = _COMPILED_DTYPES.get(device_type)
    refused = [d for d in dtypes if supported is not None and d not in supported]
    if refused:
        dtype = refused[0]
        names = ", ".join(str(d).removeprefix("torch.") for d in supported)
        return ("torch", f"the compiled {device_type!r} kernels take {names}, not {str(dtype).removeprefix('torch.')}",
                (device_type, dtype))
    return compiled[device_type], f"the extension registered the {compiled[device_type]!r} kernel", None


# torch.compile evaluates this once while tracing: the dispatcher query cannot be traced, and the
# choice (and its warning) belongs to the trace, not to the compiled graph.
@constant_under_compile
def _auto(op, device_type, dtypes):
    algorithm, reason, warning_key = explain_auto(op, device_type, *dtypes)
    if warning_key is not None:
        _warn_once(warning_key, reason)
    return algorithm
