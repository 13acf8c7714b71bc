#!/usr/bin/env bash
# The one GPU check: on a CUDA machine, build clipshard from source against the machine's torch,
# run every CUDA test, run every benchmark on the GPU, and print a short summary last.
# Usage: benchmarks/gpu_check.sh [LOG_DIR]   (or GPU_CHECK_LOGS=DIR; default ./gpu_logs)
# Budget: under 8 minutes on one H200 with 16 cores. docs/gpu_check.md says how to run it.
set -uo pipefail
cd "$(dirname "$0")/.."
LOG_DIR=${1:-${GPU_CHECK_LOGS:-gpu_logs}}
PY=${PYTHON:-python3}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
status=0
start=$SECONDS
step() { echo "== $1 (t=$((SECONDS - start)) s)"; }

step "GPU"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG_DIR/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# Baselines the machine may lack (open_clip, whose import needs ftfy and wcwidth) travel as
# wheels in .whl/ (docs/gpu_check.md); they install into a scratch folder, never system-wide.
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/clipshard_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/clipshard_site"
fi
"$PY" -c "import open_clip" 2>/dev/null || echo "note: open_clip is not importable here; its baselines are skipped"

step "build (FORCE_CUDA=1)"
if ! MAX_JOBS=${MAX_JOBS:-16} TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} FORCE_CUDA=1 \
    timeout 240 "$PY" setup.py build_ext --inplace >"$LOG_DIR/build.log" 2>&1; then
  tail -n 80 "$LOG_DIR/build.log"; echo "BUILD FAILED"; exit 1
fi
grep -m1 -o "clipshard: building.*" "$LOG_DIR/build.log"

step "CUDA tests"
timeout 180 "$PY" -m pytest -q -m cuda -p no:cacheprovider tests >"$LOG_DIR/cuda_tests.log" 2>&1
[ $? -eq 0 ] || status=1
grep -E "^(FAILED|ERROR)" "$LOG_DIR/cuda_tests.log" | head -n 40
tail -n 1 "$LOG_DIR/cuda_tests.log"

step "benchmarks (CUDA)"
for bench in benchmarks/bench_*.py; do
  name=$(basename "$bench" .py)
  timeout 50 "$PY" "$bench" --device cuda --json "$LOG_DIR/$name.json" >"$LOG_DIR/$name.txt" 2>&1 \
    || { echo "$name FAILED or timed out (see $LOG_DIR/$name.txt)"; status=1; }
done

step "summary"
for table in "$LOG_DIR"/bench_*.txt; do echo "-- $(basename "$table" .txt)"; tail -n 20 "$table"; done
echo "-- CUDA tests: $(tail -n 1 "$LOG_DIR/cuda_tests.log")"
echo "-- total $((SECONDS - start)) s, status $status"
exit $status
