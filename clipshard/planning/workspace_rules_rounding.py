"""Workspace rules of the stochastic rounding ops (clipshard/planning/kernel_workspaces.py).

stochastic_round and stochastic_round_into (csrc/cpu/stochastic_round.cpp, csrc/cuda/stochastic_round.cu,
the same on both devices) give every element the random word of its row-major index, so a strided
source is first copied contiguous (`in`, kept to the end); stochastic_round_into with a strided
destination rounds into a contiguous buffer of dst's shape and dtype, then copies it into dst.
adamw_step_ (csrc/cpu/adamw.cpp, csrc/cuda/adamw.cu) allocates no tensor (it updates its
contiguous arguments in place; the CUDA kernel's tensor table is a kernel argument), so it has no rule.
"""
from clipshard.planning.workspace_timeline import contiguous_copy_bytes, nbytes


def stochastic_round(device_type, src, dtype, seed, offset, saturate):
    return [("src as contiguous", contiguous_copy_bytes(src))]


def stochastic_round_into(device_type, dst, src, seed, offset, saturate):
    buffer = 0 if dst.is_contiguous() else nbytes(dst.numel(), dst.dtype)
    return [("src as contiguous", contiguous_copy_bytes(src)), ("contiguous buffer of the strided dst", buffer)]


RULES = {"clipshard::stochastic_round": stochastic_round, "clipshard::stochastic_round_into": stochastic_round_into}
