"""clipshard.GradCache over 2 and 3 gloo ranks with DDP: the gradients of the plain DDP step (the
whole local batch through DDP, the loss, backward), fp64 within 1e-10 relative and fp32 within
1e-5, for ClipLoss in exchange, local and ring modes and SigLipLoss (gather and ring), with unequal
local batches (so ranks run different numbers of micro-batches); DDP's gradient reduction runs as
often as in the plain step (once per bucket per step); a bad input on one rank raises on every
rank without waiting for a collective's timeout, with DDP and with a plain module. On 2 ranks the same with FSDP2 (fully_shard'ed
towers) against the plain FSDP2 step. One process group per world size runs every case. A loss with
parameters of its own through DDP gives them the plain DDP step's (local) gradients; a loss that
reads the DDP model's own parameters is refused on every rank."""
import datetime
import io
import time

import pytest
import torch
import torch.distributed as dist

import clipshard
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from tests.dist_utils import run_group
from tests.integrations.grad_cache.grad_cache_models import (
    LearnedLoss, TinyClip, batch, grads, max_relative_difference, plain_step)

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without torch.distributed")

MICRO = 3
# The same on every rank, as a loss weight or GradScaler's scale is: the cached gradients hold the
# other ranks' terms at their upstream gradient, which GradCache cannot know (docs/grad_cache.md).
UPSTREAM = 0.5 / 9
LOSSES = [  # (name, constructor options, dtype, tolerance)
    ("ClipLoss", dict(local_loss=True, gather_with_grad=True), torch.float64, 1e-10),
    ("ClipLoss", dict(local_loss=True, gather_with_grad=True, mode="local"), torch.float64, 1e-10),
    ("ClipLoss", dict(local_loss=True, gather_with_grad=True, mode="ring"), torch.float64, 1e-10),
    ("SigLipLoss", dict(), torch.float64, 1e-10),
    ("SigLipLoss", dict(mode="ring"), torch.float32, 1e-5),
    ("ClipLoss", dict(local_loss=False, gather_with_grad=True), torch.float32, 1e-5),
]


def _counting_ddp(model):
    """DDP around model, counting its gradient reductions (one per bucket per synchronised backward)."""
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    calls = []

    def hook(state, bucket):
        calls.append(1)
        return allreduce_hook(state, bucket)
    ddp.register_comm_hook(None, hook)
    return ddp, calls


def _ddp_cases(rank, world_size):
    size = 7 + 2 * rank  # 7, 9, 11 rows: 3, 3, 4 micro-batches of 3
    out = {}
    for index, (name, options, dtype, _) in enumerate(LOSSES):
        loss_fn = getattr(clipshard, name)(rank=rank, world_size=world_size, **options)
        images, tokens = batch(size, 100 * index + rank, dtype)
        results = []
        for cached in (True, False):
            ddp, reductions = _counting_ddp(TinyClip(dtype=dtype, with_bias=name == "SigLipLoss"))
            if cached:
                loss = clipshard.GradCache(ddp, loss_fn, MICRO)(images, tokens)
                (loss * UPSTREAM).backward()
            else:
                loss = plain_step(ddp, loss_fn, images, tokens, upstream=UPSTREAM)
            results.append((grads(ddp.module), len(reductions), loss.item()))
        out[index] = results
    return out


SHORT_TIMEOUT_S = 5  # the plain-module cases' loss group: a rank left waiting fails within seconds


