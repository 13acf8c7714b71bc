"""fp64 references of siglip_loss / SigLipLoss with sample ids ("multi" / "mask" targets) and hard
negatives (extra -1 columns), materialised over the global batch from the formulas
(docs/siglip.md, "Sample ids and hard negatives").

Labels of row i (global id a_i) against text column j (id c_j): +1 for the own pair (j = offset + i);
otherwise +1 ("multi") or no term ("mask") when a_i == c_j, else -1. Every hard negative column is -1
for every row. A rank's loss is its terms' sum divided by its own batch size M_r, as without ids.
"""
import torch

from tests.references.similarity import similarity_reference


def _labels(m, k, row_ids, col_ids, pos_offset, targets):
    """The M x K labels (+1, -1, 0 = no term) of a row block against the text columns; row_ids None:
    no ids (only the own pairs are +1)."""
    labels = -torch.ones(m, k, dtype=torch.float64)
    if row_ids is not None:
        same = row_ids[:, None] == col_ids[None, :]
        labels[same] = 1.0 if targets == "multi" else 0.0
    index = torch.arange(m)
    labels[index, pos_offset + index] = 1.0
    return labels


def siglip_targets_sum(image, text, scale, bias, pos_offset, row_ids=None, col_ids=None, targets=None,
                       hard_negatives=None):
    """sum over the terms of one row block (not normalised), differentiable, fp64: the text columns
    with labels from the ids, then every hard negative column with label -1."""
    m, k = image.shape[0], text.shape[0]
    if row_ids is not None and targets is None:
        targets = "multi"  # SigLIP's default with ids
    labels = _labels(m, k, row_ids, col_ids, pos_offset, targets)
    logits = similarity_reference(image, text, scale, bias)
    # softplus(-z l) = -logsigmoid(z l): torch's softplus returns t itself above its threshold 20,
    # off by up to 2e-9 per term in fp64
    terms = -torch.nn.functional.logsigmoid(labels * logits) * (labels != 0)  # label 0: no term
    total = terms.sum()
    if hard_negatives is not None and hard_negatives.shape[0] > 0:
        total = total - torch.nn.functional.logsigmoid(-similarity_reference(image, hard_negatives, scale, bias)).sum()
    return total


def siglip_targets_loss_reference(image, text, scale, bias=None, sample_ids=None, targets=None, hard_negatives=None):
    """The single-device loss: siglip_targets_sum / M."""
    return siglip_targets_sum(image, text, scale, bias, 0, sample_ids, sample_ids, targets,
                              hard_negatives) / image.shape[0]


def siglip_targets_rank_reference(image, text, scale, bias, sizes, upstream, rank, sample_ids=None, targets=None,
                                  hard_negatives=None, hard_sizes=None):
    """What rank `rank` of a group gets: (loss, d image_r, d text_r, d hard_negatives_r or None, d scale,
    d bias or None), fp64, in one process.

    image, text: the global batch (sum(sizes) x D), rank q's rows from sum(sizes[:q]); sample_ids: the
    global ids (or None); hard_negatives: every rank's hard negatives concatenated (sum(hard_sizes) x D,
    rank q's from sum(hard_sizes[:q])). Rank q's loss: its images against every text and every hard
    negative, divided by sizes[q]. Feature gradients are those of sum_q upstream[q] * L_q (texts and
    hard negatives take part in every rank's loss); scale / bias gradients those of upstream[rank] * L_rank.
    """
    leaf = lambda t: None if t is None else t.detach().double().requires_grad_()  # noqa: E731
    image, text, scale, bias, negatives = (leaf(t) for t in (image, text, scale, bias, hard_negatives))
    offsets = [sum(sizes[:q]) for q in range(len(sizes))]
    losses = []
    for q, (offset, m) in enumerate(zip(offsets, sizes)):
        rows = slice(offset, offset + m)
        row_ids = None if sample_ids is None else sample_ids[rows]
        losses.append(siglip_targets_sum(image[rows], text, scale, bias, offset, row_ids, sample_ids, targets,
                                         negatives) / m)
    features = [image, text] + ([negatives] if negatives is not None else [])
    grads = torch.autograd.grad(sum(g * loss for g, loss in zip(upstream, losses)), features, retain_graph=True,
                                allow_unused=True)
    scalars = [scale] + ([bias] if bias is not None else [])
    d_scalars = torch.autograd.grad(upstream[rank] * losses[rank], scalars)
    local = slice(offsets[rank], offsets[rank] + sizes[rank])
    d_negatives = None
    if negatives is not None:
        begin = sum(hard_sizes[:rank])
        whole = grads[2] if grads[2] is not None else torch.zeros_like(negatives)  # no hard negative anywhere
        d_negatives = whole[begin: begin + hard_sizes[rank]]
    return (losses[rank].detach(), grads[0][local], grads[1][local], d_negatives, d_scalars[0],
            d_scalars[1] if bias is not None else None)
