"""examples/train_clip.py: interrupted again and again, a run always resumes from the newest step
that every rank completed, never from a checkpoint of an abandoned timeline, and ends bitwise where
an uninterrupted run does; a refused resume ends every rank with its message, none by a signal.

Interruptions are reproduced by the files they leave (checkpoints are renamed into place, so a kill
leaves each rank with the checkpoints it had finished, and perhaps a *.tmp): first as a simulation
of many runs with fake training states on checkpoint.py itself, then with real 2-rank runs."""
import os
import random
import re
import shutil
import sys

import pytest
import torch

from tests.examples.example_runner import EXAMPLES, TINY_MODEL, assert_bitwise_equal, run_example, torchrun_ok

sys.path.insert(0, EXAMPLES)

from clip_digits import checkpoint  # noqa: E402
from clip_digits.checkpoint import (agree_on_step, checkpoint_dir, checkpoint_path, load_checkpoint,  # noqa: E402
                                    save_checkpoint, saved_steps, set_aside_later_steps)

# ---- retention and the choice of the resume step, on fake training states ----------------------

# What one rank had done with a save when the run was killed.
BEFORE, DURING, RENAMED, DONE = "before the save", "while writing", "after the rename, before retention", "done"


def _save(out_dir, rank, step, run, phase, monkeypatch):
    """This rank's save of `step` by run number `run`, cut short as `phase` says."""
    if phase == BEFORE:
        return
    if phase == DURING:  # a killed torch.save leaves part of the temporary file
        with open(checkpoint_path(out_dir, rank, step) + ".tmp", "wb") as f:
            f.write(b"part of a checkpoint")
        return
    state = dict(config={}, model=torch.nn.Linear(2, 1), optimizers={}, schedulers={}, generators={},
                 history={"written_by_run": run})
    with monkeypatch.context() as patch:
        if phase == RENAMED:  # killed at its first deletion of an old checkpoint or leftover
            patch.setattr(checkpoint.os, "remove", _killed)
        try:
            save_checkpoint(out_dir, rank, step=step, **state)
        except KeyboardInterrupt:
            assert phase == RENAMED


def _killed(path):
    raise KeyboardInterrupt


@pytest.mark.parametrize("world_size", [2, 3])
def test_any_interruption_repeated_many_times_leaves_the_newest_completed_step(world_size, tmp_path, monkeypatch):
    """Many runs in a row, each resumed from the last one's checkpoints, each saving a few checkpoints
    and then killed during its next save, at any moment on each rank (before it, while writing, after
    the rename but before the old checkpoints are deleted, or after), or killed right after resuming,
    with only some ranks having set the abandoned checkpoints aside. Every resume must pick the newest
    step that every rank completed in the current timeline, and read the files the current timeline
    wrote of it, never those of an abandoned run."""
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: None)  # durability is tested elsewhere
    generator = random.Random(world_size)
    for sequence in range(12):
        out_dir = str(tmp_path / f"sequence{sequence}")
        os.makedirs(checkpoint_dir(out_dir))
        timeline = {}  # step -> the run that wrote it on every rank, in the history resumed from
        start = 0
        for run in range(8):
            if run > 0:
                start = agree_on_step([saved_steps(out_dir, r) for r in range(world_size)], out_dir)
                assert start == max(timeline), (sequence, run)
                for r in range(world_size):
                    assert load_checkpoint(out_dir, r, start)["history"]["written_by_run"] == timeline[start]
                timeline = {s: w for s, w in timeline.items() if s <= start}
                if generator.random() < 0.2:  # killed right after resuming: some ranks set aside, no save
                    for r in generator.sample(range(world_size), generator.randint(0, world_size)):
                        set_aside_later_steps(out_dir, r, start)
                    continue
                for r in range(world_size):
                    set_aside_later_steps(out_dir, r, start)
            step = start
            for _ in range(generator.randint(1 if run == 0 else 0, 3)):  # completed checkpoints
                step += generator.randint(1, 3)
                for r in range(world_size):
                    _save(out_dir, r, step, run, DONE, monkeypatch)
                timeline[step] = run
            step += generator.randint(1, 3)  # the save during which the run is killed
            phases = [generator.choice([BEFORE, DURING, RENAMED, DONE]) for _ in range(world_size)]
            for r, phase in enumerate(phases):
                _save(out_dir, r, step, run, phase, monkeypatch)
            if all(phase in (RENAMED, DONE) for phase in phases):
                timeline[step] = run
        assert len(os.listdir(checkpoint_dir(out_dir))) <= world_size * 6  # no pile-up of old files


