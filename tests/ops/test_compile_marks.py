"""clipshard marks its constant-under-compile functions without importing torch._dynamo; the mark
must be the one torch's own decorator sets, and importing clipshard must not load the compiler."""
import subprocess
import sys

import torch

from clipshard.ops.compile_marks import MARK, constant_under_compile


def test_torchs_decorator_sets_exactly_the_attribute_we_set():
    def theirs():
        return 1

    def ours():
        return 1

    before = set(vars(theirs))
    assert torch.compiler.assume_constant_result(theirs) is theirs
    assert set(vars(theirs)) - before == {MARK} and getattr(theirs, MARK) is True
    assert constant_under_compile(ours) is ours and getattr(ours, MARK) is True


def test_a_marked_function_is_a_constant_in_a_fullgraph_compile():
    calls = []

    @constant_under_compile
    def choice(n):
        calls.append(n)
        return 2

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return x * choice(3)

    assert torch.equal(f(torch.ones(4)), torch.full((4,), 2.0))
    assert torch.equal(f(torch.ones(4)), torch.full((4,), 2.0))
    assert calls == [3]  # evaluated once, while tracing


def test_importing_clipshard_loads_neither_the_compiler_nor_the_optimizer():
    code = ("import sys, clipshard; loaded = [m for m in ('torch._dynamo', 'clipshard.optim') if m in sys.modules]; "
            "assert not loaded, loaded; from clipshard import optim; assert optim.AdamW.__name__ == 'AdamW'")
    subprocess.run([sys.executable, "-c", code], check=True)
