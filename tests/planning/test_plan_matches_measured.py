"""clipshard.plan_memory against the measured peak of the real call, on 1, 2 and 3 gloo ranks on the
CPU, for every loss, mode and option (tests/planning/plan_cases.py): the plan must be within 10 % of
the measured peak plus 256 KiB on every rank.

One spawn per world size measures every case on every rank (a module fixture, on first use); the
plans are made here in the test process, which never joins a process group (a plan makes a fake
default group of its own, which a process with a real one cannot have: each spawn checks that
plan_memory refuses there).
"""
import contextlib

import pytest
import torch

from tests.dist_utils import run_group
from tests.planning.plan_cases import (CASES, TOLERANCE_BYTES, TOLERANCE_FRACTION, measure_on_rank, plan_gather,
                                       within_tolerance)

WORLD_SIZES = (1, 2, 3)


@contextlib.contextmanager
def _one_thread():
    """The ranks run single-threaded (tests/dist_utils.py): the plans are made for the same."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def spawns():
    """world size -> each rank's measure_on_rank result, spawned on first use."""
    cache = {}

    def measured(world_size):
        if world_size not in cache:
            cache[world_size] = run_group(measure_on_rank, world_size, timeout=300)
        return cache[world_size]

    return measured


@pytest.mark.parametrize("case, world_size", [
    pytest.param(case, n, id=f"{case.name.replace(' ', '-')}-{n}ranks")
    for n in WORLD_SIZES for case in CASES if case.runs_in(n)])
def test_plan_matches_measured(spawns, case, world_size):
    with _one_thread():
        plan = case.plan(world_size)
    measured = [rank["cases"][case.name] for rank in spawns(world_size)]
    ratios = " ".join(f"{plan.peak_bytes / m:.3f}" for m in measured)
    print(f"{case.name} on {world_size} ranks: planned {plan.peak_bytes}, measured {measured}, ratio {ratios}")
    assert all(within_tolerance(plan.peak_bytes, m) for m in measured), (
        f"{case.name} on {world_size} ranks: planned {plan.peak_bytes} bytes, measured {measured} on the ranks "
        f"(planned / measured {ratios}; allowed: {TOLERANCE_FRACTION:.0%} + {TOLERANCE_BYTES} bytes)\n"
        + plan.table())


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_plan_refused_while_distributed_is_initialised(spawns, world_size):
    for rank, result in enumerate(spawns(world_size)):
        assert result["refusal"] is not None, f"rank {rank}: plan_memory planned in a process with a process group"
        assert "init_process_group" in result["refusal"], result["refusal"]


@pytest.mark.parametrize("world_size", WORLD_SIZES[1:])
def test_gloo_staging_of_the_collectives_is_planned(spawns, world_size):
    """gloo's reduce-scatter copies its input and its all-gather stages its output as torch tensors
    (clipshard/planning/collective_workspaces.py); a CPU plan of the collectives alone counts them."""
    planned = plan_gather(world_size)
    for rank, result in enumerate(spawns(world_size)):
        measured = result["gather"]
        assert abs(planned - measured) <= 0.02 * measured, (rank, planned, measured)
