#!/usr/bin/env bash
# Issue 31's device pass on one H100 (or H200: the same chip), inside BUDGET_S seconds (default 340):
#   1. install this tree and the CUTLASS / DeepGEMM headers (WHEELHOUSE: a folder of their wheels); the cutlass
#      backend's libraries start building in the background
#   (GPU tests start first: TESTS_K below, bounded by TESTS_S seconds where given; with SWEEP they run alongside its
#   compile phase and end before it measures)
#   2. with SWEEP (decode_sweep.py argument sets separated by ";", e.g. "--presets qwen3-30b-a3b --quant fp8_block"):
#      SHARDS (default 3) parallel --warm-only processes per set compile the decode kernels' candidates, then each set is swept (configs, then
#      the layer with the decode kernels against the pipeline at SWEEP_TOKENS, default "1 2 4") and merged into the
#      package's H100 decode table, which everything after uses -> OUT/sweep_<i>.json, OUT/decode_table.json
#   3. parallel `decode.py --warm-only` processes fill Triton's kernel cache for every decode cell (and, with BASE,
#      for the T=1 cells of the tree in BASE) while the GPU tests of the decode path (TESTS_K, default the decode
#      kernels, the replay, the direct launcher and the triton and cutlass layers against the reference, in CUDA
#      graphs and under torch.compile; TESTS_K=none skips them) run on 4 xdist workers -> OUT/gpu_tests.log (stopped
#      when the warm phase ends)
#   4. decode.py at TOKENS (default "1 16 64") for BACKENDS (default "auto triton cutlass"), bf16 and FP8 block ->
#      OUT/decode-h100-<date>.{json,md}
#   5. host_time.py on this tree (T=1, sections) -> OUT/host_time.md; with BASE, host_time.py at T=1 on BASE (the
#      code before, imported through PYTHONPATH) -> OUT/host_time_base.md
#   6. with EXTRA_TOKENS, decode.py for the planner's pick at those T in what is left (rows printed, files in the logs)
#   7. with DECODE_AGAIN (decode.py argument sets separated by ";", e.g. "--own-tables-only --gpu h200-own"), decode.py
#      once more per set, the same cells (warmed in step 3 too) -> OUT/decode-<its tag>-<date>.{json,md};
#      DECODE_LEFT: the seconds step 4 leaves for them (default 30)
# TEST_FILES: the GPU tests' files (default: the decode path's and the layers', plugins/cuda/tests/test_*.py).
# Each phase gets what is left of the budget; the logs of the rest are in OUT/logs.tar.
# PRESETS (default all four): the presets of decode.py and host_time.py; QUANT (default both): decode.py's.
# Usage (repo root): WHEELHOUSE=DIR BASE=DIR SWEEP="..." bash benchmarks/cuda/decode_h100.sh OUT
set -o pipefail
OUT=${1:?usage: decode_h100.sh OUT}
mkdir -p "$OUT" /tmp/decode_logs
OUT=$(cd "$OUT" && pwd)
LOGS=/tmp/decode_logs
export PYTHONUNBUFFERED=1
BUDGET_S=${BUDGET_S:-340}
T0=$(date +%s)
left() { echo $(( BUDGET_S - ($(date +%s) - T0) )); }
until_left() { local s=$(( $(left) - $1 )); [ "$s" -lt 5 ] && s=5; echo "$s"; }  # seconds until $1 are left
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
PRESETS=${PRESETS:-mixtral-8x7b qwen3-30b-a3b qwen3-235b-a22b deepseek-v3}  # (of decode.py and host_time.py)
BENCH=$(pwd)/benchmarks/cuda

say install
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cuda 2>&1 | grep -v -i warning | tail -3
python3 -m pip install -q --no-deps ${WHEELHOUSE:+--no-index --find-links "$WHEELHOUSE"} nvidia-cutlass==4.2.0.0 \
  sgl-deep-gemm==0.2.5 2>&1 | grep -v -i warning | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,noheader

say "build the libraries"
python3 -c "import time, torch; t = time.time(); from moe_plugin_cuda.cutlass import lib; lib.library(); \
print(f'cutlass library ready in {time.time() - t:.0f} s')" > $LOGS/build_cutlass.log 2>&1 &
python3 -c "import time, torch; t = time.time(); from moe_plugin_cuda.deepgemm import lib; \
lib.library(torch.cuda.get_device_properties(0).multi_processor_count); \
print(f'DeepGEMM library ready in {time.time() - t:.0f} s')" > $LOGS/build_deepgemm.log 2>&1 &

TESTS_K=${TESTS_K:-test_decode or test_replay or test_launch or matches_reference or graph_capture or torch_compile}
if [ "$TESTS_K" != none ]; then  # (with SWEEP: alongside its compile phase, ended before it measures)
  say "GPU tests start (-k '$TESTS_K')"
  timeout "${TESTS_S:-$(until_left $(( ${WARM_LEFT:-190} + 5 )))}" python3 -m pytest plugins/cuda/tests/test_decode.py \
    plugins/cuda/tests/test_replay.py plugins/cuda/tests/test_launch.py plugins/cuda/tests/test_triton.py \
    plugins/cuda/tests/test_cutlass.py $TEST_FILES -m gpu -q -p no:cacheprovider -n ${TEST_WORKERS:-4} -k "$TESTS_K" > "$OUT/gpu_tests.log" 2>&1 &
  TESTS_PID=$!
fi

