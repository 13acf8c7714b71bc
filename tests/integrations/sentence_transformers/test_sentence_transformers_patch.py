"""apply_to_sentence_transformers() in one process: what it replaces and leaves alone, undo, the
fallback with its log line, MatryoshkaLoss around the patched losses, bad input, the version policy."""
import logging

import pytest
import torch

pytest.importorskip("sentence_transformers", reason="sentence-transformers is not installed: "
                    "pip install '.[sentence_transformers]'")

import clipshard  # noqa: E402
from clipshard.integrations import supported_import  # noqa: E402
from tests.integrations.sentence_transformers.st_cases import global_batch, loss_and_grads, make_loss  # noqa: E402

from sentence_transformers import util  # noqa: E402
from sentence_transformers.sentence_transformer import losses  # noqa: E402

ALL = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")


@pytest.fixture
def patch():
    patch = clipshard.apply_to_sentence_transformers()
    yield patch
    patch.undo()


def _columns(negatives=2, dtype=torch.float64, batch=6):
    return [c for c in global_batch([batch], negatives, dtype, seed=3)[0]]


def test_replaces_the_loss_methods_and_undo_restores_them():
    own = (losses.MultipleNegativesRankingLoss.__dict__["compute_loss_from_embeddings"],
           losses.CachedMultipleNegativesRankingLoss.__dict__["calculate_loss"])
    patch = clipshard.apply_to_sentence_transformers()
    try:
        assert set(patch.replaced) == {"MultipleNegativesRankingLoss", "MultipleNegativesSymmetricRankingLoss",
                                       "CachedMultipleNegativesRankingLoss",
                                       "CachedMultipleNegativesSymmetricRankingLoss"}
        assert "GISTEmbedLoss" in patch.kept and not patch.rejected
        assert clipshard.apply_to_sentence_transformers() is patch
        with pytest.raises(ValueError, match="labels_as_ids"):
            clipshard.apply_to_sentence_transformers(labels_as_ids="mask")
        symmetric = losses.MultipleNegativesSymmetricRankingLoss(torch.nn.Sequential(torch.nn.Identity()))
        assert patch.covers(symmetric) and "fused loss over the local batch" in patch.report(symmetric)
        assert "left alone" in patch.report(losses.CoSENTLoss(torch.nn.Sequential(torch.nn.Identity())))
    finally:
        patch.undo()
    assert (losses.MultipleNegativesRankingLoss.__dict__["compute_loss_from_embeddings"],
            losses.CachedMultipleNegativesRankingLoss.__dict__["calculate_loss"]) == own
    assert not patch.covers(symmetric)
    patch.undo()  # a no-op the second time
    with pytest.raises(ValueError, match="labels_as_ids must be None, 'mask' or 'multi'"):
        clipshard.apply_to_sentence_transformers(labels_as_ids="yes")


@pytest.mark.parametrize("option", ["similarity_fct", "hardness_mode"])
def test_an_option_not_fused_runs_the_library_with_one_log_line(option, caplog):
    """The library's own bits, and one warning naming the option."""
    def similarity(a, b):  # a similarity_fct of the user's own
        return util.cos_sim(a, b) * 0.5

    kwargs = {"similarity_fct": {"similarity_fct": similarity},
              "hardness_mode": {"hardness_mode": "in_batch_negatives", "hardness_strength": 5.0}}[option]
    model = torch.nn.Sequential(torch.nn.Identity())
    columns = _columns()
    own = loss_and_grads(losses.MultipleNegativesRankingLoss(model, **kwargs), columns, None, False)
    patch = clipshard.apply_to_sentence_transformers()
    try:
        with caplog.at_level(logging.WARNING, logger="clipshard"):
            loss = losses.MultipleNegativesRankingLoss(model, **kwargs)
            first, second = (loss_and_grads(loss, columns, None, False) for _ in range(2))
        assert "not fused" in patch.report(loss)
    finally:
        patch.undo()
    assert torch.equal(first[0], own[0]) and all(torch.equal(a, b) for a, b in zip(first[1], own[1]))
    lines = [r.getMessage() for r in caplog.records if "not fused" in r.getMessage()]
    assert len(lines) == 1 and option in lines[0], lines


def test_a_zero_hardness_strength_is_fused(patch, caplog):
    model = torch.nn.Sequential(torch.nn.Identity())
    with caplog.at_level(logging.WARNING, logger="clipshard"):
        loss = losses.MultipleNegativesRankingLoss(model, hardness_mode="all_negatives", hardness_strength=0.0)
        loss_and_grads(loss, _columns(), None, False)
    assert not [r for r in caplog.records if "not fused" in r.getMessage()]


