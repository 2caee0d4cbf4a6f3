#!/usr/bin/env bash
# The device pass for moe-plugin-cuda on one H100, in phases (each logs under OUT; one failing
# phase does not stop the others):
#   install  pip install -e moe-core + the plugin + nvidia-cutlass and sgl-deep-gemm (headers), build the
#            CUTLASS and DeepGEMM libraries,
#            versions, nvidia-smi, `moe-core backends`
#   tests    pytest plugins/cuda/tests -m gpu                        -> OUT/gpu_tests.log
#   tune     moe-cuda-tune for TUNE_PRESETS x TUNE_QUANTS x TUNE_TOKENS -> CFG_DIR, OUT/tune.log
#            (TUNE_BACKEND=cutlass: the cutlass experts' tables)
#   bench    moe-core bench, 4 presets x 7 T x 3 quants, CFG_DIR      -> OUT/bench.json, OUT/bench.log
#            and the planner's pick against issue #5's bar (vs_bar.py) -> OUT/bench.vs_bar.md
#            (best of eager and CUDA-graph replay at every T, as the issue's SGLang bar is measured)
#   profile  PROFILE_CELL (default qwen3-30b-a3b fp8_block 4096): ncu (SOL, launch stats, occupancy) or torch.profiler,
#            registers/spills of the compiled GEMMs                  -> OUT/profile*.log
# The tuned JSON is saved to OUT/configs.tar at the end of every call (commit it into
# plugins/cuda/moe_plugin_cuda/configs/). CFG_DIR lives outside OUT so that a later call on the
# same (warm) machine still finds it.
#
# Usage (repo root): bash benchmarks/cuda/run_h100.sh OUT [phase ...]     (default: all phases)
# Under the 10-minute per-command limit, e.g.:
#   bash benchmarks/cuda/run_h100.sh $OUT install tests
#   TUNE_PRESETS="qwen3-30b-a3b mixtral-8x7b" bash benchmarks/cuda/run_h100.sh $OUT tune
#   TUNE_PRESETS="qwen3-235b-a22b deepseek-v3" bash benchmarks/cuda/run_h100.sh $OUT tune
#   bash benchmarks/cuda/run_h100.sh $OUT bench profile
set -o pipefail
OUT=${1:-bench-results}; shift || true
PHASES=${*:-install tests tune bench profile}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
CFG_DIR=${CFG_DIR:-/tmp/moe_cuda_configs}
TUNE_PRESETS=${TUNE_PRESETS:-qwen3-30b-a3b mixtral-8x7b qwen3-235b-a22b deepseek-v3}
BENCH_PRESETS=${BENCH_PRESETS:-mixtral-8x7b qwen3-30b-a3b deepseek-v3 qwen3-235b-a22b}
TOKENS="1 16 64 256 1024 4096 16384"
TUNE_TOKENS=${TUNE_TOKENS:-$TOKENS}      # e.g. "4096 16384": re-tune those T, keep the committed entries of the others
TUNE_QUANTS=${TUNE_QUANTS:-unquantized fp8_block}
TUNE_ARGS=${TUNE_ARGS:-}                 # e.g. --verbose: every candidate's time in the log
PROFILE_CELL=${PROFILE_CELL:-qwen3-30b-a3b fp8_block 4096}   # preset quant T (PROFILE_NCU=0: torch.profiler only)
BENCH_QUANTS=${BENCH_QUANTS:-unquantized fp8_block fp8_per_token}
BENCH_TOKENS=${BENCH_TOKENS:-$TOKENS}
mkdir -p "$CFG_DIR"
T0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
FAILED=""

phase_install() {
  python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cuda 2>&1 | grep -v -i warning | tail -3
  # CUTLASS headers for the cutlass experts (WHEELHOUSE: a folder holding the wheel, where pip has no index)
  python3 -m pip install -q --no-deps ${WHEELHOUSE:+--no-index --find-links "$WHEELHOUSE"} nvidia-cutlass==4.2.0.0 \
    sgl-deep-gemm==0.2.5 2>&1 | grep -v -i warning | tail -3
  # the cutlass experts compile their libraries at first use: do it here, timed, not inside a benchmark
  python3 -c "import time; t = time.time(); from moe_plugin_cuda.cutlass import lib as cutlass_lib; cutlass_lib.library(); \
print(f'cutlass library ready in {time.time() - t:.0f} s: {cutlass_lib.where()}')" 2>&1 | tail -5
  python3 -c "import time, torch; t = time.time(); from moe_plugin_cuda.deepgemm import lib as deepgemm_lib; \
deepgemm_lib.library(torch.cuda.get_device_properties(0).multi_processor_count); \
print(f'DeepGEMM library ready in {time.time() - t:.0f} s: {deepgemm_lib.where()}')" 2>&1 | tail -5
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
  moe-core backends 2>&1 | tee "$OUT/backends.txt"
}

