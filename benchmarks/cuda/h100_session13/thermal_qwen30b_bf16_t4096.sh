#!/usr/bin/env bash
# qwen3-30b bf16 T=4096 (the planner's cutlass pick = the Triton kernels) timed on a cool GPU, then right after
# 90 s of sustained bf16 GEMM load, then after 60 s idle; nvidia-smi logs SM clock, power, temperature and
# throttle reasons every 250 ms meanwhile.
OUT=$1
nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv -lms 250 > "$OUT/smi.csv" & SMI=$!
cell() { echo "=== $(date +%T.%N | cut -c1-12) $1"; moe-core bench -- --presets qwen3-30b-a3b --quant unquantized \
  --tokens 4096 --backends cutlass triton --iters 10 --graph-max-tokens 16384 --json "$OUT/$1.json" 2>&1 | grep -E "cutlass|triton" | grep -v "^moe-core"; }
cell cool
echo "=== $(date +%T.%N | cut -c1-12) heat 90 s"
python3 -c "
import torch, time
a = torch.randn(8192, 8192, device='cuda', dtype=torch.bfloat16); b = torch.randn_like(a)
t = time.time(); n = 0
while time.time() - t < 90:
    for _ in range(20): a @ b
    torch.cuda.synchronize(); n += 20
print(f'{n} matmuls, {2 * 8192**3 * n / 90 / 1e12:.0f} TFLOP/s sustained')"
cell hot
echo "=== $(date +%T.%N | cut -c1-12) idle 60 s"; sleep 60
cell rested
kill $SMI
