"""Bad input on one rank of two, or ranks that disagree, in the patched losses with
gather_across_devices=True: every rank raises (the message of each rank, in order), and the
group still works afterwards (a good call follows every case)."""
import torch

import clipshard
from tests.integrations.sentence_transformers.st_cases import global_batch, loss_and_grads

CASES = ("ids of the wrong length", "ids of the wrong type", "scale differs", "directions differ",
         "fallback with ids", "fallback with unequal batches")


def _loss(**kwargs):
    from sentence_transformers.sentence_transformer import losses

    return losses.MultipleNegativesRankingLoss(torch.nn.Sequential(torch.nn.Identity()), gather_across_devices=True,
                                               **kwargs)


def messages(rank):
    """{case: this rank's error message (or None when it raised nothing)}."""
    from sentence_transformers import util

    columns, ids = global_batch([4, 4], 1, torch.float64, seed=5)
    local, local_ids = [c[4 * rank: 4 * rank + 4] for c in columns], ids[4 * rank: 4 * rank + 4]
    plans = {
        "ids of the wrong length": (_loss(), local_ids[: 3 if rank else 4], "mask", local),
        "ids of the wrong type": (_loss(), local_ids.double() if rank else local_ids, "mask", local),
        "scale differs": (_loss(scale=20.0 + rank), None, None, local),
        "directions differ": (_loss(directions=("query_to_doc",) + ("doc_to_query",) * rank), None, None, local),
        "fallback with ids": (_loss(similarity_fct=util.manhattan_sim), local_ids, "mask", local),
        "fallback with unequal batches": (_loss(similarity_fct=util.manhattan_sim), None, None,
                                          [c[: 3 if rank else 4] for c in local]),
    }
    out = {}
    for case in CASES:
        loss, labels, targets, embeddings = plans[case]
        patch = clipshard.apply_to_sentence_transformers(labels_as_ids=targets)
        try:
            loss_and_grads(loss, embeddings, labels, False)
            out[case] = None
        except (ValueError, TypeError) as e:
            out[case] = str(e)
        finally:
            patch.undo()
        patch = clipshard.apply_to_sentence_transformers()
        try:  # the group is still in step
            loss_and_grads(_loss(), local, None, False)
        finally:
            patch.undo()
    return out
