"""Every ```python block of README.md and docs/*.md runs here on the CPU (issue 46), with the names
it assumes supplied by a fragment of doc_fragments.py, or is marked as not runnable here
(`signature`, `needs-gpu`, `torchrun`; docs/development.md, "Code in the docs"). Every block's
clipshard.* names must exist; a block not run must compile and bind every name it reads."""
import importlib

import pytest
import torch

import clipshard
from tests.docs.doc_blocks import NOT_RUN, all_blocks, clipshard_names, free_names
from tests.docs.doc_fragments import FRAGMENTS

BLOCKS = all_blocks()
PROVIDED = {"torch", "clipshard"}


def test_there_are_blocks_and_every_marker_word_is_known():
    assert len(BLOCKS) >= 15
    unknown = [(b.where, w) for b in BLOCKS for w in b.words if w not in NOT_RUN and w not in FRAGMENTS]
    assert unknown == [], f"marker words must be one of {NOT_RUN} or a fragment of doc_fragments.py"


def _resolve(dotted):
    """The object clipshard.a.b names (importing submodules on the way)."""
    parts = dotted.split(".")
    obj = clipshard
    for i, part in enumerate(parts[1:], start=2):
        if not hasattr(obj, part):
            try:
                importlib.import_module(".".join(parts[:i]))
            except ModuleNotFoundError:
                pass
        if not hasattr(obj, part):
            return None
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.where)
def test_every_clipshard_name_exists(block):
    assert [name for name in clipshard_names(block.code) if _resolve(name) is None] == []


@pytest.mark.parametrize("block", [b for b in BLOCKS if not b.runs and "signature" not in b.words],
                         ids=lambda b: b.where)
def test_a_block_not_run_compiles_and_binds_its_names(block):
    supplied = set(PROVIDED)
    for word in block.words:
        if word in FRAGMENTS:
            supplied |= set(FRAGMENTS[word]())
    assert sorted(free_names(block.code) - supplied) == []


def _undo_patches(namespace):
    for value in namespace.values():
        if type(value).__name__.endswith("Patch") and callable(getattr(value, "undo", None)):
            value.undo()


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.runs], ids=lambda b: b.where)
def test_the_block_runs(block):
    namespace = {"torch": torch, "clipshard": clipshard}
    try:
        for word in block.words:
            namespace.update(FRAGMENTS[word]())
        exec(compile(block.code, block.where, "exec"), namespace)
    finally:
        _undo_patches(namespace)


def test_the_parser_reads_markers_and_indented_blocks_and_finds_unbound_names(tmp_path):
    from tests.docs.doc_blocks import python_blocks
    page = tmp_path / "page.md"
    page.write_text("Text.\n\n<!-- doc-test: torchrun, model -->\n```python\nmain(sys.argv[1:])\n```\n\n"
                    "- a list item:\n\n  ```python\n  y = clipshard.stochastic_round(x)\n  ```\n")
    first, second = python_blocks(page)
    assert (first.words, first.line, first.runs) == (("torchrun", "model"), 4, False)
    assert free_names(first.code) == {"main", "sys"}
    assert (second.words, second.code, second.runs) == ((), "y = clipshard.stochastic_round(x)", True)
    assert clipshard_names(second.code) == ["clipshard.stochastic_round"]
    page.write_text("```python\nx = 1\n")
    with pytest.raises(ValueError, match="without its closing fence"):
        python_blocks(page)
