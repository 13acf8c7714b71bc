"""apply / undo of every integration (open_clip, transformers, sentence-transformers), in any count
and order, interleaved with each other and with refused applies (other options while applied): while
no patch of an integration is active, every object it replaces is the library's own object (the
same object, and for transformers' forwards the same signature, which Trainer reads to choose the
dataset columns it keeps); while one is, every one of them is replaced. Copies of a patched function
made while applied (accelerate's mixed-precision wrapper on a model's forward, MatryoshkaLoss's on a
cached loss's calculate_loss) follow later applies and undos too. Issue 40 item 3.

Integrations whose library is not installed are left out; the test skips when none is installed.
"""
import importlib
import inspect
import itertools
import random
import types

import pytest

import clipshard


def _installed(module):
    try:
        importlib.import_module(module)
        return True
    except ImportError:
        return False


def _transformers_objects():
    from clipshard.integrations import transformers_models
    classes = [entry.model_class_if_present() for entry in transformers_models.COVERED]
    return {cls.__name__: cls.__dict__["forward"] for cls in classes if cls is not None}


def _open_clip_objects():
    from clipshard.integrations import open_clip_patch
    return {(module, name): getattr(importlib.import_module(module), name, None)
            for module in open_clip_patch.MODULES for name in open_clip_patch._replacements()}


def _sentence_transformers_objects():
    from clipshard.integrations import sentence_transformers_patch as patch
    module = importlib.import_module(patch._MODULE)
    return {(name, method): vars(getattr(module, name)).get(method)
            for name, (method, _) in patch._PATCHED.items() if hasattr(module, name)}


# name -> (library, what its patch replaces, the applies to draw from: the first one's options
# conflict with the second's, so that applying the other while one is active is refused)
INTEGRATIONS = {
    "open_clip": ("open_clip", _open_clip_objects, [clipshard.apply_to_open_clip]),
    "transformers": ("transformers", _transformers_objects,
                     [lambda: clipshard.apply_to_transformers(),
                      lambda: clipshard.apply_to_transformers(logits=False),
                      lambda: clipshard.apply_to_transformers(micro_batch_size=2)]),
    "sentence_transformers": ("sentence_transformers", _sentence_transformers_objects,
                              [lambda: clipshard.apply_to_sentence_transformers(),
                               lambda: clipshard.apply_to_sentence_transformers(labels_as_ids="mask")]),
}
INSTALLED = {name: spec for name, spec in INTEGRATIONS.items() if _installed(spec[0])}
pytestmark = pytest.mark.skipif(not INSTALLED, reason="none of open_clip, transformers, sentence-transformers "
                                                      "is installed")


def _signatures(objects):
    return {key: inspect.signature(value) for key, value in objects.items() if inspect.isfunction(value)}


class _Run:
    """One sequence of operations, with the patches it got, checked after every operation."""

    def __init__(self, originals):
        self.originals = originals
        self.patches = {name: [] for name in INSTALLED}

    def apply(self, name, which):
        try:
            self.patches[name].append(INSTALLED[name][2][which]())
        except ValueError as error:  # other options while applied: refused, nothing changes
            assert "already applied" in str(error) and any(p.active for p in self.patches[name]), error

    def undo(self, name, which):
        if self.patches[name]:
            self.patches[name][which % len(self.patches[name])].undo()

    def check(self, history):
        for name, (_, objects, _) in INSTALLED.items():
            now, original = objects(), self.originals[name]
            if any(p.active for p in self.patches[name]):
                replaced = [key for key, value in original.items() if now[key] is not value]
                assert replaced, (history, name, "applied but nothing replaced")
            else:
                changed = [key for key, value in original.items() if now[key] is not value]
                assert not changed, (history, name, changed)
                assert _signatures(now) == _signatures(original), (history, name)

    def undo_all(self):
        for patches in self.patches.values():
            for patch in patches:
                patch.undo()


def _operations():
    ops = []
    for name, (_, _, applies) in INSTALLED.items():
        ops += [("apply", name, k) for k in range(len(applies))]
        ops += [("undo", name, 0), ("undo", name, -1)]  # the first patch got, the last one
    return ops


def _run(sequence, originals):
    run = _Run(originals)
    try:
        for step, (action, name, which) in enumerate(sequence):
            getattr(run, action)(name, which)
            run.check(sequence[: step + 1])
    finally:
        run.undo_all()
    run.check(list(sequence) + ["undo everything"])


def test_any_count_and_order_of_applies_and_undos_restores_the_very_objects():
    originals = {name: objects() for name, (_, objects, _) in INSTALLED.items()}
    ops = _operations()
    for sequence in itertools.product(ops, repeat=2):  # every pair, then random longer sequences
        _run(sequence, originals)
    rng = random.Random(40)
    for _ in range(40):
        _run([rng.choice(ops) for _ in range(rng.randint(3, 9))], originals)
    # applied twice, undone twice (the same patch, or each one)
    for name in INSTALLED:
        _run([("apply", name, 0), ("apply", name, 0), ("undo", name, 0), ("undo", name, -1)], originals)
        _run([("apply", name, 0), ("undo", name, 0), ("apply", name, 0), ("undo", name, -1), ("undo", name, 0)],
             originals)


