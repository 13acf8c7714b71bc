"""The layout of the ranks while a memory plan traces a loss (clipshard.plan_memory, docs/scale.md).

A plan runs the loss on fake tensors over a fake process group, where the metadata exchange cannot
run: it reads the ranks' rows to the host, and fake tensors hold no values. The plan states the
layout instead (every rank has the same local batch and the same count of hard negatives, as
plan_memory's arguments say), and shard_layout takes it from here after this rank's own checks
(while clipshard.ops.planned_device.tracing_a_plan() is true).
"""
import torch.distributed as dist

from clipshard.parallel.layout import ShardLayout


def planned_layout(group, batch, negatives):
    """The ShardLayout of a plan being traced: every rank with `batch` pairs and `negatives` hard
    negatives (None: without them)."""
    world_size = dist.get_world_size(group)
    return ShardLayout(sizes=(batch,) * world_size, rank=dist.get_rank(group), group=group,
                       negative_sizes=None if negatives is None else (negatives,) * world_size)
