"""Counting the host's blocking reads of tensor data (docs/distributed.md, "Compiling and host syncs").

On a GPU every read of a device value by the host (`.item()`, `bool(t)`, `.tolist()`, `.cpu()`) and
every blocking copy between host and device waits for the work queued before it: the CPU stops
launching kernels until the GPU catches up. `HostReads` counts them while a block runs:

- `aten._local_scalar_dense` (what `.item()`, `bool(t)`, `int(t)`, `float(t)` dispatch to);
- copies between the CPU and another device (`.cpu()`, `.to(...)`, `copy_`), unless non_blocking;
- `Tensor.tolist()` / `Tensor.numpy()` of CPU tensors, which read memory without dispatching an op
  (on another device they first copy to the host, which the previous rule counts).

On CPU tensors none of these waits for anything, but the same code on a GPU would: the count is
the number of synchronisations the code would make there. Autograd's backward runs in the calling
thread for CPU tensors, so a block that calls `backward()` counts its reads too.
"""
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_COPIES = (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)


def _device_of(value):
    return value.device if torch.is_tensor(value) else None


def _crosses_host(func, args, kwargs, out):
    """A blocking copy between the CPU and another device."""
    if func is torch.ops.aten.copy_.default:
        dst, src = args[0], args[1]
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
    else:
        src, dst = args[0], out
        non_blocking = kwargs.get("non_blocking", False)
    devices = {_device_of(src).type, _device_of(dst).type}
    return not non_blocking and "cpu" in devices and len(devices) == 2


class _Dispatch(TorchDispatchMode):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads.append(f"{func} ({args[0].device})")
        elif func in _COPIES and _crosses_host(func, args, kwargs, out):
            self.reads.append(str(func))
        return out


class _Function(TorchFunctionMode):
    def __init__(self, reads):
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (torch.Tensor.tolist, torch.Tensor.numpy) and args and args[0].device.type == "cpu":
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


class HostReads:
    """`with HostReads() as reads: ...`; then `reads.count` and `reads.events` (what was read)."""

    def __init__(self):
        self.events = []
        self._modes = (_Function(self.events), _Dispatch(self.events))

    @property
    def count(self):
        return len(self.events)

    def __enter__(self):
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False
