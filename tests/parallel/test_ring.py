"""Ring mode (clipshard/parallel/ring.py) over real multi-process gloo groups: the same loss and gradients as
exchange mode, open_clip's ClipLoss and the fp64 reference; bitwise reproducible; per-rank memory
that does not grow with the world size; no gather of the batch; errors before any P2P transfer.

One 4-rank group runs the world group (N = 4) and its subgroups {0, 1, 2} (N = 3) and {0, 1}
(N = 2), so every world size from 2 to 4 runs in one start (world size 1 is the single-device
loss, tests/parallel/test_clip_loss_distributed.py). The multi-node torchrun launch is in test_ring_torchrun.py.
"""
import os
import sys
import warnings
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import clipshard
from clipshard.parallel import collectives as cdist
from tests.dist_utils import report_worst, run_group
from tests.parallel.test_clip_loss_distributed import TOLERANCE, _error, _global_batch, _open_clip_loss_class, _run_loss
from tests.references.contrastive import clip_loss_rank_reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from _measure import peak_memory_bytes  # noqa: E402

NAMES = ["loss", "image", "text", "scale", "bias"]
# (local_loss, gather_with_grad): ring is defined wherever exchange is
COMBINATIONS = [(True, True), (False, True), (False, False)]
RUNS = [(torch.float32, 1, 14.3, None), (torch.float32, 2, 100.0, -2.5), (torch.bfloat16, 3, 14.3, -1.0),
        (torch.float16, 5, 50.0, 0.5)]


def _sum_over(group, x):
    x = x.clone()
    dist.all_reduce(x, group=group)
    return x


def _compare(rank, group, sizes, dtype, seed, scale_value, bias_value, worst):
    """Ring against the fp64 reference (exchange's tolerances), exchange mode and, for equal batches,
    open_clip; and ring run twice gives the same bits."""
    world_size = len(sizes)
    dim = 11
    image64, text64 = _global_batch(sum(sizes), dim, seed)
    local = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    image, text = image64[local].to(dtype), text64[local].to(dtype)
    image_ref, text_ref = image64.to(dtype).double(), text64.to(dtype).double()
    scale = torch.tensor(scale_value, dtype=torch.float32)
    bias = None if bias_value is None else torch.tensor(bias_value, dtype=torch.float32)
    upstream = [1.0 + 0.75 * q for q in range(world_size)]
    check_open_clip = group is None and len(set(sizes)) == 1
    loss_tol, grad_tol = TOLERANCE[dtype]

    def loss_module(mode, local_loss, gather_with_grad):
        return clipshard.ClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world_size, mode=mode,
                                  group=group)

    for local_loss, gather_with_grad in COMBINATIONS:
        case = f"{dtype} sizes={sizes} local_loss={local_loss} gather_with_grad={gather_with_grad} bias={bias_value}"
        want = clip_loss_rank_reference(image_ref, text_ref, scale, bias, sizes, upstream, rank, local_loss,
                                        gather_with_grad)
        ring = _run_loss(loss_module("ring", local_loss, gather_with_grad), image, text, scale, bias, upstream[rank])
        again = _run_loss(loss_module("ring", local_loss, gather_with_grad), image, text, scale, bias, upstream[rank])
        exchange = _run_loss(loss_module("exchange", local_loss, gather_with_grad), image, text, scale, bias,
                             upstream[rank])
        theirs = None
        if check_open_clip:
            theirs = _run_loss(_open_clip_loss_class()(local_loss, gather_with_grad, rank=rank, world_size=world_size),
                               image, text, scale, bias, upstream[rank])
        for k, name in enumerate(NAMES):
            got, exp = ring[k], want[k]
            if exp is None:
                assert got is None and exchange[k] is None, (case, name)
                continue
            assert torch.equal(got, again[k]), f"{case}: ring is not bitwise reproducible ({name})"
            # the same per-rank split of the logit_scale / logit_bias gradient as exchange mode
            tol = loss_tol if k == 0 else grad_tol
            vs_exchange = _error(name, got, exchange[k])
            assert vs_exchange <= tol, f"{case}: {name} ring vs exchange {vs_exchange:.3g} > {tol:.3g}"
            worst[f"ring_vs_exchange/{dtype}/{name}"] = max(worst.get(f"ring_vs_exchange/{dtype}/{name}", 0.0),
                                                            vs_exchange)
            if k >= 3 and local_loss:  # exchange's split: compare the sums over ranks with the reference
                got, exp = _sum_over(group, got), _sum_over(group, exp)
            if theirs is not None and dtype != torch.float32:
                theirs_value = _sum_over(group, theirs[k]) if k >= 3 and local_loss else theirs[k]
                tol = max(tol, 2 * _error(name, theirs_value, exp))
            error = _error(name, got, exp)
            assert error <= tol, f"{case}: {name} relative error {error:.3g} > {tol:.3g}"
            worst[f"vs_fp64/{dtype}/{name}"] = max(worst.get(f"vs_fp64/{dtype}/{name}", 0.0), error)


