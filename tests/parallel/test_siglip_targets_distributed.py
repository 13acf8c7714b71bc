"""SigLipLoss / siglip_loss with sample ids and hard negatives over real gloo groups, against the fp64
global-batch reference (tests/references/siglip_targets.py): every dist_impl, both modes ("gather"
and "ring"), the compiled op and the torch path, unequal batches, unequal hard-negative counts (a rank
with none), ids shared across ranks; bad input on one rank and ranks that disagree raise on every
rank, without a hang.

One 4-rank group runs the world group (N = 4) and its subgroups {0, 1, 2} (N = 3) and {0, 1} (N = 2).
"""
import pytest
import torch
import torch.distributed as dist

import clipshard
from tests.comparisons import GRADIENT_NAMES, max_relative_error
from tests.dist_utils import report_worst, run_group
from tests.parallel.test_ring import _no_batch_gathers
from tests.references.siglip_targets import siglip_targets_rank_reference

DIST_IMPLS = [None, "bidir", "shift", "reduce", "gather"]
# Relative to the largest reference value (of the rounded inputs). bf16: the gradient GEMMs take the logit
# gradients rounded to bf16, and the results are rounded again (test_siglip_distributed.py's 3e-2; seen: 7e-3)
TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 3e-2}


def _global(sizes, hard_sizes, dim, seed, id_range):
    """The global batch, its ids (repeats within and across ranks) and every rank's hard negatives."""
    gen = torch.Generator().manual_seed(seed)

    def unit(n):
        return torch.nn.functional.normalize(torch.randn(n, dim, generator=gen, dtype=torch.float64), dim=1)

    total = sum(sizes)
    image = unit(total)
    text = torch.nn.functional.normalize(unit(total) + 0.5 * image, dim=1)
    h = sum(hard_sizes or ())
    negatives = torch.nn.functional.normalize(unit(h) + 0.3 * image[torch.arange(h) % total], dim=1)
    ids = torch.randint(0, id_range, (total,), generator=gen)
    return image, text, negatives, ids


def _local(tensor, sizes, rank):
    begin = sum(sizes[:rank])
    return tensor[begin: begin + sizes[rank]]


def _run(loss_fn, image, text, negatives, scale, bias, upstream, **kwargs):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (image, text, negatives, scale, bias)]
    loss = loss_fn(leaves[0], leaves[1], leaves[3], leaves[4], hard_negatives=leaves[2], **kwargs)
    (loss * upstream).backward()
    return [loss.detach()] + [None if t is None else t.grad for t in leaves]