if [ -n "$SWEEP" ]; then
  say "decode kernels: compile the candidates, sweep, merge the decode table"
  TABLE=$(python3 -c "from moe_plugin_cuda.triton import tuning_configs as t; import torch; \
print(t.CONFIG_DIR / t.decode_table_name(torch.cuda.get_device_name()))")
  IFS=';' read -ra SETS <<< "$SWEEP"
  WARM=""
  for set in "${SETS[@]}"; do
    for i in $(seq 0 $(( ${SHARDS:-3} - 1 ))); do
      python3 "$BENCH/decode_sweep.py" $set --warm-only --shard $i/${SHARDS:-3} >> $LOGS/sweep_warm.log 2>&1 &
      WARM="$WARM $!"
    done
  done
  wait $WARM
  grep -c FAILED $LOGS/sweep_warm.log
  [ -n "$TESTS_PID" ] && wait "$TESTS_PID"  # (no test on the GPU while the sweep measures)
  n=0
  for set in "${SETS[@]}"; do
    timeout "$(until_left ${SWEEP_LEFT:-170})" python3 "$BENCH/decode_sweep.py" $set --tokens ${SWEEP_TOKENS:-1 2 4} \
      --json "$OUT/sweep_$n.json" --table "$TABLE" 2>&1 | grep -E "best|pairs|layer|FAILED|table" | cut -c1-220
    n=$((n + 1))
  done
  cp "$TABLE" "$OUT/decode_table.json"
fi

say "warm Triton's cache, GPU tests"

for p in $PRESETS; do
  (IFS=';' read -ra AGAIN <<< "$DECODE_AGAIN"
   for b in ${BACKENDS:-triton cutlass}; do
     for a in "" "${AGAIN[@]}"; do
       python3 "$BENCH/decode.py" --warm-only --presets "$p" --backends $b --tokens ${TOKENS:-1 16 64} \
         ${QUANT:+--quant $QUANT} $a; done; done
  ) > "$LOGS/warm_$p.log" 2>&1 &
done
if [ -n "$BASE" ]; then
  PYTHONPATH=$BASE:$BASE/plugins/cuda python3 "$BENCH/decode.py" --warm-only --tokens 1 \
    --backends triton grouped_mm cutlass > "$LOGS/warm_base.log" 2>&1 &

fi
while [ "$(left)" -gt ${WARM_LEFT:-190} ] && [ -n "$(jobs -rp)" ]; do sleep 2; done
say "warm done; still running (stopped now): $(jobs -rp | tr '\n' ' ')"
[ -n "$TESTS_PID" ] && wait "$TESTS_PID"  # (its own timeout ends it by now)
for pid in $(jobs -rp); do pkill -P "$pid"; kill "$pid"; done 2>/dev/null
tail -n 2 $LOGS/build_*.log; grep -h "FAILED\|cells in" $LOGS/warm_*.log | head -20
if [ -n "$TESTS_PID" ]; then
  say "GPU tests (-k '$TESTS_K')"; grep -h "FAILED\|ERROR\|Timeout\|passed\|failed" "$OUT/gpu_tests.log" | tail -n 25
fi

say decode
timeout "$(until_left ${DECODE_LEFT:-30})" python3 "$BENCH/decode.py" --presets $PRESETS --tokens ${TOKENS:-1 16 64} \
  --backends ${BACKENDS:-auto triton cutlass} ${QUANT:+--quant $QUANT} --out-dir "$OUT" 2>&1 | tail -n 70

if [ -n "$DECODE_AGAIN" ]; then
  IFS=';' read -ra AGAIN <<< "$DECODE_AGAIN"
  for a in "${AGAIN[@]}"; do
    say "decode ($a)"
    timeout "$(until_left 30)" python3 "$BENCH/decode.py" --presets $PRESETS --tokens ${TOKENS:-1 16 64} \
      --backends ${BACKENDS:-auto triton cutlass} ${QUANT:+--quant $QUANT} --out-dir "$OUT" $a 2>&1 | tail -n 70
  done
fi

say "host_time (this tree)"
HT_LEFT=3; [ -n "$BASE" ] && HT_LEFT=25; [ -n "$EXTRA_TOKENS" ] && HT_LEFT=35  # (what the phases after get)
timeout "$(until_left $HT_LEFT)" python3 "$BENCH/host_time.py" --presets $PRESETS --tokens 1 --sections 1 \
  --backends triton cutlass --json "$LOGS/host_time.json" > "$OUT/host_time.md" 2>$LOGS/host_time.err
grep -v "^<\!--   " "$OUT/host_time.md" | tail -n 40
grep -A 14 "qwen3-30b-a3b | unquantized | triton | 1 |" "$OUT/host_time.md" | head -n 15

if [ -n "$BASE" ]; then
  say "host_time (BASE)"
  PYTHONPATH=$BASE:$BASE/plugins/cuda timeout "$(until_left 3)" python3 "$BENCH/host_time.py" --tokens 1 \
    --json "$LOGS/host_time_base.json" > "$OUT/host_time_base.md" 2>$LOGS/host_time_base.err
  tail -n 40 "$OUT/host_time_base.md"
fi
if [ -n "$EXTRA_TOKENS" ]; then  # (what the budget leaves: the planner's pick at larger T, rows printed and in the logs)
  say "decode.py, the pick at T = $EXTRA_TOKENS"
  timeout "$(until_left 2)" python3 "$BENCH/decode.py" --tokens $EXTRA_TOKENS --backends auto --reps 10 \
    --out-dir "$LOGS/extra" 2>&1 | grep -E "graph|FAILED"
fi
tar -C $LOGS -cf "$OUT/logs.tar" . 2>/dev/null
say done
