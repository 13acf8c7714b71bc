"""examples/train_clip.py --micro-batch-size m on 2 gloo ranks (torchrun): the per-step losses of
the run without it (fp32 text tower, so that no stochastic rounding tells the runs apart) within
1e-5 relative; a micro-batch size below 1 exits with a clear message."""
import json
import sys

import pytest

from tests.examples.example_runner import EXAMPLES, TINY_MODEL, torchrun_ok

sys.path.insert(0, EXAMPLES)
import train_clip  # noqa: E402

RUN = ["--steps", "4", "--batch-size", "64", "--warmup", "1", "--eval-every", "4", "--checkpoint-every", "0",
       "--text-precision", "fp32", *TINY_MODEL]


def test_micro_batch_size_below_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        train_clip.parse_args(["--micro-batch-size", "0"], world_size=2)
    assert "--micro-batch-size must be at least 1, got 0" in capsys.readouterr().err


def test_micro_batches_give_the_losses_of_the_plain_run(tmp_path):
    losses = []
    for name, extra in (("plain", []), ("micro", ["--micro-batch-size", "7"])):  # 32 local pairs: 4 x 7 + 4
        torchrun_ok(tmp_path / name, *RUN, *extra)
        losses.append(json.loads((tmp_path / name / "metrics.json").read_text())["history"]["loss"])
    plain, micro = losses
    assert len(plain) == len(micro) == 4
    difference = max(abs(a - b) / abs(b) for a, b in zip(micro, plain))
    print(f"max relative per-step loss difference {difference:.2e}")
    assert difference <= 1e-5
