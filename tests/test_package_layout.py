"""The package's layers (clipshard/ops, clipshard/parallel, the public losses, clipshard/optim,
clipshard/integrations): every public name imports from where the README says, no module imports a
layer above its own, no import cycle, the core never imports the integrations, and no module of the
old flat layout is left behind."""
import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

import clipshard

ROOT = pathlib.Path(clipshard.__file__).parent

PUBLIC = [("clipshard", n) for n in ("ClipLoss", "clip_loss", "SigLipLoss", "siglip_loss", "contrastive_lse",
                                      "siglip_sum", "stochastic_round", "stochastic_round_", "apply_to_open_clip",
                                      "apply_to_transformers")] + \
         [("clipshard.optim", n) for n in ("AdamW", "to_half_precision_")]

# The modules of the flat layout that moved into ops/, parallel/ and optim/ (no re-export shims).
MOVED = ("fused_op", "siglip_op", "portable_lse", "portable_siglip", "_portable_chunks", "_algorithm", "_workspace",
         "_block_checks", "distributed", "sharded_loss", "ring", "siglip_ring", "_ring_pass", "optim_dtensor")


def _modules():
    """{dotted name: path} of every module of the package."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(path):
    """The clipshard modules a file imports, at any depth (function-level imports included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("clipshard"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("clipshard"):
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)
    return found


def _graph():
    modules = _modules()
    return {name: {m for m in _imports(path) if m in modules and m != "clipshard"}
            for name, path in modules.items() if name != "clipshard"}


def _core():
    """Everything but the integrations and the `python -m clipshard.open_clip_train` entry."""
    return sorted(n for n in _graph() if not n.startswith("clipshard.integrations") and n != "clipshard.open_clip_train")


@pytest.mark.parametrize("module,name", PUBLIC)
def test_every_public_name_imports(module, name):
    assert callable(getattr(importlib.import_module(module), name))


def test_the_open_clip_train_entry_module_imports():
    assert callable(importlib.import_module("clipshard.open_clip_train").main)


@pytest.mark.parametrize("old", MOVED)
def test_no_module_of_the_flat_layout_is_left(old):
    assert not (ROOT / f"{old}.py").exists()
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(f"clipshard.{old}")


# A module of the first layer may import nothing from the layers listed beside it.
FORBIDDEN = {
    "clipshard.ops": ("clipshard.parallel", "clipshard.loss", "clipshard.siglip", "clipshard.optim",
                      "clipshard.integrations"),
    "clipshard.parallel": ("clipshard.loss", "clipshard.siglip", "clipshard.optim", "clipshard.integrations"),
    # optim/ sits beside ops/ (DESIGN 19): it may use ops' single-device pieces (ops/first_use.py)
    "clipshard.optim": ("clipshard.parallel", "clipshard.loss", "clipshard.siglip", "clipshard.integrations"),
}


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_a_layer_above_it(layer):
    graph = _graph()
    members = [n for n in graph if n == layer or n.startswith(layer + ".")]
    assert len(members) >= 3, members
    wrong = {n: sorted(m for m in graph[n] if m.startswith(FORBIDDEN[layer])) for n in members}
    assert not any(wrong.values()), wrong


def test_no_import_cycle_between_clipshard_modules():
    graph = _graph()
    assert "clipshard.integrations.coca_loss" in graph and "clipshard.ops.contrastive_lse" in graph
    state = {}

    def visit(node, trail):
        if state.get(node) == "done":
            return
        assert state.get(node) != "open", "import cycle: " + " -> ".join(trail + [node])
        state[node] = "open"
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, trail + [node])
        state[node] = "done"

    for name in sorted(graph):
        visit(name, [])
    for name in _core():
        assert not any(m.startswith("clipshard.integrations") for m in graph[name]), name


def test_the_core_never_imports_the_integrations():
    """Each core module imports in a fresh interpreter where clipshard's own __init__ (which imports the
    integrations for the public names) is bypassed and clipshard.integrations cannot be imported."""
    core = _core()
    assert "clipshard.parallel.ring" in core and "clipshard.optim.adamw" in core
    script = f"""
import importlib, importlib.abc, sys, types
import torch
class Forbid(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("clipshard.integrations"):
            raise ImportError("the core imported " + name)
sys.meta_path.insert(0, Forbid())
package = types.ModuleType("clipshard")
package.__path__ = [{str(ROOT)!r}]
sys.modules["clipshard"] = package
importlib.import_module("clipshard._C")
for name in {core!r}:
    importlib.import_module(name)
print(sorted(n for n in sys.modules if n.startswith("clipshard.integrations")))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]
