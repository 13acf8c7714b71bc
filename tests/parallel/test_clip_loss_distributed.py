"""clipshard.ClipLoss / clip_loss over real multi-process gloo groups, against open_clip's ClipLoss
(run in the same processes on the same data) and an fp64 single-process reference.

Each process group runs many checks (starting one costs time): all four (local_loss,
gather_with_grad) combinations, both modes, fp32, bf16 and fp16, with and without logit_bias, a
different upstream gradient on every rank; world size 3 adds unequal local batches; world size 2
adds DDP end to end and the cross-rank error cases. Every ClipLoss check runs with the compiled
kernels (algorithm="auto") and with the portable PyTorch path (algorithm="torch").
"""
import importlib.util
import math
import os
import warnings

import pytest
import torch
import torch.distributed as dist

import clipshard
from tests.dist_utils import report_worst, run_group
from tests.references.contrastive import clip_loss_rank_reference, clip_loss_reference

COMBINATIONS = [(True, True), (False, True), (True, False), (False, False)]  # (local_loss, gather_with_grad)
ALGORITHMS = ["auto", "torch"]  # the compiled kernels, the portable PyTorch path (docs/portable.md)


def _modes(local_loss, gather_with_grad):
    if local_loss and not gather_with_grad:
        return ["local"]  # exchange cannot drop open_clip's terms there (refused, see test_errors_without_group)
    return ["exchange", "local"]


def _open_clip_loss_class(name="ClipLoss"):
    """One of open_clip's loss classes, loaded from its loss.py alone (importing the package pulls
    in every model and takes seconds per process)."""
    spec = importlib.util.find_spec("open_clip")
    path = os.path.join(spec.submodule_search_locations[0], "loss.py")
    module_spec = importlib.util.spec_from_file_location("open_clip_loss_module", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return getattr(module, name)


def _global_batch(total, dim, seed):
    gen = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(total, dim, generator=gen, dtype=torch.float64), dim=1)
    text = torch.nn.functional.normalize(torch.randn(total, dim, generator=gen, dtype=torch.float64), dim=1)
    # correlate the pairs a little so that positives are not just noise
    text = torch.nn.functional.normalize(text + 0.5 * image, dim=1)
    return image, text


def _run_loss(loss_module, image, text, scale, bias, upstream):
    """Loss value and gradients of (features, scale, bias) on this rank after backward(upstream)."""
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in (image, text, scale, bias)]
    loss = loss_module(*leaves[:2], leaves[2], leaves[3])
    (loss * upstream).backward()
    return [loss.detach().double()] + [None if t is None else t.grad.double() for t in leaves]


def _all_reduce(x):
    x = x.clone()
    dist.all_reduce(x)
    return x


def _max_rel(got, want, floor=1e-30):
    return ((got - want).abs().max() / want.abs().max().clamp_min(floor)).item()


def _error(name, got, want):
    """Relative error; the logit_bias gradient of a softmax loss is exactly zero (a constant added to
    every logit of a row cancels), so it is compared in absolute terms."""
    return _max_rel(got, want, floor=1.0 if name == "bias" else 1e-30)


# Tolerances relative to the largest reference value: (loss, gradients).
TOLERANCE = {torch.float32: (2e-6, 2e-5), torch.float16: (2e-3, 1e-2), torch.bfloat16: (2e-3, 3e-2)}


