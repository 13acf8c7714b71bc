"""CLIP contrastive loss on one device, through the fused log-sum-exp op (docs/fused_loss.md)."""
import torch

from clipshard.fused_op import contrastive_lse


def _check_pair(image_features, text_features):
    for name, t in (("image_features", image_features), ("text_features", text_features)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"clip_loss: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 2:
            raise ValueError(f"clip_loss: {name} must be 2-D (batch x dim), got shape {tuple(t.shape)}")
    if image_features.dtype != text_features.dtype:
        raise TypeError(f"clip_loss: image_features and text_features must have the same dtype, got "
                        f"{image_features.dtype} and {text_features.dtype}")
    if image_features.device != text_features.device:
        raise ValueError(f"clip_loss: image_features and text_features must be on the same device, got "
                         f"{image_features.device} and {text_features.device}")
    if image_features.shape != text_features.shape:
        raise ValueError(f"clip_loss: image_features and text_features must have the same shape, got "
                         f"{tuple(image_features.shape)} and {tuple(text_features.shape)}")


def clip_loss(image_features, text_features, logit_scale, logit_bias=None):
    """open_clip's ClipLoss on one device: (CE(logits_per_image) + CE(logits_per_text)) / 2 with
    logits = logit_scale * image_features @ text_features^T (+ logit_bias), the positives on the
    diagonal. One fused pass gives the row and column log-sum-exps from the same similarity tiles;
    the B x B logits are never stored. Returns a 0-dim fp32 tensor (fp64 for fp64 features).
    """
    _check_pair(image_features, text_features)
    row_lse, pos_logit, col_lse = contrastive_lse(image_features, text_features, logit_scale, logit_bias,
                                                  pos_offset=0, want_col_lse=True)
    return ((row_lse - pos_logit).mean() + (col_lse - pos_logit).mean()) / 2
