"""Makes FOLDER a folder of links to torch and the distributions it requires, recursively (plus any
named on the command line), from this interpreter's site-packages: a fresh venv with a .pth file
naming FOLDER then holds torch and nothing else of .venv, without installing torch again (several
GB). Used by .ci/packaging_check.sh.

  python .ci/torch_only_site.py FOLDER [EXTRA_DISTRIBUTION ...]
"""
import importlib.metadata as metadata
import os
import re
import sys


def closure(names):
    """The distributions `names` require (installed ones; markers aside, extras followed), themselves included."""
    seen, todo = {}, [(name, ()) for name in names]
    while todo:
        name, extras = todo.pop()
        name = re.sub(r"[-_.]+", "-", name).lower()
        if (name, extras) in seen:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue  # a requirement for another platform or Python
        seen[(name, extras)] = dist
        for requirement in dist.requires or []:
            extra = re.search(r"""extra\s*==\s*["']([^"']+)""", requirement)
            if extra is None or extra.group(1) in extras:
                found = re.match(r"([A-Za-z0-9._-]+)\s*(?:\[([^]]*)\])?", requirement)
                todo.append((found.group(1), tuple(sorted(e.strip() for e in (found.group(2) or "").split(",") if e))))
    return {dist.metadata["Name"]: dist for dist in seen.values()}.values()


def main(folder, *extra):
    os.makedirs(folder, exist_ok=True)
    for dist in closure(["torch", *extra]):
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".." and not f.parts[0].endswith(".pth")}:
            source, link = os.path.join(str(dist.locate_file("")), top), os.path.join(folder, top)
            if os.path.exists(source) and not os.path.lexists(link):
                os.symlink(source, link)


if __name__ == "__main__":
    main(*sys.argv[1:])
