"""fp64 references of clip_loss / ClipLoss beyond the diagonal (docs/targets.md): sample ids with
targets "mask" / "multi", hard negatives (extra columns), direction. Everything is materialised:
the logits of the global batch, the same-id masks, the extra columns.

Row i (id a_i) against columns j (id c_j), S_ij = scale * rows_i . cols_j + bias, own(i) its pair:
- "mask": row i's LSE leaves out the columns with a_i == c_j other than own(i) (logit -inf there);
  its positive is S_i,own(i);
- "multi": the LSE over every column; the positive is the mean of S_ij over the columns with c_j == a_i;
- no ids: "mask" with every id distinct (open_clip's loss);
- extra columns (hard negatives) join the rows' LSEs only.
The columns' terms are the same formula on S^T (text rows against the images), without extra columns.
"""
import torch

from tests.references.similarity import similarity_reference


def target_terms(rows, cols, scale, bias, row_ids, col_ids, own, targets, extra=None):
    """Per-row terms LSE_i - positive_i (fp64, differentiable) of rows (M) against cols (K): own[i]
    the column of row i's pair; row_ids / col_ids None means every id distinct; extra: H x D."""
    logits = similarity_reference(rows, cols, scale, bias)
    index = torch.arange(rows.shape[0])
    if row_ids is None:
        row_ids, col_ids = own, torch.arange(cols.shape[0])
    same = row_ids[:, None] == col_ids[None, :]
    if targets == "multi":
        kept = logits
        positive = (logits * same).sum(1) / same.sum(1)
    else:
        is_own = torch.zeros_like(same)
        is_own[index, own] = True
        kept = logits.masked_fill(same & ~is_own, float("-inf"))
        positive = logits[index, own]
    if extra is not None and extra.shape[0] > 0:
        kept = torch.cat([kept, similarity_reference(rows, extra, scale, bias)], dim=1)
    return torch.logsumexp(kept, dim=1) - positive


def clip_targets_reference(image, text, scale, bias=None, sample_ids=None, targets=None, hard_negatives=None,
                           direction="both"):
    """The single-device loss: mean row term (and, direction "both", the mean column term, halved)."""
    targets = targets or ("mask" if sample_ids is not None else None)
    own = torch.arange(image.shape[0])
    rows = target_terms(image, text, scale, bias, sample_ids, sample_ids, own, targets, hard_negatives)
    if direction == "image_to_text":
        return rows.mean()
    cols = target_terms(text, image, scale, bias, sample_ids, sample_ids, own, targets)
    return (rows.mean() + cols.mean()) / 2


def _rank_partial(q, sizes, image, text, ids, targets, negatives, direction, scale, bias):
    """Rank q's sum of row terms (and column terms) as open_clip's local_loss=True computes it: its
    rows against the given (maybe detached) global columns."""
    offset, m = sum(sizes[:q]), sizes[q]
    mine = slice(offset, offset + m)
    own = torch.arange(m) + offset
    q_ids = None if ids is None else ids[mine]
    all_ids = ids
    image_q, text_q = image[0][mine], text[0][mine]  # the query rows (always with grad)
    all_image, all_text = image[1], text[1]  # the columns (detached where open_clip detaches them)
    partial = target_terms(image_q, all_text, scale, bias, q_ids, all_ids, own, targets, negatives).sum()
    if direction == "both":
        partial = partial + target_terms(text_q, all_image, scale, bias, q_ids, all_ids, own, targets).sum()
    return partial


def clip_targets_rank_reference(image_features, text_features, logit_scale, logit_bias, sizes, upstream, rank,
                                local_loss, gather_with_grad, sample_ids=None, targets=None, hard_negatives=None,
                                direction="both"):
    """What ClipLoss returns on `rank` over len(sizes) ranks, and the gradients rank's inputs receive,
    with open_clip's semantics (tests/references/contrastive.py's clip_loss_rank_reference, extended):
    rank q holds rows sum(sizes[:q]) .. of the global batch and hard_negatives[q] (a list, one H_q x D
    tensor per rank, or None); its loss is backpropagated with upstream[q]. Hard negatives are gathered
    like the texts (with gather_with_grad=False and local_loss=True they are constants, every rank's).
    Returns (loss, d image_r, d text_r, d hard_negatives_r or None, d scale, d bias or None)."""
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale, bias = (leaf(t) for t in (image_features, text_features, logit_scale, logit_bias))
    negs = None if hard_negatives is None else [leaf(h) for h in hard_negatives]
    targets = targets or ("mask" if sample_ids is not None else None)
    all_negs = None if negs is None else torch.cat(negs)
    terms = 2 if direction == "both" else 1
    if len(sizes) == 1:
        local_loss, gather_with_grad = True, True
    n = len(sizes)

    def partial(q, detach):
        cols = (lambda t: t.detach()) if detach else (lambda t: t)  # noqa: E731
        return _rank_partial(q, sizes, (image, cols(image)), (text, cols(text)), sample_ids, targets,
                             None if all_negs is None else cols(all_negs), direction, scale, bias)

    if local_loss and gather_with_grad:
        losses = [partial(q, False) / (terms * sizes[q]) for q in range(n)]
        feature_objective = sum(g * loss for g, loss in zip(upstream, losses))
        loss = losses[rank]
    elif local_loss:
        loss = partial(rank, True) / (terms * sizes[rank])
        feature_objective = upstream[rank] * loss
    else:
        loss = sum(partial(q, False) for q in range(n)) / (terms * sum(sizes))
        feature_objective = (sum(upstream) if gather_with_grad else upstream[rank]) * loss
    wrt = [image, text] + ([negs[rank]] if negs is not None else [])
    grads = torch.autograd.grad(feature_objective, wrt, retain_graph=True, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for g, t in zip(grads, wrt)]
    scalars = [scale] + ([bias] if bias is not None else [])
    d_scalars = torch.autograd.grad(upstream[rank] * loss, scalars)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    d_negs = grads[2] if negs is not None else None
    return (loss.detach(), grads[0][mine], grads[1][mine], d_negs, d_scalars[0],
            d_scalars[1] if bias is not None else None)
