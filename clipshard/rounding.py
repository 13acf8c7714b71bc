"""Stochastic rounding of fp32 tensors to fp16 / bf16 (docs/stochastic_rounding.md).

x between the neighbours lo < x < hi of the target format becomes hi with probability
(x - lo) / (hi - lo), else lo, so E[stochastic_round(x)] = x. The random bits are Philox4x32-10:
element i (row-major) uses word i % 4 of Philox(key=seed, counter=(i // 4, offset)), so the result
depends only on (x, seed, offset), and CPU and CUDA agree bit for bit.

Autograd: the gradient of stochastic_round is the identity (straight-through), as for torch's own
cast x.to(dtype), and E[stochastic_round(x)] = x makes it the gradient of the expected result.
stochastic_round_ is an in-place write with torch's copy_ semantics: it bumps dst's version counter
(so a graph that saved dst raises in backward), refuses a leaf that requires grad while grad mode
is on, and passes the same identity gradient from dst to src.
"""
import torch

from clipshard.ops.inputs import check_bool, check_generator
from clipshard.ops.seeds import as_int64, draw_seed_offset
from clipshard.ops.stochastic_round import round_into, round_to

_TARGETS = (torch.float16, torch.bfloat16)


def _check_source(fn: str, name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fn}: {name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.float32:
        raise TypeError(f"{fn}: {name} must be float32, got {x.dtype}")


def _check_target(fn: str, name: str, dtype) -> None:
    if dtype not in _TARGETS:
        raise TypeError(f"{fn}: {name} must be torch.float16 or torch.bfloat16, got {dtype}")


def _as_uint64(fn: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{fn}: {name} must be a Python int in [0, 2**64), got {type(value).__name__}")
    if not 0 <= value < (1 << 64):
        raise ValueError(f"{fn}: {name} must be in [0, 2**64), got {value}")
    return as_int64(value)


def _seed_offset(fn: str, device: torch.device, seed, offset, generator) -> tuple[int, int]:
    """Explicit (seed, offset) as given, else a fresh pair from the generator."""
    if (seed is None) != (offset is None):
        raise ValueError(f"{fn}: give both seed and offset or neither, got seed={seed!r}, offset={offset!r}")
    if seed is None:
        check_generator(fn, generator, device)
        return draw_seed_offset(device, generator)
    if generator is not None:
        raise ValueError(f"{fn}: give either seed and offset or a generator, not both")
    return _as_uint64(fn, "seed", seed), _as_uint64(fn, "offset", offset)


def stochastic_round(x: torch.Tensor, dtype: torch.dtype = torch.float16, *, seed: int | None = None,
                     offset: int | None = None, generator: torch.Generator | None = None,
                     saturate: bool = False) -> torch.Tensor:
    """Stochastically rounds the float32 tensor `x` to `dtype` (float16 or bfloat16).

    seed, offset: both or neither; they fully determine the result (ints in [0, 2**64)). Without
    them a fresh pair is drawn from `generator` (default: the default generator of x's device), so
    torch.manual_seed makes runs reproducible; on CUDA this involves no host-device sync.
    saturate: False (default) lets |x| > 65504 (fp16) round to +-Inf with probability growing with
    the distance, and keeps +-Inf; True clamps finite overflow and +-Inf to the largest finite value.
    Returns a new contiguous tensor of x's shape. Its gradient is the identity (straight-through).
    """
    fn = "stochastic_round"
    _check_source(fn, "x", x)
    _check_target(fn, "dtype", dtype)
    check_bool(fn, "saturate", saturate)
    seed, offset = _seed_offset(fn, x.device, seed, offset, generator)
    return round_to(x, dtype, seed, offset, saturate)


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, *, seed: int | None = None,
                      offset: int | None = None, generator: torch.Generator | None = None,
                      saturate: bool = False) -> torch.Tensor:
    """Stochastically rounds the float32 tensor `src` into the float16/bfloat16 tensor `dst` (same
    shape and device, any strides) and returns `dst`. Arguments as in `stochastic_round`.

    Behaves like dst.copy_(src) for autograd: dst's version counter is bumped; with grad mode on, a
    dst that is a leaf requiring grad is refused, and when src or dst requires grad the write is
    recorded (identity gradient to src)."""
    fn = "stochastic_round_"
    _check_source(fn, "src", src)
    if not isinstance(dst, torch.Tensor):
        raise TypeError(f"{fn}: dst must be a torch.Tensor, got {type(dst).__name__}")
    _check_target(fn, "dst.dtype", dst.dtype)
    if dst.shape != src.shape:
        raise ValueError(f"{fn}: dst and src must have the same shape, got {tuple(dst.shape)} and "
                         f"{tuple(src.shape)}")
    if dst.device != src.device:
        raise ValueError(f"{fn}: dst and src must be on the same device, got {dst.device} and {src.device}")
    check_bool(fn, "saturate", saturate)
    seed, offset = _seed_offset(fn, src.device, seed, offset, generator)
    if torch.is_grad_enabled() and (src.requires_grad or dst.requires_grad):
        # copy_ brings torch's in-place checks and records the write in dst's history; the values
        # are those of the fused kernel (both number elements in row-major order).
        return dst.copy_(round_to(src, dst.dtype, seed, offset, saturate))
    round_into(dst, src, seed, offset, saturate)
    torch.autograd.graph.increment_version(dst)  # the kernel writes through a pointer autograd cannot see
    return dst
