"""clipshard.GradCache on one process: the gradients of the plain step (fp64 within 1e-10
relative, fp32 within 1e-5) for ClipLoss and SigLipLoss, dict and tuple outputs, odd sizes, with an
upstream gradient of 0.5 / M; the loss evaluated once; the same dropout masks in both passes and
the generators put back; autocast and a bf16 text tower trained with clipshard's AdamW; BatchNorm
refused unless allowed; bad input refused before anything runs."""
import pytest
import torch
from torch import nn

import clipshard
from tests.integrations.grad_cache.grad_cache_models import (
    LearnedLoss, TinyClip, batch, grads, max_relative_difference, plain_step)

M = 23  # odd: the last micro-batch is shorter


def _compare(model_kwargs, loss_fn, micro, *, reference_micro, dtype=torch.float64, size=M, seed=1):
    """(GradCache's gradients, the plain step's, the two losses) from the same initial model and
    generator state."""
    images, tokens = batch(size, seed, dtype)
    upstream = 0.5 / size
    results = []
    for cached in (True, False):
        torch.manual_seed(7)
        model = TinyClip(dtype=dtype, **model_kwargs)
        if cached:
            loss = clipshard.GradCache(model, loss_fn, micro)(images, tokens)
            (loss * upstream).backward()
            loss = loss.detach()
        else:
            loss = plain_step(model, loss_fn, images, tokens, reference_micro, upstream)
        results.append((grads(model), loss))
    (ours, our_loss), (reference, reference_loss) = results
    return ours, reference, our_loss, reference_loss


CASES = [  # (loss, output as tuple, dtype, tolerance, micro-batch size: 1, odd, more than the batch)
    (clipshard.ClipLoss(), False, torch.float64, 1e-10, 5),
    (clipshard.ClipLoss(), False, torch.float64, 1e-10, 1),
    (clipshard.ClipLoss(), False, torch.float64, 1e-10, 64),
    (clipshard.SigLipLoss(), True, torch.float64, 1e-10, 5),
    (clipshard.ClipLoss(), True, torch.float32, 1e-5, 5),
    (clipshard.SigLipLoss(), False, torch.float32, 1e-5, 4),
]


@pytest.mark.parametrize("loss_fn,as_tuple,dtype,tolerance,micro", CASES,
                         ids=["clip-dict-fp64-5", "clip-dict-fp64-1", "clip-dict-fp64-64", "siglip-tuple-fp64-5",
                              "clip-tuple-fp32-5", "siglip-dict-fp32-4"])
def test_gradients_equal_the_plain_step_with_the_same_dropout(loss_fn, as_tuple, dtype, tolerance, micro):
    with_bias = isinstance(loss_fn, clipshard.SigLipLoss)
    ours, reference, our_loss, reference_loss = _compare(dict(dropout=0.2, as_tuple=as_tuple, with_bias=with_bias),
                                                         loss_fn, micro, reference_micro=micro, dtype=dtype)
    expected = {n for n, _ in TinyClip(with_bias=with_bias).named_parameters()}
    assert set(ours) == expected  # logit_scale (and SigLIP's logit_bias) included
    assert max_relative_difference(ours, reference) <= tolerance
    assert abs(our_loss - reference_loss) <= tolerance * abs(reference_loss)


def test_without_dropout_gradients_equal_the_full_batch_step():
    ours, reference, _, _ = _compare(dict(with_bias=False), clipshard.ClipLoss(), 4, reference_micro=None)
    assert max_relative_difference(ours, reference) <= 1e-10


def test_the_loss_runs_once_per_step():
    calls = []

    def counting_loss(**outputs):
        calls.append(1)
        return clipshard.ClipLoss()(**outputs)

    model = TinyClip(dropout=0.1, with_bias=False)
    loss = clipshard.GradCache(model, counting_loss, 4)(*batch(M, 2))
    loss.backward()
    assert len(calls) == 1
    with pytest.raises(RuntimeError, match="backward ran twice"):
        loss.backward()


class RecordingDropout(nn.Module):
    """Dropout that keeps every mask it draws."""

    def __init__(self):
        super().__init__()
        self.masks = []

    def forward(self, x):
        mask = torch.rand_like(x) > 0.3
        self.masks.append(mask)
        return x * mask / 0.7


def test_both_passes_draw_the_same_dropout_masks_and_the_generator_is_put_back():
    model = TinyClip(with_bias=False)
    model.image[2] = RecordingDropout()
    micro_batches = 5
    torch.manual_seed(3)
    loss = clipshard.GradCache(model, clipshard.ClipLoss(), 5)(*batch(M, 3))
    after_forward = torch.get_rng_state()
    loss.backward()
    masks = model.image[2].masks
    assert len(masks) == 2 * micro_batches
    first, second = masks[:micro_batches], masks[micro_batches:]
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    assert not torch.equal(first[0], first[1][:first[0].shape[0]])  # micro-batches draw different masks
    assert torch.equal(torch.get_rng_state(), after_forward)  # the re-runs' draws are not seen afterwards


