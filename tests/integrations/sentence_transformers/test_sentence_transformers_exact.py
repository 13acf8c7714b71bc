"""apply_to_sentence_transformers(): the loss and the embedding gradients of MultipleNegativesRankingLoss
and CachedMultipleNegativesRankingLoss (and so of their symmetric forms, which are these with fixed
options) equal the library's own in fp64 (1e-10 relative) and fp32 (1e-5) for every fused option
combination on 1, 2 and 3 gloo ranks, with and without gathering; unequal local batches with
gathering, and sample ids, equal the fp64 reference of the global batch. One process group per
world size runs every case."""
import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed: "
                    "pip install '.[sentence_transformers]'")

from tests.dist_utils import report_worst, run_group  # noqa: E402
from tests.integrations.sentence_transformers.st_cases import TOLERANCE, worst_differences  # noqa: E402

SIZES = {1: [[5]], 2: [[4, 4], [5, 2]], 3: [[3, 3, 3], [4, 1, 3]]}


def _check(worst_per_rank):
    worst = {}
    for ranks_worst in worst_per_rank:
        for key, value in ranks_worst.items():
            worst[key] = max(worst.get(key, 0.0), value)
    report_worst({f"{case} {dtype}": v for (case, dtype), v in worst.items()})
    tolerance = {str(dtype): tol for dtype, tol in TOLERANCE.items()}
    bad = {key: v for key, v in worst.items() if not v <= tolerance[key[1]]}
    assert worst and not bad, bad


@pytest.mark.parametrize("with_ids", [False, True], ids=["options", "sample_ids"])
def test_one_process(with_ids):
    _check([worst_differences(0, 1, SIZES[1], with_ids)])


def _rank(rank, world_size):
    return {with_ids: worst_differences(rank, world_size, SIZES[world_size], with_ids) for with_ids in (False, True)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks(world_size):
    results = run_group(_rank, world_size, timeout=240)
    for with_ids in (False, True):
        _check([r[with_ids] for r in results])
