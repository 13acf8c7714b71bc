"""Who this process is among the ranks (torchrun's environment), and the few collectives the
example needs beyond the loss. Without torchrun the example runs as a single rank."""
import contextlib
import os
import signal
import sys
import traceback

import torch
import torch.distributed as dist


def cuda_fits() -> bool:
    """Whether every rank on this machine can have a GPU of its own (NCCL needs that)."""
    return torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE", 1))


class Refusal(Exception):
    """A reason to stop that every rank raises at the same point, after the ranks exchanged what
    each found (so the message is the same everywhere): they can still leave the group together."""


class Terminated(Exception):
    """SIGTERM, as an exception that the shutdown handling sees."""


def _raise_terminated(signum, frame):
    raise Terminated("SIGTERM (torchrun stops every rank when one fails; or the run was cancelled)")


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

    @contextlib.contextmanager
    def leaving_cleanly(self):
        """Runs the body, then leaves the process group, on every path:
        - finished, or refused on every rank (Refusal): the ranks meet at a barrier, then leave
          together (tearing the group down while another rank still uses it can abort that rank),
          and from then on ignore SIGTERM; a refusal exits with status 1 and its message;
        - failed on this rank alone (an error, or torchrun's SIGTERM after another rank failed): the
          others cannot meet it at a barrier, so it prints what happened and exits at once with
          status 1, without tearing down the group; its closed connections make the others'
          collectives fail, and they exit the same way."""
        signal.signal(signal.SIGTERM, _raise_terminated)
        refusal = None
        try:
            try:
                yield
            except Refusal as error:
                refusal = error
            self._leave_together()
        except BaseException as error:  # noqa: BLE001 (every failure must end the process cleanly)
            if not self.distributed:
                raise
            _exiting_now()
            traceback.print_exc()
            print(f"rank {self.rank}: stopped by {type(error).__name__}: {error}", file=sys.stderr, flush=True)
            sys.stdout.flush()
            os._exit(1)
        if refusal is not None:
            raise SystemExit(str(refusal))

    def _leave_together(self):
        if self.distributed:
            dist.barrier()
            dist.destroy_process_group()
        _exiting_now()


def _exiting_now():
    """From here the process only exits: torchrun's SIGTERM, sent to the ranks still running when one
    exits with an error (a refusal included), must not cut short an exit already under way."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
