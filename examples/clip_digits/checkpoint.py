"""Checkpoints that let an interrupted run continue exactly where it stopped.

Every rank writes its own file (the model and optimizer states are the same on all ranks, the
random-number-generator states are not): DIR/checkpoint/rank{r}.pt, written to a temporary name
and renamed, so a crash while saving never leaves a half-written checkpoint behind. The data
position needs no state of its own: batch `step` is a pure function of (seed, step, rank).
"""
import os
import random

import numpy as np
import torch


def checkpoint_path(out_dir: str, rank: int) -> str:
    return os.path.join(out_dir, "checkpoint", f"rank{rank}.pt")


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


def save_checkpoint(out_dir: str, rank: int, *, step: int, config: dict, model: torch.nn.Module,
                    optimizers: dict, schedulers: dict, generators: dict, history: dict) -> str:
    path = checkpoint_path(out_dir, rank)
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
    temporary = path + ".tmp"
    torch.save(state, temporary)
    os.replace(temporary, path)
    return path


def load_checkpoint(out_dir: str, rank: int) -> dict:
    path = checkpoint_path(out_dir, rank)
    if not os.path.exists(path):
        raise FileNotFoundError(f"--resume: no checkpoint for rank {rank} at {path}")
    # weights_only=False: the file holds numpy/python RNG states; it is our own file.
    return torch.load(path, map_location="cpu", weights_only=False)


def restore(state: dict, *, model: torch.nn.Module, optimizers: dict, schedulers: dict, generators: dict) -> None:
    model.load_state_dict(state["model"])
    for name, opt in optimizers.items():
        opt.load_state_dict(state["optimizers"][name])
    for name, s in schedulers.items():
        s.load_state_dict(state["schedulers"][name])
    set_rng_states(state["rng"], generators)
