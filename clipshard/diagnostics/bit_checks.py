"""The bit-exact kernels' checks of `python -m clipshard`: stochastic rounding and AdamW, which
promise the same bits on every device.

On a GPU each is compared bit for bit with the CPU kernel on the same inputs. On the CPU, with no
reference implementation in the package, the kernel's results are held to what can be stated
without one:
- every stored value is one of the two neighbours, in the target format, of the exact value (for
  stochastic rounding the fp32 input; for AdamW the fp64 update of the same decoded state, widened
  by a bound on the kernel's fp32 rounding), NaNs are the canonical NaN, and the special values
  keep their rules (Inf stays Inf, a zero keeps its sign, fp16 values of magnitude 65536 or more
  become Inf);
- the bits match a known answer: a CRC-32 of the stored bits of each case, taken from the fp64 /
  numpy references of the tests (tests/test_self_check.py recomputes them), which pins the Philox
  stream and every rounding decision.
The error is the number of stored values that break the first promise, at least 1 when the bits
differ from the known answer; the tolerance is 0. The inputs are built from integer bit patterns,
so that they are the same on every machine.
"""
import zlib

import torch

from clipshard.ops.seeds import as_int64
from clipshard.diagnostics.measurement import Measurement
from clipshard.ops import has_compiled_kernel

_CANONICAL_NAN_BITS = {torch.float32: 0x7FC00000, torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}
_FP16_INF_FROM = 65536.0  # the fp16 grid point after 65504: larger magnitudes always round to Inf


def _name(dtype):
    return str(dtype).removeprefix("torch.")


def _draws(n, salt):
    """n pseudo-random 64-bit integers (splitmix64 of 0..n-1 and salt): the same on every machine."""
    out = []
    for i in range(n):
        z = (i * 0x9E3779B97F4A7C15 + salt * 0xD1B54A32D192ED03) & (2**64 - 1)
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & (2**64 - 1)
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & (2**64 - 1)
        out.append(z ^ (z >> 31))
    return out


def _fp32_from_bits(words):
    return torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32).view(torch.float32)


def _fp32_values(n, salt, exponents, signed=True):
    """n fp32 values with random mantissas, exponents (unbiased) drawn from `exponents`, random signs."""
    low, high = exponents
    words = [(((z >> 63) if signed else 0) << 31) | ((127 + low + (z >> 23) % (high - low + 1)) << 23) | (z & 0x7FFFFF)
             for z in _draws(n, salt)]
    return _fp32_from_bits(words)


def _bits(t):
    """The stored bits of each value, as int64 (fp32: 32 bits, 16-bit dtypes: 16)."""
    t = t.detach().cpu()
    if t.dtype == torch.float32:
        return t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return t.view(torch.int16).to(torch.int64) & 0xFFFF


def _digest(tensors):
    """CRC-32 of the stored bits of `tensors`, as text (independent of byte order)."""
    return zlib.crc32(" ".join(str(b) for t in tensors for b in _bits(t).reshape(-1).tolist()).encode())


def _step16(y, up):
    """The 16-bit value next to each non-NaN 16-bit y towards +Inf (up) or -Inf, from its bits."""
    bits = _bits(y)
    sign, magnitude = bits >> 15, bits & 0x7FFF
    away_from_zero = (sign == 0) == up
    new_magnitude = torch.where(magnitude == 0, 1, torch.where(away_from_zero, magnitude + 1, magnitude - 1))
    new_sign = torch.where(magnitude == 0, 0 if up else 1, sign)
    return ((new_sign << 15) | new_magnitude).to(torch.int16).view(y.dtype)


def _below(x, dtype):
    """The largest `dtype` value <= each fp64 x (-Inf below the range)."""
    y = x.to(dtype)
    return torch.where(y.double() <= x, y, _step16(y, up=False))


def _above(x, dtype):
    """The smallest `dtype` value >= each fp64 x (+Inf above the range)."""
    y = x.to(dtype)
    return torch.where(y.double() >= x, y, _step16(y, up=True))


def _outside(got, low, high):
    """Which stored 16-bit values lie outside the neighbours of [low, high] (fp64 bounds, NaN where
    a NaN is wanted, which must be the canonical NaN)."""
    got = got.detach().cpu()
    lo, hi = _below(low, got.dtype), _above(high, got.dtype)
    inside = (got.double() >= lo.double()) & (got.double() <= hi.double())
    return torch.where(torch.isnan(low), _bits(got) != _CANONICAL_NAN_BITS[got.dtype], ~inside)


# --- stochastic rounding ------------------------------------------------------------------------

