"""ClipLoss, SigLipLoss and DistillClipLoss with the forward under CPU autocast (bf16 and fp16; fp32 and
16-bit features; the backward inside and after the block; every mode in one process; the compiled
kernels and the portable torch path): autocast does not apply inside clipshard's ops, so each call
gives exactly what it gives outside autocast, and what open_clip's loss gives under the same
autocast within the 16-bit type's reach (open_clip's logits are 16-bit there)."""
import itertools

import pytest
import torch

import clipshard

open_clip_loss = pytest.importorskip("open_clip.loss", reason="open_clip is not installed: pip install '.[open_clip]'")

B, D = 5, 8
SCALE, BIAS, TEACHER_SCALE = 10.0, -5.0, 12.0
MODES = {"ClipLoss": ("local", "exchange", "ring"), "SigLipLoss": ("gather", "ring"),
         "DistillClipLoss": ("local", "exchange", "ring")}
UPSTREAM = 0.5 / B  # a realistic upstream gradient


def _features(dtype, seed):
    g = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(image + 0.5 * torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    return image.to(dtype), text.to(dtype)


def _call(loss, features, autocast_dtype, backward_inside):
    """(loss, d image, d text, d scale) of one call; the forward under autocast unless autocast_dtype is None."""
    image, text = (f.detach().clone().requires_grad_() for f in features)
    scale = torch.tensor(SCALE, requires_grad=True)
    with torch.autocast("cpu", dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        if isinstance(loss, (clipshard.SigLipLoss, open_clip_loss.SigLipLoss)):
            value = loss(image, text, scale, torch.tensor(BIAS))
        elif isinstance(loss, (clipshard.DistillClipLoss, open_clip_loss.DistillClipLoss)):
            teacher = _features(image.dtype, seed=2)
            value = sum(loss(image, text, scale, *teacher, torch.tensor(TEACHER_SCALE)))
        else:
            value = loss(image, text, scale)
        if backward_inside:
            (value * UPSTREAM).backward()
    if not backward_inside:
        (value * UPSTREAM).backward()
    return [t.detach().double() for t in (value, image.grad, text.grad, scale.grad)]


def _relative(got, want):
    return max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want))


@pytest.mark.parametrize("algorithm", ["auto", "torch"])
@pytest.mark.parametrize("name", list(MODES))
def test_autocast(name, algorithm):
    for mode, autocast_dtype, same_dtype, inside in itertools.product(
            MODES[name], (torch.bfloat16, torch.float16), (False, True), (False, True)):
        features = _features(autocast_dtype if same_dtype else torch.float32, seed=1)
        case = f"{name}, {mode}, {autocast_dtype} autocast, {features[0].dtype} features, backward " + (
            "inside" if inside else "after")
        ours = _call(getattr(clipshard, name)(mode=mode, algorithm=algorithm), features, autocast_dtype, inside)
        outside = _call(getattr(clipshard, name)(mode=mode, algorithm=algorithm), features, None, inside)
        assert _relative(ours, outside) == 0, (case, "differs from the same call outside autocast")
        open_clip = _call(getattr(open_clip_loss, name)(), features, autocast_dtype, inside)
        reach = torch.finfo(autocast_dtype).eps * SCALE  # a logit's rounding in 16 bits
        assert _relative(ours[:1], open_clip[:1]) < 2 * reach and _relative(ours, open_clip) < 8 * reach, (
            case, _relative(ours, open_clip))