def _bad_input_cases(rank, world_size):
    """(name, call) of each bad input on rank 1: under DDP, and (issue 40 item 1) with a plain module
    (FSDP1, DeepSpeed or a hand-written all-reduce leave the model one), whose ranks GradCache learns
    from the loss's group (the ClipLoss) or takes as the world group (a loss function naming none);
    the losses gather over a group with a short timeout, so a rank left waiting there fails fast."""
    short = dist.new_group(timeout=datetime.timedelta(seconds=SHORT_TIMEOUT_S))
    images, tokens = batch(8, rank)
    bad = rank == 1
    ids = torch.arange(8 * rank, 8 * rank + (7 if bad else 8))
    clip_loss = clipshard.ClipLoss(rank=rank, world_size=world_size, group=short)

    def loss_function(**outputs):  # no group attribute: GradCache checks over the world group
        return clip_loss(**outputs)

    def short_output_on_rank_1(images, tokens):
        output = TinyClip(with_bias=False)(images, tokens)
        return {**output, "image_features": output["image_features"][:-1]} if bad else output

    ddp = torch.nn.parallel.DistributedDataParallel(TinyClip(with_bias=False))
    yield "DDP, texts of another batch size", lambda: clipshard.GradCache(
        ddp, clipshard.ClipLoss(rank=rank, world_size=world_size), MICRO)(images, tokens[:-1] if bad else tokens)
    yield "plain module, sample_ids of the wrong length", lambda: clipshard.GradCache(
        TinyClip(with_bias=False), clip_loss, MICRO)(images, tokens, sample_ids=ids)
    yield "plain module and loss function, sample_ids of the wrong length", lambda: clipshard.GradCache(
        TinyClip(with_bias=False), loss_function, MICRO)(images, tokens, sample_ids=ids)
    yield "plain module, an output of the wrong length", lambda: clipshard.GradCache(
        short_output_on_rank_1, clip_loss, MICRO)(images, tokens)


def _bad_input_on_rank_1(rank, world_size):
    """Per case: (this rank's error message or None, seconds taken)."""
    out = {}
    for name, call in _bad_input_cases(rank, world_size):
        start = time.monotonic()
        try:
            call()
            message = None
        except Exception as error:  # noqa: BLE001 (a collective's timeout is a failure to report)
            message = f"{type(error).__name__}: {error}"
        out[name] = message, time.monotonic() - start
    return out


