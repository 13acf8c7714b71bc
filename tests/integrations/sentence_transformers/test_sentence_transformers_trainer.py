"""SentenceTransformerTrainer on 2 gloo ranks (torchrun) training the tiny local model of
examples/train_sentence_transformers.py with MultipleNegativesRankingLoss(gather_across_devices=True)
and a hard-negative column: with apply_to_sentence_transformers() it logs the library's own per-step
losses within 1e-5 (relative), and with sample ids it trains too. One launch runs all three."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed: "
                    "pip install '.[sentence_transformers]'")
pytest.importorskip("datasets", reason="datasets is not installed (SentenceTransformerTrainer needs it)")

EXAMPLE = pathlib.Path(__file__).parents[3] / "examples" / "train_sentence_transformers.py"


def test_trainer_on_two_ranks_logs_the_library_losses(tmp_path):
    out = tmp_path / "runs.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(EXAMPLE), "own", "clipshard", "ids-mask", "--steps", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    runs = json.loads(out.read_text())
    own, fused, ids = (runs[name]["losses"] for name in ("own", "clipshard", "ids-mask"))
    print("own", own, "clipshard", fused, "ids-mask", ids)
    assert runs["world_size"] == 2 and len(own) == len(fused) == len(ids) == 4
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(fused, own)), (fused, own)
    # the topic ids repeat within a batch: masking them changes the loss (and it stays finite)
    assert all(x == x and abs(x) < 1e3 for x in ids) and any(abs(a - b) > 1e-3 for a, b in zip(ids, own))
