"""References of torch.ops.clipshard.distill_lse (the seven statistics) and of DistillClipLoss on one
device and over ranks, in fp64."""
import torch

from tests.references.similarity import similarity_reference


def distill_lse_reference(rows, cols, teacher_rows, teacher_cols, scale, teacher_scale, pos_offset=0,
                          want_columns=True):
    """The seven outputs of clipshard.ops.distill_lse.distill_lse (row_lse, pos_logit,
    teacher_row_lse, row_cross, col_lse, teacher_col_lse, col_cross), materialising every logit,
    differentiable through autograd, fp64."""
    s = similarity_reference(rows, cols, scale)
    t = torch.stack([similarity_reference(r, c, ts) for r, c, ts in zip(teacher_rows, teacher_cols, teacher_scale)])
    index = torch.arange(rows.shape[0], device=rows.device)
    row_lse, teacher_row_lse = torch.logsumexp(s, dim=1), torch.logsumexp(t, dim=2)
    row_cross = (t.softmax(dim=2) * s).sum(dim=2)
    if want_columns:
        columns = torch.logsumexp(s, dim=0), torch.logsumexp(t, dim=1), (t.softmax(dim=1) * s).sum(dim=1)
    else:
        columns = s.new_empty(0), t.new_empty(t.shape[0], 0), t.new_empty(t.shape[0], 0)
    return (row_lse, s[index, pos_offset + index], teacher_row_lse, row_cross) + columns


def _distill_target(teacher_logits, average_after_softmax):
    """The distillation target (row softmax) of a list of teachers' logits."""
    if average_after_softmax:
        return torch.stack([t.softmax(dim=1) for t in teacher_logits]).mean(dim=0)
    return torch.stack(teacher_logits).mean(dim=0).softmax(dim=1)


def _distill_sums(image, text, scale, teacher_images, teacher_texts, teacher_scales, pos_offset,
                  average_after_softmax):
    """(sum of the row cross-entropies of image against text, sum of the distillation
    cross-entropies of those rows), fp64."""
    s = similarity_reference(image, text, scale)
    teachers = [similarity_reference(i, t, ts) for i, t, ts in zip(teacher_images, teacher_texts, teacher_scales)]
    log_softmax = s.log_softmax(dim=1)
    labels = torch.arange(s.shape[0], device=s.device) + pos_offset
    contrastive = -log_softmax.gather(1, labels.unsqueeze(1)).sum()
    distill = -(_distill_target(teachers, average_after_softmax) * log_softmax).sum()
    return torch.stack([contrastive, distill])


def distill_clip_loss_reference(image_features, text_features, logit_scale, teacher_image_features,
                                teacher_text_features, teacher_logit_scales, average_after_softmax=True):
    """open_clip's single-device DistillClipLoss, (contrastive, distill) as one fp64 tensor of two,
    for a list of teachers: the distillation target of each row (and column) is the mean of the
    teachers' softmaxes (average_after_softmax) or the softmax of the mean of their logits."""
    rows = _distill_sums(image_features, text_features, logit_scale, teacher_image_features, teacher_text_features,
                         teacher_logit_scales, 0, average_after_softmax)
    cols = _distill_sums(text_features, image_features, logit_scale, teacher_text_features, teacher_image_features,
                         teacher_logit_scales, 0, average_after_softmax)
    return (rows + cols) / (2 * image_features.shape[0])


def distill_clip_loss_rank_reference(features, teachers, sizes, upstream, rank, local_loss, gather_with_grad,
                                     average_after_softmax=True):
    """What open_clip's DistillClipLoss returns on `rank` and the gradients that rank's inputs
    receive, in fp64, in one process (clip_loss_rank_reference's conventions, for two losses).

    features: (image, text, logit_scale) of the global batch; teachers: (images, texts, scales)
    lists; upstream[q]: rank q's two upstream gradients (contrastive, distill). Returns (losses [2],
    gradients of (image_r, text_r, scale, teacher images_r..., teacher texts_r..., teacher scales...)).
    """
    leaf = lambda t: t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale = (leaf(t) for t in features)
    t_images, t_texts, t_scales = ([leaf(t) for t in group] for group in teachers)
    leaves = [image, text] + t_images + t_texts + [scale] + t_scales
    upstream = [torch.as_tensor(g, dtype=torch.float64) for g in upstream]
    if len(sizes) == 1:
        local_loss, gather_with_grad = True, True
    offsets = [sum(sizes[:q]) for q in range(len(sizes))]
    block = lambda t, q: t[offsets[q]: offsets[q] + sizes[q]]  # noqa: E731

    def rank_losses(q, detach):
        other = (lambda t: t.detach()) if detach else (lambda t: t)  # noqa: E731
        rows = _distill_sums(block(image, q), other(text), scale, [block(t, q) for t in t_images],
                             [other(t) for t in t_texts], t_scales, offsets[q], average_after_softmax)
        cols = _distill_sums(block(text, q), other(image), scale, [block(t, q) for t in t_texts],
                             [other(t) for t in t_images], t_scales, offsets[q], average_after_softmax)
        return (rows + cols) / (2 * sizes[q])

    if local_loss and gather_with_grad:
        losses = [rank_losses(q, False) for q in range(len(sizes))]
        feature_objective = sum((g * loss).sum() for g, loss in zip(upstream, losses))
        loss = losses[rank]
    elif local_loss:
        loss = rank_losses(rank, True)
        feature_objective = (upstream[rank] * loss).sum()
    else:
        loss = distill_clip_loss_reference(image, text, scale, t_images, t_texts, t_scales, average_after_softmax)
        feature_objective = ((sum(upstream) if gather_with_grad else upstream[rank]) * loss).sum()
    n_features = 2 + 2 * len(t_images)
    grads = torch.autograd.grad(feature_objective, leaves[:n_features], retain_graph=True)
    scalar_grads = torch.autograd.grad((upstream[rank] * loss).sum(), leaves[n_features:])
    return loss.detach(), [block(g, rank) for g in grads] + list(scalar_grads)
