"""apply_to_transformers() in one process: the loss of every covered class against the model's own loss
and the fp64 reference, logits=False, undo, an uncovered class, refusals, bf16 autocast, gradient
checkpointing, loss_from_output; subclasses that override forward and torch.compile'd models in the
report; `import clipshard` without transformers or open_clip (the package's layering:
tests/test_package_layout.py)."""
import subprocess
import sys
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers",
                                   reason="transformers is not installed: pip install '.[transformers]'")

import clipshard  # noqa: E402
from clipshard.integrations import transformers_loss, transformers_patch  # noqa: E402
from clipshard.integrations import supported_import  # noqa: E402
from tests.integrations.transformers.hf_tiny_models import (  # noqa: E402
    BUILDERS, enable_checkpointing, gradient_errors, tiny_inputs, tiny_model)
from tests.references.contrastive import clip_loss_reference  # noqa: E402
from tests.references.siglip import siglip_loss_reference  # noqa: E402


def _fp64_loss(name, model, out):
    """The fp64 reference of the model's loss from its own (fp32) embeddings."""
    scale = model.logit_scale.double().exp()
    if name.startswith("Siglip"):
        return siglip_loss_reference(out.image_embeds, out.text_embeds, scale, model.logit_bias.double())
    return clip_loss_reference(out.image_embeds, out.text_embeds, scale)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", list(BUILDERS))
def test_single_device_loss_equals_the_models_own_and_fp64_and_logits_false_skips_the_logits(name):
    model, inputs = tiny_model(name), tiny_inputs(name, 7, seed=3)
    own = model(**inputs, return_loss=True)
    own.loss.backward()
    own_grads = _grads(model)
    model.zero_grad(set_to_none=True)
    with_logits = clipshard.apply_to_transformers()
    try:
        assert with_logits.covers(model) and "clipshard's global-batch loss" in with_logits.report(model)
        ours = model(**inputs, return_loss=True)
        torch.testing.assert_close(ours.logits_per_image, own.logits_per_image, rtol=0, atol=0)
        assert list(ours.keys())[0] == "loss" and model(**inputs, return_loss=True, return_dict=False)[0] is not None
        ours.loss.backward()
        ours_grads = _grads(model)
    finally:
        with_logits.undo()
    want = _fp64_loss(name, model, own)
    assert abs(ours.loss.item() / want.item() - 1) < 1e-6 and abs(own.loss.item() / want.item() - 1) < 1e-5
    assert ours_grads.keys() == own_grads.keys()
    for param, error in gradient_errors(ours_grads, own_grads).items():  # fp32 rounding apart
        assert error < 1e-4, (param, error)

    model.zero_grad(set_to_none=True)
    without = clipshard.apply_to_transformers(logits=False)
    try:
        skipped = model(**inputs, return_loss=True)
        skipped.loss.backward()
        # where this release's get_*_features raise (4.57's ChineseCLIPModel), the forward's logits are used
        if name in transformers_patch._features_failed:
            entry = transformers_patch.models.covered_entry(model)
            with pytest.raises((TypeError, AttributeError)):
                transformers_patch.models.embeddings(model, entry, inputs)
        else:
            assert skipped.logits_per_image is None and skipped.logits_per_text is None
        assert model(**inputs).logits_per_image is not None  # evaluation calls keep them
    finally:
        without.undo()
    assert torch.equal(skipped.loss, ours.loss) and torch.equal(skipped.image_embeds, ours.image_embeds)
    for param, grad in ours_grads.items():
        assert torch.equal(model.get_parameter(param).grad, grad), param


def test_undo_restores_the_models_own_forward_and_loss_exactly():
    model, inputs = tiny_model("SiglipModel"), tiny_inputs("SiglipModel", 5, seed=4)
    classes = [entry.model_class() for entry in transformers_patch.models.COVERED if entry.name in BUILDERS]
    forwards = [cls.__dict__["forward"] for cls in classes]
    before = model(**inputs, return_loss=True).loss
    patch = clipshard.apply_to_transformers()
    assert clipshard.apply_to_transformers() is patch
    with pytest.raises(ValueError, match="already applied with logits=True"):
        clipshard.apply_to_transformers(logits=False)
    assert all(cls.__dict__["forward"] is not f for cls, f in zip(classes, forwards))
    patch.undo()
    patch.undo()
    assert all(cls.__dict__["forward"] is f for cls, f in zip(classes, forwards))
    assert torch.equal(model(**inputs, return_loss=True).loss, before)
    assert not patch.covers(model) and "left alone" in patch.report(model)


def _tiny_owlvit():
    torch.manual_seed(0)
    tower = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = transformers.OwlViTConfig(text_config=dict(tower, vocab_size=40, max_position_embeddings=16),
                                       vision_config=dict(tower, image_size=8, patch_size=4, num_channels=3),
                                       projection_dim=8)
    return transformers.OwlViTModel(config).eval()


