"""A model that holds its own forward, bound before apply_to_transformers() (accelerate's prepare does
this for mixed precision: it wraps the bound forward in autocast), runs transformers' loss: covers()
and report() say so, with a log line; bound after the patch, it runs clipshard's."""
import logging
import types

import pytest
import torch

pytest.importorskip("transformers", reason="transformers is not installed: pip install '.[transformers]'")

import clipshard  # noqa: E402
from tests.integrations.transformers.hf_tiny_models import tiny_inputs, tiny_model  # noqa: E402


def _bind_forward_as_accelerate_does(model):
    model.forward = types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16)(type(model).forward), model)


@pytest.mark.parametrize("bound", ["before", "after"])
def test_a_forward_bound_before_the_patch_is_reported(bound, caplog, monkeypatch):
    from clipshard.integrations import transformers_patch

    calls = []
    fused = transformers_patch.global_batch_loss
    monkeypatch.setattr(transformers_patch, "global_batch_loss", lambda *a, **k: calls.append(1) or fused(*a, **k))
    model = tiny_model("CLIPModel")
    if bound == "before":
        _bind_forward_as_accelerate_does(model)
    patch = clipshard.apply_to_transformers()
    try:
        if bound == "after":
            _bind_forward_as_accelerate_does(model)
        with caplog.at_level(logging.WARNING, logger="clipshard"):
            line = patch.report(model)
        covered = patch.covers(model)
        model(**tiny_inputs("CLIPModel", 4, seed=1), return_loss=True)
    finally:
        patch.undo()
    if bound == "before":
        assert not covered and not calls
        assert line == ("CLIPModel: left alone, its forward was bound before apply_to_transformers() (as "
                        "accelerate's prepare does for mixed precision); it computes its own loss")
        assert any(line in r.getMessage() for r in caplog.records)
    else:
        assert covered and calls and line == "CLIPModel: clipshard's global-batch loss (clip family)"
