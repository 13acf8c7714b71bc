"""SigLIP ring mode (clipshard/parallel/siglip_ring.py) over real multi-process gloo groups: the same loss and
gradients as the gathered mode (the default), open_clip's SigLipLoss and the fp64 reference, with
the compiled kernel and the torch path; bitwise reproducible; no gather of the batch; per-rank
memory that does not grow with the world size.

One 4-rank group runs the world group (N = 4) and its subgroups {0, 1, 2} (N = 3) and {0, 1}
(N = 2), so world sizes 2 to 4 run in one start. The op-level block without positives is tested in
tests/ops/test_siglip.py.
"""
import os
import sys
import warnings
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import clipshard
from clipshard.parallel import siglip_ring
from tests.dist_utils import report_worst, run_group
from tests.parallel.test_clip_loss_distributed import (
    ALGORITHMS, _global_batch, _max_rel, _open_clip_loss_class, _run_loss)
from tests.parallel.test_ring import _no_batch_gathers
from tests.parallel.test_siglip_distributed import NAMES, TOLERANCE
from tests.references.siglip import siglip_loss_rank_reference

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from _measure import peak_memory_bytes  # noqa: E402

# (dtype, seed, scale, bias)
RUNS = [(torch.float32, 1, 10.0, -10.0), (torch.float32, 2, 100.0, None), (torch.bfloat16, 3, 10.0, -5.0),
        (torch.float16, 4, 30.0, 0.5)]
# ring against the gathered mode (same kernel, other chunking and summation order), relative to the
# largest value: (loss, feature gradients, scale / bias gradients). fp32 sums agree to a few ulps
# (the scale / bias gradients are signed sums, which may cancel: 1e-5); 16-bit feature gradients
# are rounded once from different fp32 sums, so up to an ulp of the 16-bit result apart
VS_GATHER = {torch.float32: (1e-6, 2e-6, 1e-5), torch.bfloat16: (1e-6, 8e-3, 1e-5),
             torch.float16: (1e-6, 1e-3, 1e-5)}


def _compare(rank, group, sizes, dtype, seed, scale_value, bias_value, worst, algorithms, check_open_clip,
             equal_upstream=False):
    world_size = len(sizes)
    image64, text64 = _global_batch(sum(sizes), 11, seed)
    local = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    image, text = image64[local].to(dtype), text64[local].to(dtype)
    image_ref, text_ref = image64.to(dtype).double(), text64.to(dtype).double()  # the rounded inputs
    scale = torch.tensor(scale_value, dtype=torch.float32)
    bias = None if bias_value is None else torch.tensor(bias_value, dtype=torch.float32)
    upstream = [0.5 / m * (1.0 + 0.75 * q) for q, m in enumerate(sizes)]  # realistic, different per rank
    if equal_upstream:  # DDP's loss.backward(): one weight on every rank (ring's one-pass backward)
        upstream = [0.37] * world_size
    want = siglip_loss_rank_reference(image_ref, text_ref, scale, bias, sizes, upstream, rank)
    theirs = None
    if check_open_clip:
        theirs = _run_loss(_open_clip_loss_class("SigLipLoss")(rank=rank, world_size=world_size, dist_impl="bidir"),
                           image, text, scale, bias, upstream[rank])
    loss_tol, grad_tol = TOLERANCE[dtype]

    def loss_module(mode, algorithm):
        return clipshard.SigLipLoss(rank=rank, world_size=world_size, group=group, mode=mode, algorithm=algorithm)

    for algorithm in algorithms:
        case = f"{dtype} sizes={sizes} scale={scale_value} bias={bias_value} algorithm={algorithm}"
        ring = _run_loss(loss_module("ring", algorithm), image, text, scale, bias, upstream[rank])
        again = _run_loss(loss_module("ring", algorithm), image, text, scale, bias, upstream[rank])
        gathered = _run_loss(loss_module(None, algorithm), image, text, scale, bias, upstream[rank])
        for k, name in enumerate(NAMES):
            if want[k] is None:
                assert ring[k] is None and gathered[k] is None, (case, name)
                continue
            assert torch.equal(ring[k], again[k]), f"{case}: ring is not bitwise reproducible ({name})"
            difference = _max_rel(ring[k], gathered[k])
            tol = VS_GATHER[dtype][{0: 0, 1: 1, 2: 1}.get(k, 2)]
            assert difference <= tol, f"{case}: {name} ring vs gather {difference:.3g} > {tol:.3g}"
            worst[f"ring_vs_gather/{dtype}/{name}"] = max(worst.get(f"ring_vs_gather/{dtype}/{name}", 0.0), difference)
            error = _max_rel(ring[k], want[k])
            tol = loss_tol if k == 0 else grad_tol
            if theirs is not None and dtype != torch.float32:
                tol = max(tol, 2 * _max_rel(theirs[k], want[k]))  # no worse than twice open_clip's error
            assert error <= tol, f"{case}: {name} relative error vs fp64 {error:.3g} > {tol:.3g}"
            worst[f"vs_fp64/{dtype}/{name}"] = max(worst.get(f"vs_fp64/{dtype}/{name}", 0.0), error)
            if theirs is not None:
                difference = _max_rel(ring[k], theirs[k])
                if dtype == torch.float32:
                    assert difference <= 1e-5, f"{case}: {name} ring vs open_clip {difference:.3g}"
                worst[f"vs_open_clip/{dtype}/{name}"] = max(worst.get(f"vs_open_clip/{dtype}/{name}", 0.0),
                                                            difference)


