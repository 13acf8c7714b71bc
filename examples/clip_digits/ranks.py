"""Who this process is among the ranks (torchrun's environment), and the few collectives the
example needs beyond the loss. Without torchrun the example runs as a single rank."""
import os

import torch
import torch.distributed as dist


def cuda_fits() -> bool:
    """Whether every rank on this machine can have a GPU of its own (NCCL needs that)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))


class Ranks:
    """Who we are: rank, world size, device. Runs without torchrun as a single rank."""

    def __init__(self, device: str, backend: str):
        self.world_size = int(os.environ.get("WORLD_SIZE", 1))
        self.rank = int(os.environ.get("RANK", 0))
        self.distributed = "WORLD_SIZE" in os.environ
        if device == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            torch.cuda.set_device(local_rank)
            self.device = torch.device("cuda", local_rank)
        else:
            self.device = torch.device("cpu")
        self.backend = backend
        if self.distributed:
            dist.init_process_group(backend, device_id=self.device if device == "cuda" else None)

    def mean(self, value: torch.Tensor) -> float:
        value = value.detach().float().clone()
        if self.distributed:
            dist.all_reduce(value)
            value /= self.world_size
        return value.item()

    def gather(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj):
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self, finished: bool):
        """Leaves the process group; waits for the other ranks only after a clean finish (a rank
        that failed must not hang here: torchrun stops the others)."""
        if self.distributed:
            if finished:
                dist.barrier()
            dist.destroy_process_group()
