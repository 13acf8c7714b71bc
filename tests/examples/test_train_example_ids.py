"""examples/train_clip.py --sample-ids label --targets mask|multi: bad values and combinations exit
with a message naming the flag; a tiny 2-rank run with the digit as the sample id works, and through
GradCache (--micro-batch-size) gives the same per-step losses (fp32 text tower, 1e-5 relative)."""
import json
import sys

import pytest

from tests.examples.example_runner import EXAMPLES, TINY_MODEL, torchrun_ok

sys.path.insert(0, EXAMPLES)
import train_clip  # noqa: E402
from clip_digits.data import contrastive_loss_floor, load_digits_data  # noqa: E402

RUN = ["--steps", "4", "--batch-size", "64", "--warmup", "1", "--eval-every", "4", "--checkpoint-every", "0",
       "--text-precision", "fp32", *TINY_MODEL]


@pytest.mark.parametrize("argv, message", [
    (["--sample-ids", "digit"], "argument --sample-ids: invalid choice: 'digit'"),
    (["--sample-ids", "label", "--targets", "all"], "argument --targets: invalid choice: 'all'"),
    (["--targets", "multi"], "--targets multi needs --sample-ids label"),
    (["--sample-ids", "label", "--loss", "open_clip"], "--sample-ids label needs --loss clipshard"),
])
def test_bad_sample_id_flags_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_clip.parse_args(argv, world_size=2)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_targets_default_to_mask_with_ids_and_the_floors():
    assert train_clip.parse_args(["--sample-ids", "label"], world_size=2).targets == "mask"
    assert train_clip.parse_args([], world_size=2).targets is None
    data = load_digits_data()
    assert contrastive_loss_floor(data, 256, 0, 600, "mask") == 0.0
    assert contrastive_loss_floor(data, 256, 0, 600, "multi") == contrastive_loss_floor(data, 256, 0, 600) > 3.0


def test_a_tiny_run_with_the_digit_as_sample_id_and_through_grad_cache(tmp_path):
    runs = {}
    for name, extra in (("plain", []), ("micro", ["--micro-batch-size", "7"])):  # 32 local pairs: 4 x 7 + 4
        torchrun_ok(tmp_path / name, *RUN, "--sample-ids", "label", "--targets", "multi", *extra)
        runs[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    metrics = runs["plain"]
    assert (metrics["config"]["sample_ids"], metrics["config"]["targets"]) == ("label", "multi")
    assert metrics["loss_floor"] > 1.0 and metrics["final_loss"] >= metrics["loss_floor"] - 1e-6
    plain, micro = runs["plain"]["history"]["loss"], runs["micro"]["history"]["loss"]
    assert len(plain) == len(micro) == 4
    difference = max(abs(a - b) / abs(b) for a, b in zip(micro, plain))
    print(f"max relative per-step loss difference, GradCache vs plain {difference:.2e}")
    assert difference <= 1e-5
