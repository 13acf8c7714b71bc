"""Stochastic rounding on CPU: the Philox stream, the exact bit rule, statistics, API behaviour."""
import math

import numpy as np
import pytest
import torch

import clipshard
from clipshard.rounding import stochastic_round, stochastic_round_
from tests.isa_utils import assert_same_bits_on_every_isa, run_under_each_isa
from tests.references import stochastic_round as reference

DTYPES = [torch.float16, torch.bfloat16]
U32 = 0xFFFFFFFF


def words(seed, offset, n, first_block=0, source="kernel"):
    """Random words via the test op (uint64 seed/offset/first_block given as Python ints): from the
    CPU kernel's batch generator, the shared header's philox_block (used by CUDA) or ATen's engine."""
    from clipshard.ops.seeds import as_int64
    raw = torch.ops.clipshard_testing.philox_words(as_int64(seed), as_int64(offset), n, as_int64(first_block), source)
    return raw.numpy().view(np.uint32)


def from_bits(bits):
    return torch.tensor(np.asarray(bits, dtype=np.uint32).view(np.int32)).view(torch.float32)


def to_bits(t):
    return t.contiguous().view(torch.int16).numpy().view(np.uint16).astype(np.int64)


def sr_bits(bits, dtype, seed=7, offset=11, saturate=False):
    x = from_bits(bits)
    return to_bits(stochastic_round(x, dtype, seed=seed, offset=offset, saturate=saturate))


# ----------------------------------------------------------------------------- Philox stream