_SR_SEED, _SR_OFFSET = 0x1234_5678_9ABC_DEF0, 77
# CRC-32 of the stored bits of stochastic_round(_rounding_input(), dtype, _SR_SEED, _SR_OFFSET)
_SR_KNOWN = {torch.float16: 0xBC96D8B9, torch.bfloat16: 0x85A8AE60}


def rounding_input():
    """fp32 values over the whole range and every special value: NaNs of both signs and other
    payloads, infinities, zeros, fp16 subnormals and overflow, bf16 overflow and subnormals."""
    nans = _fp32_from_bits([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF])
    specials = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0, 3e-6, -4e-8, 65519.0, 65520.0, 7e4, -7e4, 1e-39,
                             3.3961e38, -3.4028234e38], dtype=torch.float32)
    return torch.cat([nans, specials, _fp32_values(997, 1, (-27, 16))])


def _stochastic_round(x, dtype, device):
    return torch.ops.clipshard.stochastic_round(x.to(device), dtype, as_int64(_SR_SEED), _SR_OFFSET, False).cpu()


def _rounding_violations(x, got, dtype):
    """Results that are not a neighbour of their input, or break a special-value rule: the sign is
    kept (a zero's too), fp16 magnitudes from 65536 on become Inf."""
    x = x.double()
    bad = _outside(got, x, x) | (~torch.isnan(x) & (torch.signbit(got) != torch.signbit(x)))
    if dtype == torch.float16:
        bad |= (x.abs() >= _FP16_INF_FROM) & ~torch.isinf(got)
    return int(bad.sum())


def check_stochastic_round(device):
    if not has_compiled_kernel("clipshard::stochastic_round", device.type):
        return  # a build without this device's kernels (CPU-only, ROCm): nothing compiled to check
    x = rounding_input()
    for dtype in (torch.float16, torch.bfloat16):
        got = _stochastic_round(x, dtype, device)
        note = f"{x.numel()} values, {int(torch.isnan(x).sum())} NaNs"
        if device.type == "cpu":
            differing = _rounding_violations(x, got, dtype)
            if _digest([got]) != _SR_KNOWN[dtype]:
                differing, note = max(differing, 1), note + "; the bits differ from the known answer"
            against = "neighbours, known answer"
        else:
            differing = int((_bits(got) != _bits(_stochastic_round(x, dtype, torch.device("cpu")))).sum())
            against = "CPU kernel"
        yield Measurement(f"{_name(dtype)} bits vs {against}", differing, 0, note)


# --- AdamW --------------------------------------------------------------------------------------

_STORAGE = (torch.float32, torch.float16, torch.bfloat16)
_ADAMW = dict(lr=3e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05)
_ADAMW_SIZES, _ADAMW_INDEX_BASES, _ADAMW_NUMBERS = (1, 37, 203), (0, 5, 1026), (0, 4, 9)
_ADAMW_STEP, _ADAMW_SEED, _ADAMW_OFFSET = 3, 0xC11F5, 12
# CRC-32 of the stored bits (param, grad, exp_avg, exp_avg_sq of each tensor) after one step, per
# (param dtype, state dtype)
_ADAMW_KNOWN = {
    (torch.float32, torch.float32): 0xE9076804, (torch.float32, torch.float16): 0x5FEB3CE5,
    (torch.float32, torch.bfloat16): 0xD1D0E1C4, (torch.float16, torch.float32): 0x13BBC885,
    (torch.float16, torch.float16): 0x58B19183, (torch.float16, torch.bfloat16): 0x40C0BB1F,
    (torch.bfloat16, torch.float32): 0x5482D24B, (torch.bfloat16, torch.float16): 0x92DD1676,
    (torch.bfloat16, torch.bfloat16): 0x717F465A,
}
# A bound on the kernels' fp32 rounding, relative to the magnitudes involved (16 ulps): the update
# takes about 10 roundings, the 16-bit second moment's v^(1/4) encoding 3 more each way.
_FP32_BOUND = 2.0 ** -20


def adamw_state(param_dtype, state_dtype):
    """Per tensor [param, grad, exp_avg, exp_avg_sq as stored], CPU tensors; one grad is a NaN. The
    fp16 second moment is stored as v^(1/4) (docs/adamw.md), about 0.06 for v of 1e-5."""
    tensors = []
    for index, n in enumerate(_ADAMW_SIZES):
        p = _fp32_values(n, 10 + index, (-3, 1))            # about 0.1 to 4
        g = _fp32_values(n, 20 + index, (-10, -6))          # about 1e-3 to 2e-2
        m = _fp32_values(n, 30 + index, (-13, -9))          # about 1e-4 to 2e-3
        v = _fp32_values(n, 40 + index, (-5, -4), signed=False) if state_dtype == torch.float16 else \
            _fp32_values(n, 40 + index, (-20, -16), signed=False)
        tensors.append([p.to(param_dtype), g.to(param_dtype), m.to(state_dtype), v.to(state_dtype)])
    tensors[-1][1][7] = float("nan")
    return tensors


