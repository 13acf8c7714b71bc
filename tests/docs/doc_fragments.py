"""The names the docs' code blocks assume, at small sizes on the CPU in one process (world size 1):
each fragment is a function that returns a dict of names; a block marked with the fragment's name
(tests/docs/doc_blocks.py) runs with them. Every block also gets `torch` and `clipshard`."""
import math

import torch
import torch.nn.functional as F
from torch import nn

M, D, TEACHER_D, H = 8, 16, 24, 3


def _unit(rows, dim, generator):
    return F.normalize(torch.randn(rows, dim, generator=generator), dim=-1)


def features():
    """One rank's CLIP features, scales, hard negatives and sample ids; a teacher's features."""
    g = torch.Generator().manual_seed(0)
    image, text = _unit(M, D, g), _unit(M, D, g)
    names = dict(rank=0, world_size=1, image_features=image.requires_grad_(), text_features=text.requires_grad_(),
                 logit_scale=torch.tensor(10.0), logit_bias=torch.tensor(-2.0),
                 dist_image_features=_unit(M, TEACHER_D, g), dist_text_features=_unit(M, TEACHER_D, g),
                 dist_logit_scale=torch.tensor(20.0), negatives=_unit(H, D, g), negative_features=_unit(H, D, g),
                 ids=torch.tensor([0, 1, 2, 3, 0, 5, 6, 1]), rows=_unit(M, D, g), cols=_unit(2 * M, D, g),
                 scale=torch.tensor(10.0), bias=torch.tensor(-2.0))
    return names


def tensors():
    """fp32 values to round and 16-bit destinations of their shape."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 3
    return dict(x=x, dst=torch.empty_like(x, dtype=torch.float16), dst16=torch.empty_like(x, dtype=torch.bfloat16))


class TinyClip(nn.Module):
    """A two-tower model with open_clip's interface: forward(images, texts) -> its output dict,
    encode_image / encode_text(..., normalize=), logit_scale as a log."""

    def __init__(self, vocab=20, width=12):
        super().__init__()
        self.visual = nn.Linear(6, D)
        self.token_embedding = nn.Embedding(vocab, width)
        self.text_projection = nn.Linear(width, D)
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))

    def encode_image(self, images, normalize=False):
        out = self.visual(images)
        return F.normalize(out, dim=-1) if normalize else out

    def encode_text(self, texts, normalize=False):
        out = self.text_projection(self.token_embedding(texts).mean(dim=1))
        return F.normalize(out, dim=-1) if normalize else out

    def forward(self, images, texts):
        return {"image_features": self.encode_image(images, True), "text_features": self.encode_text(texts, True),
                "logit_scale": self.logit_scale.exp()}


def model():
    """A small open_clip-like model, a batch for it, its loss and optimizer, a text encoder."""
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    net = TinyClip()
    return dict(model=net, loss_fn=clipshard_loss(), images=torch.randn(M, 6, generator=g),
                texts=torch.randint(0, 20, (M, 5), generator=g), ids=torch.arange(M),
                negative_texts=torch.randint(0, 20, (H, 5), generator=g),
                optimizer=torch.optim.SGD(net.parameters(), lr=0.1),
                text_encoder=nn.Sequential(nn.Embedding(20, 12), nn.Linear(12, D)))


def clipshard_loss():
    import clipshard
    return clipshard.ClipLoss()


def sentence_transformers():
    """MultipleNegativesRankingLoss and a model for it (the loss only keeps the model here)."""
    from sentence_transformers.sentence_transformer.losses import MultipleNegativesRankingLoss
    return dict(MultipleNegativesRankingLoss=MultipleNegativesRankingLoss,
                model=nn.Sequential(nn.Identity()))


def transformers_clip():
    """A tiny randomly initialised transformers CLIPModel's config and a batch for it."""
    import transformers
    from tests.integrations.transformers.hf_tiny_models import tiny_inputs, tiny_model
    batch = tiny_inputs("CLIPModel", M, seed=3)
    negatives = tiny_inputs("CLIPModel", H, seed=4)
    return dict(transformers=transformers, config=tiny_model("CLIPModel").config, model=tiny_model("CLIPModel"),
                batch=batch, ids=torch.arange(M), neg_ids=negatives["input_ids"],
                neg_mask=negatives["attention_mask"], **batch)


FRAGMENTS = {"features": features, "tensors": tensors, "model": model,
             "sentence-transformers": sentence_transformers, "transformers-clip": transformers_clip}


def transformers_patched():
    """transformers_clip's names with apply_to_transformers applied (undone after the block)."""
    import clipshard
    return dict(transformers_clip(), _patch=clipshard.apply_to_transformers())


FRAGMENTS["transformers-patched"] = transformers_patched
