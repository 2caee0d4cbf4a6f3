#!/usr/bin/env bash
# Issue #32's device pass for torch_a2a on 2 GPUs (NCCL, world 2), under 4.5 minutes
# (PROBE_S + KERNELS_S + NCCL_S + BENCH_S, plus start-up):
#   probe    torch symmetric memory: rendezvous, a Triton kernel writing the peers' rows through a table of
#            base addresses, barrier, CUDA graph capture, its time next to all_to_all_single (decision 64)
#                                                                     -> OUT/probe_symm.log
#   kernels  the cuda plugin's torch_a2a kernels, compiled, byte for byte against the torch functions
#   nccl     the fused paths against the torch path, the direct-write exchange, capture and replay of the
#            graph-safe modes, overflow on one rank (NCCL world 2)    -> OUT/gpu_tests.log (both)
#   bench    128 and 4096 tokens/rank, DeepSeek-V3 sizes, bf16 and fp8, each stage next to raw
#            all_to_all_single of the same bytes: MODES (default: exact normal eager, and the fixed-capacity
#            modes in CUDA graphs with the collective and the direct exchange)
#                                                                     -> OUT/torch_a2a.json, OUT/bench.log
# Each phase runs under its own timeout; the JSON is rewritten after every case, so a phase cut
# short keeps what it measured.
# Usage (repo root): NCCL_NVLS_ENABLE=0 bash benchmarks/ep/run_torch_a2a_h100x2.sh OUT
set -o pipefail
OUT=${1:?usage: bash benchmarks/ep/run_torch_a2a_h100x2.sh OUT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

# (a phase whose time is 0 is skipped)
if [ "${PROBE_S:-20}" != 0 ]; then
  say "probe: symmetric memory (world 2)"
  timeout "${PROBE_S:-20}" python3 benchmarks/ep/probe_symm_mem.py --iters 10 > "$OUT/probe_symm.log" 2>&1
  echo "probe exit status $? (124: timed out)"
  grep -vE "^\s*$" "$OUT/probe_symm.log" | grep -vE "Warning|warn" | tail -8
fi
if [ "${KERNELS_S:-45}" != 0 ]; then
  say "kernels (one GPU, 8 workers)"
  timeout "${KERNELS_S:-45}" python3 -m pytest -q -p no:cacheprovider -n 8 plugins/cuda/tests/test_a2a_kernels.py \
    > "$OUT/gpu_tests.log" 2>&1
  echo "kernels exit status $? (124: timed out)"
fi
say "nccl tests -k '${NCCL_K:=fused or graph_safe or overflow}'"
timeout "${NCCL_S:-80}" python3 -m pytest -q -p no:cacheprovider tests/ep/test_torch_a2a_nccl.py -k "$NCCL_K" \
  >> "$OUT/gpu_tests.log" 2>&1
echo "nccl tests exit status $? (124: timed out)"
grep -E "passed|failed|error|FAILED|Error" "$OUT/gpu_tests.log" | tail -12

say "bench"
timeout "${BENCH_S:-140}" python3 benchmarks/ep/bench_torch_a2a.py --world 2 --iters "${ITERS:-10}" \
  --tokens ${TOKENS:-4096 128} --warmup "${WARMUP:-2}" --modes ${MODES:-normal-collective normal-direct normal-graph-collective normal-graph-direct \
  masked-graph-collective masked-graph-direct} \
  --json "$OUT/torch_a2a.json" > "$OUT/bench.log" 2>&1
echo "bench exit status $?"
grep -E '^\||Warning|Error' "$OUT/bench.log" | tail -24
say "done"
