"""examples/train_clip.py: flag validation, data and model pieces in-process, and real 2-rank gloo
runs through torchrun (a smoke run, and interrupted + resumed == uninterrupted, bit for bit, also
when the ranks' newest checkpoints differ); checkpoints that are damaged or interrupted while being
written are refused on every rank or leave the previous ones intact. A resume with no step common
to every rank, and longer interruption sequences: test_example_resume.py."""
import json
import os
import re
import shutil
import sys

import pytest
import torch

from tests.examples.example_runner import EXAMPLES, TINY_MODEL, assert_bitwise_equal, torchrun_failing, torchrun_ok

sys.path.insert(0, EXAMPLES)

import train_clip  # noqa: E402
from clip_digits import checkpoint  # noqa: E402
from clip_digits.checkpoint import CheckpointError, checkpoint_path, load_checkpoint, save_checkpoint, saved_steps  # noqa: E402
from clip_digits.data import global_batch_indices, load_digits_data, rank_batch  # noqa: E402
from clip_digits.measure import peak_loss_memory  # noqa: E402
from clip_digits.model import TextEncoder  # noqa: E402

TINY = ["--steps", "6", "--batch-size", "64", "--warmup", "2", "--eval-every", "3", "--checkpoint-every", "2", *TINY_MODEL]


# ---- flags ------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["--batch-size", "255"], "--batch-size (255) must be divisible by the number of ranks (2)"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--text-precision", "fp8"], "argument --text-precision: invalid choice: 'fp8'"),
    (["--loss", "naive"], "argument --loss: invalid choice: 'naive'"),
    (["--lr", "0"], "--lr must be positive and finite, got 0.0"),
    (["--lr", "inf"], "--lr must be positive and finite, got inf"),
    (["--lr", "nan"], "--lr must be positive and finite, got nan"),
    (["--weight-decay", "nan"], "--weight-decay must be finite and not negative, got nan"),
    (["--warmup", "-1"], "--warmup must not be negative, got -1"),
    (["--seed", "-1"], "--seed must be in [0, 2**31), got -1"),
    (["--seed", str(2**40)], "--seed must be in [0, 2**31)"),
    (["--batch-size", "4000"], "--batch-size (4000) must not exceed the 1438 training images"),
    (["--resume"], "--resume needs --out"),
    (["--steps", "10", "--stop-after", "10"], "--stop-after must be in [1, --steps), got 10"),
    (["--text-width", "30", "--text-heads", "4"], "--text-width (30) must be divisible by --text-heads (4)"),
    (["--backend", "nccl", "--device", "cpu"], "--backend nccl needs --device cuda"),
])
def test_bad_flags_exit_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_clip.parse_args(argv, world_size=2)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_out_naming_a_file_and_resume_without_checkpoints_exit_with_a_clear_message(tmp_path, capsys):
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a run folder")
    for argv, message in ((["--out", str(a_file)], f"{a_file} is a file, not a folder"),
                          (["--out", str(a_file / "run")], f"{a_file} is a file, not a folder"),
                          (["--out", str(tmp_path), "--resume"], f"--resume: no checkpoints in {tmp_path / 'checkpoint'}")):
        with pytest.raises(SystemExit) as exit_info:
            train_clip.parse_args(argv, world_size=2)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_default_flags_are_valid_for_two_ranks():
    args = train_clip.parse_args([], world_size=2)
    assert (args.loss, args.text_precision, args.half_dtype, args.checkpointing) == ("clipshard", "sr16", "bf16", True)
    assert args.batch_size % 2 == 0


# ---- data and model ---------------------------------------------------------------------------