@pytest.fixture(scope="module")
def tiny_model_directory(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny_st"))
    example().save_tiny_model(directory, seed=0)
    return directory


def example():
    """examples/train_sentence_transformers.py as a module (its tiny model and data)."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).parents[3] / "examples" / "train_sentence_transformers.py"
    spec = importlib.util.spec_from_file_location("train_sentence_transformers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cached", [False, True], ids=["mnrl", "cached"])
def test_matryoshka_around_the_patched_losses(cached, tiny_model_directory):
    """MatryoshkaLoss (truncated embeddings through the loss-on-embeddings methods) around the
    patched losses gives the library's loss and parameter gradients on a tiny real model."""
    rows = example().triplets(6, seed=2, with_ids=False)
    results = []
    for patched in (False, True):
        patch = clipshard.apply_to_sentence_transformers() if patched else None
        try:
            model = example().load_model(tiny_model_directory).double()
            inner = make_loss(cached, ALL, "joint", util.cos_sim, False, mini_batch_size=4)
            inner.model = model
            if cached:
                inner.loss.model = model
            loss = losses.MatryoshkaLoss(model, inner, matryoshka_dims=[32, 16, 8])
            features = [model.tokenize(rows[column]) for column in ("anchor", "positive", "negative")]
            value = loss(features, None)
            value.backward()
            results.append((value.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        finally:
            if patch is not None:
                patch.undo()
    (own, own_grads), (fused, fused_grads) = results
    assert len(own_grads) == len(fused_grads) > 0
    assert abs(fused - own) <= 1e-10 * abs(own)
    for a, b in zip(fused_grads, own_grads):
        assert (a - b).abs().max() <= 1e-10 * b.abs().max().clamp_min(1e-6)


@pytest.mark.parametrize("labels, message", [
    (torch.arange(5), "length 6"),
    (torch.rand(6), "dtype torch.float32"),
    ([0, 1, 2, 3, 4, 5], "got list"),
    (torch.arange(6, device="meta"), "labels .*integer tensor of length 6.* with values, got a tensor on the meta"),
])
def test_bad_sample_ids(labels, message):
    patch = clipshard.apply_to_sentence_transformers(labels_as_ids="mask")
    try:
        with pytest.raises((ValueError, TypeError), match=message):
            loss_and_grads(make_loss(False, ALL, "joint", util.cos_sim, True), _columns(), labels, False)
    finally:
        patch.undo()


def test_sample_ids_with_an_option_not_fused():
    patch = clipshard.apply_to_sentence_transformers(labels_as_ids="multi")
    try:
        loss = losses.MultipleNegativesRankingLoss(torch.nn.Sequential(torch.nn.Identity()), similarity_fct=util.manhattan_sim)
        with pytest.raises(ValueError, match="sample ids .*need clipshard's fused loss.*similarity_fct=manhattan_sim"):
            loss_and_grads(loss, _columns(), torch.arange(6), False)
    finally:
        patch.undo()


def test_version_policy(monkeypatch):
    import sentence_transformers

    monkeypatch.setattr(sentence_transformers, "__version__", "5.7.0")
    with pytest.raises(ImportError, match="sentence-transformers 5.7.0 is not supported.*>=6.0"):
        clipshard.apply_to_sentence_transformers()
    monkeypatch.setattr(sentence_transformers, "__version__", "6.9.1")
    monkeypatch.setattr(supported_import, "_warned", set())
    with pytest.warns(UserWarning, match="6.9.1 is newer than the newest release clipshard was tested with"):
        patch = clipshard.apply_to_sentence_transformers()
    patch.undo()


class _ModelOfAnyWidth(torch.nn.Sequential):
    def get_embedding_dimension(self):  # what MatryoshkaLoss asks of a model
        return None


@pytest.mark.parametrize("built", ["before", "after"])
def test_matryoshka_around_a_cached_loss_reports_what_runs(built, monkeypatch, caplog):
    """MatryoshkaLoss binds a cached loss's calculate_loss when built: built before the patch it runs
    the library's computation, and covers() / report() say so, with the usual log line; built after,
    the fused loss runs and the report says fused (of the wrapper too)."""
    from clipshard.integrations import sentence_transformers_patch

    calls = []
    fused = sentence_transformers_patch.ranking_loss
    monkeypatch.setattr(sentence_transformers_patch, "ranking_loss", lambda *a: calls.append(1) or fused(*a))
    monkeypatch.setattr(sentence_transformers_patch, "_logged", set())
    model = _ModelOfAnyWidth(torch.nn.Identity())

    def build():
        inner = losses.CachedMultipleNegativesRankingLoss(model, mini_batch_size=2)
        return losses.MatryoshkaLoss(model, inner, matryoshka_dims=[6, 3])

    loss = build() if built == "before" else None
    patch = clipshard.apply_to_sentence_transformers()
    try:
        loss = loss or build()
        with caplog.at_level(logging.WARNING, logger="clipshard"):
            lines = patch.report(loss), patch.report(loss.loss)
        covered = patch.covers(loss), patch.covers(loss.loss)
        reps = [[x.requires_grad_() for x in c.split(2)] for c in _columns(negatives=1)]
        loss.loss.calculate_loss(reps, None, with_backward=True)
    finally:
        patch.undo()
    logged = [r.getMessage() for r in caplog.records if "not fused" in r.getMessage()]
    if built == "before":
        assert not calls and covered == (False, False), (calls, covered)
        assert all("calculate_loss bound before apply_to_sentence_transformers() is not fused" in line
                   for line in lines), lines
        assert lines[0].startswith("MatryoshkaLoss around CachedMultipleNegativesRankingLoss: ")
        assert len(logged) == 1 and "CachedMultipleNegativesRankingLoss with its calculate_loss bound" in logged[0]
    else:
        assert len(calls) == 2 and covered == (True, True), (calls, covered)
        assert all("clipshard's fused loss over the local batch" in line for line in lines) and not logged, lines
