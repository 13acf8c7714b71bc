"""clipshard's losses inside an FSDP2 model, 2 gloo ranks on CPU: a tiny CLIP (two towers, learned
logit_scale and logit_bias, the root's 1-element parameters sharded so that one rank holds empty
shards) trained a few steps with fully_shard + clipshard loss + clipshard AdamW gives the per-step
losses of the same run under DDP, for ClipLoss in every (local_loss, gather_with_grad, mode) and
SigLipLoss; and a training step (forward, distributed loss, backward, optimizer step) under
torch.compile gives the eager results. One process group runs every case."""
import io
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import clipshard
from clipshard.optim import AdamW
from tests.dist_utils import run_group

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch without torch.distributed")

STEPS = 3
LOSSES = [  # (class name, constructor options, uses logit_bias)
    ("ClipLoss", dict(local_loss=False, gather_with_grad=False), False),
    ("ClipLoss", dict(local_loss=True, gather_with_grad=False), False),
    ("ClipLoss", dict(local_loss=False, gather_with_grad=True), True),
    ("ClipLoss", dict(local_loss=True, gather_with_grad=True), False),
    ("ClipLoss", dict(local_loss=True, gather_with_grad=True, mode="local"), False),
    ("ClipLoss", dict(local_loss=False, gather_with_grad=True, mode="local"), True),
    ("SigLipLoss", dict(), True),
]


class TinyClip(nn.Module):
    """Image tower: an MLP on 12 features; text tower: mean of token embeddings, then a Linear."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.image = nn.Sequential(nn.Linear(12, 16), nn.GELU(), nn.Linear(16, 8))
        self.text = nn.Sequential(nn.Embedding(20, 16), nn.Linear(16, 8))
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        self.logit_scale = nn.Parameter(torch.full((1,), math.log(10.0)))
        self.logit_bias = nn.Parameter(torch.full((1,), -2.0))

    def forward(self, images, tokens):
        image = F.normalize(self.image(images), dim=-1)
        text = F.normalize(self.text(tokens).mean(dim=1), dim=-1)
        # (a clone: DDP with find_unused_parameters looks for parameters from the outputs' graph)
        return image, text, self.logit_scale.exp(), self.logit_bias.clone()


def _batch(step, rank):
    """This rank's batch at `step`; ranks hold different batches of different sizes."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    size = 6 + rank
    return torch.randn(size, 12, generator=gen), torch.randint(0, 20, (size, 5), generator=gen)


def _fsdp2(model, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (world_size,))
    fully_shard(model.image, mesh=mesh)
    fully_shard(model.text, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _ddp(model):
    return nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)  # (logit_bias, for ClipLoss)


def _losses(wrap, loss_fn, use_bias, rank):
    """Per-step losses of STEPS training steps of a fresh TinyClip wrapped by `wrap`."""
    model = wrap(TinyClip())
    opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    losses = []
    for step in range(STEPS):
        image, text, scale, bias = model(*_batch(step, rank))
        loss = loss_fn(image, text, scale, bias) if use_bias or isinstance(loss_fn, clipshard.SigLipLoss) \
            else loss_fn(image, text, scale)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _compiled_against_eager(rank, world_size):
    """The same training step eager and under torch.compile (aot_eager: dynamo's graph capture,
    graph breaks and AOT autograd, without inductor's C++ compile time on CPU)."""
    from torch._dynamo.utils import counters

    def make_step(model, opt, loss_fn):
        def train_step(images, tokens):
            # (with the bias: a compiled graph gives unused parameters zero gradients, not None)
            image, text, scale, bias = model(images, tokens)
            loss = loss_fn(image, text, scale, bias)
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.detach()
        return train_step

    results = []
    for compiled in (False, True):
        model = _fsdp2(TinyClip(), world_size)
        opt = AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        step = make_step(model, opt, clipshard.ClipLoss(local_loss=True, gather_with_grad=True,
                                                        rank=rank, world_size=world_size))
        if compiled:
            torch._dynamo.reset()
            counters.clear()
            step = torch.compile(step, backend="aot_eager")
        losses = [step(*_batch(s, rank)).item() for s in range(STEPS)]
        params = [p.full_tensor().detach() for p in model.parameters()]
        results.append((losses, params))
    breaks = {reason.splitlines()[0]: count for reason, count in counters["graph_break"].items()}
    (eager_losses, eager_params), (compiled_losses, compiled_params) = results
    return eager_losses, compiled_losses, eager_params, compiled_params, breaks


def _on_ranks(rank, world_size):
    out = {}
    for index, (name, options, use_bias) in enumerate(LOSSES):
        def make_loss():
            return getattr(clipshard, name)(rank=rank, world_size=world_size, **options)
        out[index] = (_losses(_ddp, make_loss(), use_bias, rank),
                      _losses(lambda m: _fsdp2(m, world_size), make_loss(), use_bias, rank))
    out["compile"] = _compiled_against_eager(rank, world_size)
    buffer = io.BytesIO()  # tensors go back serialised (see tests/optim/test_adamw_fsdp2.py)
    torch.save(out, buffer)
    return buffer.getvalue()


def test_losses_under_fsdp2_equal_ddp_and_compiled_step_equals_eager():
    results = [torch.load(io.BytesIO(b)) for b in run_group(_on_ranks, 2, timeout=420)]
    worst = 0.0
    for rank, out in enumerate(results):
        for index, (name, options, _) in enumerate(LOSSES):
            ddp, fsdp = out[index]
            for step, (a, b) in enumerate(zip(ddp, fsdp)):
                rel = abs(a - b) / abs(a)
                worst = max(worst, rel)
                assert rel <= 1e-5, (rank, name, options, step, a, b)
        eager_losses, compiled_losses, eager_params, compiled_params, breaks = out["compile"]
        print(f"  rank {rank}: graph breaks {sum(breaks.values())}: {breaks}")
        torch.testing.assert_close(compiled_losses, eager_losses, rtol=1e-6, atol=0)
        for a, b in zip(compiled_params, eager_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    print(f"  FSDP2 against DDP: max relative difference of the per-step losses {worst:.3g}")
