"""Tiny, randomly initialised transformers models of every class apply_to_transformers covers that the
installed transformers has, and random inputs for them (no hub: configs are built here), plus the
few calls whose names differ between transformers 4.5x and 5.x. Used by tests/test_transformers_*.py
and tests/integrations/transformers/hf_trainer_runner.py, in every venv of the version matrix (`make test-matrix`)."""
import contextlib

import torch

VOCAB, TOKENS, IMAGE, PATCH, CHANNELS, HIDDEN, PROJECTION = 40, 7, 8, 4, 1, 16, 8
_TOWER = dict(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
              hidden_act="gelu", attention_dropout=0.0)
_VISION = dict(_TOWER, image_size=IMAGE, patch_size=PATCH, num_channels=CHANNELS)
_TEXT = dict(_TOWER, vocab_size=VOCAB, max_position_embeddings=16, bos_token_id=0, eos_token_id=2, pad_token_id=1)
_BERT = dict(_TOWER, vocab_size=VOCAB, max_position_embeddings=16, hidden_dropout_prob=0.0,
             attention_probs_dropout_prob=0.0, type_vocab_size=2)


def _clip(t):
    return t.CLIPModel(t.CLIPConfig(text_config=_TEXT, vision_config=_VISION, projection_dim=PROJECTION))


def _metaclip2(t):
    return t.MetaClip2Model(t.MetaClip2Config(text_config=_TEXT, vision_config=_VISION, projection_dim=PROJECTION))


def _chinese_clip(t):
    return t.ChineseCLIPModel(t.ChineseCLIPConfig(text_config=_BERT, vision_config=_VISION, projection_dim=PROJECTION))


def _altclip(t):
    text = dict(_BERT, project_dim=PROJECTION, max_position_embeddings=TOKENS + 4, pad_token_id=1)
    return t.AltCLIPModel(t.AltCLIPConfig(text_config=text, vision_config=_VISION, projection_dim=PROJECTION))


def _dual_encoder(t):
    config = t.VisionTextDualEncoderConfig.from_vision_text_configs(
        t.CLIPVisionConfig(**_VISION), t.BertConfig(**_BERT), projection_dim=PROJECTION)
    return t.VisionTextDualEncoderModel(config)


def _siglip(t):
    return t.SiglipModel(t.SiglipConfig(text_config=_TEXT, vision_config=_VISION))


def _siglip2(t):
    vision = {k: v for k, v in _VISION.items() if k != "image_size"}
    return t.Siglip2Model(t.Siglip2Config(text_config=_TEXT, vision_config=dict(vision, num_patches=4)))


_ALL_BUILDERS = {"CLIPModel": _clip, "MetaClip2Model": _metaclip2, "ChineseCLIPModel": _chinese_clip,
                 "AltCLIPModel": _altclip, "VisionTextDualEncoderModel": _dual_encoder, "SiglipModel": _siglip,
                 "Siglip2Model": _siglip2}


def _installed_names():
    """The names transformers exports (its lazy module lists them without importing the models)."""
    try:
        import transformers
    except ImportError:
        return set(_ALL_BUILDERS)  # the tests skip themselves
    return set(dir(transformers))


# the covered classes the installed transformers has (MetaClip2Model is newer than 4.50)
BUILDERS = {name: build for name, build in _ALL_BUILDERS.items() if name in _installed_names()}


def tiny_model(name, seed=0):
    """The tiny model of class `name`, initialised from `seed` (the same weights on every rank), in
    eval mode (no dropout) with eager attention."""
    import transformers

    torch.manual_seed(seed)
    model = BUILDERS[name](transformers)
    model.config._attn_implementation = "eager"
    return model.eval()


def tiny_inputs(name, batch, seed):
    """Random inputs for `batch` pairs of model `name` (a dict of forward arguments)."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, TOKENS), generator=generator)
    ids[:, -1] = 2  # end of text (eos_token_id), where the CLIP-like text towers pool
    inputs = {"input_ids": ids, "attention_mask": torch.ones(batch, TOKENS, dtype=torch.int64)}
    if name == "Siglip2Model":  # patchified pixels, a mask and the patch grid of each image
        patches = (IMAGE // PATCH) ** 2
        inputs["pixel_values"] = torch.randn(batch, patches, CHANNELS * PATCH * PATCH, generator=generator)
        inputs["pixel_attention_mask"] = torch.ones(batch, patches, dtype=torch.int64)
        inputs["spatial_shapes"] = torch.tensor([[IMAGE // PATCH, IMAGE // PATCH]] * batch)
    else:
        inputs["pixel_values"] = torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=generator)
    return inputs


def rows(inputs, start, stop):
    """The inputs of pairs start..stop-1."""
    return {k: v[start:stop] for k, v in inputs.items()}


def gradient_errors(got, want):
    """{parameter: max |got - want| relative to max |want|} for two dicts of gradients. Gradients that
    are zero in exact arithmetic (attention's key bias) are measured against 1% of the model's largest
    gradient instead, so that their rounding noise is not divided by (nearly) zero."""
    floor = 1e-2 * max(g.abs().max() for g in want.values())
    return {name: ((got[name] - w).abs().max() / w.abs().max().clamp_min(floor)).item() for name, w in want.items()}


def enable_checkpointing(model):
    """Non-reentrant activation checkpointing of the towers: transformers 5.x's name, or 4.x's."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


@contextlib.contextmanager
def fp64_default_dtype():
    """torch's default dtype set to float64 for an fp64 model's forward (and a GradCache backward,
    which re-runs it): transformers 4.50 builds CLIP's causal mask as torch.full(finfo(model
    dtype).min) in the default dtype, which overflows float32 for an fp64 model."""
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(default)
