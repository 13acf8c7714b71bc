"""`apply_to_open_clip()`: open_clip builds clipshard's losses wherever it looks its loss classes up.

open_clip's `create_loss` (and so open_clip_train) finds the classes in `open_clip.factory`; users
find them in `open_clip` and `open_clip.loss`. The patch replaces the names of `_replacements()` in
all three, records what it replaced and what it left as open_clip's, and can be undone.
The version policy: open_clip_common and supported_import. docs/open_clip.md.
"""
import dataclasses
import importlib
import logging

import torch

from clipshard.integrations.coca_loss import CoCaLoss
from clipshard.losses.distill import DistillClipLoss
from clipshard.integrations.open_clip_common import ORIGINALS, import_open_clip, warn_if_newer_than_tested
from clipshard.losses.clip import ClipLoss
from clipshard.losses.siglip import SigLipLoss

_LOG = logging.getLogger("clipshard")
_FN = "clipshard.apply_to_open_clip"
MODULES = ("open_clip", "open_clip.loss", "open_clip.factory")  # where open_clip's loss classes are looked up


def _replacements():
    """open_clip class name -> clipshard class, one line per loss."""
    return {
        "ClipLoss": ClipLoss,
        "CoCaLoss": CoCaLoss,
        "DistillClipLoss": DistillClipLoss,
        "SigLipLoss": SigLipLoss,
    }


@dataclasses.dataclass
class OpenClipPatch:
    """What apply_to_open_clip changed. replaced: open_clip name -> clipshard class; kept: open_clip's
    loss classes left as they are; originals: (module, name) -> open_clip's object, for undo()."""
    replaced: dict
    kept: tuple
    originals: dict
    active: bool = True

    def undo(self):
        """Puts open_clip's classes back where the patch replaced them (a no-op the second time)."""
        global _active
        if not self.active:
            return
        for (module_name, name), original in self.originals.items():
            setattr(importlib.import_module(module_name), name, original)
        self.active = False
        ORIGINALS.clear()
        if _active is self:
            _active = None
        _LOG.info("clipshard: open_clip's loss classes restored (%s)", ", ".join(self.replaced))

    def summary(self):
        replaced = ", ".join(f"{n} -> {c.__module__}.{c.__qualname__}" for n, c in self.replaced.items())
        return f"replaced in open_clip: {replaced}; left as open_clip's: {', '.join(self.kept) or 'none'}"


_active = None


def _open_clip_losses(loss_module):
    return sorted(n for n, v in vars(loss_module).items()
                  if isinstance(v, type) and issubclass(v, torch.nn.Module) and n.endswith("Loss"))


def apply_to_open_clip():
    """Makes open_clip build clipshard's losses: afterwards `open_clip.create_loss(args)`, and so
    open_clip_train, returns clipshard.ClipLoss for the CLIP loss, clipshard.SigLipLoss for SigLIP,
    clipshard.DistillClipLoss for --distill-model runs and clipshard's CoCaLoss (fused contrastive
    term, open_clip's caption term) for CoCa models; `open_clip.ClipLoss` and
    `open_clip.loss.ClipLoss` (and the other names) name clipshard's classes too. open_clip's other
    losses stay as they are and are listed in the result's `kept`.

    Returns an OpenClipPatch (`.replaced`, `.kept`, `.summary()`, `.undo()`) and logs its summary to
    the "clipshard" logger. Calling it again while applied returns the same patch. Names bound before
    the call (`from open_clip import ClipLoss`) keep open_clip's class. Raises ImportError if
    open_clip is missing, outside the supported range (supported_import.OPEN_CLIP: 2.26 to 3.x) or
    laid out differently (no ClipLoss / CoCaLoss / SigLipLoss in open_clip.factory); a release newer
    than the newest tested (3.3) gets one warning naming its version."""
    global _active
    if _active is not None:
        return _active
    open_clip = import_open_clip(_FN)
    replacements = _replacements()
    originals = {}
    for module_name in MODULES:
        module = importlib.import_module(module_name)
        for name, cls in replacements.items():
            if hasattr(module, name):
                current = getattr(module, name)
                # clipshard's class already there: a patch of a copy of this module reloaded since
                originals[(module_name, name)] = ORIGINALS.get(name, current) if current is cls else current
    missing = [n for n in replacements if ("open_clip.factory", n) not in originals]
    if missing:
        raise ImportError(f"{_FN}: open_clip.factory has no {', '.join(missing)}: open_clip_torch "
                          f"{open_clip.__version__} is laid out differently from the supported versions")
    warn_if_newer_than_tested(_FN, open_clip)
    kept = tuple(n for n in _open_clip_losses(open_clip.loss) if n not in replacements)
    for (module_name, name) in originals:
        setattr(importlib.import_module(module_name), name, replacements[name])
    ORIGINALS.update({name: cls for (module_name, name), cls in originals.items() if module_name == "open_clip.loss"})
    _active = OpenClipPatch(replaced=replacements, kept=kept, originals=originals)
    _LOG.info("clipshard: %s", _active.summary())
    return _active
