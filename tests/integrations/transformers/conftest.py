"""Fixtures of the transformers tests (the tests skip themselves where transformers is missing)."""
import pytest

import clipshard
from tests.integrations.transformers.hf_tiny_models import BUILDERS, tiny_model


@pytest.fixture
def patch():
    patch = clipshard.apply_to_transformers()
    yield patch
    patch.undo()


@pytest.fixture(scope="module")
def models_imported():
    """Imports the covered classes' modules once, before the ranks are forked (seconds each)."""
    for name in BUILDERS:
        tiny_model(name)
