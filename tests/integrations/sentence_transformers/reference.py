"""fp64 reference of the sentence-transformers ranking losses as clipshard defines them
(docs/sentence_transformers.md), written from the definitions with dense matrices: the whole
global batch in one process, per-row terms, sample ids ("mask" / "multi") and unequal batches
(the global mean). Independent of both the library's code and clipshard's."""
import torch


def _kept_lse(scores, keep):
    return torch.logsumexp(scores.masked_fill(~keep, -torch.inf), dim=1)


def per_row_losses(queries, docs, *, scale, cosine, directions, partition_mode, ids=None, targets=None):
    """The loss term of every global row: queries W x D, docs list of (1 + H) W x D; ids: W int64."""
    queries, docs = queries.double(), [d.double() for d in docs]
    if cosine:
        queries, docs = (torch.nn.functional.normalize(queries, dim=1),
                         [torch.nn.functional.normalize(d, dim=1) for d in docs])
    width = queries.shape[0]
    same = (ids[:, None] == ids[None, :]) if ids is not None else torch.eye(width, dtype=torch.bool)
    own = torch.eye(width, dtype=torch.bool)
    all_docs = torch.cat(docs)
    blocks, positive_sums, positive_counts = [], 0, 0
    # query -> documents: the positive block (same-id pairs masked or counted), then the negatives
    s = scale * queries @ all_docs.T
    keep = torch.ones_like(s, dtype=torch.bool)
    if targets == "mask":
        keep[:, :width] = ~same | own
    pos = own if targets != "multi" else same
    blocks.append((s, keep))
    positive_sums = (s[:, :width] * pos).sum(1)
    positive_counts = pos.sum(1).double()
    if "doc_to_query" in directions:
        s = scale * docs[0] @ queries.T
        keep = (~same | own) if targets == "mask" else torch.ones_like(s, dtype=torch.bool)
        blocks.append((s, keep))
        if targets == "multi":
            positive_sums = positive_sums + (s * same).sum(1)
            positive_counts = positive_counts + same.sum(1)
    if "query_to_query" in directions:
        blocks.append((scale * queries @ queries.T, ~same))
    if "doc_to_doc" in directions:
        blocks.append((scale * docs[0] @ all_docs.T, ~same.repeat(1, len(docs))))
    if partition_mode == "joint":
        log_z = _kept_lse(torch.cat([s for s, _ in blocks], 1), torch.cat([k for _, k in blocks], 1))
    else:
        log_z = torch.stack([_kept_lse(s, k) for s, k in blocks]).mean(0)
    return log_z - positive_sums / positive_counts
