"""apply_to_open_clip() with the forward under CPU autocast: every loss open_clip then builds
(ClipLoss, SigLipLoss, DistillClipLoss, CoCaLoss), bf16 and fp16, the backward inside and after the
block, gives open_clip's own loss under the same autocast within the 16-bit type's reach."""
import itertools

import pytest
import torch

import clipshard

open_clip_loss = pytest.importorskip("open_clip.loss", reason="open_clip is not installed: pip install '.[open_clip]'")

B, D, CAPTION, VOCAB = 5, 8, 7, 11
SCALE = 10.0


def _inputs():
    g = torch.Generator().manual_seed(4)
    image = torch.nn.functional.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(image + 0.5 * torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
    teacher = [torch.nn.functional.normalize(torch.randn(B, D, generator=g, dtype=torch.float64), dim=1)
               for _ in range(2)]
    logits = torch.randn(B, CAPTION, VOCAB, generator=g, dtype=torch.float64)
    labels = torch.randint(0, VOCAB, (B, CAPTION), generator=g)
    return [t.float() for t in (image, text, *teacher, logits)] + [labels]


def _call(name, autocast_dtype, backward_inside):
    """(total loss, d image, d text, d scale) of the loss open_clip's name `name` builds now."""
    image, text, teacher_image, teacher_text, logits, labels = _inputs()
    image.requires_grad_(), text.requires_grad_()
    scale = torch.tensor(SCALE, requires_grad=True)
    loss = getattr(open_clip_loss, name)(**({"caption_loss_weight": 2.0, "clip_loss_weight": 1.0}
                                            if name == "CoCaLoss" else {}))
    arguments = {"ClipLoss": (image, text, scale), "SigLipLoss": (image, text, scale, torch.tensor(-5.0)),
                 "DistillClipLoss": (image, text, scale, teacher_image, teacher_text, torch.tensor(12.0)),
                 "CoCaLoss": (image, text, logits, labels, scale)}[name]
    with torch.autocast("cpu", dtype=autocast_dtype):
        value = loss(*arguments)
        value = sum(value) if isinstance(value, tuple) else value
        if backward_inside:
            value.backward()
    if not backward_inside:
        value.backward()
    return [t.detach().double() for t in (value, image.grad, text.grad, scale.grad)]


@pytest.mark.parametrize("name", ["ClipLoss", "SigLipLoss", "DistillClipLoss", "CoCaLoss"])
def test_the_patched_losses_under_autocast(name):
    for autocast_dtype, inside in itertools.product((torch.bfloat16, torch.float16), (False, True)):
        own = _call(name, autocast_dtype, inside)
        patch = clipshard.apply_to_open_clip()
        try:
            assert name in patch.replaced
            ours = _call(name, autocast_dtype, inside)
        finally:
            patch.undo()
        reach = torch.finfo(autocast_dtype).eps * SCALE  # a logit's rounding in 16 bits
        errors = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(ours, own)]
        assert errors[0] < 2 * reach and max(errors) < 8 * reach, (name, autocast_dtype, inside, errors)
