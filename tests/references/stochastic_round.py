"""Stochastic rounding references (docs/stochastic_rounding.md). Independent of the C++ headers:
Philox4x32-10 written from the Random123 description, and the rounding rule computed from the
float values (neighbours and spacing in exact fp64 arithmetic) rather than from bit fields."""
import numpy as np
import torch


MASK32 = 0xFFFFFFFF
_PHILOX_M = (0xD2511F53, 0xCD9E8D57)  # round multipliers
_PHILOX_W = (0x9E3779B9, 0xBB67AE85)  # key schedule increments (golden ratio, sqrt(3) - 1)


def philox4x32_10(counter, key):
    """Philox4x32 with 10 rounds on an (N, 4) array of 32-bit counters and a 2-word key; (N, 4) uint32.

    One round maps (c0, c1, c2, c3) to (hi(M1*c2) ^ c1 ^ k0, lo(M1*c2), hi(M0*c0) ^ c3 ^ k1, lo(M0*c0));
    the key is incremented by (W0, W1) before every round but the first."""
    c = [np.asarray(counter, dtype=np.uint64).reshape(-1, 4)[:, j].copy() for j in range(4)]
    k0, k1 = int(key[0]) & MASK32, int(key[1]) & MASK32
    for round_index in range(10):
        if round_index:
            k0, k1 = (k0 + _PHILOX_W[0]) & MASK32, (k1 + _PHILOX_W[1]) & MASK32
        p0 = c[0] * np.uint64(_PHILOX_M[0])  # exact: both factors < 2**32
        p1 = c[2] * np.uint64(_PHILOX_M[1])
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ np.uint64(k0), p1 & np.uint64(MASK32),
             (p0 >> np.uint64(32)) ^ c[3] ^ np.uint64(k1), p0 & np.uint64(MASK32)]
    return np.stack(c, axis=1).astype(np.uint32)


def philox_stream_reference(seed: int, offset: int, n: int) -> np.ndarray:
    """The random words of elements 0..n-1: word i % 4 of Philox(key=seed, counter=(i // 4, offset)),
    the counter's low 64 bits being i // 4 and its high 64 bits offset. seed, offset: uint64 values."""
    seed, offset = seed % (1 << 64), offset % (1 << 64)
    blocks = np.arange((n + 3) // 4, dtype=np.uint64)
    counter = np.stack([blocks & np.uint64(MASK32), blocks >> np.uint64(32),
                        np.full_like(blocks, offset & MASK32), np.full_like(blocks, offset >> 32)], axis=1)
    return philox4x32_10(counter, (seed & MASK32, seed >> 32)).reshape(-1)[:n]


# Target format: (smallest normal, spacing exponent of the subnormals, mantissa bits, largest finite)
_SR_FORMATS = {
    torch.float16: (2.0 ** -14, -24, 10, 65504.0),
    torch.bfloat16: (2.0 ** -126, -133, 7, float.fromhex("0x1.fep127")),
}


def stochastic_round_reference(x: torch.Tensor, words, dtype, saturate: bool = False) -> torch.Tensor:
    """The stochastic-rounding rule from float values, given each element's random word (uint32).

    |x| lies in [lo, lo + ulp) on the target grid; x's own format (fp32) resolves it in steps of
    ulp32, so the target drops k = log2(ulp / ulp32) bits worth d = (|x| - lo) / ulp32. Round up iff
    (r mod 2^k) < d, or, when k > 32, iff r < floor(d / 2^(k - 32)). Past the largest finite value
    the next grid point is Inf (or the largest finite value when saturating)."""
    smallest_normal, sub_exp, mant_bits, largest = _SR_FORMATS[dtype]
    v = x.detach().cpu().contiguous().reshape(-1).double().numpy()
    r = np.asarray(words, dtype=np.uint64).reshape(-1)
    a = np.abs(v)
    finite = np.isfinite(a)
    safe = np.where(finite & (a > 0), a, 1.0)
    _, e = np.frexp(safe)  # safe = m * 2^e, m in [0.5, 1): floor(log2(safe)) = e - 1
    ulp = np.ldexp(1.0, np.maximum(e - 1 - mant_bits, sub_exp))
    ulp32 = np.ldexp(1.0, np.maximum(e - 1 - 23, -149))
    ulp = np.where(safe < smallest_normal, 2.0 ** sub_exp, ulp)
    lo = np.floor(safe / ulp) * ulp  # exact: power-of-two scaling
    k = np.round(np.log2(ulp / ulp32)).astype(np.int64)
    d = (safe - lo) / ulp32  # an integer, exact
    small_k = k <= 32
    mod = np.where(small_k, r % np.ldexp(1.0, np.minimum(k, 32)).astype(np.uint64), 0)
    up_small = mod.astype(np.float64) < d
    up_large = r.astype(np.float64) < np.floor(d / np.ldexp(1.0, np.maximum(k - 32, 0)))
    up = np.where(small_k, up_small, up_large)
    mag = np.where(up, lo + ulp, lo)
    mag = np.where(a == 0, 0.0, mag)
    mag = np.where(np.isinf(a) | (a >= largest + ulp), np.inf, mag)  # overflow, Inf stays Inf
    mag = np.where(mag > largest, largest if saturate else np.inf, mag)
    out = np.copysign(mag, v)
    out = np.where(np.isnan(v), np.nan, out)
    return torch.from_numpy(out).to(dtype).reshape(x.shape)
