"""The losses' distributed modes under CPU autocast on 2 gloo ranks (issue 44, item 7; the one-process
sweep is tests/losses/test_autocast.py, where every mode is the single-device loss): ClipLoss
(local, exchange, ring; local_loss True and False), SigLipLoss (gather, ring) and DistillClipLoss
(local, exchange, ring), bf16 and fp16 autocast, fp32 and 16-bit features, backward inside and after
the block, algorithm "auto" and "torch": each call gives on every rank exactly the bits of the same
call outside autocast (autocast does not apply inside clipshard's ops or its collectives)."""
import itertools

import torch

import clipshard
from tests.dist_utils import run_group

B, D = 5, 8
UPSTREAM = 0.5 / B
LOSSES = [("ClipLoss", mode, local_loss) for mode in ("local", "exchange", "ring") for local_loss in (True, False)]
LOSSES += [("SigLipLoss", mode, None) for mode in ("gather", "ring")]
LOSSES += [("DistillClipLoss", mode, True) for mode in ("local", "exchange", "ring")]


def _features(rank, dtype, seed):
    g = torch.Generator().manual_seed(100 * seed + rank)
    image = torch.nn.functional.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(image + 0.5 * torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    return image.to(dtype), text.to(dtype)


def _loss(name, mode, local_loss, rank, world, algorithm):
    if name == "SigLipLoss":
        return clipshard.SigLipLoss(rank=rank, world_size=world, mode=mode, algorithm=algorithm)
    return getattr(clipshard, name)(local_loss=local_loss, gather_with_grad=True, rank=rank, world_size=world,
                                    mode=mode, algorithm=algorithm)


def _call(loss, rank, features, autocast_dtype, backward_inside):
    image, text = (f.detach().clone().requires_grad_() for f in features)
    scale = torch.tensor(10.0, requires_grad=True)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        if isinstance(loss, clipshard.SigLipLoss):
            value = loss(image, text, scale, torch.tensor(-5.0))
        elif isinstance(loss, clipshard.DistillClipLoss):
            value = sum(loss(image, text, scale, *_features(rank, image.dtype, seed=2), torch.tensor(12.0)))
        else:
            value = loss(image, text, scale)
        if backward_inside:
            (value * UPSTREAM).backward()
    if not backward_inside:
        (value * UPSTREAM).backward()
    return [t.detach() for t in (value, image.grad, text.grad, scale.grad)]


def _rank(rank, world):
    differing = []
    for (name, mode, local_loss), algorithm, autocast_dtype, same_dtype, inside in itertools.product(
            LOSSES, ("auto", "torch"), (torch.bfloat16, torch.float16), (False, True), (False, True)):
        features = _features(rank, autocast_dtype if same_dtype else torch.float32, seed=1)
        loss = _loss(name, mode, local_loss, rank, world, algorithm)
        under = _call(loss, rank, features, autocast_dtype, inside)
        outside = _call(loss, rank, features, None, inside)
        if not all(torch.equal(a, b) for a, b in zip(under, outside)):
            differing.append((name, mode, local_loss, algorithm, str(autocast_dtype), str(features[0].dtype), inside))
    return differing


def test_every_mode_under_autocast_gives_the_bits_outside_it_on_2_ranks():
    for differing in run_group(_rank, 2, timeout=300):
        assert differing == []
