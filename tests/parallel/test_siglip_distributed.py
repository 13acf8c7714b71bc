"""clipshard.SigLipLoss / siglip_loss over real multi-process gloo groups, against open_clip's
SigLipLoss (run in the same processes on the same data, for each of its dist_impl values) and an fp64
single-process reference.

open_clip's neighbour exchanges (bidir, shift) and its collectives with gradient (reduce, gather)
all give a rank the gradient of sum_q g_q * L_q with respect to its own features (its texts take
part in every rank's loss; g_q is rank q's upstream gradient) and the gradient of its own g_r * L_r
with respect to logit_scale and logit_bias; clipshard must match both, per rank, with the compiled
kernel (algorithm="auto") and with the portable PyTorch path (algorithm="torch").
"""
import warnings

import pytest
import torch
import torch.distributed as dist

import clipshard
from tests.dist_utils import report_worst, run_group
from tests.parallel.test_clip_loss_distributed import (
    ALGORITHMS, _global_batch, _max_rel, _open_clip_loss_class, _run_loss)
from tests.references.siglip import siglip_loss_rank_reference

DIST_IMPLS = [None, "bidir", "shift", "reduce", "gather"]
NAMES = ["loss", "image", "text", "scale", "bias"]
# Relative to the largest reference value: (loss, gradients). fp32: the 1e-5.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-3, 3e-2), torch.float16: (2e-3, 1e-2)}


def _compare_rank(rank, world_size, sizes, dtype, seed, scale_value, bias_value, check_open_clip):
    """Every dist_impl on one global batch; returns the largest differences seen."""
    open_clip_loss = _open_clip_loss_class("SigLipLoss")
    image64, text64 = _global_batch(sum(sizes), 11, seed)
    offset = sum(sizes[:rank])
    local = slice(offset, offset + sizes[rank])
    image, text = image64[local].to(dtype), text64[local].to(dtype)
    image_ref, text_ref = image64.to(dtype).double(), text64.to(dtype).double()  # the rounded inputs
    scale = torch.tensor(scale_value, dtype=torch.float32)
    bias = None if bias_value is None else torch.tensor(bias_value, dtype=torch.float32)
    upstream = [1.0 + 0.75 * q for q in range(world_size)]  # different on every rank
    want = siglip_loss_rank_reference(image_ref, text_ref, scale, bias, sizes, upstream, rank)
    if bias is not None:
        assert want[4].abs() > 0  # unlike the softmax loss, the bias gradient is not zero
    loss_tol, grad_tol = TOLERANCE[dtype]
    worst = {}

    def note(key, value):
        worst[key] = max(worst.get(key, 0.0), value)

    for dist_impl in DIST_IMPLS:
        theirs = None
        if check_open_clip:
            theirs = _run_loss(open_clip_loss(rank=rank, world_size=world_size, dist_impl=dist_impl),
                               image, text, scale, bias, upstream[rank])
        for algorithm in ALGORITHMS:
            case = (f"{dtype} world={world_size} sizes={sizes} dist_impl={dist_impl} scale={scale_value} "
                    f"bias={bias_value} algorithm={algorithm}")
            ours = _run_loss(clipshard.SigLipLoss(rank=rank, world_size=world_size, dist_impl=dist_impl,
                                                  algorithm=algorithm),
                             image, text, scale, bias, upstream[rank])
            for k, name in enumerate(NAMES):
                if want[k] is None:
                    assert ours[k] is None, (case, name)
                    continue
                error = _max_rel(ours[k], want[k])
                tol = loss_tol if k == 0 else grad_tol
                if theirs is not None and dtype != torch.float32:
                    tol = max(tol, 2 * _max_rel(theirs[k], want[k]))  # no worse than twice open_clip's error
                assert error <= tol, f"{case}: {name} relative error vs fp64 {error:.3g} > {tol:.3g}"
                note(f"vs_fp64/{dtype}/{name}", error)
                if theirs is not None:
                    difference = _max_rel(ours[k], theirs[k])
                    if dtype == torch.float32:
                        assert difference <= 1e-5, f"{case}: {name} relative difference vs open_clip {difference:.3g}"
                    note(f"vs_open_clip/{dtype}/{dist_impl}/{name}", difference)
    return worst


def _rank_main(rank, world_size, sizes_list):
    warnings.filterwarnings("ignore", category=FutureWarning)  # open_clip's deprecated collectives
    worst = {}
    runs = [(torch.float32, 1, 10.0, -10.0), (torch.float32, 2, 100.0, 5.0), (torch.float32, 3, 1.0, None),
            (torch.bfloat16, 4, 10.0, -10.0), (torch.float16, 5, 30.0, 0.0)]
    for sizes in sizes_list:
        for dtype, seed, scale_value, bias_value in runs:
            found = _compare_rank(rank, world_size, sizes, dtype, seed, scale_value, bias_value,
                                  check_open_clip=len(set(sizes)) == 1)  # open_clip needs equal sizes
            for key, value in found.items():
                worst[key] = max(worst.get(key, 0.0), value)
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_open_clip_and_fp64(world_size):
    results = run_group(_rank_main, world_size, [(5,) * world_size])
    report_worst(results[0])


