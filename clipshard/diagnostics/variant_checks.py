"""The first-use check's probes over every compiled kernel variant, for `python -m clipshard`.

A user's first call of a loss kernel variant (sample ids or not, positives or none, one direction
or both, rows per CTA, teachers per launch: clipshard/ops/first_use_probes.py) is checked by the
first-use check (docs/first_use.md). This check runs the same probes for every variant the device
has, so that the self-check sees each compiled path before any training does: on a GPU in fp32,
bf16 and fp16 (each student / teacher pair for distillation), on the CPU in fp32 (the CPU kernels
have fewer variants; the probes still run every argument combination). Each probe compares the
kernel with the torch path in fp64, within the larger of the dtype's floor and twice the torch
path's own error. One row per kernel family and dtypes when every variant passes (the worst one
named), one row per variant that fails.
"""
import torch

from clipshard.diagnostics.measurement import Measurement
from clipshard.ops import first_use, has_compiled_kernel
from clipshard.ops.first_use_probes import PROBES, describe

# kernel family -> (the operator that must have a kernel on the device, the algorithm per device type)
_FAMILIES = {
    "contrastive_lse": ("clipshard::contrastive_lse_forward", {"cuda": "chunked", "cpu": "fused"}),
    "siglip_sum": ("clipshard::siglip_forward", {"cuda": "chunked", "cpu": "chunked"}),
    "distill_lse": ("clipshard::distill_lse", {"cuda": "compiled", "cpu": "compiled"}),
}


def _dtype_sets(family, device):
    dtypes = (torch.float32, torch.bfloat16, torch.float16) if device.type == "cuda" else (torch.float32,)
    if family == "distill_lse":
        return [(s, t) for s in dtypes for t in dtypes]
    return [(d,) for d in dtypes]


def _name(dtypes):
    return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def check_every_variant(device):
    for family, (op, algorithms) in _FAMILIES.items():
        if not has_compiled_kernel(op, device.type) or device.type not in algorithms:
            continue
        algorithm, probe = algorithms[device.type], PROBES[family]
        variants = probe.every_variant(device)
        for dtypes in _dtype_sets(family, device):
            passed = []
            for variant in variants:
                with torch.no_grad():
                    error, tolerance = first_use._measure(probe, algorithm, dtypes, device, variant)
                if error <= tolerance:
                    passed.append((error / tolerance, error, tolerance, variant))
                else:
                    yield Measurement(f"{family} {algorithm} {_name(dtypes)} [{describe(variant)}]", error, tolerance)
            if len(passed) == len(variants):
                _, error, tolerance, worst = max(passed, key=lambda p: p[0])
                yield Measurement(f"{family} {algorithm} {_name(dtypes)}: {len(variants)} variants", error, tolerance,
                                  f"worst: {describe(worst)}")
