"""clipshard's version policy for the libraries its integrations plug into, in one place (shared by
the open_clip and transformers integrations).

A library is imported and checked against its VersionPolicy: missing, older than the oldest
supported release, or of a major version known not to fit: a clear ImportError. Any other release
is used; whether it fits is decided by the integration's structural check (the methods and
attributes it patches), not by the version string. A release newer than the newest tested one gets
one warning naming its version, issued by the integration after its structural check passed.
docs/transformers.md, docs/open_clip.md.
"""
import dataclasses
import importlib
import re
import warnings

_warned = set()  # (package, version) already warned about in this process


def release(version):
    """(major, minor) of a version string such as '4.57.6' or '5.25.0.dev0'; None if unreadable."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def _dotted(pair):
    return ".".join(map(str, pair))


@dataclasses.dataclass(frozen=True)
class VersionPolicy:
    """module: what is imported; package / extra: the pip name and clipshard's extra that installs it;
    oldest: the oldest supported (major, minor); newest_tested: the newest (major, minor) tested;
    refused_from: (major, minor) from which releases are refused (None: no upper bound)."""
    module: str
    package: str
    extra: str
    oldest: tuple
    newest_tested: tuple
    refused_from: tuple | None = None

    def supported(self):
        """The supported range in words, for messages and docs."""
        upper = f", <{_dotted(self.refused_from)}" if self.refused_from else ""
        return f"{self.package}>={_dotted(self.oldest)}{upper} (tested up to {_dotted(self.newest_tested)}.x)"

    def import_checked(self, fn):
        """The library, imported; an ImportError naming `fn` if it is missing or outside the range."""
        try:
            library = importlib.import_module(self.module)
        except ImportError as e:
            raise ImportError(f"{fn}: {self.module} is not installed ({e}); install clipshard with its extra, "
                              f"pip install 'clipshard[{self.extra}]' ({self.supported()})") from e
        version = getattr(library, "__version__", "unknown")
        pair = release(version)
        if pair is None or pair < self.oldest or (self.refused_from and pair >= self.refused_from):
            raise ImportError(f"{fn}: {self.package} {version} is not supported; clipshard supports "
                              f"{self.supported()}")
        return library

    def newer_than_tested(self, library):
        return release(library.__version__) > self.newest_tested

    def warn_if_newer_than_tested(self, fn, library):
        """One warning per process and version when `library` is newer than the newest tested release
        (call it after the structural check passed)."""
        version = library.__version__
        if not self.newer_than_tested(library) or (self.package, version) in _warned:
            return
        _warned.add((self.package, version))
        warnings.warn(f"{fn}: {self.package} {version} is newer than the newest release clipshard was tested "
                      f"with ({_dotted(self.newest_tested)}.x); its structure passed clipshard's checks, so it is "
                      "patched, but please report problems", UserWarning, stacklevel=3)


# The supported ranges (docs/transformers.md and docs/open_clip.md say why these bounds; the CI
# matrix, `make test-matrix`, tests the oldest and the newest of each).
TRANSFORMERS = VersionPolicy("transformers", "transformers", "transformers", oldest=(4, 50), newest_tested=(5, 24))
OPEN_CLIP = VersionPolicy("open_clip", "open_clip_torch", "open_clip", oldest=(2, 26), newest_tested=(3, 3),
                          refused_from=(4, 0))
SENTENCE_TRANSFORMERS = VersionPolicy("sentence_transformers", "sentence-transformers", "sentence_transformers",
                                      oldest=(6, 0), newest_tested=(6, 2), refused_from=(7, 0))
