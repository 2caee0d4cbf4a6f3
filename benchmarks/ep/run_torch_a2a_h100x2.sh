#!/usr/bin/env bash
# Issue #32's device pass for torch_a2a on 2 GPUs (NCCL, world 2), 5 minutes at most
# (PROBE_S + LAYOUT_S + GRAPH_S + BENCH_S):
#   probe  the wire codes of the compiled quantization against the core quantizer's, inductor's
#          approximate vs IEEE division (decision 57)                -> OUT/probe.log
#   tests  the graph-safe modes captured and replayed, then the dispatched layouts of every mode
#          (exact normal, worst-case normal, masked) on NCCL, received rows checked to 1e-6
#                                                                   -> OUT/gpu_tests.log
#   bench  128 and 4096 tokens/rank, DeepSeek-V3 sizes, bf16 and fp8: normal (eager), normal
#          worst-case (CUDA graph), masked (CUDA graph), each stage next to raw all_to_all_single
#          of the same bytes                                        -> OUT/torch_a2a-h100x2.json,
#                                                                      OUT/bench/results.{json,md}
# Each phase runs under its own timeout; the JSON is rewritten after every case, so a phase cut
# short keeps what it measured.
# Usage (repo root): bash benchmarks/ep/run_torch_a2a_h100x2.sh OUT
set -o pipefail
OUT=${1:?usage: bash benchmarks/ep/run_torch_a2a_h100x2.sh OUT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

say "probe: compiled wire codes vs the core quantizer (one GPU)"
timeout "${PROBE_S:-55}" python3 benchmarks/ep/wire_codes_probe.py > "$OUT/probe.log" 2>&1
echo "probe exit status $? (124: timed out)"
grep -E "differ|switch" "$OUT/probe.log"

# graph capture, then the layouts (which reuse its compiled kernels); each pytest under its own timeout
for t in "graph_safe:${GRAPH_S:-75}" "dispatch_layout:${LAYOUT_S:-75}"; do
  say "tests -k ${t%%:*} (NCCL world 2)"
  timeout "${t##*:}" python3 -m pytest -q -p no:cacheprovider tests/ep/test_torch_a2a_nccl.py -k "${t%%:*}" \
    >> "$OUT/gpu_tests.log" 2>&1
  echo "tests -k ${t%%:*}: exit status $? (124: timed out)"
done
grep -E "passed|failed|error|FAILED|assert" "$OUT/gpu_tests.log" | tail -8

say "bench"
timeout "${BENCH_S:-125}" python3 benchmarks/ep/bench_torch_a2a.py --world 2 --iters "${ITERS:-10}" \
  --modes normal normal-graph masked-graph --json "$OUT/torch_a2a-h100x2.json" --out "$OUT/bench" \
  > "$OUT/bench.log" 2>&1
echo "bench exit status $?"
grep -E '^\||Warning|Error' "$OUT/bench.log" | tail -16
say "done"
