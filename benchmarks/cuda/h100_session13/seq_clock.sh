#!/usr/bin/env bash
# The full bench's order for mixtral-8x7b and qwen3-30b-a3b bf16 (all CUDA backends), twice back to back,
# with nvidia-smi sampling SM clock / power / temperature every 100 ms: what the GPU runs at while the
# qwen3-30b bf16 T=4096 cell is timed inside the sequence.
OUT=$1
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader -lms 100 > "$OUT/seq_smi.csv" & SMI=$!
for run in 1 2; do
  echo "=== run $run start $(date +%s.%N)"
  moe-core bench -- --presets mixtral-8x7b qwen3-30b-a3b --quant unquantized --iters 10 --graph-max-tokens 16384 \
    --json "$OUT/seq_run$run.json" 2>&1 | grep -E "^\s+\[" 
done
kill $SMI