def test_an_uncovered_class_is_left_alone_and_reported(patch):
    model = _tiny_owlvit()  # a CLIP-like model with its own return_loss, not covered
    inputs = {"input_ids": torch.randint(3, 40, (4, 7)), "pixel_values": torch.randn(4, 3, 8, 8)}
    assert "OwlViTModel" in patch.kept and "OwlViTModel" in patch.summary()
    assert not patch.covers(model) and patch.report(model) == "OwlViTModel: left alone, it computes its own loss"
    patched = model(**inputs, return_loss=True).loss
    patch.undo()
    assert torch.equal(model(**inputs, return_loss=True).loss, patched)
    with pytest.raises(TypeError, match=r"loss_from_embeddings: model must be one of transformers' CLIPModel"):
        transformers_loss.loss_from_embeddings(model, torch.randn(4, 8), torch.randn(4, 8))


def test_loss_from_output_for_own_loops_matches_the_patched_forward(patch):
    model, inputs = tiny_model("CLIPModel"), tiny_inputs("CLIPModel", 6, seed=5)
    patched = model(**inputs, return_loss=True).loss
    own_loop = transformers_loss.loss_from_output(model, model(**inputs))
    assert torch.equal(own_loop, patched)
    with pytest.raises(ValueError, match="loss_from_output: output has no image_embeds"):
        transformers_loss.loss_from_output(model, object())


def test_refuses_transformers_older_than_supported_and_bad_arguments(monkeypatch):
    # transformers replaces its lazy module in sys.modules when models are imported: patch the current one
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "4.49.0")
    with pytest.raises(ImportError, match=r"apply_to_transformers: transformers 4\.49\.0 is not supported; "
                                          r"clipshard supports transformers>=4\.50 \(tested up to 5\.24\.x\)"):
        clipshard.apply_to_transformers()
    assert all(not getattr(entry.model_class_if_present(), "forward", None).__dict__.get("clipshard_patched")
               for entry in transformers_patch.models.COVERED if entry.name in BUILDERS)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"transformers is not installed .* pip install 'clipshard\[transformers\]'"):
        clipshard.apply_to_transformers()
    with pytest.raises(TypeError, match="apply_to_transformers: logits must be True or False"):
        clipshard.apply_to_transformers(logits="no")


@pytest.mark.parametrize("name", ["CLIPModel", "SiglipModel"])
def test_bf16_autocast_and_gradient_checkpointing(name):
    """Training mode: under bf16 autocast the loss stays within bf16 rounding of the model's own;
    gradient checkpointing of the towers gives the same gradients as without."""
    inputs = tiny_inputs(name, 6, seed=6)
    model = tiny_model(name).train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        own = model(**inputs, return_loss=True)
    patch = clipshard.apply_to_transformers()
    try:
        _bf16_and_checkpointing(model, inputs, own)
    finally:
        patch.undo()


def _bf16_and_checkpointing(model, inputs, own):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = model(**inputs, return_loss=True)
    assert ours.image_embeds.dtype == torch.bfloat16
    assert abs(ours.loss.item() / own.loss.item() - 1) < 2e-2
    ours.loss.backward()
    plain = _grads(model)
    assert all(torch.isfinite(g).all() for g in plain.values())
    model.zero_grad(set_to_none=True)
    enable_checkpointing(model)
    model(**inputs, return_loss=True).loss.float().backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model.zero_grad(set_to_none=True)
        model(**inputs, return_loss=True).loss.backward()
    for param, grad in plain.items():
        torch.testing.assert_close(model.get_parameter(param).grad, grad, rtol=0, atol=0, msg=param)


# ---- subclasses and compiled models in the report (issue 23, item 3) ----------------------------

class _OwnForward(transformers.CLIPModel):
    """A user's CLIPModel with its own forward and its own local loss (item 3)."""

    def forward(self, *args, return_loss=None, **kwargs):
        output = super().forward(*args, **kwargs)
        output.loss = output.logits_per_image.diagonal().mean() if return_loss else None
        return output


class _KeepsForward(transformers.CLIPModel):
    pass


def test_report_says_a_subclass_that_overrides_forward_is_left_alone(patch):
    """Item 3: covers() said True and report() "clipshard's global-batch loss" for a subclass whose
    own forward (with its own loss) runs unpatched."""
    assert not patch.covers(_OwnForward)
    assert patch.report(_OwnForward) == (
        "_OwnForward: left alone, its own _OwnForward.forward overrides CLIPModel's and computes its own loss "
        "(clipshard's runs only if it calls CLIPModel.forward with return_loss=True)")
    assert patch.covers(_KeepsForward)
    assert patch.report(_KeepsForward) == "_KeepsForward: clipshard's global-batch loss (clip family)"


def test_report_and_loss_from_embeddings_look_through_torch_compile(patch):
    """Wider search (every patch report): a torch.compile'd model (an OptimizedModule around the
    model, whose forward is the patched one) was reported as left alone, and loss_from_embeddings
    refused it. Wrapping compiles nothing yet, so this costs no compilation."""
    model = tiny_model("CLIPModel")
    compiled = torch.compile(model)
    assert patch.covers(compiled) and patch.report(compiled) == "CLIPModel: clipshard's global-batch loss (clip family)"
    generator = torch.Generator().manual_seed(4)
    image, text = (torch.nn.functional.normalize(torch.randn(5, 8, generator=generator), dim=1) for _ in range(2))
    want = transformers_loss.loss_from_embeddings(model, image, text)
    assert torch.equal(transformers_loss.loss_from_embeddings(compiled, image, text), want)


