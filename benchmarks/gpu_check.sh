#!/usr/bin/env bash
# The one GPU check: on a CUDA machine, build a clipshard wheel from source against the machine's
# torch and install it into a scratch folder, run the users' self-check (python -m clipshard) from
# that installed copy first, then every CUDA test and the CUDA
# benchmarks, and print a summary (also when killed).
# Usage: benchmarks/gpu_check.sh [LOG_DIR]   (or GPU_CHECK_LOGS=DIR; default ./gpu_logs)
# LOG_DIR ends with two files (a lent GPU machine returns few): summary.txt and gpu_check_logs.tar.gz,
# every log of the run under logs/ (the summary included); the logs are written to LOG_DIR/logs meanwhile.
# Budget: 8 minutes on one H200 with 16 cores (GPU_CHECK_BUDGET_S); every step has its own
# timeout, clipped to what is left, from the per-step estimates in docs/gpu_check.md (which says
# how to run it on a lent machine).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT_DIR=${1:-${GPU_CHECK_LOGS:-gpu_logs}}
LOG_DIR=$OUT_DIR/logs
PY=${PYTHON:-python3}
BUDGET_S=${GPU_CHECK_BUDGET_S:-480}
mkdir -p "$LOG_DIR"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
start=$SECONDS
status=0
RESULTS=()  # one line per step, printed by the summary

step() { echo "== $1 (t=$((SECONDS - start)) s)"; }
record() { RESULTS+=("$1"); }
# run_step LIMIT_S LOG COMMAND...: the command under min(LIMIT_S, time left); returns its status.
run_step() {
  local limit=$1 log=$2 left=$((BUDGET_S - (SECONDS - start)))
  shift 2
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "no time left" >"$log"; return 124; fi
  timeout "$limit" "$@" >"$log" 2>&1
}
# shellcheck disable=SC2329  # called by the EXIT trap
summary() {
  echo "== summary (t=$((SECONDS - start)) s of ${BUDGET_S} s)"
  for table in "$LOG_DIR"/bench_*.txt; do
    [ -f "$table" ] && { echo "-- $(basename "$table" .txt)"; grep -v "^USDT" "$table" | tail -n 22; }
  done
  [ -f "$LOG_DIR/bench_rank_sim.txt" ] && grep -E "^(chunked forward kernel|torch path /)" "$LOG_DIR/bench_rank_sim.txt"
  for line in "${RESULTS[@]}"; do echo "-- $line"; done
  echo "-- status $status"
}
# shellcheck disable=SC2329  # the EXIT trap: the summary, then the one archive of every log
finish() {
  summary | tee "$LOG_DIR/summary.txt"
  cp "$LOG_DIR/summary.txt" "$OUT_DIR/summary.txt"
  tar -czf "$OUT_DIR/gpu_check_logs.tar.gz" -C "$OUT_DIR" logs && rm -rf "$LOG_DIR"
  echo "gpu_check: logs in $OUT_DIR/gpu_check_logs.tar.gz, summary in $OUT_DIR/summary.txt"
}
trap finish EXIT
trap 'status=143; exit 143' TERM INT  # killed: the EXIT trap still writes the summary and the archive

