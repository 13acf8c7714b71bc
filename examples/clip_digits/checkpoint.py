"""Checkpoints that let an interrupted run continue exactly where it stopped, on every rank from the
same step.

Every rank writes its own file (the model and optimizer states are the same on all ranks, the
random-number-generator states are not): DIR/checkpoint/rank{r}-step{s}.pt. A file is written to a
temporary name, flushed to disk (fsync) and renamed, so a crash while saving never leaves a
half-written checkpoint under the final name. Each rank keeps its last two checkpoints: a rank
killed while saving step s leaves the others with s and itself with the step before, and a resume
picks the newest step that every rank has (`agree_on_step`), or refuses on every rank. The data
position needs no state of its own: batch `step` is a pure function of (seed, step, rank).

A resume from step s makes s the head of the run's history: before training, every rank renames
its checkpoints of later steps (the abandoned timeline, which not every rank finished) to
rank{r}-step{t}.pt.abandoned (`set_aside_later_steps`), a name that resume never reads, and the
continuation's first save on that rank deletes them. So retention only ever sees the continuation's
own steps, and one interruption at any moment, repeated any number of times, still leaves a step
that every rank has.
"""
import os
import random
import re

import numpy as np
import torch

KEEP = 2  # checkpoints kept per rank
_NAME = re.compile(r"rank(\d+)-step(\d+)\.pt")
ABANDONED = ".abandoned"  # suffix of checkpoints set aside by a resume from an earlier step
_LEFTOVER = re.compile(r"rank(\d+)-step(\d+)\.pt(\.abandoned|\.tmp)")  # files that resume never reads
_KEYS = ("step", "config", "model", "optimizers", "schedulers", "rng", "history")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names the file."""


def checkpoint_dir(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoint")


def checkpoint_path(out_dir: str, rank: int, step: int) -> str:
    return os.path.join(checkpoint_dir(out_dir), f"rank{rank}-step{step}.pt")


def saved_steps(out_dir: str, rank: int) -> list[int]:
    """The steps of this rank's complete checkpoints (renamed into place), oldest first."""
    folder = checkpoint_dir(out_dir)
    names = os.listdir(folder) if os.path.isdir(folder) else []
    matches = [_NAME.fullmatch(name) for name in names]
    return sorted(int(m.group(2)) for m in matches if m and int(m.group(1)) == rank)


def rng_states(generators: dict[str, torch.Generator]) -> dict:
    states = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate(),
              "generators": {name: g.get_state() for name, g in generators.items()}}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict, generators: dict[str, torch.Generator]) -> None:
    torch.set_rng_state(states["torch"])
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    for name, g in generators.items():
        g.set_state(states["generators"][name])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _write_durably(state: dict, path: str) -> None:
    """torch.save to a temporary file, fsync, rename over `path`, fsync the folder (the rename)."""
    temporary = path + ".tmp"
    with open(temporary, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    _sync_folder(os.path.dirname(path))


def _sync_folder(path: str) -> None:
    """fsync a folder: makes the renames in it durable."""
    folder = os.open(path, os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


def save_checkpoint(out_dir: str, rank: int, *, step: int, config: dict, model: torch.nn.Module,
                    optimizers: dict, schedulers: dict, generators: dict, history: dict) -> str:
    path = checkpoint_path(out_dir, rank, step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    state = {
        "step": step,
        "config": config,
        "model": model.state_dict(),
        "optimizers": {name: opt.state_dict() for name, opt in optimizers.items()},
        "schedulers": {name: s.state_dict() for name, s in schedulers.items()},
        "rng": rng_states(generators),
        "history": history,
    }
    _write_durably(state, path)
    for old in saved_steps(out_dir, rank)[:-KEEP]:
        os.remove(checkpoint_path(out_dir, rank, old))
    for name in _leftovers(out_dir, rank):  # set aside by a resume, or half-written by a killed save
        os.remove(os.path.join(checkpoint_dir(out_dir), name))
    return path


def _leftovers(out_dir: str, rank: int) -> list[str]:
    """This rank's files that resume never reads: abandoned checkpoints and temporary files."""
    matches = [_LEFTOVER.fullmatch(name) for name in os.listdir(checkpoint_dir(out_dir))]
    return sorted(m.group(0) for m in matches if m and int(m.group(1)) == rank)


def set_aside_later_steps(out_dir: str, rank: int, step: int) -> list[int]:
    """Makes `step`, which the run resumes from, the newest of this rank's checkpoints: renames those
    of later steps to a name that resume never reads (rank{r}-step{t}.pt.abandoned), so that they
    can neither be chosen by a later resume nor count towards the two checkpoints kept. Returns the
    steps set aside. A kill half-way changes nothing that matters: the files not yet renamed were
    not common to all ranks, so the next resume agrees on `step` again and renames the rest."""
    later = [s for s in saved_steps(out_dir, rank) if s > step]
    for s in later:
        path = checkpoint_path(out_dir, rank, s)
        os.replace(path, path + ABANDONED)
    if later:
        _sync_folder(checkpoint_dir(out_dir))
    return later


def agree_on_step(steps_per_rank: list[list[int]], out_dir: str) -> int:
    """The newest step of which every rank has a checkpoint; the same answer (or the same error) on
    every rank, since every rank decides from the same lists."""
    common = set(steps_per_rank[0]).intersection(*steps_per_rank[1:])
    if not common:
        listing = "; ".join(f"rank {r}: {steps or 'none'}" for r, steps in enumerate(steps_per_rank))
        raise CheckpointError(f"--resume: no step has a checkpoint of every rank in {checkpoint_dir(out_dir)} "
                              f"({listing})")
    return max(common)


def load_checkpoint(out_dir: str, rank: int, step: int) -> dict:
    """This rank's checkpoint of `step`, or a CheckpointError naming the file."""
    path = checkpoint_path(out_dir, rank, step)
    try:
        # weights_only=False: the file holds numpy/python RNG states; it is our own file.
        state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as error:  # noqa: BLE001 (torch.load raises many kinds for damaged files)
        raise CheckpointError(f"--resume: cannot read checkpoint {path} ({type(error).__name__}: "
                              f"{str(error).splitlines()[0] if str(error) else 'no details'}); it is damaged "
                              "or not a checkpoint of this example") from error
    if not isinstance(state, dict) or any(key not in state for key in _KEYS) or state["step"] != step:
        raise CheckpointError(f"--resume: {path} is not a checkpoint of step {step} of this example")
    return state


def load_agreed_checkpoint(out_dir: str, rank: int, gather) -> dict:
    """Every rank's checkpoint of the newest step that all ranks have. `gather(obj)` returns every
    rank's obj in rank order (a collective). A problem on any rank raises CheckpointError on every
    rank, so that no rank goes on alone into training and waits there for the others."""
    step = agree_on_step(gather(saved_steps(out_dir, rank)), out_dir)
    state, problem = None, None
    try:
        state = load_checkpoint(out_dir, rank, step)
    except CheckpointError as error:
        problem = f"rank {rank}: {error}"
    problems = [p for p in gather(problem) if p is not None]
    if problems:
        raise CheckpointError("; ".join(problems))
    return state


def restore(state: dict, *, model: torch.nn.Module, optimizers: dict, schedulers: dict, generators: dict) -> None:
    model.load_state_dict(state["model"])
    for name, opt in optimizers.items():
        opt.load_state_dict(state["optimizers"][name])
    for name, s in schedulers.items():
        s.load_state_dict(state["schedulers"][name])
    set_rng_states(state["rng"], generators)
