"""References of torch.ops.clipshard.contrastive_lse_forward, clip_loss / ClipLoss on one device, and
ClipLoss over ranks (open_clip's per-rank semantics), in fp64."""
import torch

from tests.references.similarity import similarity_reference


def contrastive_lse_reference(rows, cols, scale, bias=None, pos_offset=0, want_col_lse=True):
    """Same outputs as torch.ops.clipshard.contrastive_lse_forward (row LSE, positive logits,
    column LSE over these rows), differentiable through autograd, fp64."""
    logits = similarity_reference(rows, cols, scale, bias)
    index = torch.arange(rows.shape[0], device=rows.device)
    row_lse = torch.logsumexp(logits, dim=1)
    pos_logit = logits[index, pos_offset + index]
    col_lse = torch.logsumexp(logits, dim=0) if want_col_lse else logits.new_empty(0)
    return row_lse, pos_logit, col_lse


def clip_loss_reference(image_features, text_features, logit_scale, logit_bias=None):
    """open_clip's single-device loss, (CE(rows) + CE(columns)) / 2, in fp64."""
    logits = similarity_reference(image_features, text_features, logit_scale, logit_bias)
    labels = torch.arange(logits.shape[0], device=logits.device)
    ce = torch.nn.functional.cross_entropy
    return (ce(logits, labels) + ce(logits.T, labels)) / 2


def _cross_entropy_sum(logits, targets):
    return (torch.logsumexp(logits, dim=1) - logits.gather(1, targets[:, None])[:, 0]).sum()


def clip_loss_rank_reference(image_features, text_features, logit_scale, logit_bias, sizes, upstream,
                             rank, local_loss, gather_with_grad):
    """What open_clip's ClipLoss returns on `rank`, and the gradients that rank's features,
    logit_scale and logit_bias receive, in fp64, in one process.

    image_features, text_features: the global batch (sum(sizes) x D), rank q's rows starting at
    sum(sizes[:q]); rank q's loss is backpropagated with upstream gradient upstream[q].
    Unequal sizes generalise open_clip (which needs equal ones): labels are offset_q + i and a
    rank's mean runs over its own rows. Returns (loss, d image_r, d text_r, d scale, d bias or None).
    """
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale, bias = (leaf(t) for t in (image_features, text_features, logit_scale, logit_bias))
    if len(sizes) == 1:
        local_loss, gather_with_grad = True, True  # open_clip gathers nothing on one rank
    offsets = [sum(sizes[:q]) for q in range(len(sizes))]
    block = lambda t, q: t[offsets[q]: offsets[q] + sizes[q]]  # noqa: E731

    def rank_loss(q, other_text, other_image):
        labels = torch.arange(sizes[q]) + offsets[q]
        rows = similarity_reference(block(image, q), other_text, scale, bias)
        cols = similarity_reference(block(text, q), other_image, scale, bias)
        return (_cross_entropy_sum(rows, labels) + _cross_entropy_sum(cols, labels)) / (2 * sizes[q])

    def full_loss():
        logits = similarity_reference(image, text, scale, bias)
        labels = torch.arange(logits.shape[0])
        return (_cross_entropy_sum(logits, labels) + _cross_entropy_sum(logits.T, labels)) / (2 * logits.shape[0])

    if local_loss and gather_with_grad:
        losses = [rank_loss(q, text, image) for q in range(len(sizes))]
        feature_objective = sum(g * loss for g, loss in zip(upstream, losses))
        loss = losses[rank]
    elif local_loss:
        loss = rank_loss(rank, text.detach(), image.detach())
        feature_objective = upstream[rank] * loss
    else:
        loss = full_loss()
        feature_objective = (sum(upstream) if gather_with_grad else upstream[rank]) * loss
    d_image, d_text = torch.autograd.grad(feature_objective, [image, text], retain_graph=True)
    scalars = [scale] + ([bias] if bias is not None else [])
    d_scalars = torch.autograd.grad(upstream[rank] * loss, scalars)
    d_bias = d_scalars[1] if bias is not None else None
    return loss.detach(), block(d_image, rank), block(d_text, rank), d_scalars[0], d_bias
