#!/usr/bin/env bash
# Registers, spills, stack and shared memory of every CUDA kernel of clipshard, from ptxas -v: a
# register or spill regression shows here without a GPU. Usage: bash benchmarks/cuda_resources.sh
# [sm_arch, default 90] [source.cu ..., default every csrc/cuda/*.cu]. Needs nvcc (CUDA_HOME or the toolkit behind nvcc on PATH) and the venv's
# torch (PYTHON, default .venv/bin/python) for the headers. Takes a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${1:-90}
shift || true
SOURCES=("$@")
[ ${#SOURCES[@]} -gt 0 ] || SOURCES=(csrc/cuda/*.cu)
PY=${PYTHON:-.venv/bin/python}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# The toolkit and the include folders as setup.py finds them (behind wrapper scripts too; wheel
# headers only where the toolkit lacks them): its functions, not its setup() call.
eval "$(CUDA_HOME=${CUDA_HOME:-} "$PY" - "$OUT/wheel_headers" <<'EOF2'
import os, sys
from torch.utils import cpp_extension
namespace = {"__file__": "setup.py"}
exec(compile(open("setup.py").read().split("def build_extension")[0], "setup.py", "exec"), namespace)
home = os.environ.get("CUDA_HOME") or namespace["find_cuda_home"]() or ""
print(f"CUDA_HOME='{home}'")
if home:
    dirs = cpp_extension.include_paths() + [namespace["wheel_header_dir"](home, sys.argv[1])]
    print("INCLUDES='" + " ".join("-I" + d for d in dirs) + "'")
EOF2
)"
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "cuda_resources: no nvcc found (set CUDA_HOME)" >&2; exit 1; }
# shellcheck disable=SC2086  # INCLUDES is a list of -I flags
for source in "${SOURCES[@]}"; do
  "$CUDA_HOME/bin/nvcc" -std=c++20 -O3 --expt-relaxed-constexpr -arch="sm_$ARCH" -cubin -Xptxas -v \
    -Icsrc/include $INCLUDES -o "$OUT/$(basename "$source").cubin" "$source" > "$OUT/$(basename "$source").log" 2>&1 \
    || { cat "$OUT/$(basename "$source").log" >&2; exit 1; }
done
cat "$OUT"/*.log | "$PY" benchmarks/ptxas_table.py "sm_$ARCH"
