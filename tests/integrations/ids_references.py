"""Materialised fp64 references of the sample-id and hard-negative objectives (docs/targets.md) on one device, for the
integrations' tests: the full logits, same-id pairs masked / averaged, hard negatives as extra columns."""
import torch
import torch.nn.functional as F


def materialised_clip_loss(image_features, text_features, logit_scale, logit_bias=None, *, sample_ids=None,
                           hard_negatives=None, targets="mask"):
    """open_clip's (CE_i2t + CE_t2i) / 2 with same-id pairs masked ("mask") or averaged as positives
    ("multi"), hard negatives as extra columns of the image rows: the full logits, in fp64."""
    logits = logit_scale * image_features @ text_features.T
    if logit_bias is not None:
        logits = logits + logit_bias
    own = torch.eye(len(logits), dtype=torch.bool)
    same = own if sample_ids is None else sample_ids[:, None] == sample_ids[None, :]
    extra = logits[:, :0] if hard_negatives is None else logit_scale * image_features @ hard_negatives.T
    if hard_negatives is not None and logit_bias is not None:
        extra = extra + logit_bias
    if targets == "mask":
        kept = logits.masked_fill(same & ~own, float("-inf"))
        rows = torch.logsumexp(torch.cat([kept, extra], 1), 1) - logits.diagonal()
        cols = torch.logsumexp(kept, 0) - logits.diagonal()
    else:
        positives = torch.where(same, logits, torch.zeros_like(logits))
        rows = torch.logsumexp(torch.cat([logits, extra], 1), 1) - positives.sum(1) / same.sum(1)
        cols = torch.logsumexp(logits, 0) - positives.sum(0) / same.sum(0)
    return (rows.mean() + cols.mean()) / 2


def materialised_siglip_loss(image_features, text_features, logit_scale, logit_bias=None, *, sample_ids=None,
                             hard_negatives=None, targets="multi"):
    """open_clip's SigLipLoss (sum of -log sigmoid(z * logit) / M) with label +1 for same-id pairs
    ("multi") or no term for same-id pairs other than the own ("mask"), -1 for every hard negative."""
    logits = logit_scale * image_features @ text_features.T + logit_bias
    own = torch.eye(len(logits), dtype=torch.bool)
    same = own if sample_ids is None else sample_ids[:, None] == sample_ids[None, :]
    labels = torch.where(same, 1.0, -1.0).to(logits.dtype)
    terms = -F.logsigmoid(labels * logits)
    if targets == "mask":
        terms = torch.where(same & ~own, torch.zeros_like(terms), terms)
    total = terms.sum()
    if hard_negatives is not None:
        total = total - F.logsigmoid(-(logit_scale * image_features @ hard_negatives.T + logit_bias)).sum()
    return total / len(logits)
