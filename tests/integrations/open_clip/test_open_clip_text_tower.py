"""text_tower_to_half_precision_ on open_clip's CLIP and CustomTextCLIP: exactly the text tower in
16 bits, features in the rest of the model's dtype, state_dict and pickling unchanged in form."""
import copy
import io

import pytest
import torch

open_clip = pytest.importorskip("open_clip", reason="open_clip is not installed: pip install '.[open_clip]'")

import clipshard  # noqa: E402
from clipshard.integrations.open_clip_text_tower import HalfTextCLIP, HalfTextCustomTextCLIP  # noqa: E402

VISION = {"image_size": 32, "layers": 1, "width": 32, "head_width": 16, "patch_size": 8}
TEXT = {"context_length": 16, "vocab_size": 500, "width": 32, "heads": 2, "layers": 2}
CLASSES = {"CLIP": (open_clip.CLIP, HalfTextCLIP), "CustomTextCLIP": (open_clip.CustomTextCLIP, HalfTextCustomTextCLIP)}
# what open_clip's CLIP / CustomTextCLIP call their text tower in named_parameters()
TEXT_PREFIXES = {"CLIP": ("transformer.", "token_embedding.", "positional_embedding", "ln_final.", "text_projection"),
                 "CustomTextCLIP": ("text.",)}


def _model(kind, seed=0):
    torch.manual_seed(seed)
    return CLASSES[kind][0](embed_dim=16, vision_cfg=VISION, text_cfg=TEXT, output_dict=True)


def _batch(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(4, 3, 32, 32, generator=gen), torch.randint(1, 500, (4, 16), generator=gen)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_exactly_the_text_tower_becomes_bf16_and_features_stay_fp32(kind):
    model, reference = _model(kind), _model(kind)
    params = dict(model.named_parameters())
    assert clipshard.text_tower_to_half_precision_(model) is model
    assert type(model) is CLASSES[kind][1] and isinstance(model, CLASSES[kind][0])
    for name, p in model.named_parameters():
        assert p is params[name]  # the same Parameters: an optimizer built afterwards sees them
        expected = torch.bfloat16 if name.startswith(TEXT_PREFIXES[kind]) else torch.float32
        assert p.dtype == expected, name
    assert {b.dtype for b in model.buffers()} == {torch.float32}  # attn_mask is left as it is
    images, texts = _batch()
    out, ref = model(images, texts), reference(images, texts)
    assert out["text_features"].dtype == out["image_features"].dtype == torch.float32
    torch.testing.assert_close(out["image_features"], ref["image_features"], rtol=0, atol=0)
    torch.testing.assert_close(out["text_features"], ref["text_features"], rtol=0, atol=0.05)  # bf16 weights
    torch.testing.assert_close(out["text_features"].norm(dim=-1), torch.ones(4), rtol=1e-6, atol=0)  # fp32 norm
    clipshard.ClipLoss()(**out).backward()
    assert all(p.grad.dtype == p.dtype for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("kind", list(CLASSES))
def test_features_take_the_dtype_the_image_tower_gives(kind):
    images, texts = _batch()
    model = clipshard.text_tower_to_half_precision_(_model(kind))
    with torch.autocast("cpu", torch.bfloat16):
        out = model(images, texts)
    assert out["text_features"].dtype == out["image_features"].dtype == torch.bfloat16
    pure = clipshard.text_tower_to_half_precision_(_model(kind).to(torch.float16), torch.float16)
    out = pure(images.half(), texts)  # open_clip's pure_fp16: everything in fp16 already
    assert out["text_features"].dtype == out["image_features"].dtype == torch.float16


@pytest.mark.parametrize("kind", list(CLASSES))
def test_state_dict_and_pickle_round_trip(kind):
    model = clipshard.text_tower_to_half_precision_(_model(kind))
    state = copy.deepcopy(model.state_dict())
    assert state.keys() == _model(kind).state_dict().keys()
    other = clipshard.text_tower_to_half_precision_(_model(kind, seed=5))
    other.load_state_dict(state)
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(other.state_dict().values(), state.values()))
    stock = _model(kind, seed=6)
    stock.load_state_dict(state)  # an fp32 model takes the 16-bit checkpoint (exact upcast)
    assert all(torch.equal(a.float(), b.float()) for a, b in zip(stock.state_dict().values(), state.values()))
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert type(loaded) is type(model)
    images, texts = _batch()
    torch.testing.assert_close(loaded(images, texts)["text_features"], model(images, texts)["text_features"])


def test_converting_twice_is_a_no_op_and_other_models_are_refused():
    model = clipshard.text_tower_to_half_precision_(_model("CLIP"), generator=torch.Generator().manual_seed(0))
    before = copy.deepcopy(model.state_dict())
    clipshard.text_tower_to_half_precision_(model)
    assert type(model) is HalfTextCLIP
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), before.values()))
    with pytest.raises(TypeError, match=r"text_tower_to_half_precision_: model must be an open_clip CLIP or "
                                        r"CustomTextCLIP, got torch.nn.modules.linear.Linear"):
        clipshard.text_tower_to_half_precision_(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="to_half_precision_: parameter .* is torch.float64"):
        clipshard.text_tower_to_half_precision_(_model("CLIP").double())
