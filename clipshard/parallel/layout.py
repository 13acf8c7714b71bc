"""The process group and where each rank's rows sit in the global batch (docs/distributed.md)."""
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ShardLayout:
    """Where this rank's rows sit in the global (concatenated) batch."""

    sizes: tuple  # local batch size of every rank, in rank order
    rank: int
    group: object  # a ProcessGroup, or None for a single process
    negative_sizes: tuple = None  # every rank's count H_r of extra columns (hard negatives), or None

    def negatives_layout(self):
        """The layout of the ranks' hard negatives (H_r rows on rank r, H_r may be 0), for
        gathering them like the texts (collectives.gather_rows)."""
        return ShardLayout(sizes=self.negative_sizes, rank=self.rank, group=self.group)

    @property
    def world_size(self):
        return len(self.sizes)

    @property
    def offset(self):
        return sum(self.sizes[: self.rank])

    @property
    def local_size(self):
        return self.sizes[self.rank]

    @property
    def total(self):
        return sum(self.sizes)


def single_process_layout(batch_size):
    return ShardLayout(sizes=(batch_size,), rank=0, group=None)


def process_group(fn, group):
    """The process group to use: `group`, else the world group when torch.distributed is
    initialised, else None (a single process)."""
    initialised = dist.is_available() and dist.is_initialized()
    if group is None and not initialised:
        return None
    if not initialised:
        raise RuntimeError(f"{fn}: a process group was given but torch.distributed is not initialised")
    return group if group is not None else dist.group.WORLD


_ACCELERATOR_ONLY_BACKENDS = ("xccl", "hccl")


def metadata_device(group):
    """Where small host-side metadata travels: a device every rank's backend serves whatever its
    inputs are (a rank with inputs on an unusable device must still take part, to report it):
    NCCL's (RCCL's) CUDA device, the current accelerator for the other backends that serve only
    their accelerator (XCCL on XPU, HCCL on HPU), else the CPU (gloo, mpi, "cpu:gloo,cuda:nccl" pairs)."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if backend in _ACCELERATOR_ONLY_BACKENDS:
        accelerator = torch.accelerator.current_accelerator()
        return torch.device(accelerator.type, torch.accelerator.current_device_index())
    return torch.device("cpu")