def _extra_memory(rank, group, mode, m, dim):
    """Peak bytes one ring / exchange step (forward + backward, local_loss=True) allocates beyond
    its inputs on this rank."""
    gen = torch.Generator().manual_seed(rank)
    image = torch.randn(m, dim, generator=gen).requires_grad_()
    text = torch.randn(m, dim, generator=gen).requires_grad_()
    scale = torch.tensor(10.0)
    def step():
        clipshard.clip_loss(image, text, scale, local_loss=True, mode=mode, group=group).backward()
        image.grad = text.grad = None

    step()  # warm-up
    return peak_memory_bytes(step, "cpu")


@contextmanager
def _no_batch_gathers():
    """Every collective that could move the whole batch raises (the metadata all-gather of
    the losses' shard_layout goes through cdist.all_gather_single, captured at import, and stays usable)."""
    def refuse(name):
        def fail(*args, **kwargs):
            raise AssertionError(f"ring mode called {name}")
        return fail

    names = ["all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "reduce_scatter", "all_to_all",
             "all_to_all_single", "all_gather_single", "reduce_scatter_single"]
    patches = [mock.patch.object(cdist, "gather_rows", refuse("gather_rows")),
               mock.patch.object(cdist, "combine_column_lse", refuse("combine_column_lse")),
               mock.patch.object(cdist, "_reduce_scatter_single", refuse("_reduce_scatter_single"))]
    patches += [mock.patch.object(dist, n, refuse(n)) for n in names if hasattr(dist, n)]
    for p in patches:
        p.start()
    try:
        yield
    finally:
        for p in patches:
            p.stop()


def _four_rank_main(rank, world_size):
    warnings.filterwarnings("ignore", category=FutureWarning)  # open_clip's deprecated all_gather
    triple, pair = dist.new_group([0, 1, 2]), dist.new_group([0, 1])  # every rank creates every group
    worst = {}
    # N = 4: equal batches (against open_clip too) and unequal ones, with blocks smaller than the
    # receiving rank's batch (the transposed blocks of ring.py)
    for sizes in [(3, 3, 3, 3), (5, 2, 7, 4)]:
        for run in RUNS:
            _compare(rank, None, sizes, *run, worst)
    if rank < 3:  # N = 3, unequal batches, a subgroup
        for run in RUNS:
            _compare(rank, triple, (5, 3, 7), *run, worst)
    if rank < 2:  # N = 2, a subgroup
        for run in RUNS[:2]:
            _compare(rank, pair, (4, 6), *run, worst)

    # Nothing of the size of the batch is gathered: the patched collectives raise in ring mode...
    image, text, scale = torch.randn(6, 8).requires_grad_(), torch.randn(6, 8).requires_grad_(), torch.tensor(9.0)
    with _no_batch_gathers():
        for local_loss in (True, False):
            clipshard.clip_loss(image, text, scale, local_loss=local_loss, mode="ring").backward()
    # ... and would catch exchange mode (the check can fail)
    with _no_batch_gathers(), pytest.raises(AssertionError, match="ring mode called gather_rows"):
        clipshard.clip_loss(image, text, scale, local_loss=True, mode="exchange")

    # Peak extra memory per rank at N = 2, 3, 4, same M: ring's must not grow, exchange's does.
    m, dim = 256, 64
    memory = {}
    for mode in ("ring", "exchange"):
        for n, group in ((4, None), (3, triple), (2, pair)):
            if rank < n:
                memory[mode, n] = _extra_memory(rank, group, mode, m, dim)
    dist.barrier()
    return worst, memory