def adamw_step(tensors, device):
    """One step of the kernel on copies of `tensors` on `device`; the results on the CPU."""
    copies = [[t.clone().to(device) for t in group] for group in tensors]
    params, grads, exp_avgs, exp_avg_sqs = (list(role) for role in zip(*copies))
    a = _ADAMW
    torch.ops.clipshard.adamw_step_(params, grads, exp_avgs, exp_avg_sqs, [_ADAMW_STEP] * len(params), a["lr"],
                                    a["beta1"], a["beta2"], a["eps"], a["weight_decay"], False, True,
                                    _ADAMW_SEED, _ADAMW_OFFSET, list(_ADAMW_NUMBERS), list(_ADAMW_INDEX_BASES))
    return [[t.cpu() for t in group] for group in copies]


def _update_bounds(p, g, m, v_stored):
    """[(low, high)] of the new param, exp_avg and stored exp_avg_sq: torch.optim.AdamW's update in
    fp64 from the decoded state, widened by _FP32_BOUND of the magnitudes that enter each value."""
    a, t = _ADAMW, _ADAMW_STEP
    p, g, m, stored = (x.double() for x in (p, g, m, v_stored))
    v = stored ** 4 if v_stored.dtype == torch.float16 else stored  # exact in fp64
    m1 = m + (1 - a["beta1"]) * (g - m)
    v1 = a["beta2"] * v + (1 - a["beta2"]) * g * g
    denominator = v1.sqrt() / (1 - a["beta2"] ** t) ** 0.5 + a["eps"]
    step_size = a["lr"] / (1 - a["beta1"] ** t)
    update = step_size * m1 / denominator
    p1 = p * (1 - a["lr"] * a["weight_decay"]) - update
    slack_p = _FP32_BOUND * (p.abs() + step_size * (m.abs() + g.abs()) / denominator + update.abs())
    slack_m = _FP32_BOUND * (m.abs() + g.abs())
    v1_stored = v1.sqrt().sqrt() if v_stored.dtype == torch.float16 else v1
    return [(p1 - slack_p, p1 + slack_p), (m1 - slack_m, m1 + slack_m),
            (v1_stored * (1 - _FP32_BOUND), v1_stored * (1 + _FP32_BOUND))]


def _update_violations(before, after):
    """Stored values outside the neighbours of their bounds, and gradients the kernel changed."""
    count = 0
    for old, new in zip(before, after):
        count += int((_bits(new[1]) != _bits(old[1])).sum())
        for got, (low, high) in zip((new[0], new[2], new[3]), _update_bounds(*old)):
            if got.dtype == torch.float32:
                nan = torch.isnan(low)
                inside = (got.double() >= low) & (got.double() <= high)
                count += int(torch.where(nan, _bits(got) != _CANONICAL_NAN_BITS[torch.float32], ~inside).sum())
            else:
                count += int(_outside(got, low, high).sum())
    return count


def check_adamw(device):
    if not has_compiled_kernel("clipshard::adamw_step_", device.type):
        return  # as for stochastic rounding
    for param_dtype in _STORAGE:
        for state_dtype in _STORAGE:
            tensors = adamw_state(param_dtype, state_dtype)
            got = adamw_step(tensors, device)
            total = sum(3 * t[0].numel() for t in tensors)
            note = f"{total} stored values, index bases {_ADAMW_INDEX_BASES}, one NaN gradient"
            if device.type == "cpu":
                differing = _update_violations(tensors, got)
                if _digest([t for group in got for t in group]) != _ADAMW_KNOWN[(param_dtype, state_dtype)]:
                    differing, note = max(differing, 1), note + "; the bits differ from the known answer"
                against = "fp64 update, known answer"
            else:
                want = adamw_step(tensors, torch.device("cpu"))
                differing = sum(int((_bits(a) != _bits(b)).sum()) for ga, gb in zip(got, want) for a, b in zip(ga, gb))
                against = "CPU kernel"
            yield Measurement(f"{_name(param_dtype)}/{_name(state_dtype)} bits vs {against}", differing, 0, note)
