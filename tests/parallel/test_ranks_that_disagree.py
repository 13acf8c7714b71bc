"""Hostile inputs over ranks (issue 23), all in one group of 2 gloo ranks: a NaN upstream gradient on
one rank (item 1), ranks with different logit_scale / logit_bias (item 2), a second backward through
the distributed losses (item 4), to_half_precision_ after fully_shard (item 6), and the NaN-aware
agreement collective they share. Each check raises on its rank; run_group fails on any rank's error
or a hang."""
import math

import pytest
import torch
import torch.distributed as dist

import clipshard
from clipshard.parallel.collectives import same_on_every_rank
from clipshard.parallel.layout import ShardLayout
from tests.dist_utils import run_group
from tests.parallel.test_clip_loss_distributed import _global_batch
from tests.references.contrastive import clip_loss_rank_reference

SIZES = (5, 3)  # unequal local batches, as the last batch of an epoch


def _rank_batch(rank, seed=0, dim=12):
    image, text = _global_batch(sum(SIZES), dim, seed)
    begin = sum(SIZES[:rank])
    return image[begin: begin + SIZES[rank]].float(), text[begin: begin + SIZES[rank]].float()


def _grads_after(loss_fn, image, text, scale, bias, upstream):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (image, text, scale, bias)]
    (loss_fn(*leaves) * upstream).backward()
    return [None if t is None else t.grad for t in leaves]


def _agreement_collective(rank):
    """same_on_every_rank: NaN on one rank (or on both) is a difference, +-Inf is a value."""
    layout = ShardLayout(sizes=(1, 1), rank=rank, group=dist.group.WORLD)
    nan, inf = math.nan, math.inf
    cases = {((1.0, nan),): False, ((nan, nan),): False, ((2.5, 2.5),): True, ((inf, inf),): True,
             ((inf, 1.0),): False, ((-inf, -inf),): True, ((0.0, -0.0),): True, ((1.0, 1.0 + 2 ** -23),): False}
    for (per_rank,), expected in cases.items():
        got = same_on_every_rank(torch.tensor(per_rank[rank], dtype=torch.float32), layout)
        assert got is expected, f"{per_rank}: got {got}"
    # several values at once: one difference anywhere is a difference
    values = torch.tensor([1.0, 2.0, 3.0 if rank == 0 else float("nan")])
    assert same_on_every_rank(values, layout) is False


def _siglip_ring_nan_upstream(rank):
    """Item 1: SigLipLoss ring with a NaN upstream gradient on rank 1 only. Before the fix the
    all-reduce MAX dropped the NaN, the one-pass shortcut ran, and rank 0's text gradients came out
    finite; the gathered mode (open_clip's) puts NaN there."""
    image, text = _rank_batch(rank, seed=1)
    scale, bias = torch.tensor(10.0), torch.tensor(-1.0)
    upstream = torch.tensor([1.0, math.nan][rank])
    grads = {}
    for mode in ("gather", "ring"):
        loss = clipshard.SigLipLoss(rank=rank, world_size=2, mode=mode)
        grads[mode] = _grads_after(lambda *a: loss(*a), image, text, scale, bias, upstream)
    for k, name in enumerate(("image", "text", "scale", "bias")):
        ring, gather = grads["ring"][k], grads["gather"][k]
        assert torch.equal(torch.isnan(ring), torch.isnan(gather)), f"rank {rank} d {name}: NaN pattern differs"
        finite = ~torch.isnan(gather)
        torch.testing.assert_close(ring[finite], gather[finite], rtol=2e-5, atol=1e-7)
    if rank == 0:  # rank 1's NaN reaches every text row through its loss
        assert torch.isnan(grads["ring"][1]).all()
        assert torch.isfinite(grads["ring"][0]).all() and torch.isfinite(grads["ring"][2]).all()