def test_ring_matches_exchange_open_clip_and_fp64_on_2_3_4_ranks():
    results = run_group(_four_rank_main, 4, timeout=240)
    report_worst(results[0][0])
    block = 256 * 64 * 4  # one M x D fp32 block
    for rank in (0, 1):
        memory = results[rank][1]
        print(f"  rank {rank} peak extra bytes: " + ", ".join(f"{k[0]} N={k[1]}: {v}" for k, v in sorted(memory.items())))
        # ring: from N = 3 on, two blocks are in flight at a time (the current one and the next; at
        # N = 2 the only foreign block is the next one), then nothing grows: N = 4 is N = 3 up to
        # a few M-float vectors, and at most the second block buffers above N = 2
        assert memory["ring", 4] <= memory["ring", 3] + block // 16, memory
        assert memory["ring", 4] <= memory["ring", 2] + 2 * block + block // 16, memory
        # exchange holds the gathered T and its gradient: two more blocks per added rank (less a few
        # M-float vectors that do not grow)
        assert memory["exchange", 4] >= memory["exchange", 3] + 3 * block // 2, memory
        assert memory["exchange", 4] >= memory["exchange", 2] + 3 * block, memory


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------


def _faults_rank(rank, world_size):
    calls = []
    real_batch = dist.batch_isend_irecv

    def counting(ops):
        calls.append(len(ops))
        return real_batch(ops)

    scale = torch.tensor(10.0)
    bad = [
        (lambda: (torch.randn(4, 8, dtype=torch.bfloat16 if rank == 1 else torch.float32),) * 2, "same feature dtype"),
        (lambda: (torch.randn(4, 8 + rank), torch.randn(4, 8 + rank)), "same feature dimension D"),
        (lambda: (torch.randn(4, 8), torch.randn(3 if rank == 1 else 4, 8)),
         "same shape" if rank == 1 else "rank 1 has invalid inputs"),
        (lambda: (torch.randn(0 if rank == 0 else 4, 8),) * 2, "empty" if rank == 0 else "rank 0 has invalid inputs"),
    ]
    with mock.patch.object(dist, "batch_isend_irecv", counting):
        for make, match in bad:
            with pytest.raises(ValueError, match=match):
                clipshard.clip_loss(*make(), scale, local_loss=True, mode="ring")
        # options that differ between ranks (they would run different transfers)
        with pytest.raises(ValueError, match="same loss options"):
            clipshard.clip_loss(torch.randn(4, 8), torch.randn(4, 8), scale, mode="ring" if rank == 0 else "exchange")
        assert calls == [], "a point-to-point transfer started before the error"
        probe = torch.ones(1)
        dist.all_reduce(probe)  # nobody was left inside a transfer
        assert probe.item() == world_size
        clipshard.clip_loss(torch.randn(4, 8), torch.randn(4, 8), scale, mode="ring")
        assert calls, "the counting patch did not see ring mode's transfers"
    return True


def test_bad_input_on_one_rank_raises_on_every_rank_before_any_transfer():
    assert run_group(_faults_rank, 2, timeout=60) == [True, True]


def test_ring_with_local_loss_and_no_gather_grad_is_refused():
    with pytest.raises(ValueError, match="ClipLoss: mode='ring' cannot reproduce open_clip's"):
        clipshard.ClipLoss(local_loss=True, gather_with_grad=False, mode="ring")
    with pytest.raises(ValueError, match="clip_loss: mode='ring' cannot reproduce"):
        clipshard.clip_loss(torch.randn(2, 3), torch.randn(2, 3), 1.0, local_loss=True, gather_with_grad=False,
                            mode="ring")
