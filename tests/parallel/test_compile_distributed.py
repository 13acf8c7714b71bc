"""The distributed losses under torch.compile, and validate="on_change" (docs/distributed.md,
"Compiling and host syncs"), on real gloo groups:

- no graph break (a fullgraph=True compile raises at the first one; benchmarks/compile_counts.py
  counts them with torch._dynamo.explain), and the compiled loss and gradients are eager's (fp32
  within 1e-5, fp64 within 1e-12), on every rank, on 2 and 3 ranks (one compile per case);
- host reads per steady-state call (clipshard.diagnostics.host_reads), default and on_change;
- a bad input or a lone change on one rank raises on every rank, eager and compiled, and the group
  stays usable.

Compiling is slow on a small CPU: the paths run with the "eager" backend (dynamo's graph capture and
autograd; what makes the breaks), a few with "aot_eager" (fp64 among them) and one with "inductor".
"""
import os
import sys

import pytest
import torch
import torch.distributed as dist

from clipshard.parallel import steady_state
from tests.dist_utils import run_group

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
from compile_counts import path_inputs  # noqa: E402

COMPILED_PATHS = ("clip local", "clip local nograd", "clip exchange:ids-mask", "clip exchange:ids-multi",
                  "clip exchange:negatives", "clip exchange:image_to_text", "clip exchange:unequal", "clip ring",
                  "clip ring:unequal", "clip ring:ids-mask", "clip ring global:ids-multi", "clip exchange global",
                  "clip ring global nograd", "siglip ring:negatives", "distill exchange", "distill ring",
                  "distill exchange global")
# each backend once at least; a path compiled with another backend below is not compiled with "eager" too
CASES_2 = ([(name, "eager", torch.float32) for name in COMPILED_PATHS]
           + [("clip exchange", "aot_eager", torch.float32), ("siglip gather", "aot_eager", torch.float32),
              ("clip local", "aot_eager", torch.float64), ("clip local global nograd", "aot_eager", torch.float64),
              ("distill ring global", "aot_eager", torch.float64), ("clip exchange", "inductor", torch.float32)])
CASES_3 = [("clip exchange:unequal", "eager", torch.float32), ("siglip gather", "aot_eager", torch.float32)]
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-12}


def _step(call, inputs):
    for t in inputs:
        t.grad = None
    loss = call(*inputs)
    loss.backward(torch.tensor(0.5, dtype=loss.dtype))
    return loss.detach(), [t.grad for t in inputs]


def _difference(a, b):
    """Largest |a - b| relative to max(1, |a|) over the loss and the gradients."""
    pairs = [(a[0], b[0])] + list(zip(a[1], b[1]))
    assert all((x is None) == (y is None) for x, y in pairs)
    return max(float((x - y).abs().max() / max(1.0, float(x.abs().max()))) for x, y in pairs if x is not None)


def _compile_rank(rank, world, cases):
    import torch._dynamo

    out = {}
    for name, backend, dtype in cases:
        # each case is a program of its own (a compiled loss validates as validate="on_change" does:
        # the previous case's rows, some ranks' equal to this case's, would be a change on some ranks)
        steady_state.forget_all()
        call, inputs = path_inputs(name, rank, world, dtype=dtype)
        eager = _step(call, inputs)
        torch._dynamo.reset()
        compiled = torch.compile(call, fullgraph=True, backend=backend)
        try:
            first, second = _step(compiled, inputs), _step(compiled, inputs)  # the second call is steady
        except torch._dynamo.exc.Unsupported as error:  # a graph break (the same on every rank)
            out[(name, backend, str(dtype))] = (str(error).splitlines()[0], None, None)
            continue
        out[(name, backend, str(dtype))] = (None, _difference(eager, first), _difference(eager, second))
    return out


@pytest.fixture(scope="module")
def compiled_2():
    return run_group(_compile_rank, 2, CASES_2, timeout=900)


@pytest.mark.parametrize("name,backend,dtype", CASES_2)
def test_no_graph_break_and_compiled_equals_eager_on_2_ranks(compiled_2, name, backend, dtype):
    for rank, results in enumerate(compiled_2):
        graph_break, first, second = results[(name, backend, str(dtype))]
        assert graph_break is None, (rank, graph_break)
        assert first <= TOLERANCE[dtype] and second <= TOLERANCE[dtype], (rank, first, second)


