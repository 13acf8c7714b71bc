"""`apply_to_sentence_transformers()`: sentence-transformers' MultipleNegativesRankingLoss,
CachedMultipleNegativesRankingLoss and their symmetric forms compute their loss with clipshard's
fused op, over the global batch with gather_across_devices=True.

The patch points are the loss-on-embeddings methods: MultipleNegativesRankingLoss's
`compute_loss_from_embeddings` and CachedMultipleNegativesRankingLoss's `calculate_loss` (the
symmetric classes inherit them), so that wrappers that call them (MatryoshkaLoss, which decorates
a cached loss's bound `calculate_loss` when it is built: apply the patch first) and the cached
losses' own caching engine stay the library's. Options clipshard does not fuse run the library's own
method, with one log line per class and option (sentence_transformers_options). Undo puts the
original functions back; the patched ones run the library's own while no patch is active.
docs/sentence_transformers.md.
"""
import dataclasses
import functools
import importlib
import inspect
import logging

import torch

from clipshard.integrations import sentence_transformers_inputs as inputs
from clipshard.integrations import sentence_transformers_options as options
from clipshard.integrations.bound_methods import own_method_bypasses_patch
from clipshard.integrations.patched import unpatched
from clipshard.integrations.sentence_transformers_loss import TARGETS, ranking_loss
from clipshard.integrations.supported_import import SENTENCE_TRANSFORMERS

_LOG = logging.getLogger("clipshard")
_FN = "clipshard.apply_to_sentence_transformers"
_MODULE = "sentence_transformers.sentence_transformer.losses"
# class -> (the method patched, its parameters); the symmetric classes inherit it
_PATCHED = {"MultipleNegativesRankingLoss": ("compute_loss_from_embeddings", ("self", "embeddings", "labels")),
            "CachedMultipleNegativesRankingLoss": ("calculate_loss", ("self", "reps", "labels", "with_backward"))}
_COVERED = ("MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss",
            "CachedMultipleNegativesRankingLoss", "CachedMultipleNegativesSymmetricRankingLoss")


def _fused_or_none(loss, embeddings, labels, labels_as_ids):
    """clipshard's loss of `embeddings`, or None where the library's own computation must run."""
    fn = f"{type(loss).__name__} (clipshard)"
    ids = labels if labels_as_ids is not None and labels is not None else None
    negatives = len(embeddings) - 2 if isinstance(embeddings, (list, tuple)) else 0
    reason = options.fallback_reason(loss, negatives)
    if reason is None and isinstance(embeddings, (list, tuple)) and embeddings and torch.is_tensor(embeddings[0]):
        reason = inputs.layout_problem(embeddings)
    layout = inputs.check_and_layout(fn, loss, embeddings, ids, labels_as_ids if ids is not None else None,
                                     bool(loss.gather_across_devices), reason)
    if reason is not None:
        _log_fallback(type(loss).__name__, reason)
        return None
    if ids is not None:
        ids = ids.to(device=embeddings[0].device, dtype=torch.int64)
    opts = options.ranking_options(loss, labels_as_ids if ids is not None else None)
    return ranking_loss(embeddings[0], list(embeddings[1:]), opts, layout, ids)


_logged = set()  # (class, reason) already logged in this process


def _log_fallback(name, reason):
    if (name, reason) not in _logged:
        _logged.add((name, reason))
        _LOG.warning("clipshard: %s with %s runs sentence-transformers' own loss computation (not fused)",
                     name, reason)


# The patched methods read the active patch (its labels_as_ids) when called and run the library's own
# while none is: copies made while applied (MatryoshkaLoss's decorator on a cached loss's bound
# calculate_loss) stay on the loss objects after undo().
def _compute_loss_from_embeddings(original):
    @functools.wraps(original)
    def compute_loss_from_embeddings(self, embeddings, labels):
        patch = _active
        loss = None if patch is None else _fused_or_none(self, embeddings, labels, patch.labels_as_ids)
        return original(self, embeddings, labels) if loss is None else loss

    compute_loss_from_embeddings.clipshard_patched = True
    return compute_loss_from_embeddings


def _calculate_loss(original):
    @functools.wraps(original)
    def calculate_loss(self, reps, labels=None, *, with_backward=False):
        patch, loss = _active, None
        if patch is not None:  # the cached embeddings as whole columns, like the library's own calculate_loss
            loss = _fused_or_none(self, [torch.cat(column) for column in reps], labels, patch.labels_as_ids)
        if loss is None:
            return original(self, reps, labels, with_backward=with_backward)
        if with_backward:  # one backward of the whole loss to the cached embeddings (no per-chunk block)
            loss.backward()
            loss = loss.detach()
        return loss

    calculate_loss.clipshard_patched = True
    return calculate_loss


