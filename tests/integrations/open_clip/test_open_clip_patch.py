"""apply_to_open_clip(): what open_clip builds afterwards, undo, refusals, clipshard without open_clip,
and clipshard's CoCaLoss against open_clip's."""
import argparse
import subprocess
import sys

import pytest
import torch

open_clip = pytest.importorskip("open_clip", reason="open_clip is not installed: pip install '.[open_clip]'")

import clipshard  # noqa: E402
from clipshard.integrations import open_clip_patch  # noqa: E402
from clipshard.integrations.coca_loss import CoCaLoss  # noqa: E402

ORIGINAL = {m: {n: getattr(__import__(m, fromlist=["_"]), n, None) for n in ("ClipLoss", "CoCaLoss", "DistillClipLoss")}
            for m in open_clip_patch.MODULES}


def _args(**overrides):
    args = dict(distill=False, model="ViT-B-32", siglip=False, local_loss=False, gather_with_grad=False, rank=0,
                world_size=1, horovod=False, coca_caption_loss_weight=2.0, coca_contrastive_loss_weight=1.0,
                loss_dist_impl=None)
    return argparse.Namespace(**{**args, **overrides})


def test_create_loss_builds_clipshard_losses_and_leaves_the_others(patch):
    assert type(open_clip.create_loss(_args())) is clipshard.ClipLoss
    coca = open_clip.create_loss(_args(model="coca_ViT-B-32", local_loss=True, gather_with_grad=True))
    assert type(coca) is CoCaLoss
    assert (coca.local_loss, coca.gather_with_grad, coca.caption_loss_weight, coca.clip_loss_weight) == (True, True, 2.0, 1.0)
    distill = open_clip.create_loss(_args(distill=True, local_loss=True, gather_with_grad=True))
    assert type(distill) is clipshard.DistillClipLoss and (distill.local_loss, distill.gather_with_grad) == (True, True)
    assert type(open_clip.create_loss(_args(siglip=True))) is clipshard.SigLipLoss
    assert patch.replaced == {"ClipLoss": clipshard.ClipLoss, "CoCaLoss": CoCaLoss,
                              "DistillClipLoss": clipshard.DistillClipLoss, "SigLipLoss": clipshard.SigLipLoss}
    assert patch.kept == ()
    assert "DistillClipLoss -> clipshard.losses.distill.DistillClipLoss" in patch.summary()
    assert "left as open_clip's: none" in patch.summary()
    for module_name in open_clip_patch.MODULES:  # every place the classes are looked up by
        module = sys.modules[module_name]
        assert module.ClipLoss is clipshard.ClipLoss and module.CoCaLoss is CoCaLoss, module_name


def test_apply_twice_is_one_patch_and_undo_restores_everything():
    patch = clipshard.apply_to_open_clip()
    assert clipshard.apply_to_open_clip() is patch
    patch.undo()
    patch.undo()
    for module_name, names in ORIGINAL.items():
        for name, original in names.items():
            assert getattr(sys.modules[module_name], name) is original, (module_name, name)
    assert type(open_clip.create_loss(_args())) is ORIGINAL["open_clip.loss"]["ClipLoss"]
    again = clipshard.apply_to_open_clip()
    assert again is not patch and open_clip.factory.ClipLoss is clipshard.ClipLoss
    again.undo()


def test_refuses_an_unsupported_open_clip(monkeypatch):
    monkeypatch.setattr(open_clip, "__version__", "2.24.0")
    with pytest.raises(ImportError, match=r"apply_to_open_clip: open_clip_torch 2\.24\.0 is not supported; clipshard "
                                          r"supports open_clip_torch>=2\.26, <4\.0 \(tested up to 3\.3\.x\)"):
        clipshard.apply_to_open_clip()
    assert open_clip.factory.ClipLoss is ORIGINAL["open_clip.factory"]["ClipLoss"]


def test_refuses_without_open_clip(monkeypatch):
    monkeypatch.setitem(sys.modules, "open_clip", None)
    with pytest.raises(ImportError, match=r"apply_to_open_clip: open_clip is not installed .* "
                                          r"pip install 'clipshard\[open_clip\]'"):
        clipshard.apply_to_open_clip()


def test_clipshard_works_without_open_clip():
    """In a fresh interpreter where open_clip cannot be imported: clipshard imports, its loss runs, and
    the open_clip parts say what is missing."""
    script = """
import sys
sys.modules["open_clip"] = sys.modules["open_clip_train"] = None  # hides them: importing raises ImportError
import torch, clipshard
x = torch.nn.functional.normalize(torch.randn(4, 8), dim=-1)
assert torch.isfinite(clipshard.ClipLoss()(x, x.flip(0), torch.tensor(10.0)))
for use in (clipshard.apply_to_open_clip, lambda: clipshard.text_tower_to_half_precision_,
            lambda: __import__("clipshard.open_clip_train", fromlist=["main"]).main([])):
    try:
        use()
    except ImportError as e:
        print(e)
    else:
        raise AssertionError("no ImportError")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 3 and all("open_clip is not installed" in line for line in lines), lines
    assert lines[1].startswith("text_tower_to_half_precision_:")
    assert lines[2].startswith("python -m clipshard.open_clip_train:")


def test_importing_clipshard_does_not_import_open_clip():
    done = subprocess.run([sys.executable, "-c", "import sys, clipshard; print('open_clip' in sys.modules)"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "False", done.stderr


# ---- CoCaLoss ---------------------------------------------------------------------------------

def _coca_inputs(seed=0, batch=6, dim=8, tokens=5, vocab=11):
    gen = torch.Generator().manual_seed(seed)
    image = torch.nn.functional.normalize(torch.randn(batch, dim, generator=gen, dtype=torch.float64), dim=-1)
    text = torch.nn.functional.normalize(torch.randn(batch, dim, generator=gen, dtype=torch.float64), dim=-1)
    logits = torch.randn(batch, tokens, vocab, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, tokens), generator=gen)  # 0 is the pad id: some are ignored
    return [t.requires_grad_() if t.is_floating_point() else t for t in (image, text, logits, labels)] + [
        torch.tensor(12.5, dtype=torch.float64, requires_grad=True)]


@pytest.mark.parametrize("clip_weight", [1.0, 0.0])
def test_coca_loss_equals_open_clip_coca_loss(clip_weight):
    ours = CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=clip_weight)
    theirs = open_clip.loss.CoCaLoss(caption_loss_weight=2.0, clip_loss_weight=clip_weight)
    a, b = _coca_inputs(), _coca_inputs()
    out_a, out_b = ours(*a[:4], a[4], output_dict=True), theirs(*b[:4], b[4], output_dict=True)
    assert out_a.keys() == out_b.keys() == {"contrastive_loss", "caption_loss"}
    for key in out_a:
        torch.testing.assert_close(out_a[key].double(), out_b[key].double(), rtol=1e-12, atol=0)
    sum(out_a.values()).backward()
    sum(out_b.values()).backward()
    for x, y in zip(a, b):
        if x.is_floating_point():
            torch.testing.assert_close(x.grad, y.grad, rtol=1e-10, atol=1e-14)
    assert isinstance(ours(*a[:4], a[4]), tuple)