@pytest.mark.skipif("transformers" not in INSTALLED, reason="transformers is not installed")
def test_an_apply_that_fails_midway_changes_nothing(monkeypatch):
    """A transformers apply that raises while building the forwards (here: the second one) leaves
    every class's own forward in place, so that the next apply / undo pair restores them too (it
    used to leave the first class patched with no active patch: the next apply took that patched
    forward for the original, and its undo put it back)."""
    from clipshard.integrations import transformers_patch
    originals = {"transformers": _transformers_objects()}
    build, built = transformers_patch._with_global_loss, []

    def fails_the_second_time(*args):
        if built:
            raise RuntimeError("a forward that cannot be wrapped")
        built.append(1)
        return build(*args)
    monkeypatch.setattr(transformers_patch, "_with_global_loss", fails_the_second_time)
    with pytest.raises(RuntimeError, match="cannot be wrapped"):
        clipshard.apply_to_transformers()
    monkeypatch.setattr(transformers_patch, "_with_global_loss", build)
    assert _transformers_objects() == originals["transformers"]
    clipshard.apply_to_transformers().undo()
    now = _transformers_objects()
    assert all(now[k] is v for k, v in originals["transformers"].items())


def _mixed_precision_forward(model):
    """`model.forward` wrapped the way accelerate's prepare() wraps it for mixed precision (and so
    Trainer with bf16=True / fp16=True): an instance attribute, torch.autocast (disabled here, so that
    losses compare bit for bit) used as a decorator on the forward function of the moment
    (functools.wraps copies that function's __dict__, __signature__ included), bound to the model."""
    import torch
    return types.MethodType(torch.autocast("cpu", dtype=torch.bfloat16, enabled=False)(model.forward.__func__), model)


@pytest.mark.skipif("transformers" not in INSTALLED, reason="transformers is not installed")
def test_a_forward_wrapped_while_applied_follows_later_applies_and_undos():
    """A model whose forward accelerate wrapped while a patch was active (Trainer with bf16 keeps
    that instance attribute after training), applied twice and undone twice: after each undo its
    forward has the class's own signature again (Trainer's remove_unused_columns reads it) and
    computes the model's own loss; after the second apply, with other options, it computes that
    patch's loss. It used to keep the first patch's forward for good: the extra keywords in its
    signature and clipshard's loss with the first patch's options, whatever was applied or undone."""
    import torch
    from tests.integrations.transformers.hf_tiny_models import tiny_inputs, tiny_model
    model, inputs = tiny_model("CLIPModel"), tiny_inputs("CLIPModel", 5, seed=3)
    own_signature = inspect.signature(model.forward)
    with torch.no_grad():
        own_loss = model(**inputs, return_loss=True).loss
    patches = [clipshard.apply_to_transformers()]
    try:
        model.forward = _mixed_precision_forward(model)
        for apply in (lambda: patches[0], lambda: clipshard.apply_to_transformers(logits=False)):
            patches.append(apply())  # the first time: the patch active when the forward was wrapped
            with torch.no_grad():
                patched = model(**inputs, return_loss=True)
            assert "sample_ids" in inspect.signature(model.forward).parameters
            assert (patched.logits_per_image is None) == (not patches[-1].logits)
            patches[-1].undo()
            assert inspect.signature(model.forward) == own_signature
            with torch.no_grad():
                assert model(**inputs, return_loss=True).loss == own_loss
            model.forward = _mixed_precision_forward(model)  # a second Trainer wraps the wrapper again
    finally:
        for patch in patches:
            patch.undo()


@pytest.mark.skipif("sentence_transformers" not in INSTALLED, reason="sentence-transformers is not installed")
def test_a_loss_method_kept_while_applied_follows_later_applies_and_undos():
    """A cached loss whose bound calculate_loss was kept while a patch was active (MatryoshkaLoss's
    decorator keeps it on the loss object), applied twice and undone twice: after each undo it
    computes the library's own loss (which ignores the labels), bit for bit; while applied, clipshard's
    (the same value within rounding), and with labels_as_ids="mask" the labels masked as sample ids.
    It used to keep the first patch's method: clipshard's loss with the first patch's labels_as_ids,
    whatever was applied or undone."""
    import torch
    from tests.integrations.sentence_transformers.st_cases import global_batch, make_loss
    from sentence_transformers import util
    columns, ids = global_batch([6], 1, torch.float64, seed=5)
    reps = [list(column.split(2)) for column in columns]
    loss = make_loss(True, ("query_to_doc",), "joint", util.cos_sim, False)
    own = type(loss).calculate_loss(loss, reps, ids)
    patches = [clipshard.apply_to_sentence_transformers()]
    try:
        loss.calculate_loss = loss.calculate_loss  # what MatryoshkaLoss's decorator holds
        for apply in (lambda: patches[0], lambda: clipshard.apply_to_sentence_transformers(labels_as_ids="mask")):
            patches.append(apply())
            fused = loss.calculate_loss(reps, ids)
            assert (abs(fused - own) <= 1e-12 * abs(own)) == (patches[-1].labels_as_ids is None), (fused, own)
            patches[-1].undo()
            assert loss.calculate_loss(reps, ids) == own
    finally:
        for patch in patches:
            patch.undo()


@pytest.mark.parametrize("undo_order", ["in apply order", "in reverse"])
@pytest.mark.parametrize("name", INSTALLED)
def test_applied_twice_across_a_reload_and_undone_twice(name, undo_order):
    """Applied, then applied again by a copy of the patch module that does not know the first patch
    (its state reset, as importlib.reload / IPython's autoreload leave it), then both undone: every
    object is the library's own again. The second apply used to record the first one's replacements
    as the originals, so undoing in apply order left them in place (for transformers, a patched
    forward with its extra keywords in the signature Trainer reads)."""
    module = importlib.import_module(f"clipshard.integrations.{name}_patch")
    _, objects, applies = INSTALLED[name]
    originals = objects()
    patches = [applies[0]()]
    try:
        module._active = None  # what a reload of the module does to its state
        patches.append(applies[0]())
    finally:
        for patch in patches if undo_order == "in apply order" else patches[::-1]:
            patch.undo()
    now = objects()
    assert all(now[key] is value for key, value in originals.items())
    assert _signatures(now) == _signatures(originals)