def _compare_rank(rank, world_size, sizes, dtype, seed, scale_value, bias_value, check_open_clip):
    """All combinations and modes on one global batch; returns the largest differences seen."""
    open_clip_loss = _open_clip_loss_class()
    dim = 11
    image64, text64 = _global_batch(sum(sizes), dim, seed)
    offset = sum(sizes[:rank])
    local = slice(offset, offset + sizes[rank])
    image, text = image64[local].to(dtype), text64[local].to(dtype)
    # the reference sees exactly the rounded inputs
    image_ref, text_ref = image64.to(dtype).double(), text64.to(dtype).double()
    scale = torch.tensor(scale_value, dtype=torch.float32)
    bias = None if bias_value is None else torch.tensor(bias_value, dtype=torch.float32)
    upstream = [1.0 + 0.75 * q for q in range(world_size)]  # different on every rank
    loss_tol, grad_tol = TOLERANCE[dtype]
    worst = {}

    def note(key, value):
        worst[key] = max(worst.get(key, 0.0), value)

    for local_loss, gather_with_grad in COMBINATIONS:
        want = clip_loss_rank_reference(image_ref, text_ref, scale, bias, sizes, upstream, rank,
                                        local_loss, gather_with_grad)
        if check_open_clip:
            theirs = _run_loss(open_clip_loss(local_loss, gather_with_grad, rank=rank, world_size=world_size),
                               image, text, scale, bias, upstream[rank])
            theirs64 = _run_loss(open_clip_loss(local_loss, gather_with_grad, rank=rank, world_size=world_size),
                                 image_ref[local], text_ref[local], scale.double(),
                                 None if bias is None else bias.double(), upstream[rank])
            # the fp64 reference IS open_clip's semantics: check it, so the comparisons below mean it
            for name, got, exp in zip(["loss", "image", "text", "scale", "bias"], theirs64, want):
                if exp is not None:
                    error = _error(name, got, exp)
                    assert error < 1e-10, f"open_clip fp64 vs reference {local_loss, gather_with_grad}: {name} {error:.3g}"

        for mode, algorithm in [(m, a) for m in _modes(local_loss, gather_with_grad) for a in ALGORITHMS]:
            case = f"{dtype} world={world_size} sizes={sizes} local_loss={local_loss} gather_with_grad={gather_with_grad} mode={mode} bias={bias_value} algorithm={algorithm}"
            ours = _run_loss(clipshard.ClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world_size, mode=mode,
                                                algorithm=algorithm),
                             image, text, scale, bias, upstream[rank])
            scale_sum_only = mode == "exchange" and local_loss
            for k, name in enumerate(["loss", "image", "text", "scale", "bias"]):
                got, exp = ours[k], want[k]
                if exp is None:
                    assert got is None, (case, name)
                    continue
                if k >= 3 and scale_sum_only:
                    # exchange mode splits the logit_scale / logit_bias gradient differently between
                    # ranks; their sum over ranks (what DDP sees) must match
                    got, exp = _all_reduce(got), _all_reduce(exp)
                error = _error(name, got, exp)
                tol = loss_tol if k == 0 else grad_tol
                if check_open_clip and dtype != torch.float32:
                    # 16-bit: no worse than twice open_clip's own error on the same inputs
                    theirs_value = theirs[k] if not (k >= 3 and scale_sum_only) else _all_reduce(theirs[k])
                    tol = max(tol, 2 * _error(name, theirs_value, exp))
                assert error <= tol, f"{case}: {name} relative error {error:.3g} > {tol:.3g}"
                note(f"vs_fp64/{dtype}/{name}", error)
                if check_open_clip:
                    theirs_value = theirs[k] if not (k >= 3 and scale_sum_only) else _all_reduce(theirs[k])
                    note(f"vs_open_clip/{dtype}/{name}", _error(name, got, theirs_value))
                    note(f"open_clip_vs_fp64/{dtype}/{name}", _error(name, theirs_value, exp))
    return worst