def test_the_old_retention_rule_fails_the_simulation(tmp_path, monkeypatch):
    """The simulation above catches the issue's bug: without setting the abandoned checkpoints aside,
    the issue's sequence leaves no common step."""
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: None)
    out_dir = str(tmp_path)
    for step in (5, 7):
        _save(out_dir, 0, step, 0, DONE, monkeypatch)
    _save(out_dir, 1, 5, 0, DONE, monkeypatch)  # rank 1 killed while saving step 7
    for r in range(2):
        _save(out_dir, r, 10, 1, DONE, monkeypatch)  # resumed from 5 without setting step 7 aside
    os.remove(checkpoint_path(out_dir, 1, 10))  # rank 1 killed while saving step 10
    assert [saved_steps(out_dir, r) for r in range(2)] == [[7, 10], [5]]
    with pytest.raises(checkpoint.CheckpointError, match="no step has a checkpoint of every rank"):
        agree_on_step([saved_steps(out_dir, r) for r in range(2)], out_dir)


def test_set_aside_renames_only_later_steps_to_a_name_resume_never_reads(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint.os, "fsync", lambda fd: None)
    out_dir = str(tmp_path)
    for step in (3, 5, 7):
        _save(out_dir, 0, step, 0, RENAMED, monkeypatch)  # keeps all three
    _save(out_dir, 1, 7, 0, DONE, monkeypatch)
    assert set_aside_later_steps(out_dir, 0, 3) == [5, 7]
    assert saved_steps(out_dir, 0) == [3] and saved_steps(out_dir, 1) == [7]
    assert sorted(os.listdir(checkpoint_dir(out_dir))) == [
        "rank0-step3.pt", "rank0-step5.pt.abandoned", "rank0-step7.pt.abandoned", "rank1-step7.pt"]
    assert set_aside_later_steps(out_dir, 0, 3) == []  # a repeated resume changes nothing
    _save(out_dir, 0, 4, 1, DURING, monkeypatch)  # a killed save's temporary file
    _save(out_dir, 0, 4, 1, DONE, monkeypatch)  # the continuation's first save removes the leftovers
    _save(out_dir, 0, 6, 1, DONE, monkeypatch)
    assert sorted(os.listdir(checkpoint_dir(out_dir))) == ["rank0-step4.pt", "rank0-step6.pt", "rank1-step7.pt"]


# ---- real 2-rank runs -------------------------------------------------------------------------

# The issue's flags, with the tiny model.
ISSUE = ["--steps", "12", "--batch-size", "48", "--eval-every", "3", "--checkpoint-every", "5", *TINY_MODEL]


def _run(out_dir, *extra):
    return torchrun_ok(out_dir, *ISSUE, *extra)


