"""The AllocationTracker's count of a backward on fake tensors against the measured peak of the same
backward on real tensors, where autograd's engine sums two contributions to one gradient."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from clipshard.planning.allocation_tracker import AllocationTracker
from clipshard.planning.measured_peak import measured_peak_bytes

N = 100_003


def _dense_contributions(x):
    """x's gradient: two dense N-element contributions, which the engine sums in place."""
    ((x * 2.0).sum() + (x * 3.0).sum()).backward()


def _expanded_contributions(x):
    """Two expanded (overlapping) contributions: the engine's sum allocates a new gradient."""
    (x.sum() + x.sum()).backward()


def _third_contribution(x):
    """Three contributions: two sums, the second into the result of the first."""
    ((x * 2.0).sum() + (x * 3.0).sum() + (x * x).sum()).backward()


@pytest.mark.parametrize("work", [_dense_contributions, _expanded_contributions, _third_contribution],
                         ids=lambda work: work.__name__.strip("_"))
def test_gradient_sums_are_counted_as_autograd_makes_them(work):
    x = torch.randn(N, dtype=torch.float64).requires_grad_()
    measured = measured_peak_bytes(lambda: work(x), "cpu")
    with FakeTensorMode():
        fake = torch.empty(N, dtype=torch.float64).requires_grad_()
        tracker = AllocationTracker("cpu")
        with tracker:
            work(fake)
    assert abs(tracker.peak_bytes - measured) <= 64, (tracker.peak_bytes, measured, tracker.peak_allocations)