def _fsdp2(model, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.image, mesh=mesh)
    fully_shard(model.text, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp2_cases(rank, world_size):
    """The first two losses under FSDP2: the full gradients after one step, cached and plain."""
    out = {}
    for index in (0, 3):
        name, options, dtype, _ = LOSSES[index]
        loss_fn = getattr(clipshard, name)(rank=rank, world_size=world_size, **options)
        images, tokens = batch(7 + 2 * rank, 100 * index + rank, dtype)
        results = []
        for cached in (True, False):
            model = _fsdp2(TinyClip(dtype=dtype, with_bias=name == "SigLipLoss"), world_size)
            if cached:
                clipshard.GradCache(model, loss_fn, MICRO)(images, tokens).backward()
            else:
                plain_step(model, loss_fn, images, tokens)
            results.append({n: p.grad.full_tensor() for n, p in model.named_parameters() if p.grad is not None})
        out[index] = results
    return out


def _on_ranks(rank, world_size):
    out = {"ddp": _ddp_cases(rank, world_size), "bad": _bad_input_on_rank_1(rank, world_size)}
    if world_size == 2:
        out["fsdp2"] = _fsdp2_cases(rank, world_size)
    buffer = io.BytesIO()  # tensors go back serialised (see tests/optim/test_adamw_fsdp2.py)
    torch.save(out, buffer)
    return buffer.getvalue()


_RESULTS = {}


def _results(world_size):
    """Each rank's results on world_size ranks (one process group per world size, run once)."""
    if world_size not in _RESULTS:
        _RESULTS[world_size] = [torch.load(io.BytesIO(b)) for b in run_group(_on_ranks, world_size, timeout=300)]
    return _RESULTS[world_size]


@pytest.mark.parametrize("world_size", [2, 3])
def test_ddp_gradients_equal_the_plain_ddp_step_and_are_reduced_once(world_size):
    results = _results(world_size)
    worst = {}
    for rank, out in enumerate(results):
        for index, (name, options, dtype, tolerance) in enumerate(LOSSES):
            (ours, our_reductions, our_loss), (plain, plain_reductions, plain_loss) = out["ddp"][index]
            difference = max_relative_difference(ours, plain)
            worst[(name, str(options), str(dtype))] = max(worst.get((name, str(options), str(dtype)), 0), difference)
            assert difference <= tolerance, (rank, name, options, difference)
            assert abs(our_loss - plain_loss) <= tolerance * abs(plain_loss)
            assert our_reductions == plain_reductions >= 1, (our_reductions, plain_reductions)
            # DDP averaged: every rank holds the same gradients
            assert max_relative_difference(ours, results[0]["ddp"][index][0][0]) <= tolerance
    print(f"  {world_size} ranks: {worst}")


# what rank 1's own error says, per case; the other ranks' must say "rank 1 has invalid inputs: " and quote it
RANK_1_SAYS = {
    "DDP, texts of another batch size": "same batch size (first dimension), got 8 rows in images and 7 in texts",
    "plain module, sample_ids of the wrong length": "sample_ids must be a 1-D int64 tensor with one id per pair "
                                                    "(8), got torch.int64 of shape (7,)",
    "plain module and loss function, sample_ids of the wrong length": "got torch.int64 of shape (7,)",
    "plain module, an output of the wrong length": "the model's output 'image_features' must have one row per "
                                                   "sample (3 in this micro-batch), got shape (2, 8)",
}


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bad_input_on_one_rank_raises_on_every_rank(world_size):
    """Every rank raises GradCache's ValueError, naming rank 1 and what it passed, well within the
    loss group's timeout (issue 40 items 1 and 8: with a plain module the other ranks waited in the
    loss's collective)."""
    results = _results(world_size)
    for rank, out in enumerate(results):
        for name, says in RANK_1_SAYS.items():
            message, seconds = out["bad"][name]
            assert message is not None and message.startswith("ValueError: GradCache: "), (rank, name, message)
            assert says in message and ("rank 1 has invalid inputs: " in message) == (rank != 1), (rank, name, message)
            assert seconds < SHORT_TIMEOUT_S, (rank, name, seconds)  # no collective waited for its timeout


def test_fsdp2_gradients_equal_the_plain_fsdp2_step():
    for rank, out in enumerate(_results(2)):
        for index, (ours, plain) in out["fsdp2"].items():
            name, options, dtype, tolerance = LOSSES[index]
            difference = max_relative_difference(ours, plain)
            print(f"  FSDP2 rank {rank} {name} {options}: {difference:.3g}")
            assert difference <= tolerance, (rank, name, options)


def _loss_parameters_on_ranks(rank, world_size):
    """(model and loss gradients, cached and plain) for a LearnedLoss around a cross-rank ClipLoss, and
    the error a loss reading ddp.module.logit_scale gets."""
    images, tokens = batch(7 + 2 * rank, 40 + rank)
    results = []
    for cached in (True, False):
        ddp = torch.nn.parallel.DistributedDataParallel(TinyClip(dropout=0.2, with_bias=False))
        loss_fn = LearnedLoss(clipshard.ClipLoss(rank=rank, world_size=world_size, local_loss=True,
                                                 gather_with_grad=True))
        torch.manual_seed(5 + rank)
        if cached:
            (clipshard.GradCache(ddp, loss_fn, MICRO)(images, tokens) * UPSTREAM).backward()
        else:
            plain_step(ddp, loss_fn, images, tokens, MICRO, UPSTREAM)
        results.append({**grads(ddp.module), **{f"loss.{k}": v for k, v in grads(loss_fn).items()}})
    ddp = torch.nn.parallel.DistributedDataParallel(TinyClip(with_bias=False))
    reads_the_model = lambda image_features, text_features, logit_scale: clipshard.ClipLoss(  # noqa: E731
        rank=rank, world_size=world_size)(image_features, text_features, ddp.module.logit_scale.exp())
    try:
        clipshard.GradCache(ddp, reads_the_model, MICRO)(images, tokens)
        refused = None
    except ValueError as error:
        refused = str(error)
    buffer = io.BytesIO()
    torch.save((results, refused), buffer)
    return buffer.getvalue()


def test_loss_parameters_get_the_plain_ddp_steps_gradients_and_the_models_are_refused():
    for rank, out in enumerate(run_group(_loss_parameters_on_ranks, 2, timeout=300)):
        (ours, plain), refused = torch.load(io.BytesIO(out))
        assert {"loss.head.weight", "loss.head.bias", "loss.log_temperature"} <= plain.keys()
        difference = max_relative_difference(ours, plain)
        print(f"  rank {rank}: {difference:.3g}")
        assert difference <= 1e-10, (rank, difference)
        assert refused is not None and "differentiates through the model's own parameters (module.logit_scale)" \
            in refused and "DDP" in refused, (rank, refused)
