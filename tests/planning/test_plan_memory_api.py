"""clipshard.planning.plan_memory's interface, in this process (no ranks spawned): clear errors for
bad arguments, the report, the caller's loss left as it was, ring plans flat in the world size, and
a process that planned can still fork children that train."""
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import clipshard
from clipshard.planning import format_bytes, plan_memory

SIZES = {"batch_size": 613, "dim": 256, "device": "cpu"}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


_BAD_ARGUMENTS = [  # (the arguments changed, the error, words its message must have)
    ({"world_size": 0}, ValueError, ("world_size", ">= 1", "0")),
    ({"batch_size": 2.5}, ValueError, ("batch_size", "int")),
    ({"hard_negatives": -1}, ValueError, ("hard_negatives", ">= 0")),
    ({"dtype": "int8"}, ValueError, ("dtype", "'int8'", "bf16")),
    ({"dtype": torch.int64}, ValueError, ("dtype", "torch.int64")),
    ({"device": "mps"}, ValueError, ("device", "'cpu' or 'cuda'", "'mps'")),
    ({"device": "no such device"}, ValueError, ("device", "'no such device'")),
    ({"targets": "soft", "sample_ids": True}, ValueError, ("targets", "'mask' or 'multi'", "'soft'")),
    ({"targets": "multi"}, ValueError, ("targets='multi'", "sample_ids=True")),
]


@pytest.mark.parametrize("changes, error, words", [
    pytest.param(*bad, id=",".join(f"{k}={v}" for k, v in bad[0].items())) for bad in _BAD_ARGUMENTS])
def test_bad_arguments_name_the_argument(changes, error, words):
    arguments = {"world_size": 2, **SIZES, **changes}
    with pytest.raises(error) as raised:
        plan_memory(clipshard.ClipLoss(gather_with_grad=True), **arguments)
    for word in words:
        assert word in str(raised.value), (word, str(raised.value))


@pytest.mark.parametrize("not_a_loss", [torch.nn.Linear(4, 4), "ClipLoss", None, clipshard.ClipLoss],
                         ids=("a-module", "a-name", "None", "the-class"))
def test_not_a_loss_is_refused(not_a_loss):
    with pytest.raises(TypeError, match="loss must be a clipshard ClipLoss, SigLipLoss or DistillClipLoss, got"):
        plan_memory(not_a_loss, world_size=2, **SIZES)


def test_distill_takes_no_extras():
    with pytest.raises(ValueError, match="DistillClipLoss takes neither hard_negatives nor sample_ids"):
        plan_memory(clipshard.DistillClipLoss(), world_size=2, hard_negatives=3, **SIZES)


def test_report_shows_the_peak_and_the_largest_allocations():
    plan = plan_memory(clipshard.ClipLoss(gather_with_grad=True), world_size=4, hard_negatives=101, **SIZES)
    out = io.StringIO()
    plan.report(file=out)
    text = out.getvalue()
    assert f"peak per rank: {format_bytes(plan.peak_bytes)} ({plan.peak_bytes} bytes)" in text
    assert "world_size=4" in text and "hard_negatives=101" in text
    kinds = plan.by_kind()
    assert sum(nbytes for nbytes, _, _ in kinds) == plan.peak_bytes
    assert kinds[0][0] >= kinds[-1][0]
    for nbytes, what, count in kinds[:3]:  # the largest kinds, each on its own line with its size and count
        assert any(what in line and format_bytes(nbytes) in line and f" {count} " in line for line in text.splitlines())
    # the largest at a 4-rank exchange's peak: the gathered texts (4 x 613 x 256 fp32), or more
    assert kinds[0][0] >= 4 * 613 * 256 * 4


@pytest.mark.parametrize("loss", [
    clipshard.ClipLoss(gather_with_grad=True, rank=1, world_size=2, mode="ring"),
    clipshard.SigLipLoss(rank=1, world_size=2),
    clipshard.DistillClipLoss(gather_with_grad=True, rank=1, world_size=2),
], ids=lambda loss: type(loss).__name__)
def test_plan_leaves_the_callers_loss_as_it_was(loss):
    before = dict(vars(loss))
    plan_memory(loss, world_size=4, **SIZES)
    assert (loss.group, loss.rank, loss.world_size) == (None, 1, 2)
    assert dict(vars(loss)) == before


@pytest.mark.parametrize("ring, gathered", [
    (clipshard.ClipLoss(gather_with_grad=True, mode="ring"), clipshard.ClipLoss(gather_with_grad=True)),
    (clipshard.SigLipLoss(mode="ring"), clipshard.SigLipLoss()),
    (clipshard.DistillClipLoss(gather_with_grad=True, mode="ring"), clipshard.DistillClipLoss(gather_with_grad=True)),
], ids=("clip", "siglip", "distill"))
def test_ring_is_flat_in_the_world_size_where_gathering_grows(ring, gathered):
    ring_4, ring_16 = (plan_memory(ring, world_size=n, **SIZES).peak_bytes for n in (4, 16))
    assert abs(ring_16 - ring_4) <= 0.05 * ring_4, (ring_4, ring_16)
    gathered_4, gathered_16 = (plan_memory(gathered, world_size=n, **SIZES).peak_bytes for n in (4, 16))
    # 12 more ranks' texts (and images) gathered: at least 12 x M x D fp32 more
    assert gathered_16 - gathered_4 >= 12 * 613 * 256 * 4, (gathered_4, gathered_16)


_PLAN_THEN_FORK = textwrap.dedent("""
    import multiprocessing, torch, clipshard
    from clipshard.planning import plan_memory

    def train():
        torch.ones(3, requires_grad=True).sum().backward()

    # the process's first backward is the plan's
    plan_memory(clipshard.ClipLoss(), world_size=2, batch_size=8, dim=4, device="cpu")
    child = multiprocessing.get_context("fork").Process(target=train)
    child.start()
    child.join(60)
    print("child exit code", child.exitcode)
""")


def test_a_process_that_planned_can_fork_children_that_train():
    """A fresh interpreter (this one has run backwards long before): plan, then fork a child whose
    backward must run (autograd refuses in a fork of a process with its device threads started)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    result = subprocess.run([sys.executable, "-c", _PLAN_THEN_FORK], capture_output=True, text=True, timeout=120,
                            env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "child exit code 0" in result.stdout, result.stderr[-3000:]


@pytest.mark.parametrize("loss", [
    clipshard.SigLipLoss(mode="ring"),  # its backward asks whether every rank's upstream gradient is the same
    clipshard.DistillClipLoss(),  # the teachers' agreement across ranks
    clipshard.DistillClipLoss(gather_with_grad=True),  # and the full-batch backward's "same upstream gradient"
    clipshard.DistillClipLoss(local_loss=True, gather_with_grad=True, mode="ring"),
], ids=("siglip-ring", "distill-local", "distill-exchange", "distill-ring-local_loss"))
def test_host_reads_of_the_ranks_agreement_are_answered_in_a_plan(loss):
    """Fake tensors hold no values: a plan's ranks are this rank's copies, so they agree."""
    plan = plan_memory(loss, world_size=2, **SIZES)
    assert plan.peak_bytes >= 2 * 613 * 256 * 4  # at least the features' gradients