def _rank_main(rank, world_size, sizes_list):
    warnings.filterwarnings("ignore", category=FutureWarning)  # open_clip's deprecated all_gather
    worst = {}
    for sizes in sizes_list:
        equal = len(set(sizes)) == 1
        runs = [(torch.float32, 1, 14.3, None), (torch.float32, 2, 100.0, -2.5),
                (torch.bfloat16, 3, 14.3, -1.0), (torch.bfloat16, 4, 30.0, None), (torch.float16, 5, 50.0, 0.5)]
        for dtype, seed, scale_value, bias_value in runs:
            found = _compare_rank(rank, world_size, sizes, dtype, seed, scale_value, bias_value, equal)
            for key, value in found.items():
                worst[key] = max(worst.get(key, 0.0), value)
    # the functional form on the world group, exact full-batch gradient
    image64, text64 = _global_batch(sum(sizes_list[0]), 11, 7)
    sizes = sizes_list[0]
    local = slice(sum(sizes[:rank]), sum(sizes[: rank + 1]))
    image = image64[local].clone().requires_grad_()
    scale = torch.tensor(20.0, dtype=torch.float64)
    loss = clipshard.clip_loss(image, text64[local], scale, local_loss=False)
    full = image64.clone().requires_grad_()
    want = clip_loss_reference(full, text64, scale)
    (want * world_size).backward()
    loss.backward()
    assert abs(loss.item() - want.item()) < 1e-12
    assert _max_rel(image.grad, full.grad[local]) < 1e-10
    return worst


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_matches_open_clip_and_fp64(world_size):
    sizes = [(6,) * world_size] if world_size != 4 else [(3,) * 4]
    results = run_group(_rank_main, world_size, sizes)
    report_worst(results[0])


def test_world_size_3_equal_and_unequal_batches():
    results = run_group(_rank_main, 3, [(4, 4, 4), (5, 3, 7)])
    report_worst(results[0])


