#!/usr/bin/env bash
# One full pass on a CUDA machine: install, list backends, GPU tests, benchmark.
# Usage (from the repo root): bash benchmarks/cuda/run_h100.sh OUTDIR [bench args...]
set -o pipefail
OUT=${1:-bench-results}; shift || true
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cuda 2>&1 | grep -v -i warning | tail -3
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv
moe-core backends 2>&1 | tee "$OUT/backends.txt"
if [ -z "$SKIP_TESTS" ]; then
  python3 -m pytest plugins/cuda/tests -m gpu -q -p no:cacheprovider --timeout 600 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
fi
if [ -z "$SKIP_BENCH" ]; then
  moe-core bench -- --json "$OUT/bench.json" "$@" 2>&1 | tee "$OUT/bench.log" | grep -v "^  \[" 
fi
