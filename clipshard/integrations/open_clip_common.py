"""What every open_clip integration module needs: open_clip checked against clipshard's version policy
(supported_import.OPEN_CLIP: open_clip_torch >= 2.26, < 4), and open_clip's own loss classes whether
or not apply_to_open_clip() has replaced them.

open_clip_patch records the classes it replaces here (`ORIGINALS`), so coca_loss can reach open_clip's
CoCaLoss without importing open_clip_patch (which imports coca_loss): no import cycle.
"""
from clipshard.integrations.supported_import import OPEN_CLIP

ORIGINALS = {}  # open_clip.loss name -> open_clip's class, while apply_to_open_clip() is in effect


def import_open_clip(fn):
    """open_clip, checked to be in the supported range; a clear ImportError naming `fn` otherwise. The
    caller checks the structure it uses, then calls warn_if_newer_than_tested."""
    return OPEN_CLIP.import_checked(fn)


def warn_if_newer_than_tested(fn, open_clip):
    """One warning naming open_clip's version if it is newer than the newest tested (3.3)."""
    OPEN_CLIP.warn_if_newer_than_tested(fn, open_clip)


def original_class(name):
    """open_clip's own class `name` from open_clip.loss, whether or not the patch is applied."""
    if name in ORIGINALS:
        return ORIGINALS[name]
    return getattr(import_open_clip("clipshard.integrations.open_clip_common.original_class").loss, name)