class DtypeRecorder(TinyClip):
    """Records the dtype of the image features of every call."""

    def forward(self, images, tokens):
        output = super().forward(images, tokens)
        self.seen = getattr(self, "seen", []) + [self.image[0](images).dtype]
        return output


def test_autocast_is_re_entered_for_the_re_runs():
    """Both passes compute in bf16 under autocast (the re-runs happen in backward, outside the
    user's autocast region); the gradients then agree with the plain step's within bf16 rounding
    (the plain step sums the micro-batches' weight gradients in bf16, GradCache in fp32)."""
    images, tokens = batch(M, 4, torch.float32)
    results = []
    for cached in (True, False):
        model = DtypeRecorder(dtype=torch.float32, with_bias=False)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if cached:
                loss = clipshard.GradCache(model, clipshard.ClipLoss(), 6)(images, tokens)
            else:
                plain_step(model, clipshard.ClipLoss(), images, tokens, 6)
        if cached:
            loss.backward()
            assert model.seen == [torch.bfloat16] * 8  # 4 micro-batches, twice
        results.append(grads(model))
    assert max_relative_difference(*results) <= 2 ** -6


def test_bf16_text_tower_with_clipshard_adamw_follows_the_plain_steps():
    """Three optimiser steps: at the first, the fp32 image tower's gradients within 1e-5 and the
    bf16 text tower's within bf16 rounding (summation order); the losses of all three close."""
    trajectories = []
    for cached in (True, False):
        model = TinyClip(dtype=torch.float32, with_bias=False)
        clipshard.optim.to_half_precision_(model.text, torch.bfloat16, generator=torch.Generator().manual_seed(1))
        opt = clipshard.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1,
                                    generator=torch.Generator().manual_seed(2))
        losses, first_grads = [], None
        for step in range(3):
            images, tokens = batch(M, 10 + step, torch.float32)
            if cached:
                loss = clipshard.GradCache(model, clipshard.ClipLoss(), 6)(images, tokens)
                loss.backward()
            else:
                loss = plain_step(model, clipshard.ClipLoss(), images, tokens, 6)
            first_grads = first_grads or grads(model)
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        assert {p.dtype for n, p in model.named_parameters() if n.startswith("text.")} == {torch.bfloat16}
        trajectories.append((first_grads, losses))
    (ours, our_losses), (reference, reference_losses) = trajectories
    fp32 = {k for k in reference if reference[k].dtype == torch.float32}
    assert max_relative_difference({k: ours[k] for k in fp32}, {k: reference[k] for k in fp32}) <= 1e-5
    assert max_relative_difference({k: ours[k] for k in reference if k not in fp32},
                                   {k: reference[k] for k in reference if k not in fp32}) <= 2 ** -7
    # later steps: a one-ulp difference in a gradient can flip a stochastic rounding, so the weights
    # part by bf16 ulps; the losses stay together
    assert max(abs(a - b) / b for a, b in zip(our_losses, reference_losses)) <= 1e-3


def test_batch_norm_in_training_mode_is_refused_unless_allowed():
    model = TinyClip()
    model.image[1] = nn.BatchNorm1d(16).double()
    images, tokens = batch(M, 5)
    with pytest.raises(ValueError, match=r"BatchNorm in training mode \(image.1 \(BatchNorm1d\)\).*allow_batch_norm=True"):
        clipshard.GradCache(model, clipshard.ClipLoss(), 4)(images, tokens)
    assert int(model.image[1].num_batches_tracked) == 0  # nothing ran
    clipshard.GradCache(model, clipshard.ClipLoss(), 4, allow_batch_norm=True)(images, tokens).backward()
    model.eval()
    clipshard.GradCache(model, clipshard.ClipLoss(), 4)(images, tokens).backward()  # eval mode: exact, accepted


@pytest.mark.parametrize("micro,error,match", [
    (0, ValueError, "micro_batch_size must be >= 1, got 0"),
    (True, TypeError, "micro_batch_size must be an int, got True"),
    ("4", TypeError, "micro_batch_size must be an int, got '4'"),
])
def test_bad_micro_batch_size_is_refused(micro, error, match):
    with pytest.raises(error, match=match):
        clipshard.GradCache(TinyClip(), clipshard.ClipLoss(), micro)


