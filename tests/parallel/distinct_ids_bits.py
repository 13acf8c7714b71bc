"""All sample ids distinct give the bits of the call without ids (docs/targets.md), for every loss
that takes ids (ClipLoss in every mode and (local_loss, gather_with_grad) combination, SigLipLoss in
both modes), both targets, both directions, with and without hard negatives, fp32 and fp64, every
algorithm: the loss and every gradient, compared with torch.equal. `distinct_ids_mismatches` runs on
one rank of a process group (or alone, world_size 1) and returns the cases that differ; `configs`:
the (dtype, algorithm) pairs to run (every pair by default; a group's spawn may take a share)."""
import torch

import clipshard

CLIP_COMBINATIONS = [(True, True), (False, True), (True, False), (False, False)]  # (local_loss, gather_with_grad)


def _data(sizes, negative_sizes, dtype, d=11, seed=5):
    gen = torch.Generator().manual_seed(seed)
    normal = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    total = sum(sizes)
    image = torch.nn.functional.normalize(normal(total, d), dim=1)
    text = torch.nn.functional.normalize(normal(total, d) + 0.5 * image, dim=1)
    negatives = torch.nn.functional.normalize(normal(sum(negative_sizes), d), dim=1)
    ids = torch.randperm(total, generator=gen) * 7 - 20  # distinct, shuffled across ranks
    return image.to(dtype), text.to(dtype), list(negatives.to(dtype).split(list(negative_sizes))), ids


def _grads(call, image, text, negatives, scale, bias, upstream):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (image, text, negatives, scale, bias)]
    loss = call(*leaves)
    (loss * upstream).backward()
    return [loss.detach()] + [None if t is None else t.grad for t in leaves]


def _clip_calls(rank, world_size):
    """(name, module, targets options) of ClipLoss for every mode and combination."""
    for local_loss, gather_with_grad in CLIP_COMBINATIONS:
        modes = ["local"] if local_loss and not gather_with_grad else ["exchange", "local", "ring"]
        for mode in modes:
            for direction in ("both", "image_to_text"):
                module = clipshard.ClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world_size, mode=mode,
                                            direction=direction)
                yield f"ClipLoss({local_loss}, {gather_with_grad}, {mode}, {direction})", module


def _siglip_calls(rank, world_size):
    for mode in ("gather", "ring"):
        yield f"SigLipLoss({mode})", clipshard.SigLipLoss(rank=rank, world_size=world_size, mode=mode)


ALL_CONFIGS = [(dtype, algorithm) for dtype in (torch.float32, torch.float64) for algorithm in ("auto", "torch")]


def distinct_ids_mismatches(rank, world_size, sizes, negative_sizes, configs=ALL_CONFIGS):
    mine = slice(sum(sizes[:rank]), sum(sizes[:rank + 1]))
    upstream = 0.5 / sizes[rank] * (1.0 + 0.25 * rank)
    mismatches = []
    for dtype, algorithm in configs:
        image, text, negatives, ids = _data(sizes, negative_sizes, dtype)
        acc = torch.float64 if dtype == torch.float64 else torch.float32
        scale, bias = torch.tensor(13.0, dtype=acc), torch.tensor(-2.5, dtype=acc)
        calls = [(name, module, None) for name, module in _clip_calls(rank, world_size)]
        calls += [(name, module, bias) for name, module in _siglip_calls(rank, world_size)]
        for name, module, logit_bias in calls:
            module.algorithm = algorithm
            for with_negatives in (False, True):
                negs = negatives[rank] if with_negatives else None
                without = _grads(lambda i, t, h, s, b: module(i, t, s, b, hard_negatives=h), image[mine],
                                 text[mine], negs, scale, logit_bias, upstream)
                for targets in ("mask", "multi"):
                    got = _grads(lambda i, t, h, s, b: module(i, t, s, b, hard_negatives=h, sample_ids=ids[mine],
                                                              targets=targets),
                                 image[mine], text[mine], negs, scale, logit_bias, upstream)
                    for what, g, w in zip(("loss", "d image", "d text", "d negatives", "d scale", "d bias"),
                                          got, without):
                        if (g is None) != (w is None) or (g is not None and not torch.equal(g, w)):
                            mismatches.append(f"rank {rank}/{world_size} {dtype} {algorithm} {name} {targets} "
                                              f"negatives={with_negatives}: {what}")
    return mismatches
