"""The chunk driver's buffered column gradient (csrc/chunked/chunk_driver.h, GradientAccumulator) on
the CPU. Only CUDA's 16-bit and fp16 pre-scaled calls take that path in the losses; the test op
clipshard_testing::chunked_gradients drives the same driver with an unscale factor or a bf16
output, so that its blocks of column_buffer_rows(M, kc) columns (M rounded down to 128, at least
128, at most a chunk) are checked here: the values against fp64, the buffer's size by the bytes
the call allocates."""
import pytest
import torch

import clipshard  # noqa: F401  (registers torch.ops.clipshard*)
from clipshard.ops.launch_variants import column_buffer_rows
from clipshard.planning.measured_peak import measured_peak_bytes

chunked_gradients = torch.ops.clipshard_testing.chunked_gradients


def _problem(m, k, d, dtype, seed):
    """Unit-norm features and logit gradients of realistic size (about 0.5 / M, random signs)."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.nn.functional.normalize(torch.randn(m, d, generator=gen, dtype=torch.float64), dim=1)
    cols = torch.nn.functional.normalize(torch.randn(k, d, generator=gen, dtype=torch.float64), dim=1)
    dlogits = torch.randn(m, k, generator=gen, dtype=torch.float64) * (0.5 / m)
    return rows.to(dtype), cols.to(dtype), dlogits.to(dtype)


def test_the_buffer_rows_follow_m_and_stay_within_a_chunk():
    assert [column_buffer_rows(m, 10_000) for m in (1, 127, 128, 300, 1000, 65536)] == [128, 128, 128, 256, 896,
                                                                                        10_000]
    assert [column_buffer_rows(300, width) for width in (1, 200, 256, 257)] == [1, 200, 256, 256]
    with pytest.raises(RuntimeError, match="column_buffer_rows: need M, width_max >= 1, got 0, 5"):
        column_buffer_rows(0, 5)


# M, K, D, chunk columns: blocks of 128 in chunks of 384 (the last chunk 232 wide: 128 + 104); M
# below 128 (one block of 128 in chunks of 300); blocks of 256 in one chunk of all 1000 columns.
CASES = [(130, 1000, 7, 384), (5, 1000, 9, 300), (300, 1000, 24, 1000)]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "M{}K{}D{}kc{}".format(*c))
@pytest.mark.parametrize("dtype,unscale,out_dtype", [
    (torch.float32, 0.25, None),  # the fp16 pre-scale's unscale, fp32 out
    (torch.float32, None, torch.bfloat16),  # rounded once to bf16 from the fp32 buffer
    (torch.float64, 0.125, None),
], ids=["fp32-unscaled", "fp32-to-bf16", "fp64-unscaled"])
def test_buffered_column_gradient_matches_fp64(case, dtype, unscale, out_dtype):
    m, k, d, kc = case
    rows, cols, dlogits = _problem(m, k, d, dtype, seed=m + k)
    factor = None if unscale is None else torch.tensor(unscale)
    grad_rows, grad_cols = chunked_gradients(rows, cols, dlogits, factor, out_dtype, kc)
    assert grad_rows.dtype == grad_cols.dtype == (out_dtype or dtype)
    u = 1.0 if unscale is None else unscale
    want_rows = u * dlogits.double() @ cols.double()
    want_cols = u * dlogits.double().t() @ rows.double()
    # fp32: a few roundings per dot of M (or K) terms; bf16: one rounding (2^-9 relative) on top
    eps = {torch.float32: 2e-6, torch.float64: 1e-14}[dtype]
    rel = 2.0 ** -8 if out_dtype == torch.bfloat16 else 0.0
    for got, want, terms in ((grad_rows, want_rows, k), (grad_cols, want_cols, m)):
        scale = u * (0.5 / m) * terms ** 0.5  # about the size of one entry
        err = (got.double() - want).abs()
        assert (err <= rel * want.abs() + eps * scale * 8).all(), f"max error {err.max().item():.3g}"


def test_the_buffer_holds_a_block_of_m_columns_not_the_chunk():
    """M = 130, one chunk of K = 4096 columns, D = 64: the call allocates its outputs (fp32 M x D and
    K x D), the chunk's similarities and logit gradients (M x K fp32 each) and a 128 x D buffer; a
    whole-chunk buffer would add 4096 x 64 x 4 = 1 MiB."""
    m, k, d = 130, 4096, 64
    rows, cols, dlogits = _problem(m, k, d, torch.float32, seed=3)
    factor = torch.tensor(0.5)
    peak = measured_peak_bytes(lambda: chunked_gradients(rows, cols, dlogits, factor, None, k), "cpu")
    expected = 4 * ((m + k) * d + 2 * m * k + 128 * d)
    assert expected <= peak <= expected + (64 << 10), f"peak {peak} bytes, expected about {expected}"
