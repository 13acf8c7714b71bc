"""query_to_doc of the sentence-transformers ranking loss over every rank's document columns, with
a backward that recomputes instead of keeping copies (the default options' path of ranking_loss).

Rank q's columns are its pieces (positives, then each hard-negative column: 1 + H pieces of
B_q x D), stacked rank by rank: the stacked gather's order, row i's positive at stacked index
(1 + H) * offset + i. Piece (q, k) travels by one broadcast from rank q.

Forward (no autograd graph inside): normalise (cosine) the local rows and, directly into their
slice of the gathered buffer, the local columns; broadcast the pieces; one contrastive_lse call for
the row LSEs and the positive logits. Saved: the raw inputs (the caller's tensors), their norms,
the row LSEs; not the normalised or the gathered copies.

Backward, piece by piece in the same order: re-normalise and broadcast piece (q, k) again (the
forward's communication), the op's backward on (rows, piece) with the FULL row LSEs (positives only
in this rank's own first piece), accumulate d rows, and reduce the piece's d columns to rank q, so
that one piece, its gradient and the rows are alive besides the gradients returned. Then the
cosine backward by hand on the raw inputs: for y = x / max(||x||, eps), with g = dL/dy,
dx = (g - y <y, g>) / ||x|| where ||x|| >= eps, else g / eps (F.normalize's rule).

A small block keeps its softmax instead: when the B x K fp32 / fp64 similarities take at most
KEEP_SOFTMAX_BYTES (32 MiB, the CPU op's default workspace; e.g. B = 1024 against K = 8192
columns), the forward forms them with one GEMM, saves P = softmax(S) and the backward's
dS = g_row P + g_pos [own positive] needs two GEMMs per piece instead of the op's recomputation
(three): the library's three GEMMs in all. Measured (2 ranks on a 2-core CPU, D = 768, steady
state, the library's MNRL = 1): B = 1024 against 8192 columns 0.65x-0.76x kept (63 MiB) against 0.98x
recomputed (30.5 MiB). With cosine similarity the normalised copies (the gathered buffer, the rows)
are fp32 for 16-bit embeddings, as the library's cos_sim computes, and follow the same budget; 16-bit
embeddings with dot products stay 16-bit (the op accumulates their exact products in fp32) and
recompute. The scale is an input tensor: a learnable one gets its gradient, sum(dS * C) over the
pieces (C the unscaled similarities, dS the logits' gradient before the scale).
"""
import torch
import torch.distributed as dist

from clipshard.ops.contrastive_lse import contrastive_lse, contrastive_lse_backward
from clipshard.ops.inputs import accumulate_dtype
from clipshard.ops.no_autocast import without_autocast

_EPS = 1e-12  # F.normalize's default
KEEP_SOFTMAX_BYTES = 32 << 20  # the largest block of similarities kept for the backward (module docstring)


def _denominator(x, dtype):
    """max(||x_i||, eps) per row, as F.normalize (a column vector), computed in `dtype`."""
    return torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=dtype).clamp_min_(_EPS)


def _normalised(x, denom, out=None):
    return x if denom is None else torch.div(x, denom, out=out)


def _cosine_backward_(grad, x, denom):
    """dL/dx from grad = dL/d(x / denom), in place in `grad` (module docstring)."""
    if denom is None:
        return grad
    x = x.to(grad.dtype)  # 16-bit queries: their gradient accumulates in fp32
    dot = torch.bmm(x.unsqueeze(1), grad.unsqueeze(2)).view(-1, 1)  # <x, g> per row, no B x D temporary
    # dx = (g - x <x, g> / ||x||^2) / ||x||; the clamped norm (below eps) passes no gradient
    coef = torch.where(denom > _EPS, dot / (denom * denom), torch.zeros_like(dot))
    return grad.addcmul_(x, coef, value=-1).div_(denom)


def _pieces(layout, count):
    """(rank q, piece k, first stacked row, rows) of every piece, in the order every rank visits them."""
    start = 0
    for q, size in enumerate(layout.sizes):
        for k in range(count):
            yield q, k, start, size
            start += size


