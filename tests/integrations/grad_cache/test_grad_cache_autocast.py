"""clipshard.GradCache with the forward under CPU autocast (bf16 and fp16; ClipLoss and SigLipLoss by
the compiled kernels and by the portable torch path; the backward inside and after the block): the
gradients of the plain step under the same autocast, within the 16-bit type's reach (both run the
towers in 16 bits; the loss computes as outside autocast)."""
import itertools

import pytest
import torch

import clipshard
from tests.integrations.grad_cache.grad_cache_models import TinyClip, batch, call_loss, concatenated, grads, \
    max_relative_difference

M, MICRO = 11, 4  # the last micro-batch is shorter
UPSTREAM = 0.5 / M


def _gradients(cached, name, algorithm, autocast_dtype, backward_inside):
    """The model's gradients after one step, GradCache's or the plain one (the same micro-batches, every
    graph kept), the forward under autocast and the backward inside or after the block."""
    torch.manual_seed(3)
    model = TinyClip(dtype=torch.float32, with_bias=name == "SigLipLoss")
    loss_fn = getattr(clipshard, name)(algorithm=algorithm)
    images, tokens = batch(M, 4, torch.float32)
    with torch.autocast("cpu", dtype=autocast_dtype):
        if cached:
            loss = clipshard.GradCache(model, loss_fn, MICRO)(images, tokens)
        else:
            outputs = [model(i, t) for i, t in zip(images.split(MICRO), tokens.split(MICRO))]
            loss = call_loss(loss_fn, concatenated(outputs))
        if backward_inside:
            (loss * UPSTREAM).backward()
    if not backward_inside:
        (loss * UPSTREAM).backward()
    return grads(model)


@pytest.mark.parametrize("algorithm", ["auto", "torch"])
@pytest.mark.parametrize("name", ["ClipLoss", "SigLipLoss"])
def test_grad_cache_under_autocast(name, algorithm):
    for autocast_dtype, inside in itertools.product((torch.bfloat16, torch.float16), (False, True)):
        ours = _gradients(True, name, algorithm, autocast_dtype, inside)
        plain = _gradients(False, name, algorithm, autocast_dtype, inside)
        difference = max_relative_difference(ours, plain)
        assert difference <= 4 * torch.finfo(autocast_dtype).eps, (name, algorithm, autocast_dtype, inside, difference)
