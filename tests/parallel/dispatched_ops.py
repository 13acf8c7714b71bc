"""What a loss call dispatches, forward and backward: no op that is nondeterministic on CUDA (float
atomics: index_add, scatter_add, index_put with accumulate, bincount, ... and the backwards that
call them) and none that waits for the device or has an output shape that depends on the data
(unique, nonzero, masked_select, .item(), ...), docs/fused_loss.md, "Determinism".

A TorchDispatchMode records every aten op a call dispatches. On the CPU this is what the same call
dispatches on CUDA: the Python code, and so the ops, are the same; the compiled kernels are single
ops (clipshard::*). The losses' one metadata exchange per call (validation, documented, before any
collective) is left out: the recorder pauses inside exchange_rows. `offending_ops(rank, world_size)`
runs every loss, mode and target with sample ids (and the calls without ids), on one rank of a
process group or alone, and returns the offending ops per call."""
import collections
import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import clipshard
from clipshard.integrations import sentence_transformers_loss as st_loss
from clipshard.losses import base
from clipshard.parallel import agreement
from clipshard.parallel.layout import ShardLayout

# Float atomics or a nondeterministic algorithm on CUDA (torch.use_deterministic_algorithms changes
# or refuses them); index_select_backward and the gather's backward are index_add / scatter_add.
NONDETERMINISTIC = {"index_add", "index_add_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                    "index_reduce", "index_reduce_", "index_copy", "index_copy_", "bincount", "histc", "cumsum",
                    "cumsum_", "embedding_dense_backward", "_embedding_bag_backward", "index_select_backward",
                    "_unsafe_index_put", "put", "put_"}
ACCUMULATING = {"index_put", "index_put_", "_index_put_impl_"}  # nondeterministic with accumulate=True
# A host sync (a value read back) or an output shape that depends on the data.
SYNCING = {"_local_scalar_dense", "item", "nonzero", "argwhere", "masked_select", "_unique", "_unique2",
           "unique_dim", "unique_consecutive", "unique_dim_consecutive", "equal", "is_nonzero", "allclose",
           "repeat_interleave", "masked_scatter", "_assert_async"}


def _offence(func, args, kwargs):
    name = func._overloadpacket.__name__
    if name in NONDETERMINISTIC or name in SYNCING:
        return name
    if name in ACCUMULATING and (kwargs.get("accumulate") or (len(args) > 3 and args[3])):
        return f"{name}(accumulate=True)"
    if name == "index" and any(t is not None and t.dtype == torch.bool for t in args[1]):
        return "index with a boolean mask"
    return None


class OpRecorder(TorchDispatchMode):
    """Records the offending ops dispatched while active (not while paused)."""

    def __init__(self):
        super().__init__()
        self.offences, self.paused = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.paused:
            offence = _offence(func, args, kwargs)
            if offence is not None:
                self.offences.append(offence)
        return func(*args, **kwargs)


@contextlib.contextmanager
def recording():
    """An OpRecorder, paused inside the metadata exchange (exchange_rows, wherever it is called from)."""
    recorder = OpRecorder()
    original = agreement.exchange_rows

    def paused_exchange(*args, **kwargs):
        recorder.paused += 1
        try:
            return original(*args, **kwargs)
        finally:
            recorder.paused -= 1

    patched = [(agreement, "exchange_rows"), (base, "exchange_rows")]
    for module, name in patched:
        setattr(module, name, paused_exchange)
    try:
        with recorder:
            yield recorder
    finally:
        for module, name in patched:
            setattr(module, name, original)


D, H = 6, 3


class _LinearClip(nn.Module):
    """Two Linear towers (nothing in the model itself that would be recorded) for GradCache."""

    def __init__(self):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.image, self.text = nn.Linear(5, D), nn.Linear(4, D)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(10.0)))
        self.logit_bias = nn.Parameter(torch.tensor(-3.0))

    def encode_text(self, texts):
        return F.normalize(self.text(texts), dim=-1)

    def forward(self, images, texts):
        return {"image_features": F.normalize(self.image(images), dim=-1), "text_features": self.encode_text(texts),
                "logit_scale": self.logit_scale.exp(), "logit_bias": self.logit_bias}


def _features(n, seed):
    gen = torch.Generator().manual_seed(seed)
    return F.normalize(torch.randn(n, D, generator=gen), dim=1)


