#!/usr/bin/env bash
# Registers, spills and the resulting CTAs per SM of every CUDA kernel variant of clipshard, per
# architecture, from ptxas -v: a register or spill regression shows here without a GPU.
# Usage: bash benchmarks/cuda_resources.sh [ARCHS, default 80,90,100,120] [source.cu ..., default
# every csrc/cuda/*.cu]. Prints one markdown table (benchmarks/ptxas_table.py) headed by the date and
# the command; exits 1 if any kernel spills. Needs nvcc (CUDA_HOME or the toolkit behind nvcc on
# PATH) and the venv's torch (PYTHON, default .venv/bin/python) for the headers and torch's nvcc
# flags, so the figures are the build's. One device pass per file and architecture: several minutes
# on 2 cores for the whole matrix.
set -euo pipefail
cd "$(dirname "$0")/.."
COMMAND="bash benchmarks/cuda_resources.sh"
[ $# -eq 0 ] || COMMAND+=$(printf ' %q' "$@")
ARCHS=${1:-80,90,100,120}
shift || true
SOURCES=("$@")
[ ${#SOURCES[@]} -gt 0 ] || SOURCES=(csrc/cuda/*.cu)
PY=${PYTHON:-.venv/bin/python}
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
# The toolkit, the include folders and torch's own nvcc flags as setup.py's build gets them (behind
# wrapper scripts too; wheel headers only where the toolkit lacks them): its functions, not its setup() call.
eval "$(CUDA_HOME=${CUDA_HOME:-} "$PY" - "$OUT/wheel_headers" 2>/dev/null <<'EOF2'
import os, sys
from torch.utils import cpp_extension
namespace = {"__file__": "setup.py"}
exec(compile(open("setup.py").read().split("def build_extension")[0], "setup.py", "exec"), namespace)
home = os.environ.get("CUDA_HOME") or namespace["find_cuda_home"]() or ""
print(f"CUDA_HOME='{home}'")
if home:
    dirs = cpp_extension.include_paths() + [namespace["wheel_header_dir"](home, sys.argv[1])]
    print("INCLUDES='" + " ".join("-I" + d for d in dirs) + "'")
    print("TORCH_FLAGS='" + " ".join(cpp_extension.COMMON_NVCC_FLAGS) + "'")
EOF2
)"
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "cuda_resources: no nvcc found (set CUDA_HOME)" >&2; exit 1; }
for arch in ${ARCHS//,/ }; do
  for source in "${SOURCES[@]}"; do
    log="$OUT/$(basename "$source").$arch.log"
    # shellcheck disable=SC2086  # INCLUDES and TORCH_FLAGS are lists of flags
    "$CUDA_HOME/bin/nvcc" -std=c++20 -O3 -lineinfo $TORCH_FLAGS -DCLIPSHARD_WITH_CUDA=1 \
      -gencode "arch=compute_$arch,code=sm_$arch" -cubin -Xptxas -v -Icsrc/include $INCLUDES \
      -o "$OUT/$(basename "$source").$arch.cubin" "$source" > "$log" 2>&1 || { cat "$log" >&2; exit 1; }
  done
done
version=$("$CUDA_HOME/bin/nvcc" --version | grep -o "release [0-9.]*")
"$PY" benchmarks/ptxas_table.py --check "$OUT"/*.log \
  --title "$(date -u +%F), nvcc ${version#release }, \`$COMMAND\`. Cells: registers, CTAs per SM (from registers, threads and static shared memory)."
