"""The layout of the ranks while a memory plan traces a loss (clipshard.plan_memory, docs/scale.md).

A plan runs the loss on fake tensors over a fake process group, where the metadata exchange cannot
run: it reads the ranks' rows to the host, and fake tensors hold no values. The plan states the
layout instead (every rank has the same local batch and the same count of hard negatives, as
plan_memory's arguments say), and shard_layout takes it from here after this rank's own checks.
"""
import contextlib
import contextvars

import torch.distributed as dist

from clipshard.parallel.layout import ShardLayout

_equal_shards = contextvars.ContextVar("clipshard_planned_equal_shards", default=False)


@contextlib.contextmanager
def equal_shards():
    """Within the block, every rank of a process group is taken to hold this rank's batch sizes."""
    token = _equal_shards.set(True)
    try:
        yield
    finally:
        _equal_shards.reset(token)


def in_memory_plan():
    """Whether a memory plan is being traced: every rank is then this rank's copy, so a question
    about the ranks' agreement (a host read, which fake tensors cannot answer) has the answer yes."""
    return _equal_shards.get()


def planned_layout(group, batch, negatives):
    """The ShardLayout of a plan being traced (`negatives`: this rank's count of hard negatives, or
    None without them), or None outside a plan."""
    if not in_memory_plan():
        return None
    world_size = dist.get_world_size(group)
    return ShardLayout(sizes=(batch,) * world_size, rank=dist.get_rank(group), group=group,
                       negative_sizes=None if negatives is None else (negatives,) * world_size)
