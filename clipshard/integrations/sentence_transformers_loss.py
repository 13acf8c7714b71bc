"""The loss of sentence-transformers' MultipleNegativesRankingLoss family on given embeddings, with
clipshard's fused op: no similarity matrix is ever formed. It does not import sentence-transformers.

Rank r holds B_r rows (anchor i, positive i, hard negatives i_1..i_H); with gathering, the global
batch has W = sum_q B_q rows and rank r's rows start at global row o. With S = scale * sim
(sim: cosine or dot product), each local row i has, per direction, a row log-sum-exp:

    query_to_doc    q_i against every document (positives, then each hard-negative column), positive d_i
    doc_to_query    d_i against every query
    query_to_query  q_i against every query but itself
    doc_to_doc      d_i against every document but those of its own row (its positive and negatives)

joint: log Z_i = log-add-exp of the directions' LSEs (one softmax over the concatenated blocks, exactly);
per_direction: log Z_i = their mean. The loss is mean_i (log Z_i - S(q_i, d_i)), the library's.

The self / own-row exclusions are the op's id masks with no positive (pos_offset=None): each row its
own id (the global row index), or the sample ids when given ("same-id samples are one sample" in the
same-type blocks). Sample ids (targets "mask" / "multi", docs/targets.md) change query_to_doc and
doc_to_query: "mask" drops the other same-id pairs from the denominators, "multi" counts them as
positives, the positive score being the mean over the same-id pairs of both blocks. Hard negatives
are never masked in query_to_doc.

Unequal batches with gathering: rank r's loss is w_r * mean_i, w_r = N * B_r / W (1 for equal ones),
so that the ranks' mean and the gradient after DDP's average are those of the global-batch mean.
docs/sentence_transformers.md.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clipshard.integrations.sentence_transformers_columns import logit_scale, query_to_doc_lse
from clipshard.ops.contrastive_lse import contrastive_lse
from clipshard.ops.no_autocast import without_autocast
from clipshard.parallel.collectives import gather_rows
from clipshard.parallel.layout import ShardLayout

DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
TARGETS = (None, "mask", "multi")


@dataclass(frozen=True)
class RankingOptions:
    """The fused loss's options: scale (the library's: a positive number, or a one-element tensor
    such as a learnable temperature, which gets its gradient), cosine (cos_sim, else
    dot_score), directions (a subset of DIRECTIONS with query_to_doc), partition_mode, targets of
    the sample ids (None without ids)."""

    scale: object
    cosine: bool
    directions: tuple
    partition_mode: str
    targets: str = None


def _normalised(x, dtype):
    return F.normalize(x.to(dtype), p=2, dim=-1)


def _self_ids(ids, ids_all, layout, device):
    """Ids for the self / own-row masks: the sample ids, else the global row indices."""
    if ids is not None:
        return ids, ids_all
    return (torch.arange(layout.offset, layout.offset + layout.local_size, device=device),
            torch.arange(layout.total, device=device))


def ranking_loss(queries, docs, options, layout, ids=None):
    """This rank's loss (module docstring). queries: B x D, docs: list of (1 + H) B x D tensors
    (positives, then hard-negative columns), one dtype and device, dense; layout: the ShardLayout of
    the gathered batch (single_process_layout(B) without gathering); ids: B int64 sample ids on the
    embeddings' device, or None (then options.targets is None). With query_to_doc alone and no ids
    (the default options) the normalised and gathered columns are recomputed in the backward
    instead of kept, and a small block (up to 32 MiB of similarities) keeps its softmax
    (sentence_transformers_columns); the other options take the path below. Autocast does not
    apply: the loss computes in the embeddings' dtype, fp32 for 16-bit ones (accumulation and the
    normalised copies), so that it is never less accurate than the library's."""
    with without_autocast(queries.device):
        return _ranking_loss(queries, docs, options, layout, ids)


def _ranking_loss(queries, docs, options, layout, ids):
    directions = set(options.directions)
    if ids is None and directions == {"query_to_doc"}:  # the default options: normalised and gathered
        # copies only inside the op's forward and backward (sentence_transformers_columns)
        lse, pos = query_to_doc_lse(queries, docs, options.scale, options.cosine, layout)
        return _weighted((lse - pos).mean(), layout)
    scale = logit_scale(options.scale, queries)
    if options.cosine:  # once per embedding, in fp32 for 16-bit ones (as the library's cos_sim)
        queries, docs = _normalised(queries, scale.dtype), [_normalised(d, scale.dtype) for d in docs]
    gathered_docs = None if ids is None and "doc_to_doc" not in directions else [gather_rows(d, layout) for d in docs]
    all_queries = gather_rows(queries, layout) if directions & {"query_to_query", "doc_to_query"} else None
    ids_all = None if ids is None else gather_rows(ids, layout, with_grad=False)
    offset, targets = layout.offset, options.targets
    with_ids = dict(row_ids=ids, col_ids=ids_all, targets=targets) if ids is not None else {}

    lses, positives = [], []
    if gathered_docs is None:  # one gather of this rank's columns stacked, one call over them (the
        # columns' order does not change a log-sum-exp; row i's positive is the stack's row i)
        stacked = ShardLayout(tuple(n * len(docs) for n in layout.sizes), layout.rank, layout.group)
        lse, pos, _ = contrastive_lse(queries, gather_rows(torch.cat(docs), stacked), scale, None,
                                      offset * len(docs), False)
    elif ids is None:  # one call over every document column; the positives sit in the first block
        lse, pos, _ = contrastive_lse(queries, torch.cat(gathered_docs), scale, None, offset, False)
    else:
        negatives = torch.cat(gathered_docs[1:]) if len(docs) > 1 else None
        lse, pos, _ = contrastive_lse(queries, gathered_docs[0], scale, None, offset, False, extra_cols=negatives,
                                      **with_ids)
    lses.append(lse)
    positives.append(pos)
    if "doc_to_query" in directions:
        lse, pos, _ = contrastive_lse(docs[0], all_queries, scale, None, offset, False, **with_ids)
        lses.append(lse)
        positives.append(pos)
    if directions & {"query_to_query", "doc_to_doc"}:
        own, own_all = _self_ids(ids, ids_all, layout, queries.device)
        if "query_to_query" in directions:
            lses.append(contrastive_lse(queries, all_queries, scale, None, None, False, row_ids=own,
                                        col_ids=own_all, targets="mask")[0])
        if "doc_to_doc" in directions:
            lses.append(contrastive_lse(docs[0], torch.cat(gathered_docs), scale, None, None, False, row_ids=own,
                                        col_ids=own_all.repeat(len(docs)), targets="mask")[0])

    if options.partition_mode == "joint":
        log_z = lses[0]
        for lse in lses[1:]:
            log_z = torch.logaddexp(log_z, lse)
    else:
        log_z = sum(lses[1:], lses[0]) / len(lses)
    # the positive score: query_to_doc's (S(d_i, q_i) is the same number); with "multi" the mean
    # over the same-id pairs of both blocks that hold positives
    positive = positives[0] if targets != "multi" else sum(positives[1:], positives[0]) / len(positives)
    return _weighted((log_z - positive).mean(), layout)


def _weighted(loss, layout):
    """w_r x this rank's mean (module docstring: unequal batches)."""
    if layout.world_size > 1 and min(layout.sizes) != max(layout.sizes):
        loss = loss * (layout.world_size * layout.local_size / layout.total)
    return loss