def test_world_size_3_equal_and_unequal_batches():
    results = run_group(_rank_main, 3, [(4, 4, 4), (5, 3, 7)])
    report_worst(results[0])


def _functional_and_subgroups_rank(rank, world_size):
    """siglip_loss on the world group with unequal sizes, then on two independent pairs (group=)."""
    sizes = (2, 6, 1, 5)
    image64, text64 = _global_batch(sum(sizes), 7, seed=30)
    local = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    scale, bias = torch.tensor(12.0, dtype=torch.float64), torch.tensor(-4.0, dtype=torch.float64)
    upstream = [0.5 / m for m in sizes]  # open_clip's trainer: 1/M_r per rank, halved
    want = siglip_loss_rank_reference(image64, text64, scale, bias, sizes, upstream, rank)
    got = _run_loss(lambda *a: clipshard.siglip_loss(*a), image64[local], text64[local], scale, bias, upstream[rank])
    for k, name in enumerate(NAMES):
        assert _max_rel(got[k], want[k]) < 1e-12, name

    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group, sub_rank = groups[rank // 2], rank % 2
    sizes = (4, 6) if rank < 2 else (5, 5)
    image64, text64 = _global_batch(sum(sizes), 9, seed=31 + rank // 2)
    local = slice(sum(sizes[:sub_rank]), sum(sizes[: sub_rank + 1]))
    upstream = [1.0, 2.0]
    want = siglip_loss_rank_reference(image64, text64, scale, None, sizes, upstream, sub_rank)
    loss_fn = clipshard.SigLipLoss(rank=sub_rank, world_size=2, dist_impl="shift", group=group)
    got = _run_loss(loss_fn, image64[local], text64[local], scale, None, upstream[sub_rank])
    for k, name in enumerate(NAMES[:4]):
        assert _max_rel(got[k], want[k]) < 1e-12, name
    assert got[4] is None


def test_functional_unequal_sizes_and_subgroups():
    run_group(_functional_and_subgroups_rank, 4)


def _bad_input_rank(rank, world_size):
    """Each case makes rank 1's input bad or inconsistent; every rank must raise, none may hang."""
    good = torch.nn.functional.normalize(torch.randn(4, 3, dtype=torch.float64), dim=1).float()
    scale = torch.tensor(10.0)
    cases = {
        "dtype": (lambda: clipshard.siglip_loss(good.double(), good.double(), scale.double()) if rank == 1
                  else clipshard.siglip_loss(good, good, scale)),
        "shape": (lambda: clipshard.siglip_loss(good, good[:3], scale) if rank == 1
                  else clipshard.siglip_loss(good, good, scale)),
        "dim": (lambda: clipshard.siglip_loss(good[:, :2], good[:, :2], scale) if rank == 1
                else clipshard.siglip_loss(good, good, scale)),
        "bias": (lambda: clipshard.siglip_loss(good, good, scale, torch.tensor(-1.0)) if rank == 1
                 else clipshard.siglip_loss(good, good, scale)),
        "scale": (lambda: clipshard.siglip_loss(good, good, torch.ones(2)) if rank == 1
                  else clipshard.siglip_loss(good, good, scale)),
        "rank argument": (lambda: clipshard.SigLipLoss(rank=0 if rank == 1 else rank, world_size=2)(
            good, good, scale, None)),
        "other loss": (lambda: clipshard.ClipLoss(rank=rank, world_size=2)(good, good, scale) if rank == 1
                       else clipshard.SigLipLoss(rank=rank, world_size=2)(good, good, scale, None)),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
        except (ValueError, TypeError) as error:
            messages[name] = str(error)
        else:
            raise AssertionError(f"rank {rank}: case {name!r} did not raise")
    return messages


def test_bad_input_on_one_rank_raises_on_all():
    results = run_group(_bad_input_rank, 2, timeout=60)
    assert "rank 1 has invalid inputs" in results[0]["shape"]
    assert "same feature dtype" in results[0]["dtype"] and "same feature dtype" in results[1]["dtype"]
    assert "feature dimension D" in results[0]["dim"]
    assert "presence of logit_bias" in results[1]["bias"]
    assert "logit_scale must be a tensor with one element" in results[1]["scale"]
    assert "was given rank=0" in results[0]["rank argument"]
    assert "loss options" in results[0]["other loss"] and "loss options" in results[1]["other loss"]
