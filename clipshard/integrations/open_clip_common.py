"""What every open_clip integration module needs: open_clip checked to be a supported version, and
open_clip's own loss classes whether or not apply_to_open_clip() has replaced them.

open_clip_patch records the classes it replaces here (`ORIGINALS`), so coca_loss can reach open_clip's
CoCaLoss without importing open_clip_patch (which imports coca_loss): no import cycle.
"""
from clipshard.integrations.supported_import import import_supported

SUPPORTED_VERSIONS = ("3.3",)  # open_clip_torch major.minor versions tested against
ORIGINALS = {}  # open_clip.loss name -> open_clip's class, while apply_to_open_clip() is in effect


def import_open_clip(fn):
    """open_clip, checked to be a supported version; a clear ImportError naming `fn` otherwise."""
    return import_supported(fn, "open_clip", "open_clip_torch", "open_clip", SUPPORTED_VERSIONS)


def original_class(name):
    """open_clip's own class `name` from open_clip.loss, whether or not the patch is applied."""
    if name in ORIGINALS:
        return ORIGINALS[name]
    return getattr(import_open_clip("clipshard.integrations.open_clip_common.original_class").loss, name)
