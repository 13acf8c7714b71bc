"""The chunked CUDA forward and backward take the same number of rows: with
CLIPSHARD_CHUNKED_FORWARD_ROWS=16 the forward used to refuse M > 65535 * 16 = 1,048,560 while the
backward took up to 65535 * 32; past its grid the 16-row variant now hands over to the 32-row one."""
import pytest
import torch

import clipshard
from tests.references.contrastive import contrastive_lse_reference

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("rows_per_cta", ["16", "32"])
def test_forward_and_backward_take_the_same_rows(monkeypatch, rows_per_cta):
    monkeypatch.setenv("CLIPSHARD_CHUNKED_FORWARD_ROWS", rows_per_cta)
    M, D = 65535 * 16 + 1, 8
    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(M, D, device="cuda", generator=generator).bfloat16().requires_grad_()
    cols = torch.randn(M, D, device="cuda", generator=generator).bfloat16()
    row_lse, pos, col_lse = clipshard.contrastive_lse(rows, cols, 2.0, algorithm="chunked")
    (row_lse.sum() * (0.5 / M)).backward()
    assert torch.isfinite(rows.grad.float()).all()
    tail = slice(M - 5, M)  # the last row block, past the 16-row grid
    want = contrastive_lse_reference(rows[tail].detach(), cols, torch.tensor(2.0, device="cuda"),
                                     pos_offset=M - 5, want_col_lse=False)[0]
    torch.testing.assert_close(row_lse[tail].double(), want, rtol=1e-5, atol=1e-4)
    too_many = torch.randn(65535 * 32 + 1, D, device="cuda", generator=generator).bfloat16()
    with pytest.raises(RuntimeError, match="too many rows"):
        clipshard.contrastive_lse(too_many, too_many, 2.0, algorithm="chunked")
