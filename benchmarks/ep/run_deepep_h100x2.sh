#!/usr/bin/env bash
# Every real-GPU check of the `deepep` dispatcher in one command, on 2 GPUs with DeepEP built
# (issue #30; `source .deepep/build.sh build` first, see ../shared/deepep/build.sh):
#     bash benchmarks/ep/run_deepep_h100x2.sh OUT
# Logs and deepep-h100x2.json go to OUT; each step has its own time limit (about 9 minutes in all)
# and a failing step does not stop the next. Prints a summary line per step.
set -u
out=${1:?usage: run_deepep_h100x2.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
run2() { timeout "$1" python3 -m torch.distributed.run --nproc-per-node 2 "${@:2}"; }
step() { echo "== $1: rc=$2 ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, deep_ep; print('torch', torch.__version__, 'deep_ep', deep_ep.__file__)"; } > "$out/summary.txt" 2>&1

# the CUTLASS experts' library compiles at first use (~1-2 min of CPU): build it beside the first steps
# (a file lock makes the layer checks wait for it if they reach cutlass first)
python3 -c "from moe_plugin_cuda import cutlass_lib as c; print(c.missing() or c.library())" > "$out/cutlass_build.log" 2>&1 &
run2 120 plugins/cuda/scripts/deepep_vs_torch_a2a.py > "$out/vs_torch_a2a.log" 2>&1; step "deepep_vs_torch_a2a" $?
run2 60 plugins/cuda/tests/emulation/deepep_fidelity.py > "$out/fidelity.log" 2>&1; step "fidelity (real deep_ep)" $?
run2 170 plugins/cuda/scripts/deepep_gpu_checks.py > "$out/gpu_checks.log" 2>&1; step "layer/graph/overlap" $?

# cases: the equivalence cases, the fidelity run, and every layer/graph/overlap check that ran
vs_line=$(grep -Eo '[0-9]+/[0-9]+ cases passed' "$out/vs_torch_a2a.log" | tail -1)
vs_pass=${vs_line%%/*}; vs_total=$(echo "$vs_line" | sed -E 's#[0-9]+/([0-9]+).*#\1#')
fid_pass=$(grep -c "fidelity ok" "$out/fidelity.log"); fid_pass=$(( fid_pass == 2 ? 1 : 0 ))
chk_pass=$(grep -c '^RESULT .*"status": "passed"' "$out/gpu_checks.log")
chk_total=$(grep '^RESULT' "$out/gpu_checks.log" | grep -vc '"status": "refused"')
passed=$(( ${vs_pass:-0} + fid_pass + chk_pass )); total=$(( ${vs_total:-18} + 1 + (chk_total > 0 ? chk_total : 8) ))
echo "cases passed $passed/$total" | tee -a "$out/summary.txt"

run2 150 benchmarks/ep/bench_deepep.py --out "$out/deepep-h100x2.json" --cases-passed "$passed" \
  --cases-total "$total" > "$out/bench.log" 2>&1; step "bench_deepep" $?
timeout 75 python3 - > "$out/kit.log" 2>&1 <<'PY'
from moe_core.testing import run_kit
from moe_core.testing.data import Shape
r = run_kit("cuda.deepep", ep_sizes=(2,), shape=Shape(8, 4, 2048, 128), ep_timeout_s=60)
print(r.text()); print("KIT", "ok" if r.ok else "FAILED", sum(x.status == "passed" for x in r.results), "passed of", len(r.results))
PY
step "conformance kit ep2" $?
grep -h "^ok\|^FAIL\|cases passed" "$out/vs_torch_a2a.log" | cut -c1-300 | tail -25
grep -h "^RESULT" "$out/gpu_checks.log" | cut -c1-400
grep -h "^KIT" "$out/kit.log"; cat "$out/summary.txt"
