"""Where the random numbers of stochastic rounding come from.

Kernels take an explicit (seed, offset) pair: element i of a tensor uses word (i mod 4) of
Philox4x32-10(key=seed, counter=(i // 4, offset)). This module draws a fresh pair from a
torch.Generator, so that torch.manual_seed makes runs reproducible and every call gets new bits.
"""
import torch

from clipshard.ops.planned_device import tracing_a_plan

_INT64_SPAN = 1 << 64
# torch's own CUDA random ops key Philox with the generator's seed and put the thread index in the
# counter's high word; ours puts the generator offset there. XOR-ing our key with this constant
# keeps the two streams apart, so stochastic rounding never reuses the words of, say, dropout.
_CUDA_KEY_SALT = 0x636C697073686172  # "clipshar"


def as_int64(value: int) -> int:
    """The int64 bit pattern of a uint64 value (op schemas take int64)."""
    value %= _INT64_SPAN
    return value - _INT64_SPAN if value >= (1 << 63) else value


def draw_seed_offset(device: torch.device, generator: torch.Generator | None = None) -> tuple[int, int]:
    """A fresh (seed, offset) pair, both as int64 bit patterns.

    CUDA: seed = the generator's seed (salted, see _CUDA_KEY_SALT) and offset = its Philox offset,
    which we then advance; both live on the host, so there is no host-device synchronisation. CPU: two 64-bit words drawn from
    the (Mersenne Twister) generator.
    """
    if tracing_a_plan():  # a memory plan traces fake tensors: no bits are drawn, any pair will do
        return 0, 0
    device = torch.device(device)
    if device.type == "cuda":
        if generator is None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            generator = torch.cuda.default_generators[index]
        offset = generator.get_offset()
        generator.set_offset(offset + 4)  # torch keeps CUDA offsets a multiple of 4
        return as_int64(generator.initial_seed() ^ _CUDA_KEY_SALT), as_int64(offset)
    words = torch.randint(-(1 << 63), (1 << 63) - 1, (2,), dtype=torch.int64, generator=generator)
    seed, offset = words.tolist()
    return seed, offset
