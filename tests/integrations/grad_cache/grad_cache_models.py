"""A small two-tower model for the GradCache tests: an MLP image tower with dropout, a text tower
of token embeddings (mean-pooled) and a Linear, learned logit_scale and logit_bias; it returns
open_clip's dict or tuple; and a loss with trainable parameters of its own. The same initial weights
on every rank (a fixed generator)."""
import math

import torch
import torch.nn.functional as F
from torch import nn

IMAGE_DIM, VOCAB, TOKENS, EMBED = 12, 20, 5, 8


class TinyClip(nn.Module):
    def __init__(self, *, dropout=0.0, as_tuple=False, dtype=torch.float64, with_bias=True):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.image = nn.Sequential(nn.Linear(IMAGE_DIM, 16), nn.GELU(), nn.Dropout(dropout), nn.Linear(16, EMBED))
        self.text = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Dropout(dropout), nn.Linear(16, EMBED))
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(10.0)))
        if with_bias:  # (ClipLoss's gradient of a bias is 0, rounding noise; DDP wants every parameter used)
            self.logit_bias = nn.Parameter(torch.full((1,), -2.0))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 if p.dim() > 1 or p.numel() > 1 else p)
        self.to(dtype)
        self.as_tuple, self.with_bias = as_tuple, with_bias

    def encode_text(self, tokens):
        """The text tower alone: normalised features (what hard negative texts go through)."""
        return F.normalize(self.text(tokens).mean(dim=1).to(self.image[0].weight.dtype), dim=-1)

    def forward(self, images, tokens):
        image = F.normalize(self.image(images.to(self.image[0].weight.dtype)), dim=-1)
        text = self.encode_text(tokens).to(image.dtype)
        scale = self.logit_scale.exp()
        if self.as_tuple:
            return (image, text, scale, self.logit_bias.clone()) if self.with_bias else (image, text, scale)
        output = {"image_features": image, "text_features": text, "logit_scale": scale}
        return {**output, "logit_bias": self.logit_bias.clone()} if self.with_bias else output


class LearnedLoss(nn.Module):
    """A loss with trainable parameters of its own: a projection head on the image features and a
    learned temperature that multiplies the model's logit_scale."""

    def __init__(self, loss, dtype=torch.float64):
        super().__init__()
        gen = torch.Generator().manual_seed(11)
        self.head = nn.Linear(EMBED, EMBED).to(dtype)
        self.log_temperature = nn.Parameter(torch.tensor(0.2, dtype=dtype))
        with torch.no_grad():
            self.head.weight.copy_(torch.eye(EMBED) + 0.3 * torch.randn(EMBED, EMBED, generator=gen))
            self.head.bias.copy_(0.1 * torch.randn(EMBED, generator=gen))
        self.loss = loss

    def forward(self, image_features, text_features, logit_scale):
        image = F.normalize(self.head(image_features), dim=-1)
        return self.loss(image, text_features, logit_scale * self.log_temperature.exp())


def batch(size, seed, dtype=torch.float64):
    """(images, tokens) of `size` pairs, drawn from a fixed generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(size, IMAGE_DIM, generator=gen, dtype=dtype), torch.randint(0, VOCAB, (size, TOKENS), generator=gen)


def call_loss(loss_fn, output):
    """loss_fn on a model output (dict or tuple), as GradCache calls it."""
    if isinstance(output, dict):
        return loss_fn(**output)
    return loss_fn(*output)


def concatenated(outputs):
    """The outputs of several micro-batches as one batch's (features concatenated)."""
    first = outputs[0]
    if isinstance(first, dict):
        return {k: torch.cat([o[k] for o in outputs]) if k.endswith("features") else v for k, v in first.items()}
    return (torch.cat([o[0] for o in outputs]), torch.cat([o[1] for o in outputs]), *first[2:])


def plain_step(model, loss_fn, images, tokens, micro_batch_size=None, upstream=1.0):
    """The step without the cache: the model over the whole batch (or over the same micro-batches,
    all graphs kept, so that dropout draws what GradCache's first pass draws), the loss, one
    backward of upstream * loss. Returns the loss."""
    if micro_batch_size is None:
        output = model(images, tokens)
    else:
        output = concatenated([model(i, t) for i, t in zip(images.split(micro_batch_size),
                                                             tokens.split(micro_batch_size))])
    loss = call_loss(loss_fn, output)
    (loss * upstream).backward()
    return loss.detach()


def grads(model):
    return {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


def max_relative_difference(ours, reference):
    """max over parameters of max|ours - reference| / max|reference| (fp64)."""
    assert ours.keys() == reference.keys(), (sorted(ours), sorted(reference))
    return max(((ours[k].double() - reference[k].double()).abs().max() / reference[k].double().abs().max()).item()
               for k in reference)
