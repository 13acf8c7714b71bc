"""Fixtures of the open_clip tests (the tests skip themselves where open_clip is missing)."""
import pytest

import clipshard


@pytest.fixture
def patch():
    patch = clipshard.apply_to_open_clip()
    yield patch
    patch.undo()