step "GPU"
if ! found=$("$PY" -c "import torch, sys; print('torch', torch.__version__)
sys.exit(0 if torch.cuda.is_available() else 1)" 2>&1); then
  echo "gpu_check: torch.cuda.is_available() is false here ($(echo "$found" | tail -n 1)): this script checks" \
       "CUDA code and needs a GPU" | tee "$LOG_DIR/no_gpu.txt"
  status=2
  record "no CUDA device: nothing was checked"
  exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$LOG_DIR/gpu.txt"
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# What the machine may lack (ninja, open_clip with ftfy/wcwidth, pytest, numpy) travels as wheels
# in .whl/ (docs/gpu_check.md); they install into a scratch folder, never system-wide.
if ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/clipshard_site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/clipshard_site" PATH="/tmp/clipshard_site/bin:$PATH"
fi
for module in pytest numpy open_clip; do
  "$PY" -c "import $module" 2>/dev/null || { echo "missing: $module (bring it as a wheel in .whl/)"; record "missing: $module"; }
done

step "build (a wheel: FORCE_CUDA=1, ninja, the visible GPU's arch + PTX; installed into a scratch folder)"
if ! "$PY" -c "import ninja" 2>/dev/null && ! command -v ninja >/dev/null; then
  echo "missing: ninja (without it torch builds serially and the build cannot fit): bring it as a wheel in .whl/"
  record "BUILD not run: ninja missing"
  status=1
  exit 1
fi
# No TORCH_CUDA_ARCH_LIST unless the caller sets one: torch then builds for the visible GPU's
# architecture plus its PTX (CI's no-GPU build covers sm_80/90/100/120, tests/test_build_archs.py).
WHEELS=/tmp/clipshard_wheelhouse INSTALLED=/tmp/clipshard_installed
rm -rf "$WHEELS" "$INSTALLED"
# NVCC_APPEND_FLAGS (read by nvcc): ptxas' registers and spills of every kernel go into the build log.
if ! run_step 140 "$LOG_DIR/build.log" env MAX_JOBS="${MAX_JOBS:-16}" FORCE_CUDA=1 \
    NVCC_APPEND_FLAGS="${NVCC_APPEND_FLAGS:+$NVCC_APPEND_FLAGS }-Xptxas=-v" "$PY" -m pip wheel -v \
    --no-build-isolation --no-deps --no-index . -w "$WHEELS" \
    || ! "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$INSTALLED" "$WHEELS"/clipshard-*.whl \
    >>"$LOG_DIR/build.log" 2>&1; then
  tail -n 60 "$LOG_DIR/build.log"
  record "BUILD FAILED (see $LOG_DIR/build.log)"
  status=1
  exit 1
fi
# The tests import the source tree's clipshard (tests/ is a package): with the wheel's library.
cp "$INSTALLED"/clipshard/_C*.so clipshard/
grep -m1 -o "clipshard: building.*" "$LOG_DIR/build.log"
record "wheel: $(cd "$WHEELS" && ls clipshard-*.whl) ($(du -k "$WHEELS"/clipshard-*.whl | cut -f1) KiB)"
# Registers, spills and CTAs per SM of every kernel for this GPU's architecture: a spill fails the check.
if "$PY" benchmarks/ptxas_table.py --check "$LOG_DIR/build.log" >"$LOG_DIR/ptxas.txt" 2>&1; then
  record "ptxas: $(tail -n 1 "$LOG_DIR/ptxas.txt")"
else
  tail -n 1 "$LOG_DIR/ptxas.txt"
  record "PTXAS: $(tail -n 1 "$LOG_DIR/ptxas.txt")"
  status=1
fi
# torch up to 2.11 passes -std=c++17 to extensions, newer ones -std=c++20 (docs/gpu_check.md)
standard=$(grep -o -m1 -- "-std=c++[0-9]*" "$LOG_DIR/build.log" || echo "-std unknown")
record "build: ok in $((SECONDS - start)) s ($standard)"
# Which chunked-backward path this torch takes for 16-bit features (csrc/chunked/chunk_driver.h).
record "$("$PY" -c "import torch, clipshard
ok = torch.ops.clipshard._addmm_accepts_fp32_accumulator(torch.device('cuda'), torch.bfloat16)
print(f'torch {torch.__version__}: addmm.dtype_out with an fp32 accumulator on CUDA is',
      'accepted (no fp32 M x D buffer)' if ok else 'refused (fp32 M x D buffer path)')" 2>&1 | tail -n 1)"

step "self-check (python -m clipshard: what a user runs first; from the installed wheel, outside the tree)"
if run_step 20 "$LOG_DIR/self_check.txt" bash -c 'cd /tmp && exec "$@"' _ \
    env PYTHONPATH="$INSTALLED${PYTHONPATH#"$PWD"}" "$("$PY" -c "import sys; print(sys.executable)")" -m clipshard; then
  record "self-check: $(tail -n 1 "$LOG_DIR/self_check.txt")"
else
  cat "$LOG_DIR/self_check.txt"
  record "SELF-CHECK FAILED: $(grep -m1 -E "^(FAILED|PROBLEM)" "$LOG_DIR/self_check.txt" || tail -n 1 "$LOG_DIR/self_check.txt")"
  status=1
fi

step "first-use check (the check a user's first call of each CUDA kernel runs)"
if "$PY" -c "import pytest" 2>/dev/null; then
  if run_step 20 "$LOG_DIR/first_use.log" env CLIPSHARD_FIRST_USE_CHECK=1 "$PY" -m pytest -q -s -m cuda \
      -p no:cacheprovider tests/ops/test_first_use_check.py; then
    # Every kernel variant the probes verified (kernel, algorithm, device, dtypes [variant]), one a line.
    grep -o "first-use check [0-9.]* ms: .*" "$LOG_DIR/first_use.log" | sed "s/^first-use check [0-9.]* ms: //" \
      | tee "$LOG_DIR/first_use_variants.txt"
    record "first-use check: $(tail -n 1 "$LOG_DIR/first_use.log"); verified $(wc -l < \
      "$LOG_DIR/first_use_variants.txt") kernel variants x dtypes ($LOG_DIR/first_use_variants.txt); slowest probe: \
$(grep -o "first-use check [0-9.]* ms: .*" "$LOG_DIR/first_use.log" | sort -k3 -g | tail -n 1)"
  else
    grep -E "^(FAILED|ERROR)" "$LOG_DIR/first_use.log" | head -n 20
    record "FIRST-USE CHECK FAILED: $(tail -n 1 "$LOG_DIR/first_use.log")"
    status=1
  fi
else
  record "first-use check not run: pytest missing"
fi

step "determinism of the id paths (sample ids, both targets, hard negatives: two runs, bitwise)"
if run_step 20 "$LOG_DIR/determinism.log" env CLIPSHARD_FIRST_USE_CHECK=0 "$PY" -m pytest -q -s -m cuda \
    -p no:cacheprovider tests/ops/test_id_paths_repeat.py; then
  grep -o "determinism cuda .*" "$LOG_DIR/determinism.log" | tee "$LOG_DIR/determinism.txt"
  record "determinism: $(tail -n 1 "$LOG_DIR/determinism.log") ($LOG_DIR/determinism.txt)"
else
  grep -E "^(FAILED|ERROR)|determinism cuda" "$LOG_DIR/determinism.log" | head -n 20
  record "ID PATHS NOT DETERMINISTIC or not run: $(tail -n 1 "$LOG_DIR/determinism.log")"
  status=1
fi

step "CUDA tests"
if "$PY" -c "import pytest" 2>/dev/null; then
  # With the first-use check off, so that its fallback can never stand in for a kernel a test checks.
  run_step 140 "$LOG_DIR/cuda_tests.log" env CLIPSHARD_FIRST_USE_CHECK=0 "$PY" -m pytest -q -m cuda \
    -p no:cacheprovider tests --ignore=tests/ops/test_first_use_check.py \
    --ignore=tests/ops/test_id_paths_repeat.py || status=1
  grep -E "^(FAILED|ERROR)" "$LOG_DIR/cuda_tests.log" | head -n 40
  record "CUDA tests: $(tail -n 1 "$LOG_DIR/cuda_tests.log")"
else
  record "CUDA tests not run: pytest missing"
fi

step "compiled loss (torch.compile fullgraph, host reads per call, compiled vs eager time)"
if run_step 30 "$LOG_DIR/gpu_compile_check.txt" "$PY" benchmarks/gpu_compile_check.py; then
  record "compiled loss: $(grep -c " compiled: ok" "$LOG_DIR/gpu_compile_check.txt") of 2 ok; $(grep -m1 \
    "on_change'" "$LOG_DIR/gpu_compile_check.txt")"
else
  record "COMPILED LOSS CHECK FAILED or timed out (see $LOG_DIR/gpu_compile_check.txt)"
  status=1
fi

step "memory plans vs the CUDA allocator's peaks (clipshard.plan_memory, docs/scale.md)"
if run_step 40 "$LOG_DIR/gpu_plan_check.txt" "$PY" benchmarks/gpu_plan_check.py; then
  record "memory plans: $(tail -n 1 "$LOG_DIR/gpu_plan_check.txt")"
else
  grep -E "^OFF" "$LOG_DIR/gpu_plan_check.txt" | head -n 12
  record "MEMORY PLANS OFF or not run: $(tail -n 1 "$LOG_DIR/gpu_plan_check.txt")"
  status=1
fi

step "benchmarks (CUDA)"
# name and time limit; the rank simulation is the headline (M = 8192 vs K = 65536, D = 768, bf16).
# Limits: about 1.5-3x the per-step estimates of docs/gpu_check.md. With the checks before the
# build (~15 s), the addmm probe (~5 s), the self-check (20 s) and the first-use check (20 s): 15 +
# build 140 + 5 + 20 + 20 + tests 140 + benchmarks (35 + 25 + 45 + 20 + 15 = 140) = 480 s, the
# budget; bench_distill (DistillClipLoss vs open_clip's, B = 8192, bf16) comes last and runs in
# what is left, at most 25 s.
for entry in bench_rank_sim:35 bench_siglip:25 bench_loss:45 bench_optim:20 bench_stochastic_round:15 bench_distill:25; do
  name=${entry%%:*} limit=${entry##*:}
  [ -f "benchmarks/$name.py" ] || continue
  if run_step "$limit" "$LOG_DIR/$name.txt" "$PY" "benchmarks/$name.py" --device cuda --json "$LOG_DIR/$name.json"; then
    record "$name: ok"
  else
    record "$name: FAILED or timed out (see $LOG_DIR/$name.txt)"
    status=1
  fi
done
exit $status
