"""`python -m clipshard.open_clip_train --accum-freq K` (a clipshard.GradCache step) against stock
open_clip_train's own --accum-freq K on 2 gloo ranks (torchrun, CPU, the tiny model of
tests/integrations/open_clip/test_open_clip_train.py): the loss runs once per step instead of K times, and the per-step
losses agree within 1e-5 relative. (Stock open_clip gives logit_scale K times its gradient, one per
loss evaluation; AdamW's update hardly depends on a gradient's scale, so the runs stay together.)"""
import pytest

from clipshard.integrations.open_clip_train import main as clipshard_train_main

pytest.importorskip("open_clip_train.main", reason="open_clip_train or its data packages are missing")
from tests.integrations.open_clip.test_open_clip_train import (  # noqa: E402
    RANKS, SAMPLES, _max_relative_difference, _train, write_data)

ACCUM, MICRO = 4, 4
STEPS = SAMPLES // (ACCUM * MICRO * RANKS)  # per epoch


def test_accum_freq_runs_grad_cache_with_the_per_step_losses_of_open_clip(tmp_path):
    (tmp_path / "data").mkdir()
    data = write_data(tmp_path / "data")
    flags = ["--epochs", "1", "--batch-size", str(MICRO), "--accum-freq", str(ACCUM), "--local-loss", "--gather-with-grad"]
    stock, _ = _train(data, tmp_path, "stock", "stock", *flags)
    ours, log = _train(data, tmp_path, "clipshard", "clipshard", *flags)
    assert f"--accum-freq runs as clipshard.GradCache: local batch {ACCUM * MICRO} per step in micro-batches of " \
           f"{MICRO}" in log
    for rank in range(RANKS):
        assert len(stock[rank]["losses"]) == STEPS * ACCUM  # open_clip: the loss K times a step
        assert len(ours[rank]["losses"]) == STEPS  # clipshard: once
        per_step = stock[rank]["losses"][ACCUM - 1::ACCUM]
        assert len(set(per_step)) == STEPS  # training moves the loss each step
        difference = _max_relative_difference(ours[rank]["losses"], per_step)
        print(f"rank {rank}: max relative per-step loss difference {difference:.2e}")
        assert difference <= 1e-5, (ours[rank]["losses"], per_step)


def test_accum_freq_refuses_distillation():
    with pytest.raises(SystemExit, match="--accum-freq .* is not supported with --distill-model"):
        clipshard_train_main(["--accum-freq", "2", "--distill-model", "RN50", "--distill-pretrained", "x",
                              "--train-data", "x.csv"])