def test_held_out_images_are_never_trained_on_and_ranks_split_each_batch():
    data = load_digits_data()
    assert len(data.train_labels) + len(data.test_labels) == 1797
    train_rows = {tuple(x.flatten().tolist()) for x in data.train_images}
    assert not any(tuple(x.flatten().tolist()) in train_rows for x in data.test_images)
    assert sorted(data.test_labels.unique().tolist()) == list(range(10))
    batch = global_batch_indices(len(data.train_labels), 64, seed=3, step=5)
    assert len(set(batch.tolist())) == 64
    shards = [rank_batch(data, 64, 3, 5, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat([labels for _, _, labels in shards]), data.train_labels[batch])
    for images, token_ids, labels in shards:  # every caption names its image's digit
        for ids, label in zip(token_ids, labels):
            assert any(torch.equal(ids, c) for c in data.caption_ids[label])


def test_gradient_checkpointing_gives_the_same_gradients():
    data = load_digits_data()
    torch.manual_seed(0)
    encoder = TextEncoder(len(data.tokenizer), data.tokenizer.max_length, 16, 2, 2, 8, checkpointing=True)
    tokens = data.caption_ids[:, :3].reshape(-1, data.tokenizer.max_length)
    grads = []
    for checkpointing in (True, False):
        encoder.checkpointing = checkpointing
        encoder.zero_grad()
        (encoder(tokens) ** 2).sum().backward()
        grads.append([p.grad.clone() for p in encoder.parameters()])
    for with_ckpt, without in zip(*grads):
        torch.testing.assert_close(with_ckpt, without, rtol=0, atol=1e-6)


def test_peak_loss_memory_sees_a_materialised_similarity_matrix():
    def materialising_loss(image, text, scale):  # keeps the 512 x 512 fp32 logits (1 MiB) alive
        logits = scale * image @ text.T
        return logits.logsumexp(dim=1).mean() - logits.diagonal().mean()

    image, text = torch.randn(512, 8), torch.randn(512, 8)
    peak = peak_loss_memory(materialising_loss, image, text, torch.tensor(2.0), repeats=1)
    assert 512 * 512 * 4 <= peak < 8 * 512 * 512 * 4


# ---- real 2-rank runs -------------------------------------------------------------------------

def _torchrun(out_dir, *extra):
    return torchrun_ok(out_dir, *TINY, *extra)


def _torchrun_failing(out_dir, *extra):
    return torchrun_failing(out_dir, *TINY, *extra)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("whole")
    return out_dir, _torchrun(out_dir)


def _table_rows(stdout):
    """The rows of the printed table that the README shows: all but steps, throughput and time."""
    rows = [line for line in stdout.splitlines() if line.startswith("  ") and not line.startswith(
        ("  steps x global batch", "  training throughput", "  wall time"))]
    assert any(row.strip().startswith("final loss") for row in rows), stdout[-2000:]
    return rows


def _deterministic_rows(stdout):
    """The rows docs/example.md calls deterministic: accuracy, loss, optimizer bytes. (The peak loss
    memory is not: a resumed run measured 256 bytes more or less than an uninterrupted one.)"""
    return [row for row in _table_rows(stdout) if "peak loss memory" not in row and "for comparison" not in row]


def test_the_readme_table_has_the_rows_the_run_prints(uninterrupted):
    """README.md ("Two commands") shows the default run's table, its one home; its rows are those
    the run prints (the values are the default run's, which the suite does not repeat)."""
    readme = open(os.path.join(EXAMPLES, "..", "README.md")).read()
    table = readme.split("## Two commands", 1)[1].split("```\n", 3)[2]
    label = lambda row: re.split(r"\s{2,}", row.strip())[0]  # noqa: E731
    _, stdout = uninterrupted
    assert [label(row) for row in table.splitlines()] == [label(row) for row in _table_rows(stdout)]


def test_smoke_run_writes_sane_metrics_and_a_plot(uninterrupted):
    out_dir, stdout = uninterrupted
    metrics = json.loads((out_dir / "metrics.json").read_text())
    assert 0.0 <= metrics["zero_shot_accuracy"] <= 1.0
    assert metrics["peak_loss_memory_bytes"] > 0
    assert metrics["wall_seconds"] > metrics["train_seconds"] > 0
    assert metrics["world_size"] == 2 and metrics["backend"] == "gloo"
    assert metrics["config"]["text_precision"] == "sr16"
    # bf16 weights + bf16 moments = 6 bytes (plus a 4-byte step counter per tensor); fp32: 12 bytes.
    assert 6.0 <= metrics["optimizer_bytes_per_param_text"] < 6.5
    assert 12.0 <= metrics["optimizer_bytes_per_param_image"] < 12.5
    assert 6.0 < metrics["optimizer_bytes_per_param"] < 12.5
    history = metrics["history"]
    assert history["loss_steps"] == list(range(1, 7)) and all(0 < x < 20 for x in history["loss"])
    assert history["eval_steps"] == [0, 3, 6]
    assert (out_dir / "training.png").stat().st_size > 1000
    assert "zero-shot accuracy" in stdout
    # Stochastic rounding with the same bits on every rank keeps the replicas identical.
    states = [torch.load(checkpoint_path(out_dir, r, 6), weights_only=False) for r in range(2)]
    assert any(t.dtype == torch.bfloat16 for t in states[0]["model"].values())
    assert_bitwise_equal(states[0]["model"], states[1]["model"], "model")
    assert_bitwise_equal(states[0]["optimizers"], states[1]["optimizers"], "optimizers")


# ---- resume that cannot mix steps, damaged checkpoints ------------------------------------------

@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory):
    """A run stopped after step 4 with --checkpoint-every 2: every rank keeps steps 2 and 4."""
    out_dir = tmp_path_factory.mktemp("stopped")
    _torchrun(out_dir, "--stop-after", "4")
    return out_dir


