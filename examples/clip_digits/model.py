"""A tiny CLIP: a small CNN for 8x8 digits and a small text transformer over word tokens."""
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class ImageEncoder(nn.Module):
    """8x8 grey image -> embedding: two 3x3 convolutions, then an MLP head."""

    def __init__(self, width: int, embed_dim: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width // 2, 3, padding=1), nn.GELU(),
            nn.Conv2d(width // 2, width, 3, padding=1, stride=2), nn.GELU(),  # -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width * 16, 2 * width), nn.GELU(),
                                  nn.Linear(2 * width, embed_dim))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(LN(x)), then x + MLP(LN(x))."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=attend)  # (B, H, L, W/H)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.mlp(self.norm2(x))


class TextEncoder(nn.Module):
    """Token ids -> embedding. Padding is masked out of attention and of the mean pooling.

    The output has the dtype of the weights (16-bit in the sr16/rn16 runs); the caller casts.
    """

    def __init__(self, vocab_size: int, max_length: int, width: int, layers: int, heads: int,
                 embed_dim: int, pad_id: int = 0, checkpointing: bool = True):
        super().__init__()
        if width % heads:
            raise ValueError(f"TextEncoder: width ({width}) must be divisible by heads ({heads})")
        self.pad_id = pad_id
        self.checkpointing = checkpointing
        self.token_embedding = nn.Embedding(vocab_size, width)
        nn.init.normal_(self.token_embedding.weight, std=0.02)  # CLIP's initialisation
        self.position_embedding = nn.Parameter(torch.randn(max_length, width) * 0.01)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        self.projection = nn.Linear(width, embed_dim)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        valid = token_ids != self.pad_id                      # (B, L)
        x = self.token_embedding(token_ids) + self.position_embedding[: token_ids.shape[1]]
        attend = valid[:, None, None, :]                       # keys a query may look at
        for block in self.blocks:
            if self.checkpointing and self.training:
                # Recompute the block's activations in backward instead of keeping them.
                x = checkpoint(block, x, attend, use_reentrant=False)
            else:
                x = block(x, attend)
        x = self.norm(x)
        weights = valid.unsqueeze(-1).to(x.dtype)
        pooled = (x * weights).sum(1) / weights.sum(1)
        return self.projection(pooled)


class TinyClip(nn.Module):
    """Both towers and CLIP's learnable temperature (log 1/0.07 at init, exp clamped to 100)."""

    def __init__(self, image: ImageEncoder, text: TextEncoder):
        super().__init__()
        self.image = image
        self.text = text
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return F.normalize(self.image(images), dim=-1)

    def encode_text(self, token_ids: torch.Tensor) -> torch.Tensor:
        # The loss works on fp32 features: the 16-bit text tower's output is cast here, and the
        # gradient flowing back is cast to the tower's dtype by autograd.
        return F.normalize(self.text(token_ids).float(), dim=-1)

    def forward(self, images: torch.Tensor, token_ids: torch.Tensor):
        scale = self.logit_scale.clamp(max=math.log(100)).exp()
        return self.encode_image(images), self.encode_text(token_ids), scale


def build_model(vocab_size: int, max_length: int, *, image_width: int, text_width: int,
                text_layers: int, text_heads: int, embed_dim: int, checkpointing: bool) -> TinyClip:
    return TinyClip(ImageEncoder(image_width, embed_dim),
                    TextEncoder(vocab_size, max_length, text_width, text_layers, text_heads, embed_dim,
                                checkpointing=checkpointing))
