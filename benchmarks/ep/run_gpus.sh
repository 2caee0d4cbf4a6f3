#!/usr/bin/env bash
# The device pass for torch_a2a on the GPUs of one host (NCCL, one process per GPU), in phases
# (each logs under OUT; one failing phase does not stop the others):
#   tests    the compiled layout functions vs eager on one GPU, then the NCCL scenarios (worlds 2
#            and 4, as many as the GPUs allow) and the slab ops           -> OUT/gpu_tests.log
#   bench    dispatch / combine vs raw all_to_all_single, 128 and 4096 tokens/rank, DeepSeek-V3
#            sizes, every mode and wire, world = the GPU count           -> OUT/bench/results.{json,md}
#   profile  4096 tokens/rank, normal (eager) and masked (CUDA graph): rank 0's kernel and host
#            tables after the timed runs                                 -> OUT/profile.log
#
# Usage (repo root): bash benchmarks/ep/run_gpus.sh OUT [phase ...]     (default: all; ~8 min on 2x H200)
# Keep NVLink multicast off (the lent machines set NCCL_NVLS_ENABLE=0; leave it so).
set -o pipefail
OUT=${1:-ep-results}; shift || true
PHASES=${*:-tests bench profile}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1 PYTHONPATH=.
WORLD=$(python3 -c "import torch; print(torch.cuda.device_count())")
ITERS=${ITERS:-20}
T0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - T0 ))s] $*"; }
FAILED=""

phase_tests() {
  # (the slab-ops tests carry no gpu mark: run them in the second call)
  { python3 -m pytest -q -p no:cacheprovider tests/ep/test_layout_compiled.py -m gpu &&
    python3 -m pytest -q -p no:cacheprovider tests/ep/test_torch_a2a_nccl.py tests/ep/test_masked_slab_ops.py; } \
    2>&1 | tee "$OUT/gpu_tests.log" | grep -E "passed|failed|error" | tail -5
}

phase_bench() {
  python3 benchmarks/ep/bench_torch_a2a.py --world "$WORLD" --iters "$ITERS" --out "$OUT/bench" 2>&1 \
    | grep -v '^{' | tee "$OUT/bench.log" | grep -E '^\||Warning' | tail -16
}

phase_profile() {
  python3 benchmarks/ep/bench_torch_a2a.py --world "$WORLD" --tokens 4096 --modes normal masked-graph \
    --profile --profile-iters 5 > "$OUT/profile.log" 2>&1
  tail -3 "$OUT/profile.log"
}

say "world $WORLD, phases: $PHASES"
for phase in $PHASES; do
  say "$phase"
  "phase_$phase" || FAILED="$FAILED $phase"
done
say "done; failed phases:${FAILED:- none}"
[ -z "$FAILED" ]
