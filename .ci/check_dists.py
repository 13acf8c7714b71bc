"""Checks clipshard's sdist and wheel (docs/packaging.md; .ci/packaging_check.sh runs it, and
tests/test_packaging.py the sdist part).

  python .ci/check_dists.py sdist DIST.tar.gz          its files are exactly the tracked files a build needs
  python .ci/check_dists.py wheel DIST.whl TORCH_VERSION  the compiled library and the Python package, no
                                                        csrc/ or tests/, Requires-Dist torch==X.Y.* of TORCH_VERSION
Prints what it counted; exits 1 with the problems.
"""
import email
import fnmatch
import os
import re
import subprocess
import sys
import tarfile
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The tracked paths (files or folders) a build from the sdist needs.
BUILD_NEEDS = ["pyproject.toml", "setup.py", "build_support.py", "MANIFEST.in", "README.md", "LICENSE", "clipshard",
               "csrc"]
# What setuptools writes into every sdist.
SDIST_GENERATED = ["PKG-INFO", "setup.cfg", "clipshard.egg-info/*"]


def tracked(paths):
    out = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def sdist_problems(path):
    """(problems, counts) of the sdist at `path` against `git ls-files` of BUILD_NEEDS."""
    with tarfile.open(path) as tar:
        names = {m.name.split("/", 1)[1] for m in tar.getmembers() if m.isfile()}
    generated = {n for n in names if any(fnmatch.fnmatch(n, p) for p in SDIST_GENERATED)}
    needed = tracked(BUILD_NEEDS)
    problems = [f"missing from the sdist: {n}" for n in sorted(needed - names)]
    problems += [f"in the sdist but not needed by the build: {n}" for n in sorted(names - generated - needed)]
    headers = [n for n in names if n.startswith("csrc/") and n.endswith((".h", ".cuh"))]
    counts = {"files": len(names), "tracked": len(names - generated), "csrc": sum(n.startswith("csrc/") for n in names),
              "headers": len(headers), "generated": len(generated)}
    return problems, counts


def wheel_problems(path, torch_version):
    """(problems, counts) of the wheel at `path`, built against torch `torch_version`."""
    with zipfile.ZipFile(path) as whl:
        names = set(whl.namelist())
        (metadata_name,) = [n for n in names if n.endswith(".dist-info/METADATA")]
        metadata = email.message_from_bytes(whl.read(metadata_name))
    problems = []
    libraries = [n for n in names if re.fullmatch(r"clipshard/_C\..*\.so", n)]
    if len(libraries) != 1:
        problems.append(f"expected one compiled library clipshard/_C.*.so, found {libraries}")
    python = tracked(["clipshard"])
    problems += [f"missing from the wheel: {n}" for n in sorted(python - names)]
    problems += [f"in the wheel but not part of the package: {n}" for n in sorted(names) if
                 n.startswith(("csrc/", "tests/", "benchmarks/", "examples/"))]
    release = ".".join(torch_version.split("+")[0].split(".")[:2])
    torch_requirements = [r for r in metadata.get_all("Requires-Dist", []) if re.match(r"torch\b", r)]
    if torch_requirements != [f"torch=={release}.*"]:
        problems.append(f"Requires-Dist for torch is {torch_requirements}, expected ['torch=={release}.*'] "
                        f"(the release line of torch {torch_version})")
    if not any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names):
        problems.append("the wheel has no LICENSE")
    for field in ("License", "Description-Content-Type"):
        if not metadata.get(field):
            problems.append(f"the metadata has no {field}")
    counts = {"files": len(names), "python": len(python & names), "libraries": len(libraries),
              "dist-info": sum(".dist-info/" in n for n in names), "torch": torch_requirements,
              "version": metadata["Version"]}
    return problems, counts


def main(argv):
    kind, path, *rest = argv
    problems, counts = sdist_problems(path) if kind == "sdist" else wheel_problems(path, *rest)
    print(f"{os.path.basename(path)}: {counts}")
    for problem in problems:
        print(f"  {problem}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
