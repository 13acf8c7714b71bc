"""References of one block with sample ids, targets "mask" / "multi" and extra columns (hard
negatives), written from the formulas of docs/targets.md: the logits materialised in fp64 and
boolean masks, differentiable through autograd."""
import torch

from tests.references.similarity import similarity_reference


def _same_ids(row_ids, col_ids):
    return row_ids[:, None] == col_ids[None, :]


def _own(m, k, pos_offset, device):
    """M x K bool: the own pairs j == pos_offset + i (none for pos_offset None)."""
    own = torch.zeros(m, k, dtype=torch.bool, device=device)
    if pos_offset is not None:
        index = torch.arange(m, device=device)
        own[index, pos_offset + index] = True
    return own


def _mean_where(logits, positives, dim):
    """Mean of logits over `positives` along dim, NaN where there is none."""
    count = positives.sum(dim)
    total = torch.where(positives, logits, torch.zeros_like(logits)).sum(dim)
    return torch.where(count > 0, total / count.clamp(min=1), torch.full_like(total, float("nan")))


def contrastive_block_terms(rows, cols, scale, bias=None, pos_offset=0, row_ids=None, col_ids=None, targets=None,
                            extra_cols=None):
    """(row_lse [M], row_pos [M], col_lse [K], col_pos [K]) of the block rows x cols (+ extra_cols), fp64.

    targets None: every pair in both LSEs, row_pos / col_pos the own pair's logit (NaN without
    pos_offset, and for columns that are no row's own). "mask": the same-id pairs other than the own
    pair leave both LSEs; positives as for None. "multi": every pair in the LSEs; row_pos[i] the mean
    logit of the columns with id row_ids[i], col_pos[j] that of the rows with id col_ids[j] (NaN
    when none). extra_cols join the row LSEs only."""
    logits = similarity_reference(rows, cols, scale, bias)
    m, k = logits.shape
    own = _own(m, k, pos_offset, logits.device)
    if targets == "multi":
        positives = _same_ids(row_ids, col_ids)
        lse_logits = logits
    else:
        positives = own
        excluded = _same_ids(row_ids, col_ids) & ~own if targets == "mask" else torch.zeros_like(own)
        lse_logits = logits.masked_fill(excluded, float("-inf"))
    row_logits = lse_logits
    if extra_cols is not None:
        row_logits = torch.cat([lse_logits, similarity_reference(rows, extra_cols, scale, bias)], dim=1)
    return (torch.logsumexp(row_logits, dim=1), _mean_where(logits, positives, 1), torch.logsumexp(lse_logits, dim=0),
            _mean_where(logits, positives, 0))


def siglip_block_sum(rows, cols, scale, bias=None, pos_offset=0, row_ids=None, col_ids=None, targets=None,
                     extra_cols=None):
    """sum over the pairs with a term of softplus(-z * l), fp64: z = +1 for the own pair and, with ids,
    for the same-id pairs ("multi", the default with ids) or no term there ("mask"); z = -1 for every
    other pair and every extra column."""
    logits = similarity_reference(rows, cols, scale, bias)
    m, k = logits.shape
    own = _own(m, k, pos_offset, logits.device)
    labels = torch.where(own, 1.0, -1.0).double()
    if row_ids is not None:
        other_same = _same_ids(row_ids, col_ids) & ~own
        labels = labels.masked_fill(other_same, 0.0 if targets == "mask" else 1.0)
    terms = -torch.nn.functional.logsigmoid(labels * logits)
    total = torch.where(labels != 0, terms, torch.zeros_like(terms)).sum()
    if extra_cols is not None:
        total = total - torch.nn.functional.logsigmoid(-similarity_reference(rows, extra_cols, scale, bias)).sum()
    return total
