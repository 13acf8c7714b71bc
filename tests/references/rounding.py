"""The fp16/bf16 neighbours of fp64 values and round to nearest even, decided in fp64 arithmetic (so
that bit-exact tests never trust torch's fp32 CPU kernels or casts)."""
import torch


def _next_16bit(y, up):
    """The fp16/bf16 value next to each finite y (same dtype), towards +inf when up, else -inf."""
    bits = y.view(torch.int16).to(torch.int32) & 0xFFFF
    sign, magnitude = bits >> 15, bits & 0x7FFF
    away_from_zero = (sign == 0) == up
    new_magnitude = torch.where(magnitude == 0, 1, torch.where(away_from_zero, magnitude + 1, magnitude - 1))
    new_sign = torch.where(magnitude == 0, 0 if up else 1, sign)
    return ((new_sign << 15) | new_magnitude).to(torch.int16).view(y.dtype)


def half_neighbours(x, dtype):
    """(lo, hi): the two values of `dtype` around each finite fp64 value x, lo <= x <= hi (equal
    when x is representable). Used to check stochastic rounding results."""
    x = x.double()
    y = x.to(dtype)
    yd = y.double()
    lo = torch.where(yd <= x, y, _next_16bit(y, up=False))
    hi = torch.where(yd >= x, y, _next_16bit(y, up=True))
    return lo, hi


def round_to_nearest_reference(x, dtype):
    """Each finite fp64 value x (within dtype's range) rounded to the nearest `dtype` value, ties to
    even, decided from the distances to the two neighbours in fp64 (exact for values of fp32
    precision) rather than taken on trust from a cast."""
    x = x.double()
    lo, hi = half_neighbours(x, dtype)
    below, above = x - lo.double(), hi.double() - x
    lo_is_even = (lo.view(torch.int16) & 1) == 0
    return torch.where((below < above) | ((below == above) & lo_is_even), lo, hi)
