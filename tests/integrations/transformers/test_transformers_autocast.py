"""apply_to_transformers() with the forward under CPU autocast (bf16 and fp16, the backward inside and
after the block): CLIPModel's and SiglipModel's loss and parameter gradients are the model's own under
the same autocast within the 16-bit type's reach (the towers run in 16 bits in both)."""
import itertools

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed: pip install '.[transformers]'")

import clipshard  # noqa: E402
from tests.integrations.transformers.hf_tiny_models import tiny_inputs, tiny_model  # noqa: E402


def _step(name, inputs, autocast_dtype, backward_inside, patched):
    model = tiny_model(name).train()
    patch = clipshard.apply_to_transformers() if patched else None
    try:
        with torch.autocast("cpu", dtype=autocast_dtype):
            loss = model(**inputs, return_loss=True).loss
            if backward_inside:
                loss.backward()
        if not backward_inside:
            loss.backward()
    finally:
        if patch is not None:
            patch.undo()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", ["CLIPModel", "SiglipModel"])
def test_the_patched_loss_under_autocast(name):
    inputs = tiny_inputs(name, 6, seed=6)
    for autocast_dtype, inside in itertools.product((torch.bfloat16, torch.float16), (False, True)):
        own, own_grads = _step(name, inputs, autocast_dtype, inside, patched=False)
        ours, our_grads = _step(name, inputs, autocast_dtype, inside, patched=True)
        assert own_grads.keys() == our_grads.keys()
        # relative to the largest gradient of the model: some (attention key biases) are 0 in exact arithmetic
        largest = max(g.abs().max() for g in own_grads.values())
        grad_error = max((our_grads[n] - own_grads[n]).abs().max() / largest for n in own_grads).item()
        reach = 4 * torch.finfo(autocast_dtype).eps
        assert abs(ours - own) / abs(own) < reach and grad_error < reach, (name, autocast_dtype, inside,
                                                                           grad_error)