def test_no_graph_break_and_compiled_equals_eager_on_3_ranks():
    for rank, results in enumerate(run_group(_compile_rank, 3, CASES_3, timeout=600)):
        for case, (graph_break, first, second) in results.items():
            assert graph_break is None and max(first, second) <= 1e-5, (rank, case, graph_break, first, second)


STEADY_PATHS = ("clip exchange", "clip exchange global", "clip local nograd", "clip ring", "clip exchange:negatives",
                "siglip gather", "siglip ring", "distill exchange", "distill local global")


def _reads_rank(rank, world):
    from clipshard.diagnostics.host_reads import HostReads

    counts = {}
    for name in STEADY_PATHS:
        steady_state.forget_all()
        for validate in ("every_call", "on_change"):
            call, inputs = path_inputs(name, rank, world, validate)
            reference = _step(call, inputs)  # the first call validates on the host
            with HostReads() as reads:
                steady = _step(call, inputs)
            assert _difference(reference, steady) == 0.0
            counts[(name, validate)] = reads.count
    return counts


def test_on_change_makes_no_host_read_in_steady_state():
    for counts in run_group(_reads_rank, 2, timeout=300):
        for name in STEADY_PATHS:
            assert counts[(name, "every_call")] >= 2, name  # the metadata table, read on the host
            assert counts[(name, "on_change")] == 0, (name, counts[(name, "on_change")])


def _raises(fn):
    try:
        fn()
    except (RuntimeError, ValueError, TypeError) as error:
        return str(error)
    return None


def _lone_changes_rank(rank, world, compiled):
    """Steady calls, then each fault on rank 1 only: every rank must raise, and the group must still
    work (an all-reduce right after each fault)."""
    import clipshard
    import torch._dynamo

    torch._dynamo.reset()
    gen = torch.Generator().manual_seed(rank)
    loss = clipshard.ClipLoss(True, True, rank=rank, world_size=world, validate="on_change")
    run = torch.compile(loss, fullgraph=True, backend="eager") if compiled else loss

    def call(rows=6, scale=10.0, dtype=torch.float32):
        image, text = torch.randn(2, rows, 8, generator=gen, dtype=dtype).requires_grad_().unbind(0)
        run(image, text, torch.tensor(scale, dtype=torch.float32)).backward()

    call(), call()
    messages = {}
    faults = {"smaller batch": dict(rows=4), "other dtype": dict(dtype=torch.float64),
              "other logit_scale": dict(scale=20.0), "two-element logit_scale": dict(scale=[10.0, 11.0])}
    for fault, change in faults.items():
        messages[fault] = _raises(lambda: call(**(change if rank == 1 else {})))
        flag = torch.ones(())
        dist.all_reduce(flag)
        assert flag.item() == world
    both = _raises(lambda: call(rows=4))  # every rank changes at the same call: revalidated, no error
    call(rows=4)
    return messages, both


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_lone_change_in_steady_state_raises_on_every_rank(compiled):
    for rank, (messages, both) in enumerate(run_group(_lone_changes_rank, 2, compiled, timeout=300)):
        assert both is None, (rank, both)
        for fault, message in messages.items():
            assert message is not None, (rank, fault)
            if rank == 0:  # a steady rank: the device check
                assert "changed since the ranks validated them" in message, (fault, message)
        if rank == 1:  # the rank that changed says what (its host validation)
            assert "every rank must change" in messages["smaller batch"], messages["smaller batch"]
            assert "logit_scale must be" in messages["two-element logit_scale"], messages["two-element logit_scale"]


def test_host_reads_counts_what_reads_device_values_on_the_host():
    from clipshard.diagnostics.host_reads import HostReads

    x = torch.arange(6.0)
    with HostReads() as reads:
        y = (x * 2).sum()  # no read
    assert reads.count == 0
    with HostReads() as reads:
        y.item(), bool(y > 0), x.tolist(), float(y)
    assert reads.count == 4, reads.events
