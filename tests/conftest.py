import os

import pytest
import torch

# The first-use check's fallback must never stand in for a kernel a test checks, nor its warning
# reach a test that counts warnings: off for the suite (tests/ops/test_first_use_check.py turns it on).
os.environ.setdefault("CLIPSHARD_FIRST_USE_CHECK", "0")


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU; without one they are reported as skipped, never passed."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