class DictTextModel(nn.Module):
    """Takes texts as a dict of input_ids and attention_mask (Hugging Face style)."""

    def __init__(self, returns=None):
        super().__init__()
        self.inner, self.returns = TinyClip(with_bias=False), returns

    def forward(self, images, texts):
        output = self.inner(images, texts["input_ids"] * texts["attention_mask"])
        return self.returns(output) if self.returns else output


def test_dict_inputs_are_split_like_tensors():
    images, tokens = batch(M, 6)
    texts = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens)}
    results = []
    for cached in (True, False):
        model = DictTextModel()
        if cached:
            clipshard.GradCache(model, clipshard.ClipLoss(), 5)(images, texts).backward()
        else:
            plain_step(model.inner, clipshard.ClipLoss(), images, tokens)
        results.append({k.removeprefix("inner."): v for k, v in grads(model).items()})
    assert max_relative_difference(*results) <= 1e-10


@pytest.mark.parametrize("texts,returns,match", [
    (lambda t: t[:-1], None, r"same batch size.*23 rows in images and 22 in texts"),
    (lambda t: {"input_ids": t, "attention_mask": torch.ones_like(t)[:-2]}, None,
     r"same batch size.*23 rows in images and 21 in texts\['attention_mask'\]"),
    (lambda t: {"input_ids": t, "attention_mask": 1}, None, r"texts\['attention_mask'\] must be a tensor"),
    (lambda t: t, lambda o: {"image_features": o["image_features"], "logit_scale": o["logit_scale"]},
     "output dict has no tensor text_features"),
    (lambda t: t, lambda o: o["image_features"], "the model must return a dict with image_features"),
    (lambda t: t, lambda o: {**o, "text_features": o["text_features"][:1]}, "output 'text_features' must have one row"),
])
def test_bad_input_is_refused_before_anything_is_updated(texts, returns, match):
    model = DictTextModel(returns)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    calls = []
    images, tokens = batch(M, 7)
    text_input = texts(tokens)
    text_input = text_input if isinstance(text_input, dict) or not torch.is_tensor(text_input) else \
        {"input_ids": text_input, "attention_mask": torch.ones_like(text_input)}
    with pytest.raises((TypeError, ValueError), match=match):
        clipshard.GradCache(model, lambda **o: calls.append(1), 5)(images, text_input)
    assert not calls and all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_without_grad_mode_it_is_the_loss():
    model = TinyClip()
    images, tokens = batch(M, 8)
    with torch.no_grad():
        loss = clipshard.GradCache(model, clipshard.ClipLoss(), 5)(images, tokens)
        reference = clipshard.ClipLoss()(**model(images, tokens))
    assert not loss.requires_grad
    assert abs(loss - reference) <= 1e-12 * abs(reference)


def _reads_the_models_scale(model):
    """A loss function that takes the temperature from the model itself, not from its outputs."""
    return lambda image_features, text_features, logit_scale: clipshard.ClipLoss()(
        image_features, text_features, 1.5 * model.logit_scale.exp())


@pytest.mark.parametrize("loss_kind,as_tuple,parameters_mode,micro", [
    ("module", False, False, 5), ("module", True, False, 5), ("module", False, True, 5), ("module", False, True, M),
    ("module", False, True, M + 1), ("closure over the model", False, False, 5),
    ("closure over the model", False, True, 5)])
def test_loss_fn_parameters_get_the_plain_step_gradients(loss_kind, as_tuple, parameters_mode, micro):
    """loss_fn's own parameters (a module's head and temperature, or the model's logit_scale read by a
    closure) get the plain step's gradient, fp64 within 1e-10, with dropout, odd micro-batches and an
    upstream gradient of 0.5 / M; the model's gradients too (in `parameters` mode the two parts of
    logit_scale's gradient are summed in one slot). One micro-batch (m = M, m > M) in `parameters`
    mode raised "can only concatenate tuple (not "list") to tuple" (issue 40 item 7)."""
    images, tokens = batch(M, 12)
    upstream = 0.5 / M
    results = []
    for cached in (True, False):
        torch.manual_seed(7)
        model = TinyClip(dropout=0.2, as_tuple=as_tuple, with_bias=False)
        loss_fn = LearnedLoss(clipshard.ClipLoss()) if loss_kind == "module" else _reads_the_models_scale(model)
        if cached:
            parameters = model.parameters() if parameters_mode else None
            (clipshard.GradCache(model, loss_fn, micro, parameters=parameters)(images, tokens) * upstream).backward()
        else:
            plain_step(model, loss_fn, images, tokens, micro, upstream)
        loss_grads = grads(loss_fn) if loss_kind == "module" else {}
        results.append(({**grads(model), **{f"loss.{k}": v for k, v in loss_grads.items()}}))
    ours, reference = results
    expected = {"head.weight", "head.bias", "log_temperature"} if loss_kind == "module" else set()
    assert {k.removeprefix("loss.") for k in reference if k.startswith("loss.")} == expected
    assert "logit_scale" in reference
    difference = max_relative_difference(ours, reference)
    print(f"  {loss_kind}, tuple {as_tuple}, parameters mode {parameters_mode}, m = {micro}: {difference:.3g}")
    assert difference <= 1e-10


