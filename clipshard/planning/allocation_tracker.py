"""Counting the bytes a traced computation allocates, as it happens (docs/scale.md).

`AllocationTracker` is a TorchDispatchMode that sits above torch's FakeTensorMode: every op that
runs while it is active passes through it, and every new storage among the op's outputs is counted
as live until Python frees it (a weak reference's callback). Views share their base's storage and
count once; in-place ops allocate nothing. The tensors that existed before the tracker started (the
loss's inputs) are not counted. The peak is the largest live total seen, with the allocations live
at that moment, each labelled by what made it (the clipshard function that called the op, the op,
the shape and dtype).

Where two contributions to one gradient meet, autograd's engine sums them as old + new: on real
tensors in place into old when the engine holds old's last reference, on fake tensors (a tensor
subclass) never. The tracker counts such a sum as made in place when old dies with it.

A compiled kernel's own temporaries (its workspace) are invisible to its fake kernel, which only
makes the outputs: for the clipshard ops the tracker asks
clipshard.planning.kernel_workspaces for the temporaries the kernel holds at its own peak, and
counts them as live for that instant; likewise, for the collectives of the fake process group,
clipshard.planning.collective_workspaces for the staging buffers of the backend planned for.
"""
import sys
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from clipshard.planning import collective_workspaces, kernel_workspaces

_PACKAGE_DIR = __file__.rsplit("/planning/", 1)[0] + "/"
_OWN_FILES = (_PACKAGE_DIR + "planning/", _PACKAGE_DIR + "ops/no_autocast.py")
# the frames between a dispatch mode's __torch_dispatch__ and the code that called the op
_DISPATCH_WRAPPERS = ("/torch/_dynamo/eval_frame.py", "/torch/_compile.py", "/torch/utils/_python_dispatch.py")


@dataclass(frozen=True)
class Allocation:
    """One live allocation: its size in bytes and what it is."""

    nbytes: int
    what: str


def _caller():
    """The innermost clipshard function (outside the planner) on the Python stack: 'module.function',
    or '(outside clipshard)'."""
    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if filename.startswith(_PACKAGE_DIR) and not filename.startswith(_OWN_FILES):
            module = filename[len(_PACKAGE_DIR):].removesuffix(".py").replace("/", ".")
            return f"{module}.{frame.f_code.co_name}"
        frame = frame.f_back
    return "(outside clipshard)"


def _sums_gradients(func, args, kwargs, out):
    """Whether the op is autograd's engine summing two contributions to one gradient (old + new,
    called by the engine itself, not from a backward written in Python), with grad mode off."""
    if func is not torch.ops.aten.add.Tensor or kwargs or len(args) != 2 or torch.is_grad_enabled():
        return False
    if not all(torch.is_tensor(t) and t.shape == out.shape and t.dtype == out.dtype for t in args):
        return False
    old = args[0]  # the engine adds in place only into a dense buffer of the sum's size
    if not old.is_contiguous() or old.untyped_storage().nbytes() != out.untyped_storage().nbytes():
        return False
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.endswith(_DISPATCH_WRAPPERS):
        frame = frame.f_back
    return frame is not None and "/torch/autograd/" in frame.f_code.co_filename


def _describe(tensor):
    return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"


class AllocationTracker(TorchDispatchMode):
    """Live bytes, their peak and the allocations at the peak, of the ops run inside the block.

    round_to: allocations are counted rounded up to this many bytes (the CUDA caching allocator
    rounds every block to 512 bytes; the CPU allocator counts what was asked). device_type: whose
    kernel workspace rules apply to the clipshard ops ("cpu" or "cuda")."""

    def __init__(self, device_type, round_to=1):
        super().__init__()
        self.device_type, self.round_to = device_type, round_to
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_allocations = ()
        self._live = {}  # id(storage) -> Allocation, for the storages still alive
        self._finalizers = []
        self._summed = None  # a gradient sum whose peak waits for the next op (see _note_sum)

    def _rounded(self, nbytes):
        return -(-nbytes // self.round_to) * self.round_to

    def _note_peak(self, transient=()):
        self._note(self.live_bytes + sum(a.nbytes for a in transient), tuple(self._live.values()) + tuple(transient))

    def _note(self, total, allocations):
        if total > self.peak_bytes:
            self.peak_bytes, self.peak_allocations = total, allocations

    def _note_sum(self, old, out):
        """Autograd sums two contributions to a gradient as old + new: on real tensors in place into
        `old` when it holds old's last reference (no allocation), on fake tensors (a tensor subclass)
        never. Which it was shows once the sum is stored: `old` freed means it was the last
        reference. Until the next op: the peak of either case, and the key of `old`."""
        out_key = id(out.untyped_storage())
        everything = tuple(self._live.values())
        in_place = tuple(a for key, a in self._live.items() if key != out_key)
        self._summed = (id(old.untyped_storage()), (self.live_bytes, everything),
                        (self.live_bytes - self._live[out_key].nbytes, in_place))

    def _settle_sum(self):
        if self._summed is not None:
            old_key, out_of_place, in_place = self._summed
            self._summed = None
            self._note(*(out_of_place if old_key in self._live else in_place))

    def _track(self, tensor, what):
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self._live:
            return
        allocation = Allocation(self._rounded(storage.nbytes()), what)
        self._live[key] = allocation
        self.live_bytes += allocation.nbytes
        self._finalizers.append(weakref.finalize(storage, self._release, key))

    def _release(self, key):
        allocation = self._live.pop(key, None)
        if allocation is not None:
            self.live_bytes -= allocation.nbytes

    def allocation_of(self, tensor):
        """The live Allocation of `tensor`'s storage, or None (made before the tracker, or freed)."""
        return self._live.get(id(tensor.untyped_storage()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self._settle_sum()
        before = {id(t.untyped_storage()) for t in tree_leaves((args, kwargs)) if torch.is_tensor(t)}
        out = func(*args, **kwargs)
        caller = _caller()
        op_name = func.name().removesuffix(".default")
        for tensor in tree_leaves(out):
            if torch.is_tensor(tensor) and id(tensor.untyped_storage()) not in before:
                self._track(tensor, f"{caller}: {op_name} -> {_describe(tensor)}")
        if _sums_gradients(func, args, kwargs, out) and id(args[0].untyped_storage()) in self._live:
            self._note_sum(args[0], out)
            return out
        workspace = kernel_workspaces.internal_allocations(func, self.device_type, args, kwargs)
        workspace += collective_workspaces.internal_allocations(func, self.device_type, args)
        self._note_peak([Allocation(self._rounded(n), f"{caller}: {op_name} workspace: {what}")
                         for what, n in workspace])
        return out

    def __exit__(self, *exc):
        self._settle_sum()
        for finalizer in self._finalizers:
            finalizer.detach()
        return super().__exit__(*exc)
