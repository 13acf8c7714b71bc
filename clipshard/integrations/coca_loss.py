"""CoCaLoss for open_clip's CoCa models: clipshard's fused contrastive term plus open_clip's own
caption term. Needs open_clip (the caption term is an instance of open_clip's CoCaLoss)."""
import torch

from clipshard.losses.clip import ClipLoss
from clipshard.integrations.open_clip_common import original_class


class CoCaLoss(ClipLoss):
    """Drop-in for open_clip.loss.CoCaLoss (open_clip 3.3 signature): the same
    (clip_loss_weight * contrastive loss, caption_loss_weight * caption cross-entropy), with the
    contrastive term from clipshard.ClipLoss (same options, and `mode` / `group` as there) and the
    caption term computed by an open_clip CoCaLoss whose contrastive weight is 0, so that it stays
    open_clip's code. apply_to_open_clip() makes open_clip.create_loss build this class."""

    def __init__(self, caption_loss_weight, clip_loss_weight, pad_id=0, local_loss=False,
                 gather_with_grad=False, cache_labels=False, rank=0, world_size=1, use_horovod=False, *,
                 mode=None, group=None):
        super().__init__(local_loss=local_loss, gather_with_grad=gather_with_grad, cache_labels=cache_labels,
                         rank=rank, world_size=world_size, use_horovod=use_horovod, mode=mode, group=group)
        self.clip_loss_weight = clip_loss_weight
        self.caption_loss_weight = caption_loss_weight
        self.caption_term = original_class("CoCaLoss")(
            caption_loss_weight=caption_loss_weight, clip_loss_weight=0, pad_id=pad_id)

    def forward(self, image_features, text_features, logits, labels, logit_scale, output_dict=False):
        """logits: the text decoder's (batch, tokens, vocab) logits; labels: (batch, tokens) token ids
        (pad_id is ignored). logit_scale is already exponentiated, as for ClipLoss.forward. Returns
        (contrastive_loss, caption_loss), both weighted, or a dict with those keys if output_dict."""
        if self.clip_loss_weight:
            clip_loss = self.clip_loss_weight * super().forward(image_features, text_features, logit_scale)
        else:
            clip_loss = torch.tensor(0, device=logits.device)  # what open_clip returns for weight 0
        _, caption_loss = self.caption_term(image_features, text_features, logits, labels, logit_scale)
        if output_dict:
            return {"contrastive_loss": clip_loss, "caption_loss": caption_loss}
        return clip_loss, caption_loss
