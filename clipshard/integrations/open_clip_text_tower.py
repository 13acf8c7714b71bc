"""A 16-bit, stochastically rounded text tower for open_clip's CLIP and CustomTextCLIP models.

`text_tower_to_half_precision_(model)` converts exactly the text tower's parameters and changes the
model's class to a subclass whose encode_text hands the loss features in the rest of the model's
dtype, so that training, DDP and state_dict save / load work with no other change. Needs open_clip.
docs/open_clip.md.
"""
import torch
import torch.nn.functional as F

from clipshard.integrations.open_clip_common import import_open_clip, warn_if_newer_than_tested
from clipshard.optim import to_half_precision_

_FN = "text_tower_to_half_precision_"
_open_clip = import_open_clip(_FN)

# The text tower of open_clip's CLIP lives in these attributes; attn_mask, a buffer, stays as it is.
CLIP_TEXT_TOWER = ("transformer", "token_embedding", "positional_embedding", "ln_final", "text_projection")


def features_dtype(model, device_type):
    """The dtype the text features leave the 16-bit tower in: what an fp32 tower would give them,
    i.e. autocast's dtype inside autocast, else the dtype of the parameters outside the text tower
    (logit_scale: fp32, or 16 bits under open_clip's pure_fp16 / pure_bf16 precisions)."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return model.logit_scale.dtype


class _FeaturesInModelDtype:
    """encode_text for a 16-bit text tower: the tower's features, unnormalised, are cast to
    features_dtype and only then normalised, so that the norm is taken in that dtype."""

    def encode_text(self, text, normalize: bool = False):
        features = super().encode_text(text, normalize=False)
        features = features.to(features_dtype(self, features.device.type))
        return F.normalize(features, dim=-1) if normalize else features


class HalfTextCLIP(_FeaturesInModelDtype, _open_clip.CLIP):
    """open_clip.CLIP whose text tower is stored in 16 bits (text_tower_to_half_precision_)."""


class HalfTextCustomTextCLIP(_FeaturesInModelDtype, _open_clip.CustomTextCLIP):
    """open_clip.CustomTextCLIP whose `text` tower is stored in 16 bits (text_tower_to_half_precision_)."""


_HALF_CLASS = {_open_clip.CLIP: HalfTextCLIP, _open_clip.CustomTextCLIP: HalfTextCustomTextCLIP}


def text_tower(model):
    """The modules and Parameters that make up the text tower of an open_clip CLIP / CustomTextCLIP."""
    cls = type(model)
    base = next((b for b, half in _HALF_CLASS.items() if cls in (b, half)), None)
    if base is None:
        raise TypeError(f"{_FN}: model must be an open_clip CLIP or CustomTextCLIP, got {cls.__module__}."
                        f"{cls.__qualname__}; for other models convert the text modules with "
                        "clipshard.optim.to_half_precision_ and cast the text features yourself")
    if base is _open_clip.CustomTextCLIP:
        return [model.text]
    missing = [name for name in CLIP_TEXT_TOWER if not hasattr(model, name)]
    if missing:  # a release whose CLIP names its text tower differently: refused, never half converted
        raise TypeError(f"{_FN}: this open_clip_torch {_open_clip.__version__} CLIP has no {', '.join(missing)}; "
                        "its text tower is not laid out as clipshard expects")
    return [getattr(model, name) for name in CLIP_TEXT_TOWER if getattr(model, name) is not None]


def text_tower_to_half_precision_(model, dtype: torch.dtype = torch.bfloat16, *,
                                  generator: torch.Generator | None = None):
    """Stores the text tower of an open_clip CLIP (transformer, token_embedding,
    positional_embedding, ln_final, text_projection) or CustomTextCLIP (`text`) in `dtype`, rounded
    stochastically (clipshard.optim.to_half_precision_), and makes `encode_text` return features in
    features_dtype (the image features' dtype), so the loss sees one dtype. Buffers (attn_mask) and
    the image tower are untouched. Call it before DistributedDataParallel and before building the
    optimizer. The model's class becomes HalfTextCLIP / HalfTextCustomTextCLIP (subclasses, so
    isinstance checks hold; state_dict keys are unchanged). Returns the model."""
    tower = text_tower(model)
    warn_if_newer_than_tested(_FN, _open_clip)
    to_half_precision_(tower, dtype, generator=generator)
    model.__class__ = _HALF_CLASS.get(type(model), type(model))
    return model
