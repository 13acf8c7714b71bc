"""apply_to_sentence_transformers(): the loss and the embedding gradients of MultipleNegativesRankingLoss
and CachedMultipleNegativesRankingLoss (and so of their symmetric forms, which are these with fixed
options) equal the library's own in fp64 (1e-10 relative) and fp32 (1e-5) for every fused option
combination on 1, 2 and 3 gloo ranks, with and without gathering; unequal local batches with
gathering, and sample ids, equal the fp64 reference of the global batch. The default options'
query_to_doc (sentence_transformers_columns: recomputing, or from the kept softmax of a small block)
equals plain autograd through F.normalize, the gather and the op in fp64 (unequal batches, hard
negatives), and keeps a softmax only up to its limit. Bad input on one rank, or ranks that
disagree, raise on every rank (2 ranks). One process group per world size runs every case."""
import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed: "
                    "pip install '.[sentence_transformers]'")

from tests.dist_utils import report_worst, run_group  # noqa: E402
from clipshard.parallel.layout import ShardLayout, single_process_layout  # noqa: E402
from tests.integrations.sentence_transformers import bad_inputs, columns_case  # noqa: E402
from tests.integrations.sentence_transformers.st_cases import TOLERANCE, worst_differences  # noqa: E402

SIZES = {1: [[5]], 2: [[4, 4], [5, 2]], 3: [[3, 3, 3], [4, 1, 3]]}
COLUMNS_TOLERANCE = 1e-10  # fp64


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


def _check_columns(worst_per_rank):
    worst = max(worst_per_rank)
    report_worst({"query_to_doc (recomputing, kept softmax) vs autograd float64": worst})
    assert worst <= COLUMNS_TOLERANCE, worst_per_rank


def test_columns_one_process():
    _check_columns([columns_case.worst_difference(single_process_layout(5))])


def test_only_small_fp32_or_fp64_blocks_keep_their_softmax():
    from clipshard.integrations.sentence_transformers_columns import keeps_softmax

    rows = torch.empty(1024, 4)  # KEEP_SOFTMAX_BYTES: 32 MiB, 1024 x 8192 fp32 similarities
    assert keeps_softmax(rows, 8192) and not keeps_softmax(rows, 8193)
    assert not keeps_softmax(rows.double(), 8192) and keeps_softmax(rows.double(), 4096)
    assert not keeps_softmax(rows.bfloat16(), 16)  # 16-bit features: the op accumulates in fp32
    assert not keeps_softmax(rows, 1, budget=0) and keeps_softmax(rows, 1, budget=4096)


def _rank(rank, world_size):
    import torch.distributed as dist

    out = {with_ids: worst_differences(rank, world_size, SIZES[world_size], with_ids) for with_ids in (False, True)}
    # the unequal sizes
    out["columns"] = columns_case.worst_difference(ShardLayout(tuple(SIZES[world_size][1]), rank, dist.group.WORLD))
    out["bad input"] = bad_inputs.messages(rank) if world_size == 2 else None
    return out


# what every rank's message says, per case (the rank with the problem names it; the other names that rank)
EXPECTED = {"ids of the wrong length": ("rank 1 has invalid inputs", "length 4"),
            "ids of the wrong type": ("rank 1 has invalid inputs", "dtype torch.float64"),
            "scale differs": ("same scale, got rank 0: 20.0, rank 1: 21.0",) * 2,
            "directions differ": ("same directions, got rank 0: query_to_doc, rank 1: query_to_doc+doc_to_query",) * 2,
            "fallback with ids": ("sample ids (labels_as_ids) need clipshard's fused loss",) * 2,
            "fallback with unequal batches": ("unequal local batches [4, 3]",) * 2}


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks(world_size):
    results = run_group(_rank, world_size, timeout=400)
    for with_ids in (False, True):
        _check([r[with_ids] for r in results])
    _check_columns([r["columns"] for r in results])
    if world_size == 2:
        for case in bad_inputs.CASES:
            for rank, expected in enumerate(EXPECTED[case]):
                message = results[rank]["bad input"][case]
                assert message is not None and expected in message, (case, rank, message)
