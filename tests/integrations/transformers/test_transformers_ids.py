"""apply_to_transformers with its sample-id and hard-negative keywords: sample_ids, targets and hard negative texts
(hard_negative_input_ids, hard_negative_attention_mask, ...). The patched forward's signature lists
them (what Trainer keeps of a dataset's columns); the loss and every parameter gradient equal a
materialised fp64 reference of the objective on the model's own embeddings (CLIPModel and
SiglipModel, fp64, 1e-10), also through GradCache (micro_batch_size); calls without return_loss
ignore them; hard negatives without input ids are refused."""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed: pip install '.[transformers]'")

import clipshard  # noqa: E402
from clipshard.integrations import transformers_models as models  # noqa: E402
from tests.integrations.ids_references import materialised_clip_loss, materialised_siglip_loss  # noqa: E402
from tests.integrations.transformers.hf_tiny_models import (  # noqa: E402
    fp64_default_dtype, gradient_errors, tiny_inputs, tiny_model)

M, H = 9, 5
NAMES = ["CLIPModel", "SiglipModel"]


def _case(name):
    inputs = tiny_inputs(name, M, seed=4)
    negatives = tiny_inputs(name, H, seed=5)
    ids = torch.tensor([0, 1, 0, 2, 3, 1, 4, 0, 5])
    return inputs, {"hard_negative_input_ids": negatives["input_ids"],
                    "hard_negative_attention_mask": negatives["attention_mask"]}, ids


def _normalised_text(model, input_ids, attention_mask):
    entry = models.covered_entry(model)
    return models.text_embeddings(model, entry, {"input_ids": input_ids, "attention_mask": attention_mask})


def _reference(name, model, inputs, negatives, ids, targets):
    """The materialised loss of the model's own (unpatched) embeddings, and its parameter gradients."""
    output = model(**inputs)
    hard = None if negatives is None else _normalised_text(model, negatives["hard_negative_input_ids"],
                                                           negatives["hard_negative_attention_mask"])
    scale = model.logit_scale.exp()
    if name.startswith("Siglip"):
        loss = materialised_siglip_loss(output.image_embeds, output.text_embeds, scale, model.logit_bias,
                                        sample_ids=ids, hard_negatives=hard, targets=targets)
    else:
        loss = materialised_clip_loss(output.image_embeds, output.text_embeds, scale, sample_ids=ids,
                                      hard_negatives=hard, targets=targets)
    loss.backward()
    return loss.detach(), _grads(model)


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def test_the_patched_signature_lists_the_new_keywords():
    patch = clipshard.apply_to_transformers()
    try:
        parameters = inspect.signature(tiny_model("CLIPModel").forward).parameters
    finally:
        patch.undo()
    assert {"sample_ids", "targets", "hard_negative_input_ids", "hard_negative_attention_mask"} <= set(parameters)
    assert "sample_ids" not in inspect.signature(tiny_model("CLIPModel").forward).parameters  # undone


@pytest.mark.parametrize("micro_batch_size", [None, 4], ids=["forward", "grad-cache"])
@pytest.mark.parametrize("targets", ["mask", "multi"])
@pytest.mark.parametrize("name", NAMES)
def test_ids_and_hard_negatives_give_the_materialised_loss_and_gradients(name, targets, micro_batch_size):
    with fp64_default_dtype():
        model = tiny_model(name).double()
        inputs, negatives, ids = _case(name)
        inputs["pixel_values"] = inputs["pixel_values"].double()
        want, want_grads = _reference(name, model, inputs, negatives, ids, targets)
        patch = clipshard.apply_to_transformers(micro_batch_size=micro_batch_size)
        try:
            loss = model(**inputs, **negatives, sample_ids=ids, targets=targets, return_loss=True).loss
            loss.backward()
        finally:
            patch.undo()
        got_grads = _grads(model)
    assert abs(loss.item() - want.item()) <= 1e-10 * abs(want.item())
    assert got_grads.keys() == want_grads.keys()
    errors = gradient_errors(got_grads, want_grads)
    print(f"  {name} {targets} micro {micro_batch_size}: loss {abs(loss.item() / want.item() - 1):.2g}, "
          f"gradients {max(errors.values()):.2g}")
    assert max(errors.values()) <= 1e-10
    # the negatives matter: the text tower's gradients without them are clearly other ones
    with fp64_default_dtype():
        without = _reference(name, model, inputs, None, ids, targets)[1]
    assert max(gradient_errors(without, want_grads).values()) > 1e-3


def test_calls_without_return_loss_ignore_them_and_negatives_need_input_ids():
    model = tiny_model("CLIPModel")
    inputs, negatives, ids = _case("CLIPModel")
    own = model(**inputs).logits_per_image
    patch = clipshard.apply_to_transformers()
    try:
        assert torch.equal(model(**inputs, **negatives, sample_ids=ids).logits_per_image, own)
        with pytest.raises(ValueError, match="hard negative texts need hard_negative_input_ids, got only "
                                             "hard_negative_attention_mask"):
            model(**inputs, hard_negative_attention_mask=negatives["hard_negative_attention_mask"], return_loss=True)
    finally:
        patch.undo()
