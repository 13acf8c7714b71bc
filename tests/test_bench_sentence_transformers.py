"""benchmarks/bench_sentence_transformers.py --quick on 2 gloo ranks: every method of every case runs
on both ranks and the JSON holds positive times and peaks, MNRL's ratios being 1."""
import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed")

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks", "bench_sentence_transformers.py")
METHODS = {"MNRL", "cached MNRL loss stage", "clipshard MNRL", "clipshard cached loss stage"}


def test_quick_run_measures_every_method_on_both_ranks(tmp_path):
    path = tmp_path / "st.json"
    done = subprocess.run([sys.executable, SCRIPT, "--quick", "--steps", "2", "--json", str(path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(path.read_text())["rows"]
    assert {(r["rank"], r["negatives"], r["method"]) for r in rows} == {
        (rank, h, m) for rank in (0, 1) for h in (0, 3) for m in METHODS}
    for r in rows:
        assert r["median_s"] > 0 and r["peak_bytes"] > 0, r
        if r["method"] == "MNRL":
            assert r["time_vs_mnrl"] == 1.0 and r["memory_vs_mnrl"] == 1.0
