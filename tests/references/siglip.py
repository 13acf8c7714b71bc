"""References of torch.ops.clipshard.siglip_forward, siglip_loss / SigLipLoss on one device and over
ranks, in fp64."""
import torch

from tests.references.similarity import similarity_reference


def siglip_sum_reference(rows, cols, scale, bias=None, pos_offset=0):
    """The loss_sum of torch.ops.clipshard.siglip_forward: sum_ij softplus(-z_ij * l_ij) with
    z_ij = +1 iff j == pos_offset + i, else -1 (every z_ij = -1 for pos_offset None),
    differentiable through autograd, fp64."""
    logits = similarity_reference(rows, cols, scale, bias)
    index = torch.arange(rows.shape[0], device=rows.device)
    labels = -torch.ones_like(logits)
    if pos_offset is not None:
        labels[index, pos_offset + index] = 1.0
    return -torch.nn.functional.logsigmoid(labels * logits).sum()


def siglip_loss_reference(image_features, text_features, logit_scale, logit_bias=None):
    """open_clip's single-device SigLipLoss, sum_ij softplus(-z_ij * l_ij) / B, in fp64."""
    return siglip_sum_reference(image_features, text_features, logit_scale, logit_bias) / image_features.shape[0]


def siglip_loss_rank_reference(image_features, text_features, logit_scale, logit_bias, sizes, upstream, rank):
    """What open_clip's SigLipLoss returns on `rank`, and the gradients that rank's features,
    logit_scale and logit_bias receive, in fp64, in one process.

    image_features, text_features: the global batch (sum(sizes) x D), rank q's rows starting at
    sum(sizes[:q]); rank q's loss is backpropagated with upstream gradient upstream[q]. Rank q's loss
    is its own images against all texts, divided by sizes[q] (unequal sizes generalise open_clip,
    which needs equal ones). Feature gradients: of sum_q upstream[q] * L_q (the texts take part in
    every rank's loss); logit_scale / logit_bias gradients: of upstream[rank] * L_rank.
    Returns (loss, d image_r, d text_r, d scale, d bias or None).
    """
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale, bias = (leaf(t) for t in (image_features, text_features, logit_scale, logit_bias))
    offsets = [sum(sizes[:q]) for q in range(len(sizes))]
    losses = [siglip_sum_reference(image[offsets[q]: offsets[q] + sizes[q]], text, scale, bias, offsets[q]) / sizes[q]
              for q in range(len(sizes))]
    feature_objective = sum(g * loss for g, loss in zip(upstream, losses))
    d_image, d_text = torch.autograd.grad(feature_objective, [image, text], retain_graph=True)
    scalars = [scale] + ([bias] if bias is not None else [])
    d_scalars = torch.autograd.grad(upstream[rank] * losses[rank], scalars)
    local = slice(offsets[rank], offsets[rank] + sizes[rank])
    return (losses[rank].detach(), d_image[local], d_text[local], d_scalars[0],
            d_scalars[1] if bias is not None else None)
