#!/usr/bin/env bash
# The one GPU check: on a CUDA machine, build clipshard from source against the machine's torch,
# run every CUDA test, run the benchmarks on the GPU, and print a short summary last.
# Usage: benchmarks/gpu_check.sh [LOG_DIR]   (or GPU_CHECK_LOGS=DIR; default ./gpu_logs)
# Budget: under 8 minutes on one H200 with 16 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${1:-${GPU_CHECK_LOGS:-gpu_logs}}
PY=${PYTHON:-python3}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
step() { echo "== $1 ($(date +%T))"; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG_DIR/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

step "build (sm_90, FORCE_CUDA=1)"
if ! MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} FORCE_CUDA=1 \
    "$PY" setup.py build_ext --inplace >"$LOG_DIR/build.log" 2>&1; then
  tail -n 80 "$LOG_DIR/build.log"; echo "BUILD FAILED"; exit 1
fi
grep -m1 -o "clipshard: building.*" "$LOG_DIR/build.log"

step "CUDA tests"
timeout 300 "$PY" -m pytest -q -x -m cuda tests 2>&1 | tee "$LOG_DIR/cuda_tests.log" | tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "benchmarks (CUDA)"
for bench in benchmarks/bench_*.py; do
  name=$(basename "$bench" .py)
  timeout 120 "$PY" "$bench" --device cuda --json "$LOG_DIR/$name.json" >"$LOG_DIR/$name.txt" 2>&1 \
    || { echo "$name FAILED"; status=1; }
done

step "summary"
for table in "$LOG_DIR"/bench_*.txt; do echo "-- $(basename "$table" .txt)"; tail -n 25 "$table"; done
grep -E "passed|failed" "$LOG_DIR/cuda_tests.log" | tail -n 1
exit $status
