"""Which compiled CUDA kernel variant a call runs, by the launchers' own rules.

The CUDA host code picks a kernel variant from the problem's sizes and the GPU: the chunked
contrastive forward's rows per CTA (16 or 32, CLIPSHARD_CHUNKED_FORWARD_ROWS), the rows per CTA of
SigLIP's kernel with ids (1, 2, 4 or 8, from M and the SM count), the teachers per launch of the
distillation forward (distill_forward_kernel<1> or <2>). Those rules live once, in
csrc/include/clipshard/launch_rules.h; the launchers call them, and so do the internal ops
torch.ops.clipshard._chunked_forward_rows_per_cta, _siglip_ids_rows_per_cta and
_distill_launch_teachers that this module wraps, on any machine. The first-use check
(clipshard/ops/first_use.py) keys its verdicts by these answers and builds problems that reach them.
One sizing rule of the chunk driver is answered the same way (column_buffer_rows, for the memory
planner's workspace rules).
"""
import contextlib
import os

import torch

from clipshard import _C  # noqa: F401  (registers torch.ops.clipshard.*)

FORWARD_ROWS_VARIABLE = "CLIPSHARD_CHUNKED_FORWARD_ROWS"
_HUGE = 1 << 40  # more rows than any grid limit: the rules' answer for "very large M"


def chunked_forward_rows(m):
    """Rows per CTA of the chunked contrastive forward kernel for m rows (16 or 32)."""
    return int(torch.ops.clipshard._chunked_forward_rows_per_cta(m))


def siglip_ids_rows(m, multiprocessors):
    """Rows per CTA of SigLIP's kernel with ids for m rows on a GPU with that many SMs (1, 2, 4 or 8)."""
    return int(torch.ops.clipshard._siglip_ids_rows_per_cta(m, multiprocessors))


def distill_launch_teachers(teachers):
    """The distinct teachers-per-launch of the distillation forward for T teachers, in launch order:
    (1,), (2,) or (2, 1)."""
    return tuple(int(n) for n in torch.ops.clipshard._distill_launch_teachers(teachers))


def column_buffer_rows(m, width):
    """Columns per block of the chunk driver's fp32 buffer of the columns' gradient (GradientAccumulator,
    csrc/chunked/chunk_driver.h) for m rows and chunks of at most `width` columns: m rounded down to
    a multiple of 128, at least 128, at most width."""
    return int(torch.ops.clipshard._column_buffer_rows(m, width))


_multiprocessor_counts = {}


def multiprocessors(device):
    """The SM count of a CUDA device (cached), None for other devices (no CUDA launch rule there)."""
    if device.type != "cuda":
        return None
    count = _multiprocessor_counts.get(device)
    if count is None:
        count = _multiprocessor_counts[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return count


@contextlib.contextmanager
def forward_rows_requested(rows):
    """CLIPSHARD_CHUNKED_FORWARD_ROWS set to `rows` (16 or 32; None: unset, the default) for the
    block, restored after."""
    saved = os.environ.pop(FORWARD_ROWS_VARIABLE, None)
    if rows is not None:
        os.environ[FORWARD_ROWS_VARIABLE] = str(rows)
    try:
        yield
    finally:
        os.environ.pop(FORWARD_ROWS_VARIABLE, None)
        if saved is not None:
            os.environ[FORWARD_ROWS_VARIABLE] = saved


def every_forward_rows():
    """Every rows-per-CTA variant of the chunked forward: the rule's answers for small and huge M
    under each accepted value of CLIPSHARD_CHUNKED_FORWARD_ROWS."""
    answers = set()
    for requested in (16, 32):
        with forward_rows_requested(requested):
            answers.update(chunked_forward_rows(m) for m in (1, _HUGE))
    return tuple(sorted(answers))


def every_siglip_ids_rows(multiprocessors):
    """Every rows-per-CTA variant of SigLIP's kernel with ids on a GPU with that many SMs: the rule's
    answers over M = 1, 2, 4, ... (it is monotone in M)."""
    return tuple(sorted({siglip_ids_rows(1 << e, multiprocessors) for e in range(41)}))


def every_distill_launch_teachers():
    """Every pattern of teachers per launch: the rule's answers for 1 to 5 teachers (two per launch
    at most, so 5 covers odd and even counts past one launch)."""
    return tuple(sorted({distill_launch_teachers(t) for t in range(1, 6)}))


def rows_reaching(rule, target, start):
    """The M nearest to `start` for which the non-decreasing rule(M) gives `target`: start itself,
    the smallest M above it, or the largest M below it. ValueError if no M gives it."""
    at_start = rule(start)
    if at_start == target:
        return start
    if at_start < target:
        high = start
        while rule(high) < target:
            if high > _HUGE:
                raise ValueError(f"no number of rows gives {target}")
            high *= 2
        low = high // 2  # rule(low) < target <= rule(high): the first M with rule(M) >= target
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if rule(middle) < target else (low, middle)
        found = high
    else:
        low, high = 1, start  # the last M with rule(M) <= target
        if rule(low) > target:
            raise ValueError(f"no number of rows gives {target}")
        while high - low > 1:
            middle = (low + high) // 2
            low, high = (middle, high) if rule(middle) <= target else (low, middle)
        found = low
    if rule(found) != target:
        raise ValueError(f"no number of rows gives {target}")
    return found
