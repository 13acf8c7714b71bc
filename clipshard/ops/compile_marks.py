"""torch.compile marks that do not import torch._dynamo (about 1.5 s of import time on a small CPU).

`torch.compiler.assume_constant_result(fn)` imports torch._dynamo to set one attribute on fn,
`_dynamo_marked_constant`, which dynamo reads when it traces a call to fn. Importing clipshard
should not pay for the compiler when nobody compiles, so `constant_under_compile` sets that
attribute itself while torch._dynamo is not loaded, and calls torch's decorator once it is.
tests/ops/test_compile_marks.py checks that torch's decorator still does exactly this.
"""
import sys

import torch

MARK = "_dynamo_marked_constant"


def constant_under_compile(fn):
    """fn, marked so that torch.compile evaluates it once while tracing and keeps its result as a constant."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    setattr(fn, MARK, True)
    return fn
