"""Helpers of the kernel workspace rules (workspace_rules_*.py): what a conversion copies, and the
temporaries of a kernel at its peak when it goes through phases.

A rule answers with the temporaries alive at the kernel's own peak besides its outputs, and the
planner adds the outputs for that instant. A kernel whose temporaries change over its run (a chunk
workspace freed before the 16-bit outputs are made from fp32 accumulators, say) is described as a
sequence of phases, each with the temporaries and the output bytes alive then; the rule's answer is
the peak phase's temporaries, less the outputs that did not exist yet at that point (so that the
planner's "temporaries + every output" is the kernel's true peak).
"""
from torch._prims_common import is_non_overlapping_and_dense_or_false as is_non_overlapping_and_dense


def nbytes(numel, dtype):
    """Bytes of numel elements of dtype."""
    return int(numel) * dtype.itemsize


def dtype_name(dtype):
    """'float32' for torch.float32: how the labels name dtypes."""
    return str(dtype).removeprefix("torch.")


def contiguous_copy_bytes(tensor):
    """Bytes that tensor.contiguous() allocates: none for a contiguous tensor, else a full copy."""
    return 0 if tensor.is_contiguous() else nbytes(tensor.numel(), tensor.dtype)


def converted_copy_bytes(tensor, dtype):
    """(kept, transient): bytes of the result of tensor.to(dtype).contiguous() that is not the input
    itself, and bytes alive only while it is made. to() keeps the strides of a dense tensor (a
    transposed one stays transposed, then contiguous() copies once more: a transient second copy);
    an overlapping one (an expanded gradient) it converts into a contiguous copy at once."""
    if tensor.dtype == dtype:
        return contiguous_copy_bytes(tensor), 0
    copy = nbytes(tensor.numel(), dtype)
    if tensor.is_contiguous() or not is_non_overlapping_and_dense(tensor):
        return copy, 0
    return copy, copy


def conversions(steps, before=()):
    """The copies that a kernel makes one after the other with .to(dtype).contiguous() (each kept
    for the rest of the call), as (kept, phases): kept the [(what, bytes)] of the copies, phases one
    [(what, bytes)] per conversion, the copies made so far, `before` and the conversion's transient
    bytes. steps: [(what, tensor, dtype)]."""
    kept, phases = [], []
    for what, tensor, dtype in steps:
        copy, transient = converted_copy_bytes(tensor, dtype)
        kept.append((what, copy))
        phases.append([*before, *kept, (f"{what}: strided conversion before contiguous()", transient)])
    return kept, phases


def at_peak(phases):
    """The temporaries at the peak of a kernel's phases, less the outputs not yet made there.

    phases: [(temporaries, outputs_alive, outputs_total)], temporaries a list of (what, bytes) alive
    during the phase, outputs_alive the bytes of the op's outputs that exist then, outputs_total
    those of all its outputs. The last phase should be the end of the kernel (every output made),
    which keeps the answer >= 0. Returns [(what, bytes), ...] whose sum is peak - outputs_total."""
    temporaries, alive, total = max(phases, key=lambda phase: sum(n for _, n in phase[0]) + phase[1])
    missing = total - alive  # counted by the planner, but made only after this phase
    answer = []
    for what, n in sorted(temporaries, key=lambda item: -item[1]):
        taken = min(n, missing)
        missing -= taken
        if taken:
            what = f"{what}, {taken} bytes less: outputs made after it is freed take their place"
        answer.append((what, n - taken))
    return answer


def per_device(cpu, cuda):
    """A rule(device_type, *op_args) that runs the CPU kernel's rule or the CUDA kernel's."""
    return lambda device_type, *args: (cuda if device_type == "cuda" else cpu)(*args)