def _runs_patched_method(cls):
    return any(getattr(getattr(cls, m, None), "clipshard_patched", False) for m, _ in _PATCHED.values())


def _bound_before_patch(loss):
    """The name of `loss`'s own loss method bound before the patch (bound_methods), or None."""
    return next((m for m, _ in _PATCHED.values() if own_method_bypasses_patch(loss, m)), None)


_WRAPPERS = {"compute_loss_from_embeddings": _compute_loss_from_embeddings, "calculate_loss": _calculate_loss}


_OPTIONS = ("scale", "similarity_fct", "gather_across_devices", "directions", "partition_mode", "hardness_mode",
            "hardness_strength")


def _structure_problem(module, name):
    """What the patch needs of class `name` that this release lacks, or None: the patched classes'
    method and constructor options, the symmetric ones' base class."""
    cls = getattr(module, name, None)
    if cls is None:
        return "no such class"
    if name not in _PATCHED:
        base = "Cached" * name.startswith("Cached") + "MultipleNegativesRankingLoss"
        return None if issubclass(cls, getattr(module, base, ())) else f"not a subclass of {base}"
    method, parameters = _PATCHED[name]
    function = cls.__dict__.get(method)
    if function is None:
        return f"no {method} of its own"
    if tuple(inspect.signature(function).parameters)[: len(parameters)] != parameters:
        return f"{method}{inspect.signature(function)} is not {method}({', '.join(parameters)})"
    missing = [o for o in _OPTIONS if o not in inspect.signature(cls.__init__).parameters]
    return f"no {', '.join(missing)} option" if missing else None


@dataclasses.dataclass
class SentenceTransformersPatch:
    """What apply_to_sentence_transformers changed. replaced: covered class name -> the method that
    now computes clipshard's loss; kept: sentence-transformers' other losses, left as they are;
    rejected: covered class name -> why it was left alone; originals: class -> {method: function},
    for undo(); labels_as_ids: None, or the targets ("mask" / "multi") of the sample ids the batch's
    labels hold."""
    replaced: dict
    kept: tuple
    originals: dict
    labels_as_ids: str = None
    rejected: dict = dataclasses.field(default_factory=dict)
    active: bool = True

    def covers(self, loss):
        """Whether `loss` (a loss object or class) runs a method this patch installed. A wrapper
        (MatryoshkaLoss, any loss module holding the loss it calls as `.loss`) covers what its loss
        covers; a loss whose own method was bound before the patch (MatryoshkaLoss decorates a cached
        loss's bound `calculate_loss` when it is built) is not covered."""
        if not self.active:
            return False
        if isinstance(loss, type):
            return _runs_patched_method(loss)
        if not _runs_patched_method(type(loss)):
            inner = getattr(loss, "loss", None)
            return isinstance(inner, torch.nn.Module) and self.covers(inner)
        return _bound_before_patch(loss) is None

    def report(self, loss):
        """One line saying what `loss` (a loss object) computes with this patch; a loss that runs
        the library's computation for a reason of clipshard's gets the usual log line too."""
        name = type(loss).__name__
        inner = getattr(loss, "loss", None)
        if not _runs_patched_method(type(loss)) and isinstance(inner, torch.nn.Module) and self.active:
            return f"{name} around {self.report(inner)}"
        if not self.covers(loss):
            if self.active and _runs_patched_method(type(loss)):
                reason = f"its {_bound_before_patch(loss)} bound before apply_to_sentence_transformers()"
                _log_fallback(name, reason)
                return f"{name}: {reason} is not fused; it computes sentence-transformers' own loss"
            return f"{name}: left alone, it computes its own loss"
        reason = options.fallback_reason(loss, negatives=1)  # as with hard-negative columns
        if reason is not None:
            return f"{name}: {reason} is not fused; it computes sentence-transformers' own loss"
        where = "over the global batch" if loss.gather_across_devices else "over the local batch"
        ids = f", the labels as sample ids ({self.labels_as_ids})" if self.labels_as_ids else ""
        return f"{name}: clipshard's fused loss {where} ({', '.join(loss.directions)}; {loss.partition_mode}){ids}"

    def undo(self):
        """Puts the library's own methods back (a no-op the second time)."""
        global _active
        if not self.active:
            return
        for cls, methods in self.originals.items():
            for method, function in methods.items():
                setattr(cls, method, function)
        self.active = False
        if _active is self:
            _active = None
        _LOG.info("clipshard: sentence-transformers' own loss methods restored (%s)", ", ".join(self.replaced))

    def summary(self):
        replaced = ", ".join(f"{n}.{m}" for n, m in self.replaced.items())
        rejected = "".join(f"; left alone, structure not recognised: {n} ({why})" for n, why in self.rejected.items())
        ids = f"; the batch's labels are sample ids ({self.labels_as_ids})" if self.labels_as_ids else ""
        return (f"clipshard's fused loss in sentence-transformers' {replaced or 'no class'}{ids}{rejected}; "
                f"left alone (their own losses): {', '.join(self.kept)}")