def test_a_compiled_patched_model_gives_the_eager_loss_and_gradients(patch):
    """torch.compile(model) of a patched model (its forward, clipshard's loss inside, traced by
    dynamo; backend aot_eager: the traced forward and backward, without inductor's codegen): the
    patched eager model's loss and gradients."""
    model, inputs = tiny_model("SiglipModel"), tiny_inputs("SiglipModel", 7, seed=5)
    results = []
    for run in (model, torch.compile(model, backend="aot_eager")):
        model.zero_grad(set_to_none=True)
        out = run(**inputs, return_loss=True)
        (out.loss * 0.5).backward()
        results.append((out.loss.detach(), _grads(model)))
    (eager, eager_grads), (compiled, compiled_grads) = results
    assert abs(compiled.item() - eager.item()) <= 1e-5 * abs(eager.item())
    assert compiled_grads.keys() == eager_grads.keys() and "logit_bias" in compiled_grads
    for param, error in gradient_errors(compiled_grads, eager_grads).items():
        assert error < 1e-5, (param, error)


# ---- versions: every class this release has, no warning on tested releases, newer ones ------------

def test_this_release_patches_every_covered_class_it_has_without_a_warning(recwarn):
    """The matrix runs this in each venv: transformers 4.50 to 5.24 patch every covered class they
    have (MetaClip2Model is absent from 4.50) with no warning and nothing rejected."""
    supported_import._warned.clear()
    patch = clipshard.apply_to_transformers()
    patch.undo()
    assert set(patch.replaced) == set(BUILDERS) and patch.rejected == {}
    assert set(patch.absent) == {e.name for e in transformers_patch.models.COVERED} - set(BUILDERS)
    assert [str(w.message) for w in recwarn if "clipshard" in str(w.message)] == []


def test_a_release_newer_than_tested_is_patched_with_one_warning_naming_it(monkeypatch):
    monkeypatch.setattr(sys.modules["transformers"], "__version__", "5.99.0.dev0")
    monkeypatch.setattr(supported_import, "_warned", set())
    messages = []
    for _ in range(2):  # one warning per process and version
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            patch = clipshard.apply_to_transformers()
        patch.undo()
        assert set(patch.replaced) == set(BUILDERS)
        messages += [str(w.message) for w in caught if "clipshard" in str(w.message)]
    assert messages == ["clipshard.apply_to_transformers: transformers 5.99.0.dev0 is newer than the newest "
                        "release clipshard was tested with (5.24.x); its structure passed clipshard's checks, so "
                        "it is patched, but please report problems"]


def test_a_class_whose_structure_is_rejected_is_left_alone_and_reported(monkeypatch):
    """A release where SiglipModel's forward no longer takes return_loss: SiglipModel is listed as
    rejected with the reason and keeps its own forward (and loss); the other classes are patched."""
    siglip = transformers.SiglipModel

    def forward(self, input_ids=None, pixel_values=None, **kwargs):  # a forward without return_loss
        return "own forward"
    monkeypatch.setattr(siglip, "forward", forward)
    patch = clipshard.apply_to_transformers()
    try:
        assert siglip.__dict__["forward"] is forward and "SiglipModel" not in patch.replaced
        assert patch.rejected == {"SiglipModel": "its forward has no return_loss parameter"}
        assert "CLIPModel" in patch.replaced and transformers.CLIPModel.forward.clipshard_patched
        assert not patch.covers(siglip)
        assert patch.report(siglip) == ("SiglipModel: left alone, its structure is not the one clipshard patches "
                                        "(its forward has no return_loss parameter); it computes its own loss")
        assert "left alone, structure not recognised: SiglipModel (its forward has no return_loss" in patch.summary()
    finally:
        patch.undo()


# ---- the integrations subpackage's place ------------------------------------------------------------

def _run(script):
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def test_clipshard_imports_without_transformers_and_open_clip():
    """In a fresh interpreter where importing transformers, accelerate or open_clip raises: clipshard
    imports without even trying them, its loss runs, and apply_to_transformers says what is missing."""
    out = _run("""
import importlib.abc, sys
tried = []
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("transformers", "accelerate", "open_clip", "open_clip_train"):
            tried.append(name)
            raise ImportError("hidden: " + name)
sys.meta_path.insert(0, Hide())
import torch, clipshard
print("tried:" + ",".join(tried))
x = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
assert torch.isfinite(clipshard.ClipLoss()(x, x.flip(0), torch.tensor(10.0)))
try:
    clipshard.apply_to_transformers()
except ImportError as e:
    print("refused:" + str(e).split(":")[0])
""")
    assert out == ["tried:", "refused:clipshard.apply_to_transformers"]
