"""apply_to_transformers() on 1, 2 and 3 real gloo ranks with DistributedDataParallel: for every covered
model class, the mean of the ranks' losses and every parameter's gradient after DDP's average equal
those of the same model in one process on the concatenated global batch, with an fp64 model and the
fp64 reference of the global contrastive / sigmoid loss; equal and unequal local batches.

Each world size is started once and runs every class, so the processes start three times in all.
"""
import functools

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers", reason="transformers is not installed: pip install '.[transformers]'")

import clipshard  # noqa: E402
from tests.dist_utils import report_worst, run_group  # noqa: E402
from tests.integrations.transformers.hf_tiny_models import (  # noqa: E402
    BUILDERS, fp64_default_dtype, gradient_errors, rows, tiny_inputs, tiny_model)
from tests.references.contrastive import clip_loss_reference  # noqa: E402
from tests.references.siglip import siglip_loss_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("models_imported")  # before the ranks are forked

# local batch sizes per world size: equal ones, then an unequal last batch
SIZES = {1: [[5]], 2: [[4, 4], [5, 2]], 3: [[3, 3, 3], [4, 1, 3]]}
LOSS_TOL, GRAD_TOL = 1e-5, 1e-4  # relative to the largest reference value of each tensor (fp32 towers)


def _seed(sizes):
    return 1000 + 10 * len(sizes) + sum(sizes)


def _rank(rank, world_size):
    """Every class and batch on this rank: (loss averaged over ranks, parameter gradients after
    DDP's average), as fp64 numpy arrays (tensors would travel through shared memory that the
    exiting rank takes with it)."""
    patch = clipshard.apply_to_transformers()
    results = {}
    try:
        for name in BUILDERS:
            model = tiny_model(name)
            ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
            for sizes in SIZES[world_size]:
                model.zero_grad(set_to_none=True)
                offset = sum(sizes[:rank])
                local = rows(tiny_inputs(name, sum(sizes), _seed(sizes)), offset, offset + sizes[rank])
                loss = ddp(**local, return_loss=True).loss
                loss.backward()
                grads = {n: p.grad.double().numpy() for n, p in model.named_parameters() if p.grad is not None}
                results[(name, tuple(sizes))] = (_mean_over_ranks(loss), grads)
            patch.undo()  # the model's own loss of the local batch: what the patch changes
            results[(name, "own")] = _mean_over_ranks(model(**local, return_loss=True).loss)
            patch = clipshard.apply_to_transformers()
    finally:
        patch.undo()
    return results if rank == 0 else None


def _mean_over_ranks(loss):
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    return (mean / dist.get_world_size()).double().numpy()


@functools.lru_cache(maxsize=None)
def _reference(name, sizes):
    """The fp64 model on the whole batch, its loss from tests/references: (loss, gradients)."""
    model = tiny_model(name).double()
    inputs = tiny_inputs(name, sum(sizes), _seed(sizes))
    inputs = {k: v.double() if v.is_floating_point() else v for k, v in inputs.items()}
    with fp64_default_dtype():
        out = model(**inputs)
    scale = model.logit_scale.exp()
    if name.startswith("Siglip"):
        loss = siglip_loss_reference(out.image_embeds, out.text_embeds, scale, model.logit_bias)
    else:
        loss = clip_loss_reference(out.image_embeds, out.text_embeds, scale)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _rel(got, want):
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_loss_and_ddp_gradients_equal_the_global_batch(world_size):
    results = run_group(_rank, world_size, timeout=240)[0]
    worst = {}  # printed with pytest -s; docs/transformers.md quotes them
    for name in BUILDERS:  # the last batch's mean local loss differs from its global loss
        own, global_loss = results.pop((name, "own")), _reference(name, tuple(SIZES[world_size][-1]))[0]
        assert (world_size == 1) == (abs(own.item() / global_loss.item() - 1) < LOSS_TOL), (name, own, global_loss)
        worst[f"{name} own local loss against the global loss"] = abs(own.item() / global_loss.item() - 1)
    for (name, sizes), (loss, grads) in results.items():
        loss, grads = torch.from_numpy(loss), {k: torch.from_numpy(v) for k, v in grads.items()}
        want_loss, want_grads = _reference(name, sizes)
        case = f"{name} world={world_size} sizes={list(sizes)}"
        assert _rel(loss, want_loss) < LOSS_TOL, (case, loss.item(), want_loss.item())
        assert grads.keys() == want_grads.keys(), case
        for param, error in gradient_errors(grads, want_grads).items():
            assert error < GRAD_TOL, (case, param, error)
            worst[f"{name} gradients"] = max(worst.get(f"{name} gradients", 0.0), error)
        worst[f"{name} loss"] = max(worst.get(f"{name} loss", 0.0), _rel(loss, want_loss))
    report_worst(worst)