def _compare(rank, group, sizes, hard_sizes, dtype, seed, targets, with_ids, bias_value, worst, equal_upstream=False):
    """Every dist_impl, both modes and both algorithms against the reference on one global batch."""
    world_size = len(sizes)
    image64, text64, negatives64, ids = _global(sizes, hard_sizes, 9, seed, id_range=max(2, sum(sizes) // 3))
    ids = ids if with_ids else None
    image, text = _local(image64, sizes, rank).to(dtype), _local(text64, sizes, rank).to(dtype)
    negatives = None if hard_sizes is None else _local(negatives64, hard_sizes, rank).to(dtype)
    local_ids = None if ids is None else _local(ids, sizes, rank)
    scale = torch.tensor(10.0, dtype=dtype)
    bias = None if bias_value is None else torch.tensor(bias_value, dtype=dtype)
    upstream = [0.37] * world_size if equal_upstream else [0.5 / m * (1.0 + 0.75 * q) for q, m in enumerate(sizes)]
    kwargs = {} if ids is None else {"sample_ids": local_ids, "targets": targets}
    want = siglip_targets_rank_reference(
        image64.to(dtype), text64.to(dtype), scale, bias, sizes, upstream, rank, sample_ids=ids, targets=targets,
        hard_negatives=None if hard_sizes is None else negatives64.to(dtype), hard_sizes=hard_sizes)
    tol = TOLERANCE[dtype]
    for mode in ("gather", "ring"):
        for algorithm in ("auto", "torch"):
            for dist_impl in DIST_IMPLS if mode == "gather" else [None]:
                case = (f"{dtype} sizes={sizes} hard={hard_sizes} ids={with_ids} targets={targets} mode={mode} "
                        f"dist_impl={dist_impl} algorithm={algorithm}")
                loss_fn = clipshard.SigLipLoss(rank=rank, world_size=world_size, dist_impl=dist_impl, group=group,
                                               mode=mode, algorithm=algorithm)
                got = _run(loss_fn, image, text, negatives, scale, bias, upstream[rank], **kwargs)
                for name, g, w in zip(GRADIENT_NAMES, got, want):
                    if w is None or (name == "hard_negatives" and sum(hard_sizes) == 0):
                        assert g is None, (case, name)  # no rank has a hard negative: they take no part
                        continue
                    if w.numel() == 0:  # this rank has no hard negative
                        assert g.shape == w.shape, (case, name)
                        continue
                    error = max_relative_error(g, w)
                    assert error <= tol, f"rank {rank} {case}: {name} relative error {error:.3g} > {tol:.3g}"
                    key = f"{dtype}/{mode}/{name}"
                    worst[key] = max(worst.get(key, 0.0), error)
            # the functional form, once per mode
            got = _run(lambda *a, **k: clipshard.siglip_loss(*a, group=group, mode=mode, algorithm=algorithm, **k),
                       image, text, negatives, scale, bias, upstream[rank], **kwargs)
            assert max_relative_error(got[0], want[0]) <= tol and max_relative_error(got[1], want[1]) <= tol


def _values_rank(rank, world_size):
    triple, pair = dist.new_group([0, 1, 2]), dist.new_group([0, 1])  # every rank creates every group
    worst = {}
    for targets in (None, "multi", "mask"):
        _compare(rank, None, (5, 1, 7, 4), (2, 0, 3, 1), torch.float64, 1, targets, True, -3.0, worst)
    _compare(rank, None, (3, 3, 3, 3), (1, 2, 0, 2), torch.float32, 2, "mask", True, -10.0, worst)
    _compare(rank, None, (3, 2, 3, 3), (1, 2, 0, 2), torch.bfloat16, 8, "multi", True, -10.0, worst)
    _compare(rank, None, (5, 1, 7, 4), (2, 0, 3, 1), torch.float32, 3, "multi", True, None, worst,
             equal_upstream=True)  # ring's backward reuses the forward's gradients
    if rank < 3:
        _compare(rank, triple, (2, 6, 3), (0, 0, 4), torch.float64, 4, "multi", True, 2.0, worst)
        _compare(rank, triple, (2, 6, 3), (0, 0, 0), torch.float64, 5, "mask", True, 2.0, worst)  # none anywhere
    if rank < 2:
        _compare(rank, pair, (4, 6), (3, 5), torch.float32, 6, None, False, -5.0, worst)  # hard negatives only
        _compare(rank, pair, (4, 6), None, torch.float64, 7, "mask", True, -5.0, worst)  # ids only

    # ring mode moves the ids and the hard negatives with the blocks: nothing of the batch is gathered...
    image, text = torch.randn(3, 5).requires_grad_(), torch.randn(3, 5).requires_grad_()
    negatives, ids = torch.randn(rank, 5).requires_grad_(), torch.tensor([0, 1, rank])
    with _no_batch_gathers():
        clipshard.siglip_loss(image, text, 10.0, -2.0, mode="ring", hard_negatives=negatives,
                              sample_ids=ids).backward()
    assert negatives.grad.shape == negatives.shape
    # ... and the check would catch the gathered mode
    with _no_batch_gathers(), pytest.raises(AssertionError, match="ring mode called gather_rows"):
        clipshard.siglip_loss(image, text, 10.0, -2.0, hard_negatives=negatives, sample_ids=ids)
    dist.barrier()
    return worst


def test_ids_and_hard_negatives_match_the_reference_on_2_3_4_ranks():
    results = run_group(_values_rank, 4, timeout=240)
    report_worst(results[0])


def _bad_inputs(rank):
    """(name, call) pairs: rank 1's input is bad, or the ranks disagree."""
    gen = torch.Generator().manual_seed(rank)
    image, text = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    negatives, ids = torch.randn(2, 6, generator=gen), torch.arange(4) + 4 * rank
    bad = rank == 1

    def loss(mode, **kwargs):
        return lambda: clipshard.siglip_loss(image, text, 10.0, -1.0, mode=mode, **kwargs)

    for mode in ("gather", "ring"):
        yield f"{mode} sample_ids on one rank", loss(mode, sample_ids=None if bad else ids)
        yield f"{mode} targets differ", loss(mode, sample_ids=ids, targets="mask" if bad else "multi")
        yield f"{mode} sample_ids length", loss(mode, sample_ids=ids[:3] if bad else ids)
        yield f"{mode} sample_ids dtype", loss(mode, sample_ids=ids.int() if bad else ids)
        yield f"{mode} hard_negatives dtype", loss(mode, hard_negatives=negatives.double() if bad else negatives)
        yield f"{mode} hard_negatives size", loss(mode, hard_negatives=negatives[:, :5] if bad else negatives)
        yield f"{mode} targets without ids", loss(mode, targets="mask" if bad else None)


def _bad_input_rank(rank, world_size):
    messages = {}
    for name, call in _bad_inputs(rank):
        with pytest.raises((TypeError, ValueError)) as error:
            call()
        messages[name] = str(error.value)
        probe = torch.ones(1)  # nobody is left waiting in a collective
        dist.all_reduce(probe)
        assert probe.item() == world_size
    return messages


# What every rank's error must say: (case, text); rank 1's own problems are named on rank 0 too.
EXPECTED = [
    ("sample_ids on one rank", "sample_ids must be given on every rank or on none, got rank 0: given, rank 1: None"),
    ("targets differ", "all ranks must use the same targets, got rank 0: multi, rank 1: mask"),
    ("sample_ids length", "sample_ids must be None or a 1-D int64 tensor with one id per pair"),
    ("sample_ids dtype", "sample_ids must be None or a 1-D int64 tensor with one id per pair"),
    ("hard_negatives dtype", "hard_negatives must be None or a 2-D tensor (H x D, H >= 0) with text_features' dtype"),
    ("hard_negatives size", "hard_negatives must be None or a 2-D tensor (H x D, H >= 0) with text_features' dtype"),
    ("targets without ids", "targets needs sample_ids"),
]


def test_bad_input_on_one_rank_and_disagreement_raise_on_every_rank():
    messages = run_group(_bad_input_rank, 2, timeout=60)
    for mode in ("gather", "ring"):
        for case, text in EXPECTED:
            for rank in (0, 1):
                assert text in messages[rank][f"{mode} {case}"], (rank, mode, case, messages[rank][f"{mode} {case}"])
            if "rank 0:" not in text:  # a problem of rank 1's inputs: rank 0 names the rank
                assert "rank 1 has invalid inputs" in messages[0][f"{mode} {case}"]