_active = None


def apply_to_sentence_transformers(*, labels_as_ids=None):
    """Makes sentence-transformers' MultipleNegativesRankingLoss, MultipleNegativesSymmetricRankingLoss,
    CachedMultipleNegativesRankingLoss and CachedMultipleNegativesSymmetricRankingLoss (and their
    subclasses that keep the loss method) compute their loss with clipshard's fused op, with the same
    constructor arguments and values: over the global batch with gather_across_devices=True (unequal
    local batches allowed: docs/sentence_transformers.md), else over the local one. cos_sim and
    dot_score, every directions / partition_mode combination and any number of hard-negative columns
    are fused; another similarity_fct or an active hardness_mode runs the library's own computation,
    with one log line naming it. The cached losses keep their caching engine (mini-batches, progress
    bar) and replace only the loss on the cached embeddings.

    labels_as_ids: None (default: the batch's labels are ignored, as the library does), "mask" or
    "multi": the labels the collator hands the loss (the dataset's first column among label, labels,
    score, scores; name it "label") are integer sample ids: same-id samples are masked as false
    negatives ("mask") or counted as positives ("multi"), across ranks too (docs/targets.md).

    Call it before building the losses (MatryoshkaLoss binds a cached loss's method when it is
    built). Returns a SentenceTransformersPatch (`.replaced`, `.kept`, `.rejected`, `.covers(loss)`,
    `.report(loss)`, `.summary()`, `.undo()`) and logs its summary to the "clipshard" logger;
    calling it again while applied with the same labels_as_ids returns the same patch.

    Versions (supported_import.SENTENCE_TRANSFORMERS): ImportError if sentence-transformers is
    missing, older than 6.0 or 7.0 and later; a class whose structure is not the one patched is left
    alone and listed in `.rejected`; a release newer than the newest tested gets one UserWarning."""
    global _active
    if labels_as_ids not in TARGETS:
        raise ValueError(f"{_FN}: labels_as_ids must be None, 'mask' or 'multi', got {labels_as_ids!r}")
    if _active is not None:
        if _active.labels_as_ids != labels_as_ids:
            raise ValueError(f"{_FN}: already applied with labels_as_ids={_active.labels_as_ids!r}; undo() that "
                             "patch first")
        return _active
    library = SENTENCE_TRANSFORMERS.import_checked(_FN)
    module = importlib.import_module(_MODULE)
    rejected = {name: why for name in _COVERED if (why := _structure_problem(module, name)) is not None}
    originals, replaced = {}, {}
    for name, (method, _) in _PATCHED.items():
        if name not in rejected:
            originals[getattr(module, name)] = {method: unpatched(getattr(module, name).__dict__[method])}
    if originals:
        SENTENCE_TRANSFORMERS.warn_if_newer_than_tested(_FN, library)
    for cls, methods in originals.items():
        for method, function in methods.items():
            setattr(cls, method, _WRAPPERS[method](function))
    for name in _COVERED:
        cls = getattr(module, name, None)
        method = next((m for m, _ in _PATCHED.values() if getattr(getattr(cls, m, None), "clipshard_patched", False)),
                      None)
        if name not in rejected and method is not None:
            replaced[name] = method
        elif name not in rejected:
            rejected[name] = "its base class was not patched"
    kept = tuple(sorted(n for n, v in vars(module).items() if isinstance(v, type) and issubclass(v, torch.nn.Module)
                        and n.endswith("Loss") and n not in replaced and n not in rejected))
    _active = SentenceTransformersPatch(replaced=replaced, kept=kept, originals=originals, labels_as_ids=labels_as_ids,
                                        rejected=rejected)
    _LOG.info("clipshard: %s", _active.summary())
    if rejected:
        _LOG.warning("clipshard: left alone, their structure is not the one clipshard patches: %s",
                     "; ".join(f"{n} ({why})" for n, why in rejected.items()))
    return _active
