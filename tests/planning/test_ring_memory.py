"""Ring mode's memory at its peak, from the plan: during a block's backward the ring pass keeps two
text blocks (the current one and the next, in flight) and one travelling gradient accumulator; the
block and the accumulator it sent are freed before the next buffers are allocated (docs/scale.md)."""
import pytest
import torch

import clipshard
from clipshard.planning import plan_memory

M, D = 4096, 256


@pytest.mark.parametrize("loss", [clipshard.ClipLoss(mode="ring"), clipshard.SigLipLoss(mode="ring")],
                         ids=["clip", "siglip"])
def test_one_travelling_accumulator_beside_the_image_gradient_and_two_blocks_at_the_peak(loss):
    plan = plan_memory(loss, world_size=8, batch_size=M, dim=D, dtype=torch.bfloat16, device="cuda")
    outside_the_op = [what for _, what in plan.peak_allocations if not what.startswith("ops.")]
    # fp32 M x D: the image rows' gradient accumulator and the text block's travelling one (before,
    # the accumulator sent on was still alive too)
    assert sum(what.endswith(f"-> ({M}, {D}) float32") for what in outside_the_op) == 2
    # bf16 blocks: the current one and the next, in flight (before, the one sent on too, at times)
    assert sum(what.endswith(f"-> ({M}, {D}) bfloat16") for what in outside_the_op) == 2


def test_ring_memory_is_flat_in_the_world_size():
    peaks = [plan_memory(clipshard.ClipLoss(mode="ring"), world_size=n, batch_size=M, dim=D, dtype=torch.bfloat16,
                         device="cuda").peak_bytes for n in (2, 8, 64)]
    assert max(peaks) - min(peaks) <= 0.02 * min(peaks)