def _copy_run(source, target):
    shutil.copytree(source, target)
    return target


def test_checkpoints_keep_the_last_two_steps_per_rank(stopped_at_4):
    assert [saved_steps(stopped_at_4, r) for r in range(2)] == [[2, 4], [2, 4]]
    assert not [name for name in os.listdir(stopped_at_4 / "checkpoint") if name.endswith(".tmp")]


def test_resume_with_ranks_at_different_steps_takes_the_newest_common_step(stopped_at_4, uninterrupted, tmp_path):
    """Rank 1 was killed while writing step 4 (so it has only step 2): both ranks resume from step 2
    and the run ends bitwise where the uninterrupted one does."""
    run = _copy_run(stopped_at_4, tmp_path / "run")
    os.remove(checkpoint_path(run, 1, 4))
    resumed_stdout = _torchrun(run, "--resume")
    whole_dir, whole_stdout = uninterrupted
    # the printed accuracy, loss and optimizer rows, which docs/example.md calls deterministic
    assert _deterministic_rows(resumed_stdout) == _deterministic_rows(whole_stdout)
    for rank in range(2):
        whole = torch.load(checkpoint_path(whole_dir, rank, 6), weights_only=False)
        resumed = torch.load(checkpoint_path(run, rank, 6), weights_only=False)
        assert_bitwise_equal(whole["model"], resumed["model"], "model")
        assert_bitwise_equal(whole["optimizers"], resumed["optimizers"], "optimizers")
        assert whole["history"] == resumed["history"]
    assert json.loads((run / "metrics.json").read_text())["resumed_from_step"] == 2


def test_a_damaged_checkpoint_on_one_rank_is_refused_on_every_rank(stopped_at_4, tmp_path):
    run = _copy_run(stopped_at_4, tmp_path / "run")
    damaged = checkpoint_path(run, 1, 4)
    with open(damaged, "r+b") as f:
        f.truncate(os.path.getsize(damaged) // 2)
    stderr = _torchrun_failing(run, "--resume")
    assert stderr.count(f"rank 1: --resume: cannot read checkpoint {damaged}") == 2, stderr[-3000:]


def _tiny_training_state():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return dict(config={"seed": 0}, model=model, optimizers={"opt": opt},
                schedulers={"opt": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)},
                generators={"sr": torch.Generator().manual_seed(1)}, history={"loss": []})


@pytest.mark.parametrize("damage", ["empty", "truncated", "random bytes", "another file"])
def test_damaged_checkpoints_give_an_error_naming_the_file(damage, tmp_path):
    path = save_checkpoint(str(tmp_path), 0, step=3, **_tiny_training_state())
    size = os.path.getsize(path)
    if damage == "another file":
        torch.save({"weights": torch.ones(2)}, path)
    else:
        with open(path, "r+b") as f:
            if damage == "random bytes":
                f.write(torch.randint(0, 256, (size,), generator=torch.Generator().manual_seed(0),
                                      dtype=torch.uint8).numpy().tobytes())
            f.truncate({"empty": 0, "truncated": size // 2, "random bytes": size}[damage])
    with pytest.raises(CheckpointError, match=path):
        load_checkpoint(str(tmp_path), 0, 3)


def test_a_crash_while_saving_leaves_the_previous_checkpoints_intact(tmp_path, monkeypatch):
    state = _tiny_training_state()
    for step in (2, 4, 6):
        checkpoint.save_checkpoint(str(tmp_path), 0, step=step, **state)
    assert checkpoint.saved_steps(str(tmp_path), 0) == [4, 6]  # the last two are kept
    synced = []
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: synced.append(fd))

    def dies_half_way(obj, f):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt  # as if killed while writing

    monkeypatch.setattr(checkpoint.torch, "save", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save_checkpoint(str(tmp_path), 0, step=8, **state)
    assert checkpoint.saved_steps(str(tmp_path), 0) == [4, 6] and not synced
    assert checkpoint.load_checkpoint(str(tmp_path), 0, 6)["step"] == 6
    monkeypatch.undo()
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: synced.append(fd))
    checkpoint.save_checkpoint(str(tmp_path), 0, step=8, **state)
    assert len(synced) == 2  # the file, then the folder (the rename)
    assert checkpoint.saved_steps(str(tmp_path), 0) == [6, 8]
