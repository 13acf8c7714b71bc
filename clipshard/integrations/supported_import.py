"""Importing the library an integration plugs into, refused clearly when it is missing or of a version
clipshard was not tested against (shared by the open_clip and transformers integrations)."""
import importlib


def import_supported(fn, module, package, extra, supported):
    """`module` imported, its version's major.minor one of `supported`; else an ImportError naming `fn`,
    the pip `package` and clipshard's `extra` that installs it."""
    versions = ", ".join(v + ".x" for v in supported)
    try:
        library = importlib.import_module(module)
    except ImportError as e:
        raise ImportError(f"{fn}: {module} is not installed ({e}); install clipshard with its extra, "
                          f"pip install 'clipshard[{extra}]' ({package} {versions})") from e
    version = getattr(library, "__version__", "unknown")
    if ".".join(version.split(".")[:2]) not in supported:
        raise ImportError(f"{fn}: {package} {version} is not supported; clipshard supports {versions}")
    return library
