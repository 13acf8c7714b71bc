"""The loss cases of the sentence-transformers tests, run on one rank of a group (or alone): every
fused option combination against the library's own computation (equal batches, and unequal ones
without gathering, where the library defines a value) and against the fp64 reference (unequal
batches with gathering, sample ids), in fp64 and fp32, as the worst relative differences."""
import itertools

import torch
import torch.distributed as dist

import clipshard
from tests.integrations.sentence_transformers.reference import per_row_losses

DIRECTION_SETS = (("query_to_doc",), ("query_to_doc", "doc_to_query"), ("query_to_doc", "query_to_query"),
                  ("query_to_doc", "doc_to_doc"), ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"))
NEGATIVES = (0, 3)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5}
D = 6
SCALES = {"cos_sim": 20.0, "dot_score": 1.0}  # the library's advice: scale 1 with dot_score


def combinations():
    """(directions, partition_mode) pairs the library accepts."""
    for directions, mode in itertools.product(DIRECTION_SETS, ("joint", "per_direction")):
        if mode == "joint" or not set(directions) & {"query_to_query", "doc_to_doc"}:
            yield directions, mode


def cases():
    """(negatives, similarity name, (directions, partition_mode), cached): every combination with
    cos_sim and MultipleNegativesRankingLoss, with and without hard negatives; dot_score and the
    cached loss (whose options are the same, delegated) on the plainest and the fullest ones."""
    plain, full = (DIRECTION_SETS[0], "joint"), (DIRECTION_SETS[-1], "joint")
    yield from ((h, "cos_sim", c, False) for c in combinations() for h in NEGATIVES)
    yield from ((3, "dot_score", c, cached) for c in (plain, full) for cached in (False, True))
    yield from ((3, "cos_sim", c, True) for c in (plain, full))
    yield 0, "cos_sim", (DIRECTION_SETS[1], "per_direction"), True


def _model():
    return torch.nn.Sequential(torch.nn.Identity())


def make_loss(cached, directions, mode, similarity, gather, mini_batch_size=2):
    from sentence_transformers.sentence_transformer import losses

    kwargs = dict(scale=SCALES[similarity.__name__], similarity_fct=similarity, gather_across_devices=gather, directions=directions,
                  partition_mode=mode)
    if cached:
        return losses.CachedMultipleNegativesRankingLoss(_model(), mini_batch_size=mini_batch_size, **kwargs)
    return losses.MultipleNegativesRankingLoss(_model(), **kwargs)


def global_batch(sizes, negatives, dtype, seed):
    """(2 + negatives) W x D embedding columns (near-duplicate rows, so that the losses are not trivial)
    and W ids with repeats."""
    g = torch.Generator().manual_seed(seed)
    width = sum(sizes)
    base = torch.randn(width, D, generator=g, dtype=torch.float64)
    columns = [base + 0.7 * torch.randn(width, D, generator=g, dtype=torch.float64) for _ in range(2 + negatives)]
    ids = torch.randint(0, max(2, width // 2), (width,), generator=g)
    return [c.to(dtype) for c in columns], ids


def loss_and_grads(loss, local, labels, cached):
    """The loss and the gradients of the embedding columns (fresh leaves) for one call."""
    leaves = [c.detach().clone().requires_grad_() for c in local]
    if cached:
        reps = [[x.detach().requires_grad_() for x in leaf.split(2)] for leaf in leaves]
        value = loss.calculate_loss(reps, labels, with_backward=True)
        return value.detach().double(), [torch.cat([r.grad for r in col]).double() for col in reps]
    value = loss.compute_loss_from_embeddings(leaves, labels)
    value.backward()
    return value.detach().double(), [leaf.grad.double() for leaf in leaves]


def _relative(a, b):
    # relative to the largest reference value or 1, whichever is larger: a rank whose only row sees
    # its positive alone (B_r = 1) has gradients 0 in exact arithmetic, and both implementations
    # leave the rounding noise of logits of size `scale` there
    scale = b.abs().max().clamp_min(1.0)
    return ((a - b).abs().max() / scale).item()


def worst_differences(rank, world_size, sizes_list, with_ids):
    """{(case, dtype): worst relative difference over every combination} on this rank."""
    from sentence_transformers import util

    worst = {}
    distributed = dist.is_available() and dist.is_initialized()

    def record(key, value):
        worst[key] = max(worst.get(key, 0.0), value)

    for sizes, dtype, (negatives, similarity, (directions, mode), cached) in itertools.product(
            sizes_list, TOLERANCE, list(cases())):
        similarity = getattr(util, similarity)
        equal = len(set(sizes)) == 1
        columns, ids = global_batch(sizes, negatives, dtype, seed=sum(sizes) * 7 + negatives)
        offset = sum(sizes[:rank])
        local = [c[offset: offset + sizes[rank]] for c in columns]
        name = f"{'cached' if cached else 'mnrl'}"
        for gather in (True, False) if distributed else (False,):
            if gather and not equal or with_ids:
                continue
            library = loss_and_grads(make_loss(cached, directions, mode, similarity, gather), local, None, cached)
            patch = clipshard.apply_to_sentence_transformers()
            try:
                fused = loss_and_grads(make_loss(cached, directions, mode, similarity, gather), local, None, cached)
            finally:
                patch.undo()
            key = (f"{name} vs library, {'gather' if gather else 'local'}", str(dtype))
            record(key, max([_relative(fused[0], library[0])] + [_relative(a, b) for a, b in zip(fused[1], library[1])]))
        targets_list = ("mask", "multi") if with_ids else (None,)
        if not with_ids and (equal or not distributed):
            continue
        for targets in targets_list:  # gathered: the fp64 reference of the global batch
            patch = clipshard.apply_to_sentence_transformers(labels_as_ids=targets)
            try:
                labels = ids[offset: offset + sizes[rank]] if targets else None
                fused = loss_and_grads(make_loss(cached, directions, mode, similarity, True), local, labels, cached)
            finally:
                patch.undo()
            reference = _reference(columns, ids if targets else None, targets, similarity is util.cos_sim, directions,
                                   mode)
            mean = fused[0].clone()
            if distributed:
                dist.all_reduce(mean)
                mean /= world_size
            # DDP averages the parameters' gradients: the embeddings' gradient / N is the global mean's
            grads = [g / world_size for g in fused[1]]
            ref_grads = [g[offset: offset + sizes[rank]] for g in reference[1]]
            key = (f"{name} vs fp64 reference, gather{', ids ' + targets if targets else ', unequal'}", str(dtype))
            record(key, max([_relative(mean, reference[0])] + [_relative(a, b) for a, b in zip(grads, ref_grads)]))
    return worst


def _reference(columns, ids, targets, cosine, directions, mode):
    leaves = [c.detach().double().requires_grad_() for c in columns]
    value = per_row_losses(leaves[0], leaves[1:], scale=SCALES["cos_sim" if cosine else "dot_score"], cosine=cosine, directions=directions,
                           partition_mode=mode, ids=ids, targets=targets).mean()
    value.backward()
    return value.detach(), [leaf.grad for leaf in leaves]
