"""What every open_clip integration module needs: open_clip checked to be a supported version, and
open_clip's own loss classes whether or not apply_to_open_clip() has replaced them.

open_clip_patch records the classes it replaces here (`ORIGINALS`), so coca_loss can reach open_clip's
CoCaLoss without importing open_clip_patch (which imports coca_loss): no import cycle.
"""
import importlib

SUPPORTED_VERSIONS = ("3.3",)  # open_clip_torch major.minor versions tested against
ORIGINALS = {}  # open_clip.loss name -> open_clip's class, while apply_to_open_clip() is in effect


def import_open_clip(fn):
    """open_clip, checked to be a supported version; a clear ImportError naming `fn` otherwise."""
    try:
        open_clip = importlib.import_module("open_clip")
    except ImportError as e:
        raise ImportError(f"{fn}: open_clip is not installed ({e}); install clipshard with its extra, "
                          "pip install 'clipshard[open_clip]' (open_clip_torch 3.3.x)") from e
    version = getattr(open_clip, "__version__", "unknown")
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VERSIONS:
        raise ImportError(f"{fn}: open_clip_torch {version} is not supported; clipshard supports "
                          f"{', '.join(v + '.x' for v in SUPPORTED_VERSIONS)}")
    return open_clip


def original_class(name):
    """open_clip's own class `name` from open_clip.loss, whether or not the patch is applied."""
    if name in ORIGINALS:
        return ORIGINALS[name]
    return getattr(import_open_clip("clipshard.integrations.open_clip_common.original_class").loss, name)