phase_tests() {
  # TESTS_K: a pytest -k expression (e.g. cutlass) to run part of the suite
  python3 -m pytest plugins/cuda/tests -m gpu -q -p no:cacheprovider --timeout 600 ${TESTS_K:+-k "$TESTS_K"} 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -30
}

phase_tune() {
  cp -n plugins/cuda/moe_plugin_cuda/configs/*.json "$CFG_DIR"/  # the committed tables: tuning some T merges into them
  # shellcheck disable=SC2086
  moe-cuda-tune --out-dir "$CFG_DIR" --presets $TUNE_PRESETS --quant $TUNE_QUANTS --tokens $TUNE_TOKENS \
    --rep-ms "${TUNE_REP_MS:-20}" --backend "${TUNE_BACKEND:-triton}" $TUNE_ARGS 2>&1 | tee -a "$OUT/tune.log"
}

phase_bench() {
  # BENCH_TWO_ACC=1: GEMM1 on the two-accumulator fallback (if the one-accumulator epilogue fails on the device)
  # BENCH_TRITON_OPTS: more triton options, e.g. '"cutlass": false' (the Triton GEMMs at every T); BENCH_NAME: file stem
  local two=""; [ -n "$BENCH_TWO_ACC" ] && two=', "gemm1_two_acc": true'
  local extra=""; [ -n "$BENCH_TRITON_OPTS" ] && extra=", $BENCH_TRITON_OPTS"
  local name=${BENCH_NAME:-bench}
  # shellcheck disable=SC2086
  moe-core bench -- --json "$OUT/$name.json" --presets $BENCH_PRESETS --tokens $BENCH_TOKENS --quant $BENCH_QUANTS \
    --iters "${BENCH_ITERS:-10}" --graph-max-tokens 16384 \
    --backend-options "{\"triton\": {\"config_dir\": \"$CFG_DIR\"$two$extra}, \"cutlass\": {\"config_dir\": \"$CFG_DIR\"}}" 2>&1 | tee "$OUT/$name.log" | grep -v "^  \[" || return 1
  # the planner's pick against issue #5's bar (exit 1 there only says a bar is missed: not a failed phase)
  python3 benchmarks/cuda/vs_bar.py "$OUT/$name.json" > "$OUT/$name.vs_bar.md"; tail -1 "$OUT/$name.vs_bar.md"
}

phase_profile() {
  local cell; read -r -a cell <<< "$PROFILE_CELL"
  local args=(benchmarks/cuda/profile_triton.py --preset "${cell[0]}" --quant "${cell[1]}" --tokens "${cell[2]}" --config-dir "$CFG_DIR")
  python3 "${args[@]}" 2>&1 | tee "$OUT/profile_torch.log"
  if [ "${PROFILE_NCU:-1}" = 1 ] && command -v ncu >/dev/null 2>&1; then
    # 2 warm-up calls x 2 GEMMs skipped, then GEMM1 and GEMM2 of one call
    timeout 300 ncu --kernel-name regex:_moe_gemm_kernel --launch-skip 4 --launch-count 2 \
      --section SpeedOfLight --section LaunchStats --section Occupancy --section MemoryWorkloadAnalysis \
      python3 "${args[@]}" --iters 1 --no-torch-profiler 2>&1 | tee "$OUT/profile_ncu.log" | tail -120
  else
    echo "ncu skipped or not found: torch.profiler times and Triton's register/spill counts above are the profile"
  fi
}

for ph in $PHASES; do
  say "phase $ph"
  if ! "phase_$ph"; then
    say "phase $ph FAILED (continuing)"
    FAILED="$FAILED $ph"
  fi
done
# as a tar: the device tool does not bring back files whose names hold '=' or ','
tar -C "$CFG_DIR" -cf "$OUT/configs.tar" . 2>/dev/null
say "done; failed phases:${FAILED:- none}; configs in $OUT/configs.tar: $(ls "$CFG_DIR" 2>/dev/null | wc -l) files"