def _extra_memory(rank, group, mode, m, dim):
    """Peak bytes one SigLIP step (forward + backward) allocates beyond its inputs on this rank."""
    gen = torch.Generator().manual_seed(rank)
    image = torch.randn(m, dim, generator=gen).requires_grad_()
    text = torch.randn(m, dim, generator=gen).requires_grad_()
    scale, bias = torch.tensor(10.0), torch.tensor(-10.0)

    def step():
        clipshard.siglip_loss(image, text, scale, bias, mode=mode, group=group).backward()
        image.grad = text.grad = None

    step()  # warm-up
    return peak_memory_bytes(step, "cpu")


def _four_rank_main(rank, world_size):
    warnings.filterwarnings("ignore", category=FutureWarning)  # open_clip's deprecated collectives
    triple, pair = dist.new_group([0, 1, 2]), dist.new_group([0, 1])  # every rank creates every group
    worst = {}
    # N = 4: equal batches (against open_clip too), then unequal ones with a block of one row
    for run in RUNS:
        _compare(rank, None, (3, 3, 3, 3), *run, worst, ALGORITHMS, check_open_clip=True)
    for run in RUNS:
        _compare(rank, None, (5, 1, 7, 4), *run, worst, ALGORITHMS, check_open_clip=False)
    if rank < 3:  # N = 3, unequal batches, a subgroup
        for run in RUNS[:3]:
            _compare(rank, triple, (2, 6, 3), *run, worst, ["auto"], check_open_clip=False)
    if rank < 2:  # N = 2, a subgroup
        _compare(rank, pair, (4, 6), *RUNS[0], worst, ["auto"], check_open_clip=False)

    # Ring's backward reuses the forward's gradients when every rank's upstream gradient is the same
    # (one pass around the ring per step), else makes a second pass: both paths run (and are checked
    # above and here); each _compare runs ring twice.
    for equal, passes in ((True, 2), (False, 4)):
        calls = []
        real_pass = siglip_ring._ring_pass

        def counting(*args, **kwargs):
            calls.append(1)
            return real_pass(*args, **kwargs)

        with mock.patch.object(siglip_ring, "_ring_pass", counting):
            for run in RUNS:
                calls.clear()
                _compare(rank, None, (5, 1, 7, 4), *run, worst, ["auto"], check_open_clip=False,
                         equal_upstream=equal)
                assert len(calls) == passes, (equal, calls)

    # Nothing of the size of the batch is gathered: the patched collectives raise in ring mode...
    image, text = torch.randn(6, 8).requires_grad_(), torch.randn(6, 8).requires_grad_()
    scale, bias = torch.tensor(9.0, requires_grad=True), torch.tensor(-3.0, requires_grad=True)
    with _no_batch_gathers():
        clipshard.siglip_loss(image, text, scale, bias, mode="ring").backward()
    # ... and would catch the gathered mode (the check can fail)
    with _no_batch_gathers(), pytest.raises(AssertionError, match="ring mode called gather_rows"):
        clipshard.siglip_loss(image, text, scale, bias)
    # ranks that disagree on the mode raise on every rank instead of waiting in different transfers
    with pytest.raises(ValueError, match="same loss options"):
        clipshard.siglip_loss(image, text, scale, bias, mode="ring" if rank == 0 else None)

    # Peak extra memory per rank at N = 2, 3, 4, same M: ring's must not grow, gather's does.
    m, dim = 256, 64
    memory = {}
    for mode in ("ring", "gather"):
        for n, group in ((4, None), (3, triple), (2, pair)):
            if rank < n:
                memory[mode, n] = _extra_memory(rank, group, mode, m, dim)
    dist.barrier()
    return worst, memory


def test_siglip_ring_matches_gather_open_clip_and_fp64_on_2_3_4_ranks():
    results = run_group(_four_rank_main, 4, timeout=240)
    report_worst(results[0][0])
    block = 256 * 64 * 4  # one M x D fp32 block
    for rank in (0, 1):
        memory = results[rank][1]
        print(f"  rank {rank} peak extra bytes: " + ", ".join(f"{k[0]} N={k[1]}: {v}" for k, v in sorted(memory.items())))
        # ring: the same peak from N = 3 on (at N = 2 the only foreign block is the next one)
        assert memory["ring", 4] <= memory["ring", 3] + block // 16, memory
        assert memory["ring", 4] <= memory["ring", 2] + 2 * block, memory
        # gather holds the gathered T and its gradient: two more blocks per added rank
        assert memory["gather", 4] >= memory["gather", 3] + 3 * block // 2, memory
        assert memory["gather", 4] >= memory["gather", 2] + 3 * block, memory


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="SigLipLoss: mode must be 'gather', 'ring' or None, got 'exchange'"):
        clipshard.SigLipLoss(mode="exchange")
    with pytest.raises(ValueError, match="siglip_loss: mode must be"):
        clipshard.siglip_loss(torch.randn(2, 3), torch.randn(2, 3), 1.0, mode="rings")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_ring_on_one_process_is_the_single_device_loss(algorithm):
    image, text = torch.randn(5, 4, dtype=torch.float64), torch.randn(5, 4, dtype=torch.float64)
    want = clipshard.siglip_loss(image, text, 10.0, -3.0, algorithm=algorithm)
    got = clipshard.SigLipLoss(mode="ring", algorithm=algorithm)(image, text, 10.0, -3.0)
    assert torch.equal(got, want)