def _different_scales(rank):
    """Item 2: logit_scale 10 on rank 0, 20 on rank 1. Exchange and ring (and local_loss=False in
    every mode) mixed the ranks' scales silently (rank losses 8.240 / 16.005 where open_clip gives
    6.154 / 17.089 in the issue's case); now every rank refuses, naming logit_scale (or logit_bias).
    mode="local" with local_loss=True computes each rank's loss with its own scale, as open_clip."""
    image, text = _rank_batch(rank, seed=2)
    scale = torch.tensor([10.0, 20.0][rank])
    for mode in ("exchange", "ring", "local"):
        for local_loss in (True, False):
            loss = clipshard.ClipLoss(local_loss=local_loss, gather_with_grad=True, rank=rank, world_size=2,
                                      mode=mode)
            if mode == "local" and local_loss:
                got = loss(image, text, scale)
                full_image, full_text = _global_batch(sum(SIZES), 12, 2)
                want = clip_loss_rank_reference(full_image, full_text, scale.double(), None, SIZES, [1.0, 1.0],
                                                rank, True, True)[0]
                assert abs(got.item() - want.item()) <= 2e-6 * abs(want.item()), (got.item(), want.item())
                continue
            with pytest.raises(ValueError, match=r"logit_scale.*rank 0: 10\.0, rank 1: 20\.0"):
                loss(image, text, scale)
    # the same scale but different biases: refused naming logit_bias
    bias = torch.tensor([-1.0, -2.0][rank])
    with pytest.raises(ValueError, match=r"same logit_bias.*rank 0: -1\.0, rank 1: -2\.0"):
        clipshard.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=2)(
            image, text, torch.tensor(10.0), bias)
    # SigLIP's loss is a sum of per-logit terms, each rank's own rows with its own scale: accepted
    clipshard.SigLipLoss(rank=rank, world_size=2, mode="ring")(image, text, scale, bias)
    # equal values (a NaN on every rank included) still pass the check
    clipshard.ClipLoss(rank=rank, world_size=2, mode="ring")(image, text, torch.tensor(math.nan))


def _second_backward(rank):
    """Item 4: ClipLoss(local_loss=False) in exchange and ring mode, backward(retain_graph=True) then
    backward(): the gradients add up, as autograd does (before: TypeError on every rank); without
    retain_graph the second backward raises torch's own error on every rank. Wider search: ClipLoss
    ring with local_loss=True and SigLipLoss ring (whose backward drops the gradients its forward
    kept, so the second backward makes a second pass) add up too."""
    image, text = _rank_batch(rank, seed=3)
    scale, bias = torch.tensor(14.0), torch.tensor(-0.5)
    upstream = 0.5 / sum(SIZES) * (1.0 + rank)
    losses = [clipshard.ClipLoss(local_loss=False, gather_with_grad=gather_with_grad, rank=rank, world_size=2,
                                 mode=mode)
              for mode in ("exchange", "ring", "local") for gather_with_grad in (True, False)
              if gather_with_grad or mode == "local"]
    losses.append(clipshard.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=2, mode="ring"))
    losses.append(clipshard.SigLipLoss(rank=rank, world_size=2, mode="ring"))
    for loss_fn in losses:
        once = _grads_after(loss_fn, image, text, scale, bias, upstream)
        leaves = [t.detach().clone().requires_grad_() for t in (image, text, scale, bias)]
        loss = loss_fn(*leaves) * upstream
        loss.backward(retain_graph=True)
        loss.backward()
        for name, single, leaf in zip(("image", "text", "scale", "bias"), once, leaves):
            torch.testing.assert_close(leaf.grad, 2 * single, rtol=1e-6, atol=0,
                                       msg=lambda m: f"{loss_fn} d {name}: {m}")
        if isinstance(loss_fn, clipshard.ClipLoss) and not loss_fn.local_loss:
            loss = loss_fn(*leaves) * upstream
            loss.backward()
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                loss.backward()


def _half_precision_after_fully_shard(rank):
    """Item 6: to_half_precision_ after fully_shard raised NotImplementedError from the op's
    missing sharding rule, after converting the layers that were not sharded. Now: a ValueError
    naming FSDP2 and the order, and nothing converted."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 4))
    fully_shard(model[1], mesh=init_device_mesh("cpu", (2,)))
    with pytest.raises(ValueError, match=r"'1\.weight' is a DTensor.*fully_shard.*to_half_precision_\(model\), "
                                         r"then fully_shard\(model\)"):
        clipshard.optim.to_half_precision_(model)
    assert all(p.dtype == torch.float32 for p in model.parameters()), "converted some parameters"


def _main(rank, world_size):
    _agreement_collective(rank)
    _siglip_ring_nan_upstream(rank)
    _different_scales(rank)
    _second_backward(rank)
    _half_precision_after_fully_shard(rank)
    return True


def test_hostile_inputs_on_two_ranks():
    assert run_group(_main, 2) == [True, True]
