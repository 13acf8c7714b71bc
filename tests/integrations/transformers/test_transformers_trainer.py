"""Trainer on 2 gloo ranks (torchrun) with apply_to_transformers() against the same training in one
process on the global batch (the model's own loss there): the per-step losses Trainer logs agree to
1e-5 relative. Without the patch the 2-rank run logs the mean of the local losses, which differ; and
the recipe run (logits=False, bf16, gradient checkpointing, clipshard.optim.AdamW as Trainer's
optimizer) trains. tests/integrations/transformers/hf_trainer_runner.py runs the training."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("transformers", reason="transformers is not installed: pip install '.[transformers]'")
pytest.importorskip("accelerate", reason="Trainer needs accelerate: pip install '.[transformers]'")

from tests.integrations.transformers import hf_trainer_runner  # noqa: E402

RUNNER = pathlib.Path(__file__).with_name("hf_trainer_runner.py")


def test_trainer_on_two_ranks_logs_the_global_batch_loss(tmp_path):
    out = tmp_path / "losses.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(RUNNER), str(out), "clipshard", "own", "recipe"],
                          capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    two_ranks = json.loads(out.read_text())
    one_process = hf_trainer_runner.train("own")
    steps = hf_trainer_runner.STEPS
    assert len(one_process) == len(two_ranks["clipshard"]) == len(two_ranks["own"]) == steps
    for step, (ours, want, local) in enumerate(zip(two_ranks["clipshard"], one_process, two_ranks["own"])):
        print(f"  step {step}: one process {want:.6f}, 2 ranks with clipshard {ours:.6f} "
              f"(relative difference {abs(ours / want - 1):.2g}), 2 ranks without {local:.6f}")
        assert abs(ours / want - 1) < 1e-5, (step, ours, want)
        assert abs(local / want - 1) > 1e-2, (step, local, want)  # the local loss is a different loss
    recipe = two_ranks["recipe"]
    assert len(recipe) == steps and all(abs(r / w - 1) < 5e-2 for r, w in zip(recipe, two_ranks["clipshard"])), recipe
