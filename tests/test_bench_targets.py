"""benchmarks/bench_targets.py --quick: every configuration runs, clipshard's loss and the
materialised one agree (fp32, tiny sizes), and the JSON holds the rows and the target checks."""
import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import bench_targets  # noqa: E402


def test_quick_run_measures_every_configuration_and_the_losses_agree(tmp_path, capsys):
    path = tmp_path / "targets.json"
    rows = bench_targets.main(["--quick", "--json", str(path)])
    assert [r["config"] for r in rows] == ["plain", "ids10-mask", "ids10-multi", "hn1", "hn3", "hn7"]
    for r in rows:
        assert r["loss_difference"] <= 1e-5, r["config"]
        for impl in ("clipshard", "materialised"):
            assert r[impl]["median_s"] > 0 and r[impl]["peak_bytes"] > 0 and math.isfinite(r[impl]["loss"])
    saved = json.loads(path.read_text())
    assert saved["meta"]["quick"] and len(saved["results"]) == 6
    assert any("1/20" in c["target"] for c in saved["checks"])
    assert "targets (quick sizes: not meaningful)" in capsys.readouterr().out


def test_the_duplicate_ids_share_a_tenth_of_the_rows():
    import torch
    ids = bench_targets.duplicate_ids(1000, torch.Generator().manual_seed(0), "cpu")
    assert ids.dtype == torch.int64 and ids.shape == (1000,)
    changed = (ids != torch.arange(1000)).sum().item()
    assert 90 <= changed <= 100  # 100 rows drew another row's id (a few drew their own)
