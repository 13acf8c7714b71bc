"""`python -m clipshard plan`: the table, the JSON, and clear errors for bad arguments."""
import json
import subprocess
import sys

import pytest

from clipshard.planning.cli import main


def test_the_table_names_the_setting_the_peak_and_the_largest_allocations(capsys):
    assert main(["--loss", "clip", "--mode", "ring", "--world-size", "4", "--batch-size", "1000", "--dim", "96",
                 "--dtype", "bf16", "--device", "cpu", "--rows", "3"]) == 0
    out = capsys.readouterr().out
    assert "loss=ClipLoss, mode=ring, world_size=4, batch_size=1000, dim=96, dtype=bfloat16" in out
    assert "peak per rank:" in out
    assert "_ring_pass" in out  # the ring's travelling buffers are among the largest allocations
    assert "smaller kinds" in out  # more kinds than the 3 rows asked for


def test_json_gives_the_peak_and_its_allocations(capsys):
    assert main(["--loss", "siglip", "--mode", "gather", "--world-size", "2", "--batch-size", "300", "--dim", "64",
                 "--device", "cpu", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["setting"]["loss"] == "SigLipLoss"
    kinds = report["peak_allocations"]
    assert report["peak_bytes"] >= sum(kind["bytes"] for kind in kinds) > 0


def test_exchange_grows_with_the_world_and_ring_does_not(capsys):
    peaks = {}
    for mode in ("exchange", "ring"):
        for world in (4, 16):
            # on the CPU: CUDA's chunk workspace (up to its 256 MiB budget) would outweigh the blocks here
            main(["--mode", mode, "--world-size", str(world), "--batch-size", "2048", "--dim", "128", "--json",
                  "--device", "cpu"])
            peaks[mode, world] = json.loads(capsys.readouterr().out)["peak_bytes"]
    assert peaks["exchange", 16] > 3 * peaks["exchange", 4]
    assert abs(peaks["ring", 16] - peaks["ring", 4]) <= 0.05 * peaks["ring", 4]


@pytest.mark.parametrize("argv, message", [
    (["--world-size", "0", "--batch-size", "8", "--dim", "4"], "world_size must be an int >= 1"),
    (["--world-size", "2", "--batch-size", "8", "--dim", "4", "--dtype", "int8"], "dtype must be"),
    (["--world-size", "2", "--batch-size", "8", "--dim", "4", "--micro-batch", "4"], "--micro-batch needs --model"),
    (["--loss", "siglip", "--mode", "exchange", "--world-size", "2", "--batch-size", "8", "--dim", "4"], "mode"),
    (["--world-size", "2", "--batch-size", "8"], "--dim is needed to plan a loss"),
    (["--world-size", "2", "--batch-size", "8", "--model", "open_clip:ViT-B-16"], "--model needs --micro-batch"),
    (["--world-size", "2", "--batch-size", "8", "--model", "ViT-B-16", "--micro-batch", "4"],
     "--model must be open_clip:<model name>"),
])
def test_bad_arguments_exit_with_a_message_naming_them(argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert message in str(exit_info.value)


def test_python_dash_m_clipshard_plan_runs():
    done = subprocess.run([sys.executable, "-m", "clipshard", "plan", "--world-size", "2", "--batch-size", "64",
                           "--dim", "32", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "peak per rank:" in done.stdout
