#!/usr/bin/env bash
# One device pass on 2 GPUs of one host (nvidia-h100-x2) within a 10-minute command:
#   GPU 0: the CUDA plugin's GPU suite (pytest -m gpu; DeepEP's 2-GPU tests run in the DeepEP step);
#   GPU 1: `moe-core bench` (unquantized + fp8_block, the four presets), scored by vs_bar.py;
#   GPU 1 after the bench, with HF_S > 0: benchmarks/hf/bench_hf_models.py (HF_MODELS) for HF_S seconds;
#   then both GPUs: benchmarks/ep/run_deepep_h100x2.sh (DeepEP built from source: carry .deepep; DEEPEP=0 skips it).
# XDIST=N runs the GPU suite in N pytest-xdist workers on GPU 0 (its time is mostly compilation on the CPU).
# The kernel libraries (CUTLASS, DeepGEMM) and DeepEP compile on the CPU while the first steps start.
# Usage (repo root; carry .deepep and .whl):  bash benchmarks/run_h100x2_pass.sh OUT
# OUT gets at most 8 files: summary.txt and one tarball of every log and JSON (the device tool's limit).
set -u
out=${1:?usage: run_h100x2_pass.sh OUT}
mkdir -p "$out/logs"
logs=$(cd "$out/logs" && pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
t0=$(date +%s)
say() { echo "=== [$(( $(date +%s) - t0 ))s] $*" | tee -a "$out/summary.txt"; }
say "start $(git rev-parse --short HEAD 2>/dev/null)"
python3 -m pip install -q --no-deps --no-build-isolation -e . -e plugins/cuda > "$logs/install.log" 2>&1
python3 -m pip install -q --no-deps --no-index --find-links .whl nvidia-cutlass==4.2.0.0 sgl-deep-gemm==0.2.5 >> "$logs/install.log" 2>&1
[ "${DEEPEP:-1}" = 1 ] && (source .deepep/build.sh build > "$logs/deepep_build.log" 2>&1) &
python3 -c "from moe_plugin_cuda.cutlass import lib; print(lib.library())" > "$logs/cutlass_build.log" 2>&1 &
python3 -c "import torch; from moe_plugin_cuda.deepgemm import lib; print(lib.library(torch.cuda.get_device_properties(0).multi_processor_count))" > "$logs/deepgemm_build.log" 2>&1 &
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,power.draw --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  moe-core backends; } > "$logs/env.txt" 2>&1
say "installed; libraries building"
(CUDA_VISIBLE_DEVICES=0 timeout "${TESTS_S:-270}" python3 -m pytest plugins/cuda/tests -m gpu -v -p no:cacheprovider \
   ${XDIST:+-n "$XDIST"} -k "not deepep" --timeout 240 > "$logs/gpu_tests.log" 2>&1; echo "gpu tests rc=$?" >> "$logs/gpu_tests.log") &
tests=$!
(CUDA_VISIBLE_DEVICES=1 timeout "${BENCH_S:-270}" moe-core bench -- --json "$logs/bench.json" \
   --presets mixtral-8x7b qwen3-30b-a3b deepseek-v3 qwen3-235b-a22b --tokens ${BENCH_TOKENS:-1 16 64 256 1024 4096 16384} \
   --quant unquantized fp8_block --iters 10 --graph-max-tokens 16384 > "$logs/bench.log" 2>&1
 echo "bench rc=$?" >> "$logs/bench.log"
 python3 benchmarks/cuda/vs_bar.py "$logs/bench.json" > "$logs/bench.vs_bar.md" 2>&1
 if [ "${HF_S:-0}" -gt 0 ]; then
   CUDA_VISIBLE_DEVICES=1 timeout "$HF_S" python3 benchmarks/hf/bench_hf_models.py --out "$logs/hf" \
     --models "${HF_MODELS:-qwen3-30b-a3b,deepseek-v3}" > "$logs/hf.log" 2>&1; echo "hf rc=$?" >> "$logs/hf.log"
 fi) &
bench=$!
wait $tests; say "$(tail -3 "$logs/gpu_tests.log" | tr '\n' ' ')"
wait $bench; say "$(tail -1 "$logs/bench.log") $(tail -1 "$logs/bench.vs_bar.md")"
wait
[ -f "$logs/hf.log" ] && say "$(tail -1 "$logs/hf.log")"
if [ "${DEEPEP:-1}" = 1 ]; then
source .deepep/build.sh build >> "$logs/deepep_build.log" 2>&1 && say "deep_ep built" || say "deep_ep build FAILED"
left=$(( ${DEADLINE_S:-570} - ($(date +%s) - t0) ))  # the tarball below must be written before the call's limit
DEEPEP_BUDGET=${DEEPEP_BUDGET:-short} timeout "$left" bash benchmarks/ep/run_deepep_h100x2.sh "$logs/deepep" > "$logs/deepep_driver.log" 2>&1
say "deepep: $(grep 'cases passed' "$logs/deepep/summary.txt" | tail -1)"
fi
tar -C "$out" -czf "$out/logs.tgz" logs && rm -rf "$out/logs"
say "done"
