"""The package's layers: ops (every torch.library registration) <- parallel (speaks no loss's
words) <- losses; rounding and optim beside ops; grad_cache, integrations, diagnostics and planning as wings
the core never imports (DESIGN.md section 19). Every public name is in the root's __all__ and
imports from there; no module imports a layer above its own or a private name from another layer;
no module below the losses mentions a loss argument in its messages; no import cycle."""
import ast
import importlib
import inspect
import pathlib
import subprocess
import sys

import pytest

import clipshard

ROOT = pathlib.Path(clipshard.__file__).parent

# The root's public names (README.md), exactly its __all__.
PUBLIC = ["ClipLoss", "DistillClipLoss", "GradCache", "SigLipLoss", "apply_to_open_clip", "apply_to_sentence_transformers",
          "apply_to_transformers",
          "clip_loss", "contrastive_lse", "optim", "plan_memory", "self_check", "siglip_loss", "siglip_sum", "stochastic_round",
          "stochastic_round_", "text_tower_to_half_precision_"]

# The modules the package root may hold beside its subpackages (no fp64 references: they live
# beside the tests, in tests/references); _build_record guards the loading of clipshard._C, so it
# belongs to the ops layer.
ROOT_MODULES = {"__init__", "__main__", "open_clip_train", "grad_cache", "_micro_batches", "rounding", "_build_record"}

# Which layer each module belongs to (by its dotted prefix), and the layers each may import.
LAYER_OF = {"clipshard.ops": "ops", "clipshard._C": "ops", "clipshard._build_record": "ops", "clipshard.rounding": "rounding",
            "clipshard.optim": "optim", "clipshard.parallel": "parallel", "clipshard.losses": "losses",
            "clipshard.grad_cache": "grad_cache", "clipshard._micro_batches": "grad_cache",
            "clipshard.integrations": "integrations", "clipshard.open_clip_train": "integrations",
            "clipshard.diagnostics": "diagnostics", "clipshard.__main__": "diagnostics",
            "clipshard.planning": "planning"}
ALLOWED = {
    "ops": {"ops"},
    "rounding": {"ops", "rounding"},
    "optim": {"ops", "rounding", "optim"},
    "parallel": {"ops", "parallel"},
    "losses": {"ops", "parallel", "losses"},
}
CORE = set(ALLOWED)
# The argument names of the losses' signatures, which only the losses' own messages may use.
LOSS_ARGUMENTS = ("image_features", "text_features", "logit_scale", "logit_bias", "local_loss", "gather_with_grad",
                  "dist_image_features", "dist_text_features", "dist_logit_scale", "average_after_softmax",
                  "world_size", "output_dict", "cache_labels", "use_horovod", "dist_impl")


def _layer(module):
    return next(layer for prefix, layer in LAYER_OF.items() if module == prefix or module.startswith(prefix + "."))


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
    # (a module's own parent packages are imported before it anyway: no edge)
    return {name: {m for m in _imports(path) if m in modules and m != "clipshard" and not name.startswith(m + ".")}
            for name, path in modules.items() if name != "clipshard"}


def _core():
    """The layers below the wings: ops, rounding, optim, parallel, losses."""
    return sorted(n for n in _graph() if _layer(n) in CORE)


def test_the_root_exports_exactly_its_public_names():
    assert clipshard.__all__ == PUBLIC
    for name in PUBLIC:  # every name imports from the root (the wings' on first use)
        assert callable(getattr(clipshard, name)) or name == "optim", name
    exposed = {n for n, v in vars(clipshard).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert exposed <= set(PUBLIC), exposed - set(PUBLIC)
    assert callable(clipshard.optim.AdamW) and callable(clipshard.optim.to_half_precision_)


def test_importing_the_root_imports_no_wing():
    """The integrations and the self-check are reached through their subpackages, on first use."""
    script = ("import sys, clipshard; print(sorted(m for m in sys.modules if m.startswith(('clipshard.integrations', "
              "'clipshard.diagnostics'))))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]


def test_the_version_has_one_source():
    pyproject = (ROOT.parent / "pyproject.toml").read_text()
    # setup.py reads clipshard.__version__ (build_support.package_version), adds the optional local
    # label and the torch pin (docs/packaging.md)
    assert 'dynamic = ["version", "dependencies"]' in pyproject
    assert "build_support.package_version()" in (ROOT.parent / "setup.py").read_text()
    assert "\nversion =" not in pyproject.split("[project]")[1].split("[")[0]
    assert clipshard.__version__.count(".") == 2


def test_the_open_clip_train_entry_module_imports():
    assert callable(importlib.import_module("clipshard.open_clip_train").main)


def test_the_root_holds_only_its_modules_and_the_layers():
    """Everything else lives in a layer's subpackage (no module of an older layout is left behind)."""
    assert {p.stem for p in ROOT.glob("*.py")} <= ROOT_MODULES
    assert {p.name for p in ROOT.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "ops", "parallel", "losses", "optim", "integrations", "diagnostics", "planning"}
    modules = _modules()
    assert all(_layer(name) for name in modules if name != "clipshard")


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_no_layer_imports_a_layer_above_it(layer):
    graph = _graph()
    members = [n for n in graph if _layer(n) == layer]
    assert members, layer
    wrong = {n: sorted(m for m in graph[n] if _layer(m) not in ALLOWED[layer]) for n in members}
    assert not any(wrong.values()), wrong


def test_no_module_imports_a_private_name_of_another_layer():
    """A layer reaches another through its public names (`_C`, the extension, and `_build_record`,
    the versions it was built with, aside)."""
    wrong = []
    for name, path in _modules().items():
        for module in _imports(path):
            private = [c for c in module.split(".")[1:] if c.startswith("_") and c not in ("_C", "_build_record", "__init__")]
            if private and name != "clipshard" and _layer(module) != _layer(name):
                wrong.append(f"{name} imports {module}")
    assert not wrong, wrong


def test_no_module_below_the_losses_mentions_a_loss_argument_in_its_messages():
    """ops/ and parallel/ speak their own words in every string that is not a docstring (messages,
    and tables of them); the losses pass theirs in."""
    wrong = []
    for name, path in _modules().items():
        if name == "clipshard" or _layer(name) not in ("ops", "parallel"):
            continue
        tree = ast.parse(path.read_text())
        docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                      if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body
                      and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
                wrong += [f"{name}:{node.lineno}: {arg}" for arg in LOSS_ARGUMENTS if arg in node.value]
    assert not wrong, wrong


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
        assert all(_layer(m) in CORE for m in graph[name]), name


def test_the_core_never_imports_the_wings():
    """Each core module imports in a fresh interpreter where clipshard's own __init__ (which imports
    grad_cache for the public names) is bypassed and no wing (grad_cache, integrations,
    diagnostics) can be imported."""
    core = _core()
    assert "clipshard.parallel.ring" in core and "clipshard.optim.adamw" in core and "clipshard.losses.base" in core
    wings = ("clipshard.integrations", "clipshard.diagnostics", "clipshard.grad_cache", "clipshard._micro_batches")
    script = f"""
import importlib, importlib.abc, sys, types
import torch
class Forbid(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.startswith({wings!r}):
            raise ImportError("the core imported " + name)
sys.meta_path.insert(0, Forbid())
package = types.ModuleType("clipshard")
package.__path__ = [{str(ROOT)!r}]
sys.modules["clipshard"] = package
importlib.import_module("clipshard._C")
for name in {core!r}:
    importlib.import_module(name)
print(sorted(n for n in sys.modules if n.startswith({wings!r})))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["[]"]
