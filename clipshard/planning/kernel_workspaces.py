"""The temporaries each compiled clipshard kernel allocates beyond its outputs (docs/scale.md).

A fake kernel makes only an op's outputs, so a plan would miss the memory the real kernel holds
while it runs: the column-chunk workspace of the chunked kernels, fp32 accumulators of 16-bit
gradients, per-thread tiles. For each op, a rule gives the temporaries alive at the kernel's own
peak (next to its outputs), from the op's arguments and the rules of the device planned for; the
AllocationTracker counts them for that instant. The chunk widths come from the kernels' own rule
(clipshard.ops.chunk_columns, the twin of csrc/chunked/chunk_driver.h's).
"""
import torch

from clipshard.planning import workspace_rules_contrastive, workspace_rules_distill, workspace_rules_rounding, \
    workspace_rules_siglip

# operator name -> rule(device_type, *op_args) -> [(what, bytes), ...]
_RULES = {
    **workspace_rules_contrastive.RULES,
    **workspace_rules_siglip.RULES,
    **workspace_rules_distill.RULES,
    **workspace_rules_rounding.RULES,
}


def internal_allocations(func, device_type, args, kwargs):
    """[(what, bytes), ...]: the temporaries the kernel of `func` holds at its peak besides its
    outputs, on `device_type`; [] for every op without a rule (ATen's ops make only their outputs,
    up to small scratch space)."""
    rule = _RULES.get(func.name().removesuffix(".default"))
    if rule is None:
        return []
    bound = list(args) + [kwargs[a.name] for a in func._schema.arguments[len(args):] if a.name in kwargs]
    return [(what, int(n)) for what, n in rule(device_type, *bound) if n > 0]
