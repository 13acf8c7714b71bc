"""ClipLoss / clip_loss with sample ids, targets and hard negatives over real gloo groups (docs/targets.md): sample ids
shared across ranks with targets "mask" / "multi", hard negatives (a rank with none among them),
direction, unequal batches, every mode and (local_loss, gather_with_grad) combination, against
the materialised fp64 reference with open_clip's per-rank gradient semantics
(tests/references/clip_targets.py); and bad input on one rank / ranks that disagree, raising on
every rank without a hang. One process group per test runs all of its cases."""
import time

import pytest
import torch
import torch.distributed as dist

import clipshard
from tests.comparisons import GRADIENT_NAMES, max_relative_error
from tests.dist_utils import report_worst, run_group
from tests.parallel.dispatched_ops import unexpected_ops
from tests.parallel.distinct_ids_bits import distinct_ids_mismatches
from tests.references.clip_targets import clip_targets_rank_reference

COMBINATIONS = [(True, True), (False, True), (True, False), (False, False)]  # (local_loss, gather_with_grad)
D = 9


def _modes(local_loss, gather_with_grad):
    return ["local"] if local_loss and not gather_with_grad else ["exchange", "local", "ring"]


def _global_data(sizes, negative_sizes, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    normal = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    total = sum(sizes)
    image = torch.nn.functional.normalize(normal(total, D), dim=1)
    text = torch.nn.functional.normalize(normal(total, D) + 0.5 * image, dim=1)
    negatives = torch.nn.functional.normalize(normal(sum(negative_sizes), D), dim=1)
    ids = torch.randint(0, (total + 1) // 2, (total,), generator=gen) * 11 - 3  # repeats across ranks
    # and the first pair of every rank shares one id: in a ring, row i and column i of another rank's
    # block (the own pair's place in the own block) have the same id
    ids[[sum(sizes[:q]) for q in range(len(sizes))]] = ids[0].item()
    negatives = list(negatives.to(dtype).double().split(list(negative_sizes)))
    return image.to(dtype).double(), text.to(dtype).double(), negatives, ids


def _run(loss_fn, image, text, negatives, scale, bias, upstream):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (image, text, negatives, scale, bias)]
    loss = loss_fn(*leaves)
    (loss * upstream).backward()
    out = [loss.detach().double()]
    for t in leaves:
        out.append(None if t is None else (torch.zeros_like(t) if t.grad is None else t.grad).double())
    return out


def _all_reduce(x):
    x = x.clone()
    dist.all_reduce(x)
    return x


def _error(name, got, want):
    assert got.shape == want.shape, (name, got.shape, want.shape)
    if want.numel() == 0:  # the hard negatives of a rank without any
        return 0.0
    return max_relative_error(got, want, floor=1.0 if name == "bias" else 1e-30)  # d bias of a softmax loss is 0


def _compare_all(rank, world_size, sizes, negative_sizes, dtype, tol, bias_value, seed, negative_options):
    image64, text64, negatives64, ids = _global_data(sizes, negative_sizes, seed, dtype)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    scale = torch.tensor(17.0, dtype=acc)
    bias = None if bias_value is None else torch.tensor(bias_value, dtype=acc)
    upstream = [0.5 / sizes[q] * (1.0 + 0.75 * q) for q in range(world_size)]  # different on every rank
    worst = {}
    for targets in ("mask", "multi"):
        for direction in ("both", "image_to_text"):
            for with_negatives in negative_options:
                negatives = negatives64 if with_negatives else None
                for local_loss, gather_with_grad in COMBINATIONS:
                    want = clip_targets_rank_reference(image64, text64, scale, bias, sizes, upstream, rank, local_loss,
                                                       gather_with_grad, ids, targets, negatives, direction)
                    for mode in _modes(local_loss, gather_with_grad):
                        case = (f"{dtype} sizes={sizes} H={negative_sizes} {targets} {direction} negatives="
                                f"{with_negatives} local_loss={local_loss} gather_with_grad={gather_with_grad} {mode}")
                        module = clipshard.ClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world_size,
                                                    mode=mode, direction=direction)

                        def call(i, t, h, s, b):
                            return module(i, t, s, b, hard_negatives=h, sample_ids=ids[mine], targets=targets)

                        got = _run(call, image64[mine].to(dtype), text64[mine].to(dtype),
                                   None if negatives is None else negatives[rank].to(dtype), scale, bias,
                                   upstream[rank])
                        for k, name in enumerate(GRADIENT_NAMES):
                            g, w = got[k], want[k]
                            if w is None:
                                assert g is None, (case, name)
                                continue
                            if k >= 4 and local_loss and mode != "local":
                                # exchange and ring split d scale / d bias differently between ranks;
                                # their sum over ranks (what DDP sees) must match
                                g, w = _all_reduce(g), _all_reduce(w)
                            error = _error(name, g, w)
                            assert error <= tol, f"{case}: {name} relative error {error:.3g} > {tol:.3g}"
                            worst[f"{dtype}/{name}"] = max(worst.get(f"{dtype}/{name}", 0.0), error)
    return worst


