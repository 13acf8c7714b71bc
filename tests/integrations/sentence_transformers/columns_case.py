"""sentence_transformers_columns' query_to_doc_lse (both of its paths: the backward that recomputes,
with no bytes to keep, and the one from the kept softmax) against plain autograd through F.normalize,
the stacked gather and contrastive_lse, in fp64 on one rank of a group (unequal local batches, 0 and 2
hard-negative columns, cosine and dot product, one row of tiny norm), as the worst relative difference
of the outputs and of the gradients."""
import functools

import torch
import torch.nn.functional as F

from clipshard.integrations.sentence_transformers_columns import keeps_softmax, query_to_doc_lse
from clipshard.ops.contrastive_lse import contrastive_lse
from clipshard.parallel.collectives import gather_rows
from clipshard.parallel.layout import ShardLayout

D = 7


def _reference(queries, docs, scale, cosine, layout):
    if cosine:
        queries, docs = F.normalize(queries, dim=-1), [F.normalize(d, dim=-1) for d in docs]
    stacked = ShardLayout(tuple(n * len(docs) for n in layout.sizes), layout.rank, layout.group)
    gathered = gather_rows(torch.cat(docs), stacked)
    lse, pos, _ = contrastive_lse(queries, gathered, scale, None, layout.offset * len(docs), False)
    return lse, pos


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def worst_difference(layout):
    """The worst relative difference over the cases, on this rank (layout: the group's, unequal sizes)."""
    worst = 0.0
    for negatives in (0, 2):
        for cosine in (True, False):
            g = torch.Generator().manual_seed(100 * layout.rank + 10 * negatives + cosine)
            batch = layout.local_size
            queries = torch.randn(batch, D, generator=g, dtype=torch.float64)
            docs = [queries + 0.8 * torch.randn(batch, D, generator=g, dtype=torch.float64)
                    for _ in range(1 + negatives)]
            queries[0] *= 1e-3  # a short embedding: the cosine backward divides by its norm
            # realistic upstream gradients: those of a mean over the local rows, perturbed
            g_row = (0.5 + torch.rand(batch, generator=g, dtype=torch.float64)) / batch
            g_pos = -(0.5 + torch.rand(batch, generator=g, dtype=torch.float64)) / batch
            scale = 20.0 if cosine else 1.0
            assert keeps_softmax(queries, layout.total * len(docs))  # the default budget keeps at these sizes
            results = []
            recomputing, keeping = (functools.partial(query_to_doc_lse, keep_budget=b) for b in (0, None))
            for fn in (_reference, recomputing, keeping):
                leaves = [x.clone().requires_grad_() for x in [queries] + docs]
                lse, pos = fn(leaves[0], leaves[1:], scale, cosine, layout)
                ((lse * g_row).sum() + (pos * g_pos).sum()).backward()
                results.append([lse.detach(), pos.detach()] + [leaf.grad for leaf in leaves])
            for got in results[1:]:
                worst = max([worst] + [_relative(a, b) for a, b in zip(got, results[0])])
    return worst