# Random123's published philox4x32_10 known answers: counter (4 words), key (2 words) -> 4 words.
PHILOX_KAT = [
    ([0, 0, 0, 0], [0, 0], [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([U32] * 4, [U32] * 2, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344], [0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
]


@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers_reference(counter, key, expected):
    assert reference.philox4x32_10([counter], key)[0].tolist() == expected


@pytest.mark.parametrize("source", ["kernel", "header", "aten"])
@pytest.mark.parametrize("counter,key,expected", PHILOX_KAT)
def test_philox_known_answers_kernel(counter, key, expected, source):
    # counter = (block low, block high, offset low, offset high), key = (seed low, seed high)
    seed = key[0] | (key[1] << 32)
    offset = counter[2] | (counter[3] << 32)
    block = counter[0] | (counter[1] << 32)
    assert words(seed, offset, 4, first_block=block, source=source).tolist() == expected


def _reference_from_block(seed, offset, first_block, n):
    blocks = (first_block + np.arange((n + 3) // 4, dtype=np.uint64)) & np.uint64(2**64 - 1)
    mask = np.uint64(U32)
    counter = np.stack([blocks & mask, blocks >> np.uint64(32), np.full_like(blocks, offset & U32),
                        np.full_like(blocks, offset >> 32)], axis=1)
    return reference.philox4x32_10(counter, (seed & U32, seed >> 32)).reshape(-1)[:n]


@pytest.mark.parametrize("source", ["kernel", "header", "aten"])
@pytest.mark.parametrize("seed,offset,first_block", [(0, 0, 0), (1, 2, 0), (2**64 - 1, 2**64 - 1, 0),
                                                     (0x9E3779B97F4A7C15, 12345, 2**32 - 37),
                                                     (7, 8, 2**64 - 300)])
def test_philox_stream_equals_reference(seed, offset, first_block, source):
    # 4099 words: odd length, several kernel batches; the block index crosses 2^32 (carry into the
    # counter's second word) and wraps past 2^64 in the last two cases
    n = 4099
    got = words(seed, offset, n, first_block, source)
    assert np.array_equal(got, _reference_from_block(seed, offset, first_block, n))
    if first_block == 0:
        assert np.array_equal(got, reference.philox_stream_reference(seed, offset, n))


def test_sr_uses_stream_words_by_row_major_index():
    # bf16 with 16 dropped bits: the result at element i says whether (r_i mod 2^16) < d.
    n, d = 1001, 0x8000
    x = from_bits(np.full(n, 0x3F800000 | d, dtype=np.uint32))
    got = to_bits(stochastic_round(x, torch.bfloat16, seed=3, offset=5))
    r = words(3, 5, n)
    assert np.array_equal(got, np.where((r & 0xFFFF) < d, 0x3F81, 0x3F80))


# ----------------------------------------------------------------------------- exact bit rule

# Values whose result does not depend on the random word: fp32 bits -> (fp16, fp16 saturating,
# bf16, bf16 saturating) bits; None where that format's result is random.
INVARIANT = {
    0x00000000: (0x0000, 0x0000, 0x0000, 0x0000),  # +0
    0x80000000: (0x8000, 0x8000, 0x8000, 0x8000),  # -0 keeps its sign
    0x7F800000: (0x7C00, 0x7BFF, 0x7F80, 0x7F7F),  # +Inf (saturate: largest finite)
    0xFF800000: (0xFC00, 0xFBFF, 0xFF80, 0xFF7F),  # -Inf
    # every NaN becomes the canonical NaN (positive, quiet, empty payload), never Inf
    0x7FC00000: (0x7E00, 0x7E00, 0x7FC0, 0x7FC0),  # quiet NaN
    0xFFC00000: (0x7E00, 0x7E00, 0x7FC0, 0x7FC0),  # negative NaN (x86's arithmetic NaN)
    0x7F800001: (0x7E00, 0x7E00, 0x7FC0, 0x7FC0),  # signalling NaN, low payload
    0x7FA00000: (0x7E00, 0x7E00, 0x7FC0, 0x7FC0),  # NaN with a payload
    0xFFA00000: (0x7E00, 0x7E00, 0x7FC0, 0x7FC0),
    0x7FFFFFFF: (0x7E00, 0x7E00, 0x7FC0, 0x7FC0),  # NVIDIA's arithmetic NaN
    0xFFFFFFFF: (0x7E00, 0x7E00, 0x7FC0, 0x7FC0),
    0x3F800000: (0x3C00, 0x3C00, 0x3F80, 0x3F80),  # 1.0, representable
    0xC0200000: (0xC100, 0xC100, 0xC020, 0xC020),  # -2.5, representable
    0x477FE000: (0x7BFF, 0x7BFF, None, None),  # 65504, the largest fp16
    0x47800000: (0x7C00, 0x7BFF, 0x4780, 0x4780),  # 65536: beyond fp16's last grid point
    0xC7800000: (0xFC00, 0xFBFF, 0xC780, 0xC780),  # -65536
    0x501502F9: (0x7C00, 0x7BFF, None, None),  # 1e10
    0x7F7FFFFF: (0x7C00, 0x7BFF, None, None),  # largest fp32
    0x7F7F0000: (0x7C00, 0x7BFF, 0x7F7F, 0x7F7F),  # largest bf16
    0x38800000: (0x0400, 0x0400, 0x3880, 0x3880),  # 2^-14, smallest fp16 normal
    0x33800000: (0x0001, 0x0001, 0x3380, 0x3380),  # 2^-24, smallest fp16 subnormal
    0xB3800000: (0x8001, 0x8001, 0xB380, 0xB380),  # -2^-24
    0x23000000: (0x0000, 0x0000, 0x2300, 0x2300),  # 2^-57: k = 56, top 32 bits of d are 0
    0x00000001: (0x0000, 0x0000, None, None),  # smallest fp32 subnormal
    0x80000001: (0x8000, 0x8000, None, None),
    0x00010000: (0x0000, 0x0000, 0x0001, 0x0001),  # fp32 subnormal that is a bf16 subnormal
}


@pytest.mark.parametrize("column,dtype,saturate", [(0, torch.float16, False), (1, torch.float16, True),
                                                    (2, torch.bfloat16, False), (3, torch.bfloat16, True)])
def test_values_with_a_certain_result(column, dtype, saturate):
    cases = [(b, e[column]) for b, e in INVARIANT.items() if e[column] is not None]
    n = 257  # every value at 257 positions, i.e. with 257 different random words
    bits = np.repeat(np.array([b for b, _ in cases], dtype=np.uint32), n)
    got = sr_bits(bits, dtype, saturate=saturate).reshape(len(cases), n)
    for (b, expected), row in zip(cases, got):
        assert set(row.tolist()) == {expected}, f"{b:#010x} -> {sorted(set(row.tolist()))}, want {expected:#06x}"


# Random results: fp32 bits, k dropped bits, their value d, result down, result up (hand-computed).
# P(up) = d / 2^k; the kernel rounds up exactly when (r mod 2^k) < d, or r < d >> (k - 32) for k > 32.
RANDOM_HALF = [
    (0x3F801000, 13, 0x1000, 0x3C00, 0x3C01),  # 1 + 2^-11, half an fp16 ulp
    (0xBF801000, 13, 0x1000, 0xBC00, 0xBC01),  # negative: the magnitude rounds
    (0x3F800001, 13, 0x0001, 0x3C00, 0x3C01),  # 1 + 2^-23
    (0x477FDFFF, 13, 0x1FFF, 0x7BFE, 0x7BFF),  # just below 65504
    (0x477FF000, 13, 0x1000, 0x7BFF, 0x7C00),  # 65520: to 65504 or Inf (65536 is the next grid point)
    (0x477FFFFF, 13, 0x1FFF, 0x7BFF, 0x7C00),  # just below 65536
    (0xC77FF000, 13, 0x1000, 0xFBFF, 0xFC00),
    (0x387FFFFF, 14, 0x3FFF, 0x03FF, 0x0400),  # just below 2^-14: carries into the normals
    (0x38400000, 14, 0x0000, 0x0300, 0x0301),  # 0.75 * 2^-14, an fp16 subnormal: exact
    (0x38502000, 14, 0x2000, 0x0340, 0x0341),  # 0.8125 * 2^-14 plus half a subnormal ulp
    (0x33C00000, 23, 0x400000, 0x0001, 0x0002),  # 1.5 * 2^-24
    (0x33000000, 24, 0x800000, 0x0000, 0x0001),  # 2^-25
    (0xB3000000, 24, 0x800000, 0x8000, 0x8001),  # -2^-25
    (0x2F800000, 31, 0x800000, 0x0000, 0x0001),  # 2^-32: up iff (r mod 2^31) < 2^23
    (0x2F000000, 32, 0x800000, 0x0000, 0x0001),  # 2^-33: k = 32, up iff r < 2^23
    (0x2B800000, 39, 0x800000, 0x0000, 0x0001),  # 2^-40: up iff r < 2^16
    (0x2BC00000, 39, 0xC00000, 0x0000, 0x0001),  # 1.5 * 2^-40: up iff r < 3 * 2^15
]
RANDOM_BF16 = [
    (0x3F808000, 16, 0x8000, 0x3F80, 0x3F81),
    (0xBF808000, 16, 0x8000, 0xBF80, 0xBF81),
    (0x3F80FFFF, 16, 0xFFFF, 0x3F80, 0x3F81),
    (0x3F800001, 16, 0x0001, 0x3F80, 0x3F81),
    (0x7F7F8000, 16, 0x8000, 0x7F7F, 0x7F80),  # the largest bf16 and a half: Inf or largest
    (0xFF7FFFFF, 16, 0xFFFF, 0xFF7F, 0xFF80),
    (0x00000001, 16, 0x0001, 0x0000, 0x0001),  # fp32 subnormals round on bf16's subnormal grid
    (0x80018000, 16, 0x8000, 0x8001, 0x8002),
    (0x477FE000, 16, 0xE000, 0x477F, 0x4780),  # 65504 is not a bf16
]


def _hand_expected(r, k, d, down, up, saturate, largest):
    r = r.astype(np.uint64)
    if k <= 32:
        go_up = (r & np.uint64((1 << k) - 1)) < d
    else:
        go_up = r < (d >> (k - 32))
    if saturate:
        up = min(up & 0x7FFF, largest) | (up & 0x8000)
    return np.where(go_up, up, down)


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("dtype,cases,largest", [(torch.float16, RANDOM_HALF, 0x7BFF),
                                                 (torch.bfloat16, RANDOM_BF16, 0x7F7F)])
def test_random_cases_exact(dtype, cases, largest, saturate):
    n = 1 << 16  # positions per value: P(up) from 2^-16 upwards, so both outcomes appear
    bits = np.repeat(np.array([c[0] for c in cases], dtype=np.uint32), n)
    got = sr_bits(bits, dtype, seed=99, offset=3, saturate=saturate).reshape(len(cases), n)
    r = words(99, 3, len(cases) * n).reshape(len(cases), n)
    for row, rr, (b, k, d, down, up) in zip(got, r, cases):
        want = _hand_expected(rr, k, d, down, up, saturate, largest)
        assert np.array_equal(row, want), f"{b:#010x}: {np.count_nonzero(row != want)} elements differ"
        collapses = saturate and (down & 0x7FFF) == largest  # up would pass the largest finite
        if n * d / 2**k >= 8 and not collapses:  # both outcomes expected several times
            assert len(set(row.tolist())) == 2, f"{b:#010x}: only one outcome seen"


@pytest.mark.parametrize("dtype", DTYPES)
def test_threshold_boundaries_at_every_position(dtype):
    """d = (r mod 2^k) must round down and d = (r mod 2^k) + 1 up, for every k of the format."""
    n = 4096
    r = words(5, 6, n).astype(np.uint64)
    ks = [16] if dtype == torch.bfloat16 else [13] + list(range(14, 24))  # k = 24 and up: hand cases
    for k in ks:
        mask = np.uint64((1 << k) - 1)
        d_down = r & mask
        d_up = np.minimum(d_down + np.uint64(1), mask)
        for d, want_up in ((d_down, False), (d_up, True)):
            if k == 13 or dtype == torch.bfloat16:  # normal range: x = 1 + d * 2^-23
                bits = (0x3F800000 | d).astype(np.uint32)
                down = 0x3C00 if dtype == torch.float16 else 0x3F80
            else:  # fp16 subnormal range: x = (2^23 + d) * 2^(exp32 - 150) with exp32 = 126 - k
                bits = (((126 - k) << 23) | d).astype(np.uint32)
                down = 1 << (23 - k)
            got = sr_bits(bits, dtype, seed=5, offset=6)
            want = np.full(n, down) + (want_up & ((r & mask) < d))
            assert np.array_equal(got, want), f"k={k} up={want_up}"


def _spanning_values(n, generator):
    """n fp32 values over many binades (fp32 subnormals to ~2^20), both signs, random mantissas."""
    mant = torch.randint(0, 1 << 23, (n,), generator=generator, dtype=torch.int64)
    exp = torch.randint(0, 148, (n,), generator=generator, dtype=torch.int64)  # up to 2^20
    sign = torch.randint(0, 2, (n,), generator=generator, dtype=torch.int64) << 31
    return (sign | (exp << 23) | mant).to(torch.int64).numpy().astype(np.uint32)


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_independent_reference(dtype, saturate):
    g = torch.Generator().manual_seed(2024)
    n = 1 << 20
    bits = _spanning_values(n, g)
    # add the fp16 overflow region and special values
    extra = np.array(list(INVARIANT) + [0x477FF000, 0x477FFFFF, 0xC77FF000, 0x7F7F8000, 0x7F7FFFFF], dtype=np.uint32)
    bits = np.concatenate([bits, extra, bits[:1001] | 0x3F000000])
    x = from_bits(bits)
    seed, offset = 0xDEADBEEFCAFEF00D, 77
    got = stochastic_round(x, dtype, seed=seed, offset=offset, saturate=saturate)
    want = reference.stochastic_round_reference(x, reference.philox_stream_reference(seed, offset, x.numel()),
                                                dtype, saturate)
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(got), nan)
    assert np.array_equal(to_bits(got[~nan]), to_bits(want[~nan]))


_ISA_RUN = """
import sys, torch, clipshard
from clipshard.ops.seeds import as_int64
g = torch.Generator().manual_seed(5)
x = torch.randn(3 * 4096 * 4 + 1027, generator=g) * 10.0 ** torch.randint(-6, 5, (3 * 4096 * 4 + 1027,), generator=g)
out = [clipshard.stochastic_round(x, dtype, seed=11, offset=12, saturate=saturate)
       for dtype in (torch.float16, torch.bfloat16) for saturate in (False, True)]
out.append(torch.ops.clipshard_testing.philox_words(as_int64(2**64 - 5), 3, 4099, as_int64(2**32 - 37), "kernel"))
torch.save(out, sys.argv[1])
"""


def test_every_cpu_instruction_set_gives_the_same_bits(tmp_path):
    """The AVX-512, AVX2 and baseline versions of the rounding loop and of the Philox words
    (CLIPSHARD_CPU_ISA narrows the choice; a CPU without AVX-512 runs its best path twice) give the
    same bits, and the words across the block index's carry into the counter's second word match
    the header's philox_block."""
    results = run_under_each_isa(_ISA_RUN, tmp_path)
    assert_same_bits_on_every_isa(results)
    header = words(2**64 - 5, 3, 4099, 2**32 - 37, source="header")
    assert np.array_equal(results[""][-1].numpy().view(np.uint32), header)


# ----------------------------------------------------------------------------- statistics

def _neighbours(value, dtype):
    """(lo, hi) target values around value (> 0), from the reference at r = max / r = 0."""
    x = torch.tensor([value], dtype=torch.float32)
    lo = reference.stochastic_round_reference(x, [U32], dtype).double().item()
    hi = reference.stochastic_round_reference(x, [0], dtype).double().item()
    return lo, hi


UNBIASED_CASES = [
    (torch.float16, 1 + 82 * 2**-23),  # small fraction (~1%) of an ulp
    (torch.float16, 1 + 8110 * 2**-23),  # large fraction (~99%)
    (torch.float16, 1 + 4097 * 2**-23),  # just over one half
    (torch.float16, -3.1),
    (torch.float16, 3.3 * 2**-24),  # fp16 subnormal
    (torch.float16, 0.01 * 2**-24),  # below the smallest subnormal
    (torch.float16, 65520.0),  # between 65504 and 65536
    (torch.bfloat16, 1 + 655 * 2**-23),
    (torch.bfloat16, 1 + 65000 * 2**-23),
    (torch.bfloat16, 0.7),
    (torch.bfloat16, 1e-40),  # fp32 subnormal
]


@pytest.mark.parametrize("dtype,value", UNBIASED_CASES)
def test_unbiased(dtype, value):
    n = 200_000
    x = torch.full((n,), value, dtype=torch.float32)
    xv = x[0].double().item()
    lo, hi = _neighbours(abs(xv), dtype)
    sign = math.copysign(1.0, xv)
    if hi == math.inf:  # 65520 -> 65504 or Inf: check P(Inf) instead of the mean
        p = (abs(xv) - 65504) / 32
        got = torch.isinf(stochastic_round(x, dtype, seed=1, offset=2)).double().mean().item()
        assert abs(got - p) < 5 * math.sqrt(p * (1 - p) / n)
        return
    p = (abs(xv) - lo) / (hi - lo)
    y = stochastic_round(x, dtype, seed=1, offset=2).double()
    se = (hi - lo) * math.sqrt(p * (1 - p) / n)
    assert abs(y.mean().item() - xv) <= 5 * se + 1e-12 * abs(xv), (y.mean().item(), xv, se)
    assert set((sign * y).unique().tolist()) <= {lo, hi}  # the two neighbours, with x's sign


@pytest.mark.parametrize("dtype", DTYPES)
def test_both_neighbours_reached_and_nothing_else(dtype):
    g = torch.Generator().manual_seed(7)
    m, reps = 2000, 64
    bits = _spanning_values(m, g)
    x = from_bits(bits)
    lo = reference.stochastic_round_reference(x, np.full(m, U32), dtype).double()
    hi = reference.stochastic_round_reference(x, np.zeros(m), dtype).double()
    y = stochastic_round(x.repeat(reps, 1), dtype, seed=11, offset=12).double()
    assert bool(((y == lo) | (y == hi)).all())
    lo32 = lo.float()
    frac = ((x.double() - lo) / (hi - lo)).abs()
    clearly_random = (frac > 0.3) & (frac < 0.7) & torch.isfinite(hi) & (lo32 != x)
    assert int(clearly_random.sum()) > 100
    assert bool((y == lo).any(0)[clearly_random].all()) and bool((y == hi).any(0)[clearly_random].all())


# ----------------------------------------------------------------------------- random source

def _x(n=4097):
    return torch.randn(n, generator=torch.Generator().manual_seed(1)) * 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_reproducible_under_manual_seed_and_fresh_each_call(dtype):
    x = _x()
    torch.manual_seed(123)
    a, b = stochastic_round(x, dtype), stochastic_round(x, dtype)
    torch.manual_seed(123)
    a2, b2 = stochastic_round(x, dtype), stochastic_round(x, dtype)
    assert torch.equal(a, a2) and torch.equal(b, b2)
    assert not torch.equal(a, b)
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(stochastic_round(x, dtype, generator=g1), stochastic_round(x, dtype, generator=g2))


def test_calls_are_independent():
    # two calls' up/down decisions at half an ulp agree about half the time, as independent bits do
    n = 100_000
    x = torch.full((n,), 1 + 2**-11)
    torch.manual_seed(0)
    a, b = stochastic_round(x), stochastic_round(x)
    agree = (a == b).double().mean().item()
    assert abs(agree - 0.5) < 5 * math.sqrt(0.25 / n)


def test_seed_and_offset_determine_the_result():
    x = _x()
    base = stochastic_round(x, seed=10, offset=20)
    assert torch.equal(base, stochastic_round(x, seed=10, offset=20))
    assert not torch.equal(base, stochastic_round(x, seed=11, offset=20))
    assert not torch.equal(base, stochastic_round(x, seed=10, offset=21))
    big = stochastic_round(x, seed=2**64 - 1, offset=2**63)
    want = reference.stochastic_round_reference(
        x, reference.philox_stream_reference(2**64 - 1, 2**63, x.numel()), torch.float16)
    assert torch.equal(big.view(torch.int16), want.view(torch.int16))


# ----------------------------------------------------------------------------- layouts and shapes

@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_input(dtype):
    base = torch.randn(37, 53, generator=torch.Generator().manual_seed(3))
    for x in (base.t(), base[:, ::2], base[1:, 3:]):
        got = stochastic_round(x, dtype, seed=4, offset=5)
        assert got.shape == x.shape
        assert torch.equal(got, stochastic_round(x.contiguous(), dtype, seed=4, offset=5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place_into_strided_destination(dtype):
    x = torch.randn(29, 31, generator=torch.Generator().manual_seed(4))
    want = stochastic_round(x, dtype, seed=8, offset=9)
    storage = torch.zeros(31, 29, dtype=dtype)
    dst = storage.t()  # non-contiguous view of 29 x 31
    ptr, strides = dst.data_ptr(), dst.stride()
    out = stochastic_round_(dst, x, seed=8, offset=9)
    assert out is dst and dst.data_ptr() == ptr and dst.stride() == strides
    assert torch.equal(dst, want) and torch.equal(storage.t(), want)
    contiguous = torch.empty(29, 31, dtype=dtype)
    stochastic_round_(contiguous, x.t().contiguous().t(), seed=8, offset=9)
    assert torch.equal(contiguous, want)
    wide = torch.zeros(29, 62, dtype=dtype)
    stochastic_round_(wide[:, ::2], x, seed=8, offset=9)
    assert torch.equal(wide[:, ::2], want) and not wide[:, 1::2].any()


@pytest.mark.parametrize("shape", [(), (0,), (3, 0, 2), (1,), (5,), (3, 1, 7)])
def test_shapes(shape):
    x = torch.randn(shape) * 5
    for dtype in DTYPES:
        y = stochastic_round(x, dtype, seed=1, offset=1)
        assert y.shape == x.shape and y.dtype == dtype
        if x.numel():
            assert torch.equal(y, stochastic_round(x.reshape(-1), dtype, seed=1, offset=1).reshape(shape))
        dst = torch.empty(shape, dtype=dtype)
        assert torch.equal(stochastic_round_(dst, x, seed=1, offset=1), y)


# ----------------------------------------------------------------------------- torch integration

def test_torch_compile_fullgraph():
    def fn(x, dst):
        y = stochastic_round(x * 2, torch.bfloat16, seed=5, offset=6)
        stochastic_round_(dst, x, seed=7, offset=8)
        return y

    x = torch.randn(1000)
    dst, dst_eager = torch.empty(1000, dtype=torch.float16), torch.empty(1000, dtype=torch.float16)
    got = torch.compile(fn, fullgraph=True)(x, dst)
    assert torch.equal(got, fn(x, dst_eager)) and torch.equal(dst, dst_eager)


# ----------------------------------------------------------------------------- errors

def test_exports():
    assert clipshard.stochastic_round is stochastic_round and clipshard.stochastic_round_ is stochastic_round_


@pytest.mark.parametrize("src_dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32])
def test_error_source_dtype(src_dtype):
    x = torch.ones(4, dtype=src_dtype)
    with pytest.raises(TypeError, match=r"stochastic_round: x must be float32, got torch\."):
        stochastic_round(x)
    with pytest.raises(TypeError, match=r"stochastic_round_: src must be float32"):
        stochastic_round_(torch.empty(4, dtype=torch.float16), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int8, torch.float8_e4m3fn])
def test_error_target_dtype(dtype):
    with pytest.raises(TypeError, match=r"stochastic_round: dtype must be torch.float16 or torch.bfloat16, got"):
        stochastic_round(torch.ones(4), dtype)
    with pytest.raises(TypeError, match=r"stochastic_round_: dst.dtype must be torch.float16 or torch.bfloat16"):
        stochastic_round_(torch.empty(4, dtype=dtype), torch.ones(4))


def test_error_shape_and_device():
    with pytest.raises(ValueError, match=r"stochastic_round_: dst and src must have the same shape, got \(4,\) and \(5,\)"):
        stochastic_round_(torch.empty(4, dtype=torch.float16), torch.ones(5))
    with pytest.raises(ValueError, match=r"stochastic_round_: dst and src must be on the same device, got meta and cpu"):
        stochastic_round_(torch.empty(4, dtype=torch.float16, device="meta"), torch.ones(4))


def test_error_seed_offset():
    x = torch.ones(4)
    with pytest.raises(ValueError, match="give both seed and offset or neither"):
        stochastic_round(x, seed=1)
    with pytest.raises(ValueError, match="give both seed and offset or neither"):
        stochastic_round_(torch.empty(4, dtype=torch.float16), x, offset=1)
    with pytest.raises(ValueError, match=r"seed must be in \[0, 2\*\*64\), got -1"):
        stochastic_round(x, seed=-1, offset=0)
    with pytest.raises(ValueError, match=r"offset must be in \[0, 2\*\*64\), got 18446744073709551616"):
        stochastic_round(x, seed=0, offset=2**64)
    with pytest.raises(TypeError, match="seed must be a Python int"):
        stochastic_round(x, seed=1.5, offset=0)
    with pytest.raises(ValueError, match="not both"):
        stochastic_round(x, seed=1, offset=2, generator=torch.Generator())


def test_error_messages_from_the_kernel():
    with pytest.raises(RuntimeError, match="clipshard::stochastic_round: src must be a float32 tensor, got Double"):
        torch.ops.clipshard.stochastic_round(torch.ones(3, dtype=torch.float64), torch.float16, 0, 0, False)
    with pytest.raises(RuntimeError, match="clipshard::stochastic_round: dtype must be Half or BFloat16, got Float"):
        torch.ops.clipshard.stochastic_round(torch.ones(3), torch.float32, 0, 0, False)
    with pytest.raises(RuntimeError, match=r"clipshard::stochastic_round_into: dst and src must have the same shape"):
        torch.ops.clipshard.stochastic_round_into(torch.empty(2, dtype=torch.float16), torch.ones(3), 0, 0, False)
    with pytest.raises(RuntimeError, match="clipshard::stochastic_round_into: src must be a float32 tensor"):
        torch.ops.clipshard.stochastic_round_into(torch.empty(3, dtype=torch.float16),
                                                  torch.ones(3, dtype=torch.float16), 0, 0, False)
