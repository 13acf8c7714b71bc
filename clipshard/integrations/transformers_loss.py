"""The global-batch loss of a Hugging Face CLIP- or SigLIP-family model, for Trainer (through
apply_to_transformers) and for users' own loops (loss_from_output, loss_from_embeddings).

Rank r of N holds M_r pairs, M = sum_q M_q in all. Its loss is

    w_r * L_r,   w_r = N * M_r / M,

where L_r is clipshard's per-rank loss over the global batch: ClipLoss(local_loss=True,
gather_with_grad=True), i.e. (sum of the row LSE terms of its M_r images + of the column LSE terms of
its M_r texts over all M columns / rows) / (2 M_r), or siglip_loss (its images against all M texts,
divided by M_r). Both send each rank the gradient of sum_q w_q L_q with respect to its own features
(the backward of the all-gather is a reduce-scatter), so after DDP's average over the N ranks every
parameter's gradient is that of (1/N) sum_q w_q L_q = sum_q M_q L_q / M, which is exactly the model's
own loss on the concatenated global batch (docs/transformers.md derives it). With equal batches
w_r = 1. The mean of the ranks' losses, which Trainer logs, is that global loss too.

Without torch.distributed (or with one rank) it is clipshard's fused single-device loss.

Sample ids, targets and hard negatives go to the loss as its keywords; they change
neither the normalisation nor w_r, so the argument above holds for them too.
"""
import functools

import torch
import torch.distributed as dist

from clipshard.grad_cache import GradCache
from clipshard.integrations.transformers_models import (CLIP, COVERED, IMAGE_ARGS, SIGLIP, TEXT_ARGS, covered_entry,
                                                        embeddings, logit_scale_and_bias, text_embeddings, unwrap)
from clipshard.losses.clip import clip_loss
from clipshard.losses.siglip import siglip_loss


def _entry(fn, model):
    entry = covered_entry(model)
    if entry is None:
        names = ", ".join(e.name for e in COVERED)
        raise TypeError(f"{fn}: model must be one of transformers' {names} (or a subclass), got "
                        f"{type(model).__module__}.{type(model).__qualname__}")
    return entry


def _active_group(group):
    if group is not None:
        return group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def _rank_weight(local_size, device, group):
    """w_r = N * M_r / M (a Python float): one all-reduce of one number."""
    world_size = dist.get_world_size(group)
    on = torch.device("cpu") if dist.get_backend(group) == "gloo" else device
    total = torch.tensor([local_size], dtype=torch.float64, device=on)
    dist.all_reduce(total, group=group)
    return world_size * local_size / total.item()


def global_batch_loss(family, image_embeds, text_embeds, logit_scale, logit_bias=None, *, group=None,
                      sample_ids=None, targets=None, hard_negatives=None):
    """The loss of the module docstring from normalised embeddings and the already exponentiated
    logit_scale (and SigLIP's logit_bias). family: "clip" or "siglip". group: the process group
    (default: the world group when torch.distributed is initialised, else one device).
    sample_ids / targets / hard_negatives (normalised text embeddings of hard negative texts): the
    losses' keywords of the same names (docs/targets.md); left out of the call when None."""
    if family not in (CLIP, SIGLIP):
        raise ValueError(f"global_batch_loss: family must be 'clip' or 'siglip', got {family!r}")
    dtypes = {image_embeds.dtype, text_embeds.dtype} | ({hard_negatives.dtype} if hard_negatives is not None else set())
    if len(dtypes) > 1:  # e.g. one tower left in fp32 under autocast
        dtype = functools.reduce(torch.promote_types, dtypes)
        image_embeds, text_embeds = image_embeds.to(dtype), text_embeds.to(dtype)
        hard_negatives = None if hard_negatives is None else hard_negatives.to(dtype)
    extras = {k: v for k, v in dict(sample_ids=sample_ids, targets=targets, hard_negatives=hard_negatives).items()
              if v is not None}
    group = _active_group(group)
    if family == SIGLIP:
        loss = siglip_loss(image_embeds, text_embeds, logit_scale, logit_bias, group=group, **extras)
    else:
        loss = clip_loss(image_embeds, text_embeds, logit_scale, logit_bias, local_loss=True,
                         gather_with_grad=True, group=group, **extras)
    if group is None or dist.get_world_size(group) == 1:
        return loss
    return loss * _rank_weight(image_embeds.shape[0], image_embeds.device, group)


def loss_from_embeddings(model, image_embeds, text_embeds, *, group=None):
    """The global-batch loss of `model` (a covered transformers model, or DDP around one) for this
    rank's normalised embeddings (the `image_embeds` / `text_embeds` its forward returns), with the
    model's own logit_scale.exp() (and logit_bias for SigLIP). Every rank must call it."""
    model = unwrap(model)
    entry = _entry("loss_from_embeddings", model)
    scale, bias = logit_scale_and_bias(model, entry, image_embeds.device)
    return global_batch_loss(entry.family, image_embeds, text_embeds, scale, bias, group=group)


def loss_from_output(model, output, *, group=None):
    """loss_from_embeddings for a model output (the ModelOutput of `model(...)`, with its
    image_embeds and text_embeds): call the model with return_loss=False, then this, in your own
    loop: loss = loss_from_output(model, model(**batch)); loss.backward()."""
    for name in ("image_embeds", "text_embeds"):
        if getattr(output, name, None) is None:
            raise ValueError(f"loss_from_output: output has no {name}; pass the ModelOutput the model returns "
                             "(return_dict=True)")
    return loss_from_embeddings(model, output.image_embeds, output.text_embeds, group=group)


def negative_embeddings(model, entry, arguments, negative_texts):
    """The normalised text embeddings of hard negative texts (their text tower arguments, e.g.
    input_ids and attention_mask), with the forward's shared options (output_attentions, ...)."""
    options = {k: v for k, v in arguments.items() if k not in IMAGE_ARGS + TEXT_ARGS}
    return text_embeddings(model, entry, {**negative_texts, **options})


def grad_cache_loss(model, entry, arguments, micro_batch_size, *, sample_ids=None, targets=None, negative_texts=None):
    """global_batch_loss of `model` (entry's class) for its forward's keyword `arguments`, through
    clipshard.GradCache in micro-batches of micro_batch_size rows. It runs inside the model's
    forward, which DDP (Trainer, accelerate) may wrap: the loss carries the parameters' gradients
    through its own graph, so DDP sees each parameter's gradient once per step. sample_ids go to the
    loss whole; negative_texts (hard negatives' text arguments) run through get_text_features in
    micro-batches too."""
    tensors = {k: v for k, v in arguments.items() if torch.is_tensor(v)}
    images = {k: v for k, v in tensors.items() if k in IMAGE_ARGS}
    texts = {k: v for k, v in tensors.items() if k not in IMAGE_ARGS}
    options = {k: v for k, v in arguments.items() if k not in tensors}

    def towers(image_args, text_args):
        image, text, _, _ = embeddings(model, entry, {**image_args, **text_args, **options})
        return (image, text, *logit_scale_and_bias(model, entry, image.device))

    def loss(image, text, scale, bias, **extras):
        return global_batch_loss(entry.family, image, text, scale, bias, targets=targets, **extras)

    def encode_text(text_args):
        return negative_embeddings(model, entry, options, text_args)

    cache = GradCache(towers, loss, micro_batch_size, parameters=model.parameters(),
                      encode_text=encode_text if negative_texts else None)
    return cache(images, texts, sample_ids=sample_ids, hard_negative_texts=negative_texts or None)
