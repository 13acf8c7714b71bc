"""Stochastic rounding on CUDA: bit-identical to the CPU kernels for the same (seed, offset)."""
import numpy as np
import pytest
import torch

from clipshard.ops.seeds import _CUDA_KEY_SALT
from clipshard.rounding import stochastic_round, stochastic_round_

pytestmark = pytest.mark.cuda

DTYPES = [torch.float16, torch.bfloat16]
SPECIAL_BITS = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001,
                0x7FA00000, 0x00000001, 0x80000001, 0x007FFFFF, 0x33000000, 0x387FFFFF, 0x38800000,
                0x477FE000, 0x477FF000, 0x477FFFFF, 0x47800000, 0xC77FF000, 0x7F7F8000, 0x7F7FFFFF]


def _bits_to_float(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(bits.astype(np.uint32).view(np.int32)).view(torch.float32)


def _all_exponents(n: int) -> torch.Tensor:
    """n random fp32 bit patterns (every exponent, NaNs and Infs included) plus the special values."""
    rng = np.random.default_rng(31)
    bits = np.concatenate([rng.integers(0, 1 << 32, n, dtype=np.uint64), np.array(SPECIAL_BITS * 8)])
    return _bits_to_float(bits)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.cpu().view(torch.int16), b.cpu().view(torch.int16))


@pytest.mark.parametrize("saturate", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_equals_cpu_bitwise(dtype, saturate):
    x = _all_exponents(32 << 20)
    seed, offset = 0x0123456789ABCDEF, 0xFEDCBA9876543210
    want = stochastic_round(x, dtype, seed=seed, offset=offset, saturate=saturate)
    got = stochastic_round(x.cuda(), dtype, seed=seed, offset=offset, saturate=saturate)
    assert got.device.type == "cuda" and _same_bits(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
def test_misaligned_odd_lengths_and_strides(dtype):
    base = _all_exponents(1 << 16)[: (1 << 16) + 5]
    for n in list(range(1, 20)) + [1001, 8 * 1024 + 7]:
        for start in (0, 1, 2, 3):  # start > 0: the data pointer is not 16-byte aligned
            x = base[start:start + n]
            assert _same_bits(stochastic_round(x.cuda(), dtype, seed=n, offset=start),
                              stochastic_round(x, dtype, seed=n, offset=start))
    m = base[: 257 * 129].reshape(257, 129)
    for x in (m.t(), m[:, ::3], m[5:, 7:]):
        assert _same_bits(stochastic_round(x.cuda(), dtype, seed=3, offset=4),
                          stochastic_round(x, dtype, seed=3, offset=4))


@pytest.mark.parametrize("dtype", DTYPES)
def test_in_place(dtype):
    x = _all_exponents(100_003)[:100_003]
    want = stochastic_round(x, dtype, seed=9, offset=10)
    dst = torch.empty(100_003, dtype=dtype, device="cuda")
    assert stochastic_round_(dst, x.cuda(), seed=9, offset=10) is dst and _same_bits(dst, want)
    m = x[: 301 * 331].reshape(301, 331)
    want = stochastic_round(m, dtype, seed=1, offset=2)
    storage = torch.zeros(331, 301, dtype=dtype, device="cuda")
    stochastic_round_(storage.t(), m.cuda(), seed=1, offset=2)
    assert _same_bits(storage.t(), want)
    want = stochastic_round(x, dtype, seed=9, offset=10)
    shifted = torch.zeros(100_004, dtype=dtype, device="cuda")
    stochastic_round_(shifted[1:], x.cuda(), seed=9, offset=10)  # contiguous, not 16-byte aligned
    assert _same_bits(shifted[1:], want) and shifted[0].item() == 0
    wide = torch.zeros(2 * 100_003, dtype=dtype, device="cuda")
    stochastic_round_(wide[::2], x.cuda(), seed=9, offset=10)  # strided destination
    assert _same_bits(wide[::2], want) and not wide[1::2].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_generator_path_without_sync(dtype):
    x = torch.randn(4097, device="cuda")
    gen = torch.cuda.default_generators[torch.cuda.current_device()]
    torch.cuda.manual_seed(77)
    seed, offset = gen.initial_seed() ^ _CUDA_KEY_SALT, gen.get_offset()  # as clipshard.ops.seeds draws them
    torch.cuda.set_sync_debug_mode("error")  # any host-device synchronisation raises
    try:
        a = stochastic_round(x, dtype)
        b = stochastic_round(x, dtype)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert not torch.equal(a, b)
    assert _same_bits(a, stochastic_round(x.cpu(), dtype, seed=seed, offset=offset))
    torch.cuda.manual_seed(77)
    assert _same_bits(stochastic_round(x, dtype), a)
    g = torch.Generator(device="cuda").manual_seed(5)
    h = torch.Generator(device="cuda").manual_seed(5)
    assert _same_bits(stochastic_round(x, dtype, generator=g), stochastic_round(x, dtype, generator=h))


def test_empty_and_zero_dim():
    for shape in [(), (0,), (4, 0)]:
        x = torch.randn(shape, device="cuda")
        for dtype in DTYPES:
            y = stochastic_round(x, dtype, seed=1, offset=2)
            assert y.shape == x.shape and y.device.type == "cuda"
            assert _same_bits(y, stochastic_round(x.cpu(), dtype, seed=1, offset=2))


def test_device_mismatch_error():
    with pytest.raises(ValueError, match="stochastic_round_: dst and src must be on the same device"):
        stochastic_round_(torch.empty(4, dtype=torch.float16, device="cuda"), torch.ones(4))
