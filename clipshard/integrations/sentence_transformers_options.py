"""Which options of a sentence-transformers ranking loss clipshard fuses, read from a loss instance
(MultipleNegativesRankingLoss, its symmetric and cached forms: the cached ones delegate their options
to the loss they wrap). Anything not fused is computed by the library's own code
(docs/sentence_transformers.md lists both).
"""
from clipshard.integrations.sentence_transformers_loss import DIRECTIONS, PARTITION_MODES, RankingOptions

HARDNESS_MODES = (None, "in_batch_negatives", "hard_negatives", "all_negatives")


def similarity_kind(similarity_fct):
    """"cos" or "dot" for sentence-transformers' cos_sim / pytorch_cos_sim / dot_score, else None."""
    from sentence_transformers import util

    if similarity_fct in (util.cos_sim, util.pytorch_cos_sim):
        return "cos"
    if similarity_fct is util.dot_score:
        return "dot"
    return None


def similarity_name(similarity_fct):
    return getattr(similarity_fct, "__qualname__", None) or type(similarity_fct).__name__


def hardness_active(loss, negatives):
    """Whether the loss's hardness weighting changes any logit (the library skips a zero strength,
    and "hard_negatives" without hard-negative columns weights nothing)."""
    if loss.hardness_mode is None or not loss.hardness_strength > 0.0:
        return False
    return not (loss.hardness_mode == "hard_negatives" and negatives == 0)


def fallback_reason(loss, negatives):
    """Why `loss`'s options are not fused (a phrase naming the option), or None when they are.
    negatives: the number of hard-negative columns of the batch."""
    kind = similarity_kind(loss.similarity_fct)
    if kind is None:
        return f"similarity_fct={similarity_name(loss.similarity_fct)} (only cos_sim and dot_score are fused)"
    if hardness_active(loss, negatives):
        return f"hardness_mode={loss.hardness_mode!r} with hardness_strength={loss.hardness_strength}"
    if not set(loss.directions) <= set(DIRECTIONS) or loss.partition_mode not in PARTITION_MODES:
        return f"directions={loss.directions!r}, partition_mode={loss.partition_mode!r}"
    return None


def ranking_options(loss, targets):
    """The RankingOptions of a loss whose options are fused; targets: of the sample ids, or None."""
    return RankingOptions(scale=loss.scale, cosine=similarity_kind(loss.similarity_fct) == "cos",
                          directions=tuple(loss.directions), partition_mode=loss.partition_mode, targets=targets)
