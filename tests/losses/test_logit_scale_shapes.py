"""logit_scale / logit_bias may be 0-dim or one-element tensors of any shape (open_clip's
nonscalar_logit_scale models use shape (1,)) on one device, as over ranks
(tests/parallel/test_bad_input_on_one_rank.py): the same loss, and gradients of the shape given."""
import pytest
import torch

import clipshard
from tests.references.contrastive import clip_loss_reference

SHAPES = [(), (1,), (1, 1)]


def _features(n, d, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randint(-16, 17, (n, d), generator=gen, dtype=torch.int64) / 16).to(torch.float64)


def _loss_and_grads(loss_fn, shape):
    image, text = _features(9, 5, 1), _features(9, 5, 2)
    scale = torch.full(shape, 7.5, dtype=torch.float64, requires_grad=True)
    bias = torch.full(shape, -0.5, dtype=torch.float64, requires_grad=True)
    loss = loss_fn(image, text, scale, bias)
    loss.backward()
    assert scale.grad.shape == shape and bias.grad.shape == shape
    return loss.detach(), scale.grad.reshape(()), bias.grad.reshape(())


LOSSES = {
    "clip_loss": clipshard.clip_loss,
    "ClipLoss": lambda *a: clipshard.ClipLoss()(*a),
    "contrastive_lse": lambda i, t, s, b: sum(o.sum() for o in clipshard.contrastive_lse(i, t, s, b)),
}


@pytest.mark.parametrize("name", LOSSES)
@pytest.mark.parametrize("shape", SHAPES[1:])
def test_one_element_scale_and_bias_equal_the_0_dim_ones(name, shape):
    want = _loss_and_grads(LOSSES[name], ())
    got = _loss_and_grads(LOSSES[name], shape)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_the_loss_with_a_one_element_scale_matches_the_fp64_reference():
    image, text = _features(9, 5, 1), _features(9, 5, 2)
    scale, bias = torch.full((1,), 7.5, dtype=torch.float64), torch.full((1,), -0.5, dtype=torch.float64)
    got = clipshard.clip_loss(image, text, scale, bias)
    want = clip_loss_reference(image, text, scale.reshape(()), bias.reshape(()))
    assert abs(got.item() - want.item()) < 1e-12


@pytest.mark.parametrize("bad, error, match", [
    (torch.ones(2), ValueError, r"scale must be a one-element tensor, got shape \(2,\)"),
    (torch.ones(0), ValueError, r"scale must be a one-element tensor, got shape \(0,\)"),
    (torch.tensor([3]), TypeError, "scale must be a floating-point tensor, got torch.int64"),
    ("10", TypeError, "scale must be a float or a one-element tensor, got str"),
])
def test_other_scales_are_refused_by_name(bad, error, match):
    image, text = _features(4, 3, 1), _features(4, 3, 2)
    with pytest.raises(error, match=match):
        clipshard.clip_loss(image.float(), text.float(), bad)