def _files(out_dir):
    return sorted(os.listdir(checkpoint_dir(out_dir)))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("uninterrupted")
    _run(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def stopped_after_7(tmp_path_factory):
    """A run stopped after step 7: both ranks keep steps 5 and 7. Each test works on a copy."""
    out_dir = tmp_path_factory.mktemp("stopped")
    _run(out_dir, "--stop-after", "7")
    return out_dir


def _assert_ends_like(run_dir, whole_dir, steps=12):
    for rank in range(2):
        whole = torch.load(checkpoint_path(whole_dir, rank, steps), weights_only=False)
        resumed = torch.load(checkpoint_path(run_dir, rank, steps), weights_only=False)
        for key in ("model", "optimizers", "schedulers", "rng", "history"):
            assert_bitwise_equal(whole[key], resumed[key], f"rank {rank} {key}")


def test_the_issue_sequence_resumes_from_step_5_twice_and_ends_bitwise_equal(uninterrupted, stopped_after_7, tmp_path):
    run = shutil.copytree(stopped_after_7, tmp_path / "run")
    os.remove(checkpoint_path(run, 1, 7))  # what rank 1 killed while saving step 7 leaves
    stdout = _run(run, "--resume", "--stop-after", "10")
    assert "resuming from step 5" in stdout and "rank 0: checkpoints of steps [7] set aside" in stdout
    assert _files(run) == ["rank0-step10.pt", "rank0-step5.pt", "rank1-step10.pt", "rank1-step5.pt"]
    os.remove(checkpoint_path(run, 1, 10))  # rank 1 killed while saving step 10
    assert "resuming from step 5" in _run(run, "--resume")
    _assert_ends_like(run, uninterrupted)


def test_three_interruptions_before_during_and_after_a_save_on_either_rank(uninterrupted, stopped_after_7, tmp_path):
    run = shutil.copytree(stopped_after_7, tmp_path / "run")
    # 1. Rank 0 killed while writing step 7 (rank 1 had finished it).
    os.remove(checkpoint_path(run, 0, 7))
    with open(checkpoint_path(run, 0, 7) + ".tmp", "wb") as f:
        f.write(b"part of a checkpoint")
    # 2. Rank 1 killed just before it saves step 10 (rank 0 had saved it); a kill after the resume and
    #    before the first save leaves step 5 alone as the newest, as here.
    stdout = _run(run, "--resume", "--stop-after", "10")
    assert "resuming from step 5" in stdout and "rank 1: checkpoints of steps [7] set aside" in stdout
    os.remove(checkpoint_path(run, 1, 10))
    # 3. Rank 1 killed after renaming step 11 into place, before deleting its older checkpoints;
    #    rank 0 killed before its save of step 11.
    step5 = [open(checkpoint_path(run, r, 5), "rb").read() for r in range(2)]  # deleted by the save of 11
    stdout = _run(run, "--resume", "--stop-after", "11")
    assert "resuming from step 5" in stdout and "rank 0: checkpoints of steps [10] set aside" in stdout
    assert _files(run) == ["rank0-step10.pt", "rank0-step11.pt", "rank1-step10.pt", "rank1-step11.pt"]
    os.remove(checkpoint_path(run, 0, 11))
    for r in range(2):
        with open(checkpoint_path(run, r, 5), "wb") as f:
            f.write(step5[r])
    stdout = _run(run, "--resume")
    assert "resuming from step 10" in stdout and "rank 1: checkpoints of steps [11] set aside" in stdout
    _assert_ends_like(run, uninterrupted)
    assert _files(run) == ["rank0-step10.pt", "rank0-step12.pt", "rank1-step10.pt", "rank1-step12.pt"]


def _exit_codes(stderr):
    """Each failed rank's exit status, from torchrun's failure report (-N: killed by signal N)."""
    return sorted(int(code) for code in re.findall(r"exitcode\s+:\s+(-?\d+) \(pid", stderr))


def test_a_refused_resume_ends_every_rank_with_its_message_never_by_a_signal(tmp_path):
    """No step common to both ranks: both refuse. A rank still leaving the process group when the
    other had exited used to be stopped by torchrun's SIGTERM (or to abort) in about 1 try of 3, so
    three tries catch that race's return about 7 times in 10 (each try is a 2-rank torchrun)."""
    os.makedirs(checkpoint_dir(tmp_path))
    for name in ("rank0-step2.pt", "rank1-step4.pt"):  # the refusal needs only the file names
        open(os.path.join(checkpoint_dir(tmp_path), name), "wb").close()
    message = f"--resume: no step has a checkpoint of every rank in {checkpoint_dir(tmp_path)} (rank 0: [2]; rank 1: [4])"
    for attempt in range(3):
        done = run_example(tmp_path, "--resume")
        assert _exit_codes(done.stderr) == [1, 1], (attempt, done.stderr[-3000:])
        assert done.stderr.count(message) == 2 and "Signal" not in done.stderr, (attempt, done.stderr[-3000:])


def test_a_failure_on_one_rank_ends_every_rank_with_a_message_never_by_a_signal(tmp_path):
    """Rank 1 cannot write its checkpoint of step 2 (its temporary file's name is taken by a folder);
    rank 0 meanwhile waits in the next step's collectives. Both exit with status 1 and say why."""
    os.makedirs(checkpoint_path(tmp_path, 1, 2) + ".tmp")
    done = run_example(tmp_path, "--steps", "4", "--batch-size", "64", "--checkpoint-every", "2", *TINY_MODEL)
    assert _exit_codes(done.stderr) == [1, 1] and "Signal" not in done.stderr, done.stderr[-3000:]
    assert "rank 1: stopped by IsADirectoryError" in done.stderr, done.stderr[-3000:]
    assert "rank 0: stopped by " in done.stderr, done.stderr[-3000:]
