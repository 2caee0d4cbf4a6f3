#!/usr/bin/env bash
# Issue #32's device pass for torch_a2a on 2 GPUs (NCCL, world 2), about 5 minutes (the phases' timeouts):
#   probe    torch symmetric memory: rendezvous, a Triton kernel writing the peers' rows through a table of
#            addresses, barrier, CUDA graph capture, its time next to all_to_all_single (decision 66)
#                                                                     -> OUT/probe_symm.log   (PROBE_S, 0: skipped)
#   kernels  the cuda plugin's torch_a2a kernels, compiled, byte for byte against the torch functions (KERNELS_S)
#   direct   the fused paths with the direct-write exchanges against the torch path, and the overflow fallback
#            (NCCL world 2; CUDA_LAUNCH_BLOCKING=1 names a faulting launch, slower) (DIRECT_S)
#   graph    capture and replay of the graph-safe modes, collective and direct exchange (GRAPH_S)
#                                                                     -> OUT/gpu_tests.log
#   bench    DeepSeek-V3 sizes, bf16 and fp8, each stage next to raw all_to_all_single of the same bytes, in three
#            runs (the direct exchanges last in each, so that a failure there keeps the rest):
#            A 4096 tokens: normal-torch, exact normal with the collective and the direct exchange, masked (BENCH_A_S)
#            B 128 tokens: the graph-safe modes, collective and direct; exact normal both ways    (BENCH_B_S)
#            C 4096 tokens: the graph-safe modes with the direct exchange                          (BENCH_C_S)
#                                                                     -> OUT/torch_a2a-{A,B,C}.json, OUT/bench.log
# Usage (repo root): NCCL_NVLS_ENABLE=0 bash benchmarks/ep/run_torch_a2a_h100x2.sh OUT
set -o pipefail
OUT=${1:?usage: bash benchmarks/ep/run_torch_a2a_h100x2.sh OUT}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=. TORCHINDUCTOR_COMPILE_THREADS=1  # (no compile-worker pool per process)
T0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }

if [ "${PROBE_S:-0}" != 0 ]; then
  say "probe: symmetric memory (world 2)"
  timeout "$PROBE_S" python3 benchmarks/ep/probe_symm_mem.py --iters 10 > "$OUT/probe_symm.log" 2>&1
  echo "probe exit status $? (124: timed out)"
  grep -E "rows|torch" "$OUT/probe_symm.log" | tail -10
fi
if [ "${KERNELS_S:-55}" != 0 ]; then
  say "kernels (one GPU, 8 workers)"
  timeout "${KERNELS_S:-55}" python3 -m pytest -q -p no:cacheprovider -n 8 plugins/cuda/tests/test_a2a_kernels.py \
    >> "$OUT/gpu_tests.log" 2>&1
  echo "kernels exit status $? (124: timed out)"
fi
say "direct exchanges (NCCL world 2)"
timeout "${DIRECT_S:-60}" python3 -m pytest -q -p no:cacheprovider \
  tests/ep/test_torch_a2a_nccl.py -k "fused_direct" >> "$OUT/gpu_tests.log" 2>&1
echo "direct tests exit status $? (124: timed out)"
say "graph capture (NCCL world 2)"
timeout "${GRAPH_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/ep/test_torch_a2a_nccl.py -k "graph_safe" \
  >> "$OUT/gpu_tests.log" 2>&1
echo "graph tests exit status $? (124: timed out)"
grep -E "passed|failed|FAILED|Error|error:" "$OUT/gpu_tests.log" | cut -c1-300 | tail -16

bench() {  # name, timeout, tokens, modes...
  local name=$1 secs=$2 tokens=$3
  shift 3
  say "bench $name: $tokens tokens, $*"
  timeout "$secs" python3 benchmarks/ep/bench_torch_a2a.py --world 2 --iters "${ITERS:-8}" --warmup "${WARMUP:-2}" \
    --tokens $tokens --modes "$@" --json "$OUT/torch_a2a-$name.json" >> "$OUT/bench.log" 2>&1
  echo "bench $name exit status $?"
}
bench A "${BENCH_A_S:-45}" 4096 normal-torch normal-collective masked-graph-collective normal-direct
bench B "${BENCH_B_S:-40}" 128 normal-graph-collective masked-graph-collective normal-collective normal-graph-direct \
  masked-graph-direct normal-direct
bench C "${BENCH_C_S:-30}" 4096 masked-graph-direct normal-graph-direct
grep -E "Error|error" "$OUT/bench.log" | cut -c1-200 | tail -6
python3 - "$OUT" <<'PY'
import glob, json, sys
for f in sorted(glob.glob(sys.argv[1] + "/torch_a2a-*.json")):
    for r in json.load(open(f)).get("rows", []):
        what = f"{r['us']:.1f} us {r['ratio']:.0%}" if "us" in r else "failed: " + str(r.get("error", ""))[-100:]
        print(r["tokens_per_rank"], r["mode"], r["wire"], r.get("stage", ""), what)
PY
say "done"