def _zero_negatives_are_no_negatives(rank, world_size, sizes):
    """hard_negatives of 0 rows on every rank give today's loss and gradients, bit for bit."""
    image64, text64, _, _ = _global_data(sizes, (0,) * world_size, seed=9, dtype=torch.float32)
    mine = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    image, text = image64[mine].float(), text64[mine].float()
    scale, bias = torch.tensor(12.0), torch.tensor(-0.5)
    for local_loss, gather_with_grad in COMBINATIONS:
        for mode in _modes(local_loss, gather_with_grad):
            module = clipshard.ClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world_size, mode=mode)
            plain = _run(lambda i, t, h, s, b: module(i, t, s, b), image, text, None, scale, bias, 0.3)
            empty = _run(lambda i, t, h, s, b: module(i, t, s, b, hard_negatives=h), image, text,
                         torch.zeros(0, D), scale, bias, 0.3)
            for k in (0, 1, 2, 4, 5):
                assert torch.equal(plain[k], empty[k]), (local_loss, gather_with_grad, mode, GRADIENT_NAMES[k])


def _main(rank, world_size, runs, distinct_ids_configs, record_ops=False):
    worst = {}
    for sizes, negative_sizes, dtype, tol, bias_value, seed, negative_options in runs:
        found = _compare_all(rank, world_size, sizes, negative_sizes, dtype, tol, bias_value, seed, negative_options)
        for key, value in found.items():
            worst[key] = max(worst.get(key, 0.0), value)
    _zero_negatives_are_no_negatives(rank, world_size, runs[0][0])
    # all ids distinct: the bits of the call without ids, every loss, mode and target (the first
    # run's batches: unequal on 3 ranks, where ring mode transposes the narrow foreign blocks); each
    # group takes one share of the (dtype, algorithm) pairs, tests/losses/test_clip_targets.py all
    mismatches = distinct_ids_mismatches(rank, world_size, runs[0][0], runs[0][1], distinct_ids_configs)
    assert not mismatches, "\n".join(mismatches)
    if record_ops:  # no float atomics, host syncs or data-dependent shapes (tests/ops/test_id_paths_dispatch.py)
        unexpected = unexpected_ops(rank, world_size)
        assert not unexpected, unexpected
    return worst


def test_three_ranks_unequal_batches_and_a_rank_without_negatives():
    runs = [((5, 3, 4), (2, 0, 3), torch.float64, 1e-10, -1.5, 1, (False, True)),
            ((4, 6, 3), (1, 3, 0), torch.float32, 2e-5, None, 2, (True,))]
    share = [(torch.float32, "auto"), (torch.float64, "torch")]
    report_worst(run_group(_main, 3, runs, share, timeout=300)[0])


def test_two_ranks():
    share = [(torch.float64, "auto"), (torch.float32, "torch")]
    report_worst(run_group(_main, 2, [((6, 6), (2, 4), torch.float64, 1e-10, 0.5, 3, (True,))], share, True,
                           timeout=300)[0])


