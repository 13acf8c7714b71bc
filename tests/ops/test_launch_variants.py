"""The launch rules that pick a compiled CUDA kernel variant (csrc/include/clipshard/launch_rules.h),
as the first-use check queries them (clipshard/ops/launch_variants.py), and that the CUDA launchers
call those same rules rather than a copy of them."""
import pathlib
import re

import pytest

from clipshard.ops import launch_variants

ROOT = pathlib.Path(__file__).resolve().parents[2]
H100_SMS = 132


def test_siglip_rows_per_cta_on_an_h100_start_at_the_documented_batches():
    rows = lambda m: launch_variants.siglip_ids_rows(m, H100_SMS)  # noqa: E731
    assert [rows(m) for m in (1, 67, 1054, 1055, 2108, 2109, 4216, 4217, 1 << 30)] == [1, 1, 1, 2, 2, 4, 4, 8, 8]
    assert launch_variants.every_siglip_ids_rows(H100_SMS) == (1, 2, 4, 8)
    assert launch_variants.every_siglip_ids_rows(1) == (1, 2, 4, 8)


def test_the_chunked_forward_rows_follow_the_variable_and_the_grid_limit(monkeypatch):
    monkeypatch.delenv(launch_variants.FORWARD_ROWS_VARIABLE, raising=False)
    assert [launch_variants.chunked_forward_rows(m) for m in (1, 67, 1 << 30)] == [32, 32, 32]
    monkeypatch.setenv(launch_variants.FORWARD_ROWS_VARIABLE, "16")
    assert [launch_variants.chunked_forward_rows(m) for m in (67, 65535 * 16, 65535 * 16 + 1)] == [16, 16, 32]
    monkeypatch.setenv(launch_variants.FORWARD_ROWS_VARIABLE, "24")
    with pytest.raises(ValueError, match="CLIPSHARD_CHUNKED_FORWARD_ROWS must be one of 16, 32"):
        launch_variants.chunked_forward_rows(67)
    monkeypatch.setenv(launch_variants.FORWARD_ROWS_VARIABLE, "32")
    assert launch_variants.every_forward_rows() == (16, 32)
    assert launch_variants.chunked_forward_rows(67) == 32  # every_forward_rows restored the variable


def test_distillation_launches_two_teachers_then_one():
    assert [launch_variants.distill_launch_teachers(t) for t in (1, 2, 3, 4, 5)] == [(1,), (2,), (2, 1), (2,), (2, 1)]
    assert launch_variants.every_distill_launch_teachers() == ((1,), (2,), (2, 1))


def test_bad_sizes_are_refused_naming_the_argument():
    with pytest.raises(RuntimeError, match="multiprocessors must be positive, got 0"):
        launch_variants.siglip_ids_rows(67, 0)
    with pytest.raises(RuntimeError, match="teachers must be positive, got 0"):
        launch_variants.distill_launch_teachers(0)


@pytest.mark.parametrize("target,start,want", [(8, 67, 4217), (4, 67, 2109), (2, 67, 1055), (1, 67, 67),
                                               (1, 5000, 1054), (2, 5000, 2108), (8, 5000, 5000)])
def test_rows_reaching_finds_the_nearest_number_of_rows_with_the_variant(target, start, want):
    rule = lambda m: launch_variants.siglip_ids_rows(m, H100_SMS)  # noqa: E731
    assert launch_variants.rows_reaching(rule, target, start) == want


def test_rows_reaching_refuses_a_variant_the_rule_never_gives():
    with pytest.raises(ValueError, match="no number of rows gives 3"):
        launch_variants.rows_reaching(lambda m: launch_variants.siglip_ids_rows(m, 2), 3, 67)


@pytest.mark.parametrize("source,call", [
    ("cuda/siglip.cu", "launch_rules::siglip_ids_rows_per_cta(M, sms,"),
    ("cuda/contrastive_lse_chunked.cu", "chunked::forward_rows_per_cta(rows.size(0))"),
    ("chunked/forward_rows.h", "launch_rules::chunked_forward_rows(M, requested_forward_rows(),"),
    ("cuda/distill_launch.h", "launch_rules::distill_launch_teachers(s.T, t0)"),
    ("launch_variants.cpp", "launch_rules::siglip_ids_rows_per_cta(rows, multiprocessors,"),
    ("launch_variants.cpp", "launch_rules::distill_launch_teachers(teachers, first)"),
])
def test_the_cuda_launchers_and_the_query_ops_call_the_shared_rules(source, call):
    """The launcher picks its variant through the rule the first-use check queries (no copy of it)."""
    assert call in (ROOT / "csrc" / source).read_text()


def test_each_launch_rule_is_defined_once():
    """launch_rules.h is the one home of the rules: no other header or source defines a function of
    the same name or repeats SigLIP's halving loop (two copies could drift apart)."""
    names = ("siglip_ids_rows_per_cta", "chunked_forward_rows", "distill_launch_teachers", "chunk_column_splits",
             "looping_grid_rows")
    home = ROOT / "csrc" / "include" / "clipshard" / "launch_rules.h"
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"}]
    for name in names:
        definition = re.compile(r"^(?:inline |constexpr |static )*[\w:<>]+ " + name + r"\(", re.M)
        assert [p for p in sources if definition.search(p.read_text())] == [home], name
    assert [p for p in sources if "while (rows > 1" in p.read_text()] == [home]