class _QueryToDocLSE(torch.autograd.Function):
    """(row LSE, positive logit) of the local queries over every rank's stacked document columns."""

    @staticmethod
    def forward(ctx, cosine, layout, keep_budget, scale, queries, *docs):
        ctx.layout, ctx.count, ctx.keep_budget = layout, len(docs), keep_budget
        # cosine: the normalised copies in fp32 (fp64) whatever the embeddings' dtype (module docstring)
        ctx.work_dtype = accumulate_dtype(queries.dtype) if cosine else queries.dtype
        q_denom = _denominator(queries, ctx.work_dtype) if cosine else None
        d_denoms = [_denominator(d, ctx.work_dtype) if cosine else None for d in docs]
        gathered = queries.new_empty(layout.total * len(docs), queries.shape[1], dtype=ctx.work_dtype)
        for q, k, start, size in _pieces(layout, len(docs)):
            piece = gathered[start: start + size]
            if q == layout.rank and cosine:
                _normalised(docs[k], d_denoms[k], out=piece)
            elif q == layout.rank:
                piece.copy_(docs[k])
            if layout.world_size > 1:
                dist.broadcast(piece, group=layout.group, group_src=q)
        rows = _normalised(queries, q_denom)
        first_positive = layout.offset * len(docs)
        if keeps_softmax(rows, gathered.shape[0], ctx.keep_budget):
            logits = torch.mm(rows, gathered.T).mul_(scale)
            pos = logits.diagonal(first_positive).clone()
            # the softmax in place (logsumexp would allocate a second B x K block)
            peak = logits.amax(1, keepdim=True)
            softmax = logits.sub_(peak).exp_()
            total = softmax.sum(1, keepdim=True)
            softmax.div_(total)
            row_lse = total.log_().add_(peak).squeeze(1)
        else:
            row_lse, pos, _ = contrastive_lse(rows, gathered, scale, None, first_positive, False)
            softmax = None
        ctx.save_for_backward(scale, queries, row_lse, q_denom, softmax, *docs, *d_denoms)
        return row_lse, pos

    @staticmethod
    def backward(ctx, g_row, g_pos):
        with without_autocast(ctx.saved_tensors[1].device):  # also when backward runs inside autocast
            return _QueryToDocLSE._backward(ctx, g_row, g_pos)

    @staticmethod
    def _backward(ctx, g_row, g_pos):
        layout, count = ctx.layout, ctx.count
        scale, queries, row_lse, q_denom, softmax, *rest = ctx.saved_tensors
        docs, d_denoms = rest[:count], rest[count:]
        g_row = torch.zeros_like(row_lse) if g_row is None else g_row.contiguous()
        g_pos = torch.zeros_like(row_lse) if g_pos is None else g_pos.contiguous()
        rows = _normalised(queries, q_denom)
        grad_dtype = torch.promote_types(queries.dtype, torch.float32)  # fp32 accumulation for 16-bit
        d_rows, d_docs, d_scale = None, [None] * count, torch.zeros_like(scale)
        for q, k, start, size in _pieces(layout, count):
            own = q == layout.rank
            if own:
                piece = _normalised(docs[k], d_denoms[k]).contiguous()
            else:
                piece = queries.new_empty(size, queries.shape[1], dtype=ctx.work_dtype)
            if layout.world_size > 1:
                dist.broadcast(piece, group=layout.group, group_src=q)
            # row i's positive is column i of this rank's own first piece; no positives elsewhere
            if softmax is None:
                dr, dc, ds, _ = contrastive_lse_backward(g_row, g_pos, None, rows, piece, scale, None,
                                                         0 if own and k == 0 else None, row_lse, None)
            else:
                dr, dc, ds = _kept_softmax_backward(softmax[:, start: start + size], g_row, g_pos, own and k == 0,
                                                    rows, piece, scale)
            d_rows = dr.to(grad_dtype) if d_rows is None else d_rows.add_(dr)
            d_scale += ds
            del piece, dr
            if layout.world_size > 1:
                dist.reduce(dc, group=layout.group, group_dst=q)
            if own:
                d_docs[k] = _cosine_backward_(dc, docs[k], d_denoms[k])
            del dc  # not alive during the next piece's work
        d_queries = _cosine_backward_(d_rows, queries, q_denom).to(queries.dtype)
        need = ctx.needs_input_grad
        return (None, None, None, d_scale if need[3] else None, d_queries if need[4] else None,
                *(d if n else None for d, n in zip(d_docs, need[5:])))


def keeps_softmax(rows, columns, budget=None):
    """Whether the B x `columns` similarities of these rows are small enough to keep (module docstring):
    fp32 / fp64 rows, B x columns elements within `budget` bytes (None: KEEP_SOFTMAX_BYTES)."""
    if rows.dtype not in (torch.float32, torch.float64):
        return False
    budget = KEEP_SOFTMAX_BYTES if budget is None else budget
    return rows.shape[0] * columns * rows.element_size() <= budget


def _kept_softmax_backward(softmax, g_row, g_pos, with_positives, rows, piece, scale):
    """(d rows, d piece, d scale) of one piece from its saved softmax P (B x piece rows): with
    dS = g_row P + g_pos at the positives (column i of the own first piece) and C = rows piece^T,
    d rows = scale dS piece, d piece = scale dS^T rows, d scale = sum(dS * C) = sum_i <dS piece, rows>_i."""
    d_logits = softmax * g_row[:, None]
    if with_positives:
        d_logits.diagonal().add_(g_pos)
    d_rows = d_logits @ piece
    d_scale = torch.linalg.vecdot(d_rows, rows).sum()
    return d_rows.mul_(scale), (d_logits.T @ rows).mul_(scale), d_scale


def query_to_doc_lse(queries, docs, scale, cosine, layout, keep_budget=None):
    """(row LSE [B], positive logit [B]) of query_to_doc: the local queries (B x D) against every
    rank's documents (docs: the local 1 + H columns, B x D each), cosine or dot-product similarity
    times `scale` (a number, or a one-element tensor that gets its gradient), the gathered batch as
    `layout` says (module docstring). keep_budget: the bytes of similarities small enough to keep
    (None: KEEP_SOFTMAX_BYTES; 0: always recompute). Autocast does not apply: the forward and the
    backward compute in the embeddings' dtype, or fp32 (accumulation, normalised copies) for 16-bit."""
    with without_autocast(queries.device):
        return _QueryToDocLSE.apply(bool(cosine), layout, keep_budget, logit_scale(scale, queries), queries, *docs)


def logit_scale(scale, like):
    """`scale` (the library's: a number, or a one-element tensor such as a learnable temperature) as
    the 0-dim fp32 (fp64) tensor on `like`'s device that the op takes; a tensor keeps its autograd
    graph, so that it gets the library's gradient."""
    dtype = accumulate_dtype(like.dtype)
    if not torch.is_tensor(scale):
        return torch.tensor(float(scale), dtype=dtype, device=like.device)
    if scale.numel() != 1:
        raise ValueError(f"the loss's scale must be a number or a one-element tensor, got shape {tuple(scale.shape)}")
    return scale.to(device=like.device, dtype=dtype).reshape(())

