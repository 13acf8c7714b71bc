#!/usr/bin/env bash
# Registers, spills, stack and shared memory of every CUDA kernel of clipshard, from ptxas -v: a
# register or spill regression shows here without a GPU. Usage: bash benchmarks/cuda_resources.sh
# [sm_arch, default 90]. Needs nvcc (CUDA_HOME or the toolkit behind nvcc on PATH) and the venv's
# torch (PYTHON, default .venv/bin/python) for the headers. Takes a few minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
ARCH=${1:-90}
PY=${PYTHON:-.venv/bin/python}
# The toolkit as setup.py finds it (behind wrapper scripts too): its search, not its setup() call.
CUDA_HOME=${CUDA_HOME:-$("$PY" - <<'EOF2'
namespace = {"__file__": "setup.py"}
exec(compile(open("setup.py").read().split("def decide_cuda")[0], "setup.py", "exec"), namespace)
print(namespace["find_cuda_home"]() or "")
EOF2
)}
[ -x "$CUDA_HOME/bin/nvcc" ] || { echo "cuda_resources: no nvcc found (set CUDA_HOME)" >&2; exit 1; }
INCLUDES=$("$PY" - <<'EOF2'
import glob, os, site
from torch.utils import cpp_extension
dirs = cpp_extension.include_paths()
for base in site.getsitepackages():
    dirs += glob.glob(os.path.join(base, "nvidia", "cu*", "include"))
print(" ".join("-I" + d for d in dirs))
EOF2
)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
for source in csrc/cuda/*.cu; do
  "$CUDA_HOME/bin/nvcc" -std=c++20 -O3 --expt-relaxed-constexpr -arch="sm_$ARCH" -cubin -Xptxas -v \
    -Icsrc/include $INCLUDES -o "$OUT/$(basename "$source").cubin" "$source" > "$OUT/$(basename "$source").log" 2>&1 \
    || { cat "$OUT/$(basename "$source").log" >&2; exit 1; }
done
cat "$OUT"/*.log | "$PY" benchmarks/ptxas_table.py "sm_$ARCH"
