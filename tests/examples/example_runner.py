"""Runs examples/train_clip.py on 2 gloo ranks through torchrun, as a user does, for the example's
tests, and compares checkpoints bit for bit."""
import os
import subprocess
import sys

import numpy as np
import torch

EXAMPLES = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "examples"))
TRAIN_CLIP = os.path.join(EXAMPLES, "train_clip.py")
# A model small enough that torchrun's start-up dominates a run.
TINY_MODEL = ["--image-width", "8", "--text-width", "16", "--text-layers", "2", "--text-heads", "2", "--embed-dim", "16"]


def _environment() -> dict:
    repo = os.path.dirname(EXAMPLES)
    return {**os.environ, "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join(filter(None, [repo, os.environ.get("PYTHONPATH")]))}


def run_example(out_dir, *args):
    """The example on 2 gloo ranks through torchrun; a hang fails through the timeout."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               TRAIN_CLIP, "--out", str(out_dir), *args]
    for attempt in range(2):
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=_environment())
        # A port picked by torchrun can be taken by another job before the ranks bind it: retry once.
        if done.returncode == 0 or "address already in use" not in done.stderr.lower():
            break
    return done


def torchrun_ok(out_dir, *args) -> str:
    """Runs the example expecting success; returns its stdout."""
    done = run_example(out_dir, *args)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def torchrun_failing(out_dir, *args) -> str:
    """Runs the example expecting it to refuse; returns its stderr."""
    done = run_example(out_dir, *args)
    assert done.returncode != 0, done.stdout[-3000:]
    return done.stderr


def assert_bitwise_equal(a, b, where):
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bitwise_equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_bitwise_equal(x, y, f"{where}[{i}]")
    elif torch.is_tensor(a):
        assert a.dtype == b.dtype and a.shape == b.shape, where
        as_bytes = lambda t: t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
        assert torch.equal(as_bytes(a), as_bytes(b)), where
    elif isinstance(a, np.ndarray):  # numpy's RNG state
        assert a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes(), where
    else:
        assert a == b, where
