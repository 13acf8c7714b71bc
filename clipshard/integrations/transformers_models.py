"""Which Hugging Face transformers models clipshard covers, and how each computes its embeddings.

Every covered model's forward does the same thing (transformers 4.50 to 5.x): the projected, pooled
embeddings of each tower, each divided by its L2 norm, then logits = logit_scale.exp() * text @ image^T
(+ logit_bias for SigLIP), then `return_loss=True` takes the loss of the local logits: the mean of the
two cross-entropies (CLIP family) or the mean over rows of the summed -log sigmoid (SigLIP family).
This module names the classes, their family and their output class, and computes the normalised
embeddings the way the forward does, without the logits (for apply_to_transformers(logits=False)),
through transformers_structure's calls that work across releases. docs/transformers.md.
"""
import dataclasses
import importlib
import sys

import torch

from clipshard.integrations import transformers_structure as structure

CLIP, SIGLIP = "clip", "siglip"


@dataclasses.dataclass(frozen=True)
class Covered:
    """One covered model class: where it lives, which loss it computes, which output class it returns."""
    name: str
    module: str
    family: str
    output: str
    output_module: str = ""  # where the output class lives, if not in `module`

    def model_class(self):
        return getattr(importlib.import_module(self.module), self.name)

    def model_class_if_present(self):
        """The class, or None in a transformers release that does not have it yet (MetaClip2Model is
        newer than 4.50)."""
        try:
            return self.model_class()
        except ModuleNotFoundError as e:
            if e.name is None or not self.module.startswith(e.name):
                raise  # a module the model's own module imports is missing: not an absent model
            return None
        except AttributeError:
            return None

    def output_class(self):
        return getattr(importlib.import_module(self.output_module or self.module), self.output)


_M = "transformers.models."
COVERED = (
    Covered("CLIPModel", _M + "clip.modeling_clip", CLIP, "CLIPOutput"),
    Covered("MetaClip2Model", _M + "metaclip_2.modeling_metaclip_2", CLIP, "MetaClip2Output"),
    Covered("ChineseCLIPModel", _M + "chinese_clip.modeling_chinese_clip", CLIP, "ChineseCLIPOutput"),
    Covered("AltCLIPModel", _M + "altclip.modeling_altclip", CLIP, "AltCLIPOutput"),
    Covered("VisionTextDualEncoderModel", _M + "vision_text_dual_encoder.modeling_vision_text_dual_encoder", CLIP,
            "CLIPOutput", _M + "clip.modeling_clip"),
    Covered("SiglipModel", _M + "siglip.modeling_siglip", SIGLIP, "SiglipOutput"),
    Covered("Siglip2Model", _M + "siglip2.modeling_siglip2", SIGLIP, "Siglip2Output"),
)

# transformers 5.23's other models whose forward takes return_loss (found in its modeling files): their
# losses add terms or pair other modalities, or they were not checked here, so they keep their own.
NOT_COVERED = ("AlignModel", "BlipModel", "BridgeTowerForContrastiveLearning", "ClapModel", "CLIPSegModel",
               "ClvpModelForConditionalGeneration", "FlavaForPreTraining", "GroupViTModel", "Owlv2Model",
               "OwlViTModel", "PeAudioFrameLevelModel", "PeAudioModel", "PeAudioVideoModel", "PeVideoModel",
               "Tipsv2Model", "VideoPrismClipModel", "XCLIPModel")

# forward arguments that only one tower takes; everything else (output_attentions, ...) goes to both
IMAGE_ARGS = ("pixel_values", "interpolate_pos_encoding", "pixel_attention_mask", "spatial_shapes")
TEXT_ARGS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")
# the patched forwards' own keywords: the pairs' ids, their targets, and hard negative texts
# as hard_negative_<text argument> (hard_negative_input_ids, hard_negative_attention_mask, ...)
NEGATIVE_PREFIX = "hard_negative_"
EXTRA_ARGS = ("sample_ids", "targets", *(NEGATIVE_PREFIX + name for name in TEXT_ARGS))


def covered_entry(model_or_class):
    """The Covered entry of a model (or model class), looking through subclasses; None if not covered."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    for base in cls.__mro__:
        for entry in COVERED:
            if base.__name__ == entry.name and base.__module__ == entry.module:
                return entry
    return None


def _normalise(entry, features):
    """features / ||features||, computed as the model's forward computes it (the CLIP family's
    modules use their own _get_vector_norm, the others Tensor.norm)."""
    vector_norm = getattr(sys.modules[entry.model_class().__module__], "_get_vector_norm", None)
    if vector_norm is not None:
        return features / vector_norm(features)
    return features / features.norm(p=2, dim=-1, keepdim=True)


def embeddings(model, entry, arguments):
    """(image_embeds, text_embeds, vision_model_output, text_model_output) as the forward of `entry`'s
    class computes them from its keyword `arguments` (without return_loss and return_dict), without
    building the logits. The tower outputs are None in transformers 4.x, whose get_*_features return
    only the embeddings."""
    shared = {k: v for k, v in arguments.items() if k not in IMAGE_ARGS + TEXT_ARGS}
    image_args = {k: arguments[k] for k in IMAGE_ARGS if k in arguments}
    text_args = {k: arguments[k] for k in TEXT_ARGS if k in arguments}
    image, vision_output = structure.features(model.get_image_features, {**image_args, **shared})
    text, text_output = structure.features(model.get_text_features, {**text_args, **shared})
    return _normalise(entry, image), _normalise(entry, text), vision_output, text_output


def text_embeddings(model, entry, arguments):
    """The normalised text embeddings of `arguments` (text tower arguments and shared options), as
    the forward computes text_embeds: what hard negative texts go through."""
    text_args = {k: v for k, v in arguments.items() if k not in IMAGE_ARGS}
    return _normalise(entry, structure.features(model.get_text_features, text_args)[0])


def logit_scale_and_bias(model, entry, device):
    """What the forward multiplies (logit_scale.exp()) and adds (SigLIP's logit_bias) to the cosine
    similarities, on `device`."""
    scale = model.logit_scale.to(device).exp()
    bias = model.logit_bias.to(device) if entry.family == SIGLIP else None
    return scale, bias


def unwrap(model):
    """The model inside DistributedDataParallel (what Trainer and accelerate wrap it in) and inside
    torch.compile's OptimizedModule (whose module torch._dynamo, imported by then, defines)."""
    while True:
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model = model.module
        elif _is_compiled(model):
            model = model._orig_mod
        else:
            return model


def _is_compiled(model):
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)
