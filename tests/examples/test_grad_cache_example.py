"""examples/train_clip.py --micro-batch-size m: a micro-batch size below 1 exits with a clear
message. That GradCache's micro-batches give the per-step losses of the run without them is
checked with sample ids on (tests/examples/test_train_example_ids.py: one pair of torchrun runs
covers both)."""
import sys

import pytest

from tests.examples.example_runner import EXAMPLES

sys.path.insert(0, EXAMPLES)
import train_clip  # noqa: E402


def test_micro_batch_size_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        train_clip.parse_args(["--micro-batch-size", "0"], world_size=2)
    assert "--micro-batch-size must be at least 1, got 0" in capsys.readouterr().err