@pytest.mark.parametrize("images,texts,parameters,match", [
    (lambda i: i[0, 0], lambda t: t, None, "images must be a tensor with a batch dimension, got a 0-dim tensor"),
    (lambda i: i, lambda t: t[0, 0], None, "texts must be a tensor with a batch dimension, got a 0-dim tensor"),
    (lambda i: i, lambda t: t, 5, r"parameters must be an iterable of tensors \(such as model.parameters\(\)\) or "
                                  "None, got int"),
    (lambda i: i, lambda t: t, torch.ones(3, requires_grad=True), "parameters must be an iterable of tensors .*got a tensor"),
    (lambda i: i, lambda t: t, [torch.ones(3, requires_grad=True), 5], "parameters must be an iterable of tensors, "
                                                                       "got int at position 1"),
], ids=["0-dim images", "0-dim texts", "parameters=5", "parameters=a tensor", "parameters holding an int"])
def test_bad_inputs_and_parameters_are_refused_naming_the_argument(images, texts, parameters, match):
    model = TinyClip(with_bias=False)
    image_input, tokens = batch(M, 13)
    with pytest.raises(TypeError, match=match):
        clipshard.GradCache(model, clipshard.ClipLoss(), 5, parameters=parameters)(images(image_input), texts(tokens))
    assert all(p.grad is None for p in model.parameters())


def test_a_loss_that_does_not_require_grad_is_refused():
    """The plain step's backward raises for such a loss; GradCache must not train nothing silently."""
    model = TinyClip(with_bias=False)
    detached = lambda **outputs: clipshard.ClipLoss()(**outputs).detach()  # noqa: E731
    with pytest.raises(RuntimeError, match="does not require grad"):
        plain_step(model, detached, *batch(M, 14))
    with pytest.raises(ValueError, match="loss_fn's result does not require grad"):
        clipshard.GradCache(model, detached, 5)(*batch(M, 14))
    with torch.no_grad():  # evaluation: the loss value, as before
        clipshard.GradCache(model, detached, 5)(*batch(M, 14))


def test_parameters_listed_twice_or_left_out_do_not_change_the_gradients_silently():
    """A tensor listed twice in `parameters` gets its gradient once (it used to get it twice); a
    trainable parameter of the model left out is refused (it used to get no gradient)."""
    images, tokens = batch(M, 15)
    results = []
    for parameters in (lambda m: m.parameters(), lambda m: list(m.parameters()) * 2):
        model = TinyClip(with_bias=False)
        clipshard.GradCache(model, clipshard.ClipLoss(), 5, parameters=parameters(model))(images, tokens).backward()
        results.append(grads(model))
    assert max_relative_difference(*results) <= 1e-12
    model = TinyClip(with_bias=False)
    with pytest.raises(ValueError, match=r"parameters must hold every trainable parameter of the model .*it misses "
                                         r"logit_scale, text.0.weight, text.2.weight, text.2.bias, which would get no"):
        clipshard.GradCache(model, clipshard.ClipLoss(), 5, parameters=model.image.parameters())
    model.text.requires_grad_(False)
    model.logit_scale.requires_grad_(False)
    clipshard.GradCache(model, clipshard.ClipLoss(), 5, parameters=model.image.parameters())(images, tokens).backward()


def test_a_compiled_model_gives_the_plain_steps_gradients():
    """GradCache around torch.compile(model) (issue: the integrations keep working compiled): the
    plain step's gradients, with dropout (the replayed pass draws the first pass's masks)."""
    images, tokens = batch(M, 3, torch.float64)
    results = []
    for cached in (True, False):
        torch.manual_seed(7)
        model = TinyClip(dropout=0.2, dtype=torch.float64)
        compiled = torch.compile(model, backend="aot_eager")
        if cached:
            (clipshard.GradCache(compiled, clipshard.SigLipLoss(), 5)(images, tokens) * (0.5 / M)).backward()
        else:
            plain_step(compiled, clipshard.SigLipLoss(), images, tokens, 5, 0.5 / M)
        results.append(grads(model))
    assert set(results[0]) == {n for n, _ in TinyClip().named_parameters()}
    assert max_relative_difference(*results) <= 1e-10
