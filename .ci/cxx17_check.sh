#!/usr/bin/env bash
# The C++ sources as a user's build on the oldest supported torch sees them: compiled as C++17
# against the headers of pyproject's torch floor (torch>=X.Y: X.Y.0). torch up to 2.11 (the GPU
# check machine's) passes -std=c++17 to extensions where CI's torch passes -std=c++20, so a C++20
# construct, or an ATen call the floor lacks, would break those builds and pass CI's own
# (docs/gpu_check.md, "The C++ standard"). Each csrc/**/*.cpp, which between them include every
# shared header, goes through `g++ -std=c++17 -fsyntax-only` (no code generated), two at a time.
# The headers come from the floor's wheel (pip download, no install), kept in .venv-matrix.
# Usage: .ci/cxx17_check.sh           the C++ files (what CI runs: about 70 s on 2 cores)
#        .ci/cxx17_check.sh --cuda    also the .cu files, through nvcc's front ends (--cuda, -O0,
#                                     one virtual architecture: about 4 CPU-minutes more)
#        .ci/cxx17_check.sh --version the torch release it checks against
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
JOBS=${JOBS:-2}
FLOOR=$(sed -n 's/.*"torch *>= *\([0-9]*\.[0-9]*\)[^"]*".*/\1/p' pyproject.toml).0
if [ "${1:-}" = "--version" ]; then echo "$FLOOR"; exit 0; fi
start=$SECONDS
HEADERS=${CXX17_TORCH_HEADERS:-.venv-matrix/torch-$FLOOR-headers}
if [ ! -f "$HEADERS/torch/include/ATen/ATen.h" ]; then
  wheels=$(mktemp -d)
  "$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: "torch==$FLOOR" -d "$wheels"
  "$PY" - "$wheels" "$HEADERS" <<'EOF'
import glob, sys, zipfile
(wheel,) = glob.glob(f"{sys.argv[1]}/torch-*.whl")
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("torch/include/")])
EOF
  rm -rf "$wheels"
fi
T=$HEADERS/torch/include
PYINC=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
COMMON=(-DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C -Icsrc/include "-I$T" "-I$T/torch/csrc/api/include"
        "-I$PYINC")
echo "cxx17_check: torch $FLOOR headers ready in $((SECONDS - start)) s"
# torch's headers parsed once, into a precompiled header that every file then starts from (a file
# that gcc cannot use it for is parsed in full: slower, the same verdict)
pch=$(mktemp -d)
printf '#include <%s>\n' ATen/ATen.h ATen/Parallel.h ATen/ThreadLocalState.h torch/library.h > "$pch/torch_headers.h"
g++ -std=c++17 -fopenmp "${COMMON[@]}" -x c++-header "$pch/torch_headers.h" -o "$pch/torch_headers.h.gch"
# csrc/build_record.cpp's header, which setup.py writes into the build folder
"$PY" -c "import sys, build_support; build_support.write_build_record(sys.argv[1], 'cxx17-check', None)" "$pch"
find csrc -name '*.cpp' | sort | xargs -P "$JOBS" -I{} g++ -std=c++17 -fopenmp "${COMMON[@]}" -fsyntax-only "-I$pch" \
  -include "$pch/torch_headers.h" {}
rm -rf "$pch"
echo "cxx17_check: $(find csrc -name '*.cpp' | wc -l) C++ files compile as C++17 against torch $FLOOR" \
     "($((SECONDS - start)) s)"
if [ "${1:-}" = "--cuda" ]; then
  NVCC=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc
  # cuBLAS / cuSPARSE headers may come from torch's nvidia wheels: after the toolkit's, as in setup.py
  wheel_includes=$("$PY" -c "import glob, site
print(*sorted(glob.glob(site.getsitepackages()[0] + '/nvidia/*/include')))")
  for dir in $wheel_includes; do
    COMMON+=(-Xcompiler "-idirafter,$dir")
  done
  out=$(mktemp -d)
  for source in $(find csrc -name '*.cu' | sort); do
    "$NVCC" -std=c++17 -Xcompiler -fopenmp "${COMMON[@]}" --expt-relaxed-constexpr -arch=compute_80 -Xcicc -O0 \
      --cuda "$source" -o "$out/$(basename "$source").ii"
  done
  rm -rf "$out"
  echo "cxx17_check: $(find csrc -name '*.cu' | wc -l) CUDA files compile as C++17 against torch $FLOOR" \
       "($((SECONDS - start)) s)"
fi