def _subgroup_rank(rank, world_size):
    """Two independent pairs of ranks, each with its own process group (group=)."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates every group
    group, sub_rank = groups[rank // 2], rank % 2
    sizes = (4, 6) if rank < 2 else (5, 5)
    image64, text64 = _global_batch(sum(sizes), 11, seed=20 + rank // 2)
    local = slice(sum(sizes[:sub_rank]), sum(sizes[: sub_rank + 1]))
    scale = torch.tensor(17.0, dtype=torch.float64)
    upstream = [1.0, 2.0]
    for local_loss in (True, False):
        for mode in ("exchange", "local"):
            want = clip_loss_rank_reference(image64, text64, scale, None, sizes, upstream, sub_rank, local_loss, True)
            loss_fn = clipshard.ClipLoss(local_loss, True, rank=sub_rank, world_size=2, mode=mode, group=group)
            got = _run_loss(loss_fn, image64[local], text64[local], scale, None, upstream[sub_rank])
            for k in range(3):
                assert _max_rel(got[k], want[k]) < 1e-10, (rank, local_loss, mode, k)
    loss = clipshard.clip_loss(image64[local], text64[local], scale, local_loss=True, group=group)
    assert abs(loss.item() - clip_loss_rank_reference(image64, text64, scale, None, sizes, upstream, sub_rank,
                                                     True, True)[0].item()) < 1e-12
    return True


def test_process_subgroups():
    assert run_group(_subgroup_rank, 4) == [True] * 4


# ---------------------------------------------------------------------------------------------
# DDP end to end
# ---------------------------------------------------------------------------------------------


class _TinyClip(torch.nn.Module):
    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.image = torch.nn.Linear(9, 8, dtype=torch.float64)
        self.text = torch.nn.Linear(7, 8, dtype=torch.float64)
        for p in self.parameters():
            p.data = torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5
        self.logit_scale = torch.nn.Parameter(torch.tensor(math.log(10.0), dtype=torch.float64))
        self.logit_bias = torch.nn.Parameter(torch.tensor(-1.5, dtype=torch.float64))

    def forward(self, image, text):
        normalize = torch.nn.functional.normalize
        return (normalize(self.image(image), dim=1), normalize(self.text(text), dim=1),
                self.logit_scale.exp(), self.logit_bias)


def _ddp_rank(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    batch = 5
    gen = torch.Generator().manual_seed(3)
    images = torch.randn(batch * world_size, 9, generator=gen, dtype=torch.float64)
    texts = torch.randn(batch * world_size, 7, generator=gen, dtype=torch.float64)
    reference_model = _TinyClip()
    clip_loss_reference(*reference_model(images, texts)).backward()
    want = {n: p.grad for n, p in reference_model.named_parameters()}
    local = slice(rank * batch, (rank + 1) * batch)
    for local_loss in (True, False):
        for mode in ("exchange", "local", "ring"):
            model = DistributedDataParallel(_TinyClip())
            loss_fn = clipshard.ClipLoss(local_loss, True, rank=rank, world_size=world_size, mode=mode)
            loss_fn(*model(images[local], texts[local])).backward()
            for name, param in model.module.named_parameters():
                error = _error("bias" if name == "logit_bias" else name, param.grad, want[name])
                assert error < 1e-10, f"DDP local_loss={local_loss} mode={mode}: {name} off by {error:.3g}"
    return True


def test_ddp_gradients_equal_full_batch():
    assert run_group(_ddp_rank, 2) == [True, True]


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


def _expect_error(fn, match):
    with pytest.raises(ValueError, match=match):
        fn()
    # the group must still work (nobody is left inside a collective)
    probe = torch.ones(1)
    dist.all_reduce(probe)
    assert probe.item() == dist.get_world_size()


def _errors_rank(rank, world_size):
    features = lambda m, d, dtype=torch.float32: torch.randn(m, d, dtype=dtype)  # noqa: E731
    scale = torch.tensor(10.0)
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    _expect_error(lambda: clipshard.clip_loss(features(4, 8, dtype), features(4, 8, dtype), scale),
                  r"clip_loss: all ranks must use the same feature dtype, got rank 0: torch.float32, rank 1: torch.bfloat16")
    dim = 8 + rank
    _expect_error(lambda: clipshard.clip_loss(features(4, dim), features(4, dim), scale),
                  r"same feature dimension D, got rank 0: 8, rank 1: 9")
    text_rows = 3 if rank == 1 else 4
    match = (r"image_features and text_features must have the same shape, got \(4, 8\) and \(3, 8\) \(on rank 1\)"
             if rank == 1 else r"rank 1 has invalid inputs: image_features and text_features must have the same shape")
    _expect_error(lambda: clipshard.clip_loss(features(4, 8), features(text_rows, 8), scale), match)
    _expect_error(lambda: clipshard.ClipLoss(rank=0, world_size=2)(features(4, 8), features(4, 8), scale),
                  r"ClipLoss: rank 1 of the process group was given rank=0")
    _expect_error(lambda: clipshard.ClipLoss(rank=rank, world_size=3)(features(4, 8), features(4, 8), scale),
                  r"ClipLoss: rank 0 was given world_size=3 but the process group has 2 ranks")
    _expect_error(lambda: clipshard.clip_loss(features(4, 8), features(4, 8), scale, local_loss=rank == 0),
                  r"same loss options")
    bias = torch.tensor(0.5) if rank == 0 else None
    _expect_error(lambda: clipshard.clip_loss(features(4, 8), features(4, 8), scale, bias),
                  r"same presence of logit_bias")
    return True


def test_errors_across_ranks_raise_on_every_rank():
    assert run_group(_errors_rank, 2, timeout=60) == [True, True]


def test_errors_without_group():
    image, text, scale = torch.randn(4, 8), torch.randn(4, 8), torch.tensor(10.0)
    with pytest.raises(ValueError, match="use_horovod=True is not supported"):
        clipshard.ClipLoss(use_horovod=True)
    with pytest.raises(RuntimeError, match="world_size=2 but torch.distributed is not initialised"):
        clipshard.ClipLoss(rank=0, world_size=2)(image, text, scale)
    with pytest.raises(ValueError, match="mode must be 'exchange', 'local', 'ring' or None, got 'both'"):
        clipshard.ClipLoss(mode="both")
    with pytest.raises(ValueError, match="mode='exchange' cannot reproduce"):
        clipshard.ClipLoss(local_loss=True, gather_with_grad=False, mode="exchange")
    with pytest.raises(TypeError, match="ClipLoss: image_features and text_features must have the same dtype"):
        clipshard.ClipLoss()(image, text.half(), scale)
