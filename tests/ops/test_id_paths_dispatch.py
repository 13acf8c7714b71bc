"""The id paths (targets "mask" and "multi") of every loss and mode, GradCache and the
sentence-transformers loss, forward and backward, dispatch no op that is nondeterministic on CUDA
and none that syncs with the host or has a data-dependent shape (tests/parallel/dispatched_ops.py);
on one process here, on 2 ranks in tests/parallel/test_clip_targets_distributed.py::test_two_ranks."""
import torch

from clipshard.ops.same_id import other_same_id_logit_sums
from tests.parallel.dispatched_ops import recording, unexpected_ops


def test_every_loss_with_ids_dispatches_no_atomics_and_no_syncs():
    unexpected = unexpected_ops(0, 1)
    assert not unexpected, unexpected


def test_the_recorder_sees_both_kinds():
    """The recorder is not blind: torch.unique (a sync, a data-dependent shape) and index_add (float
    atomics on CUDA) are caught, and the same-id sums need neither."""
    values, ids = torch.randn(6, 3, requires_grad=True), torch.tensor([3, 1, 3, 2, 1, 3])
    with recording() as recorder:
        groups = torch.unique(ids, return_inverse=True)[1]
        values.new_zeros(3, 3).index_add(0, groups, values).sum().backward()
    assert {"_unique2", "index_add"} <= set(recorder.offences)
    with recording() as recorder:
        sums = other_same_id_logit_sums(values, values.detach() * 2, 3.0, 0.5, ids, ids, 0)
        (sums[0].sum() + sums[2].sum()).backward()
    assert recorder.offences == []