# ---------------------------------------------------------------------------------------------
# Bad input on one rank, ranks that disagree
# ---------------------------------------------------------------------------------------------

SECONDS = 10  # far below the collective timeout: an error must come from the metadata exchange


def _bad_inputs(rank, case):
    """(image, text, kwargs) of `rank` for one case (only rank 1 is bad unless the case says so)."""
    gen = torch.Generator().manual_seed(rank)
    image, text = torch.randn(4, D, generator=gen), torch.randn(4, D, generator=gen)
    ids, negatives = torch.arange(4) + 4 * rank, torch.randn(2, D, generator=gen)
    bad = rank == 1
    kwargs = dict(sample_ids=ids, hard_negatives=negatives)
    if bad and case == "ids of the wrong length":
        kwargs["sample_ids"] = ids[:3]
    elif bad and case == "ids of the wrong dtype":
        kwargs["sample_ids"] = ids.int()
    elif bad and case == "ids on the wrong device":
        kwargs["sample_ids"] = ids.to("meta")
    elif bad and case == "hard negatives of the wrong D":
        kwargs["hard_negatives"] = negatives[:, :-1]
    elif bad and case == "hard negatives of the wrong dtype":
        kwargs["hard_negatives"] = negatives.double()
    elif bad and case == "targets without ids":
        kwargs = dict(targets="multi", hard_negatives=negatives)
    elif bad and case == "ids on some ranks only":
        kwargs["sample_ids"] = None
    elif bad and case == "hard negatives on some ranks only":
        kwargs["hard_negatives"] = None
    elif case == "different targets":
        kwargs["targets"] = ("mask", "multi")[rank]
    elif bad and case == "hard negatives require grad on one rank":
        kwargs["hard_negatives"] = negatives.requires_grad_()
    return image, text, kwargs


CASES = {
    "ids of the wrong length": r"sample_ids must be None or a 1-D int64 tensor",
    "ids of the wrong dtype": r"sample_ids must be None or a 1-D int64 tensor",
    "ids on the wrong device": r"sample_ids must be None or a 1-D int64 tensor",
    "hard negatives of the wrong D": r"hard_negatives must be None or a 2-D tensor",
    "hard negatives of the wrong dtype": r"hard_negatives must be None or a 2-D tensor",
    "targets without ids": r"targets needs sample_ids|sample_ids must be given on every rank or on none",
    "ids on some ranks only": r"sample_ids must be given on every rank or on none, got rank 0: given, rank 1: None",
    "hard negatives on some ranks only": (r"hard_negatives must be given on every rank or on none, got rank 0: "
                                          r"given, rank 1: None"),
    "different targets": r"all ranks must use the same targets, got rank 0: mask, rank 1: multi",
    "hard negatives require grad on one rank": r"same requires_grad pattern of .*hard_negatives",
    "different directions": r"all ranks must use the same direction, got rank 0: both, rank 1: image_to_text",
}


def _every_case_raises(rank, world_size):
    report = {}
    for case, match in CASES.items():
        for mode in ("exchange", "local", "ring"):
            image, text, kwargs = _bad_inputs(rank, case)
            direction = ("both", "image_to_text")[rank] if case == "different directions" else "both"
            scale = torch.tensor(10.0, requires_grad=True)
            started = time.monotonic()
            with pytest.raises(ValueError, match=match):
                clipshard.clip_loss(image.requires_grad_(), text, scale, mode=mode, direction=direction, **kwargs)
            report[case, mode] = time.monotonic() - started
            probe = torch.ones(1)  # the group still works: nobody is waiting in a collective
            dist.all_reduce(probe)
            assert probe.item() == world_size
    return report


def test_bad_input_on_one_rank_and_disagreeing_ranks_raise_on_every_rank():
    for rank, report in enumerate(run_group(_every_case_raises, 2, timeout=120)):
        slow = {key: seconds for key, seconds in report.items() if seconds > SECONDS}
        assert not slow, f"rank {rank}: {slow}"