def _calls(rank, world_size, m):
    """(name, thunk): every loss call with ids; each thunk runs forward and backward."""
    image, text, negatives = _features(m, rank), _features(m, 10 + rank), _features(H, 20 + rank)
    ids = (torch.arange(m) + 3 * rank) % 5  # repeats within and across ranks
    scale, bias = torch.tensor(10.0), torch.tensor(-3.0)

    def run(loss_fn, **kwargs):
        def thunk():
            leaves = [t.clone().requires_grad_() for t in (image, text, negatives, scale, bias)]
            loss_fn(*leaves, **kwargs).backward()
        return thunk

    for targets in ("mask", "multi"):
        for algorithm in ("auto", "torch"):
            for local_loss, gather_with_grad in [(True, True), (False, True), (True, False), (False, False)]:
                for mode in ["local"] if local_loss and not gather_with_grad else ["exchange", "local", "ring"]:
                    module = clipshard.ClipLoss(local_loss, gather_with_grad, rank=rank, world_size=world_size,
                                                mode=mode, algorithm=algorithm)
                    yield (f"ClipLoss({local_loss}, {gather_with_grad}, {mode}, {algorithm}) {targets}",
                           run(lambda i, t, h, s, b: module(i, t, s, hard_negatives=h, sample_ids=ids,
                                                            targets=targets)))
            for mode in ("gather", "ring"):
                module = clipshard.SigLipLoss(rank=rank, world_size=world_size, mode=mode, algorithm=algorithm)
                yield (f"SigLipLoss({mode}, {algorithm}) {targets}",
                       run(lambda i, t, h, s, b: module(i, t, s, b, hard_negatives=h, sample_ids=ids, targets=targets)))
        yield f"GradCache(ClipLoss) {targets}", _grad_cache(clipshard.ClipLoss(), m, ids, targets)
        yield f"GradCache(SigLipLoss) {targets}", _grad_cache(clipshard.SigLipLoss(), m, ids, targets)
        yield f"sentence-transformers {targets}", _sentence_transformers(rank, world_size, m, ids, targets)
    # and without ids: every loss's plain path (and the distillation loss, which takes no ids)
    for algorithm in ("auto", "torch"):
        for mode in ("exchange", "local", "ring"):
            module = clipshard.ClipLoss(rank=rank, world_size=world_size, mode=mode, algorithm=algorithm)
            yield f"ClipLoss({mode}, {algorithm}) without ids", run(lambda i, t, h, s, b: module(i, t, s))
        for mode in ("gather", "ring"):
            module = clipshard.SigLipLoss(rank=rank, world_size=world_size, mode=mode, algorithm=algorithm)
            yield f"SigLipLoss({mode}, {algorithm}) without ids", run(lambda i, t, h, s, b: module(i, t, s, b))
        for mode in ("exchange", "local", "ring"):
            module = clipshard.DistillClipLoss(rank=rank, world_size=world_size, mode=mode, algorithm=algorithm)
            yield (f"DistillClipLoss({mode}, {algorithm})",
                   run(lambda i, t, h, s, b: sum(module(i, t, s, t.detach() * 0.5 + 0.1, i.detach(), 7.0))))


def _grad_cache(loss_fn, m, ids, targets):
    def thunk():
        gen = torch.Generator().manual_seed(4)
        model = _LinearClip()
        cache = clipshard.GradCache(model, lambda **kw: loss_fn(**kw, targets=targets), 4,
                                    encode_text=model.encode_text)
        cache(torch.randn(m, 5, generator=gen), torch.randn(m, 4, generator=gen), sample_ids=ids,
              hard_negative_texts=torch.randn(H, 4, generator=gen)).backward()
    return thunk


def _sentence_transformers(rank, world_size, m, ids, targets):
    def thunk():
        import torch.distributed as dist
        queries, docs = _features(m, 30 + rank).requires_grad_(), [_features(m, 40 + rank).requires_grad_(),
                                                                  _features(m, 50 + rank).requires_grad_()]
        group = dist.group.WORLD if world_size > 1 else None
        layout = ShardLayout((m,) * world_size, rank, group)
        options = st_loss.RankingOptions(20.0, True, st_loss.DIRECTIONS, "joint", targets)
        st_loss.ranking_loss(queries, docs, options, layout, ids).backward()
    return thunk


def known_syncs(world_size):
    """{call prefix: {op: times}}: the host syncs that are there on purpose, one decision per backward
    on the values of the upstream gradients (not from the ids, no data-dependent shape): SigLIP's
    ring backward asks whether every rank's upstream gradient is the same (same_on_every_rank: one
    read), the full-batch distillation loss's backward whether the ranks' upstream gradients are
    uniform (one read)."""
    if world_size == 1:
        return {}
    return {"SigLipLoss(ring": {"_local_scalar_dense": 1}, "DistillClipLoss(": {"_local_scalar_dense": 1}}


def unexpected_ops(rank, world_size, m=5):
    """{call: {offending op: times}} for every call that dispatched an offending op beyond its
    known_syncs; empty when every call is clean."""
    known = known_syncs(world_size)
    unexpected = {}
    for name, ops in offending_ops(rank, world_size, m).items():
        allowed = next((ops_ for prefix, ops_ in known.items() if name.startswith(prefix)), {})
        if ops != allowed:
            unexpected[name] = ops
    return unexpected


def offending_ops(rank, world_size, m=5):
    """{call: {offending op: times}} for every call that dispatched one."""
    found = {}
    for name, thunk in _calls(rank, world_size, m):
        with recording() as recorder:
            thunk()
        if recorder.offences:
            found[name] = dict(collections.Counter(recorder.offences))
    return found
