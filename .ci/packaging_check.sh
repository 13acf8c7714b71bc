#!/usr/bin/env bash
# The packaging check (docs/packaging.md), from the repository as cloned:
#  1. the sdist, built as `python -m build --sdist` does (isolated: no torch), holds exactly the
#     tracked files a build needs (.ci/check_dists.py);
#  2. a fresh venv that holds only torch (and ninja), linked from .venv's (.ci/torch_only_site.py,
#     no second torch install): an isolated `pip install` of the sdist stops with clipshard's
#     message in its first line; a wheel built from the sdist without isolation (CPU kernels only:
#     CI's CUDA build is the one `make setup` made) has the library, the package, no csrc/ or
#     tests/, and Requires-Dist torch==X.Y.* of .venv's torch; installed, `python -m clipshard`
#     runs from it outside the source tree; `pip check` accepts the pin;
#  3. `twine check` of both (the README renders as the long description).
# build and twine live in a throwaway venv of their own. Usage: .ci/packaging_check.sh [WORK_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
ROOT=$PWD
WORK=${1:-$(mktemp -d)}
start=$SECONDS
step() { echo "packaging_check: $1 ($((SECONDS - start)) s)"; }
rm -rf "$WORK/dist" "$WORK/wheel" "$WORK/tools" "$WORK/torch-only" "$WORK/torch-only-site"
mkdir -p "$WORK/dist" "$WORK/wheel"

python3 -m venv "$WORK/tools"
"$WORK/tools/bin/python" -m pip install -q --disable-pip-version-check build twine
step "the tools venv (build, twine) made"
"$WORK/tools/bin/python" -m build --sdist --outdir "$WORK/dist" . > "$WORK/sdist.log" 2>&1 \
  || { tail -n 30 "$WORK/sdist.log"; exit 1; }
SDIST=$(ls "$WORK"/dist/clipshard-*.tar.gz)
"$PY" .ci/check_dists.py sdist "$SDIST"
step "sdist built in isolation and checked"

"$PY" -m venv "$WORK/torch-only"
VPY=$WORK/torch-only/bin/python
"$VPY" -m pip uninstall -q -y setuptools  # a new venv's own (65 on Python 3.11) would shadow torch's
"$PY" .ci/torch_only_site.py "$WORK/torch-only-site" ninja
"$VPY" -c "import site; print('$WORK/torch-only-site', file=open(site.getsitepackages()[0] + '/torch_only.pth', 'w'))"
ln -s "$(cd "$(dirname "$PY")" && pwd)/ninja" "$WORK/torch-only/bin/ninja"  # ninja's binary; torch looks for it on PATH
export PATH=$WORK/torch-only/bin:$PATH
TORCH=$("$VPY" -c "import importlib.metadata as m; print(m.version('torch'))")  # as pip sees it: 2.14.1

if "$VPY" -m pip install -q --disable-pip-version-check --no-deps "$SDIST" > "$WORK/isolated.log" 2>&1; then
  echo "packaging_check: an isolated pip install of the sdist succeeded: expected clipshard's message"; exit 1
fi
grep -m1 -F "clipshard builds against the torch already installed (torch $TORCH for" "$WORK/isolated.log" \
  || { tail -n 30 "$WORK/isolated.log"; exit 1; }
step "the isolated install stopped with clipshard's message"

env -u FORCE_CUDA USE_CUDA=0 "$VPY" -m pip wheel -v --disable-pip-version-check --no-build-isolation --no-deps \
  "$SDIST" -w "$WORK/wheel" > "$WORK/wheel.log" 2>&1 || { tail -n 60 "$WORK/wheel.log"; exit 1; }
WHEEL=$(ls "$WORK"/wheel/clipshard-*.whl)
"$PY" .ci/check_dists.py wheel "$WHEEL" "$TORCH"
echo "packaging_check: $(basename "$WHEEL"), $(du -k "$WHEEL" | cut -f1) KiB"
step "CPU wheel built from the sdist and checked"

"$VPY" -m pip install -q --disable-pip-version-check --no-deps "$WHEEL"
"$VPY" -m pip check | grep -v "^No broken requirements" | grep -i clipshard && exit 1
cd "$WORK"
"$VPY" -c "import clipshard, sys; assert not clipshard.__file__.startswith(sys.argv[1]), clipshard.__file__" "$ROOT"
"$VPY" -m clipshard > "$WORK/self_check.log" 2>&1 || { tail -n 40 "$WORK/self_check.log"; exit 1; }
grep -m1 "built with torch" "$WORK/self_check.log"
cd "$ROOT"
step "installed wheel: python -m clipshard passed outside the source tree"

"$WORK/tools/bin/python" -m twine check --strict "$SDIST" "$WHEEL"
# The size of the library `make setup` built (CUDA kernels too under FORCE_CUDA=1), as in a wheel.
"$PY" -c "import glob, os, zlib
for path in glob.glob('clipshard/_C*.so'):
    data = open(path, 'rb').read()
    print(f'packaging_check: {path}: {len(data) / 2**20:.1f} MiB, {len(zlib.compress(data, 6)) / 2**20:.1f} MiB deflated as in a wheel')"
step "done"
