#!/usr/bin/env bash
# Every real-GPU check of the `deepep` dispatcher in one command, on 2 GPUs with DeepEP built
# (issue #30; `source .deepep/build.sh build` first, see ../shared/deepep/build.sh):
#     bash benchmarks/ep/run_deepep_h100x2.sh OUT
# Writes to OUT (8 files): summary.txt, vs_torch_a2a.log, fidelity.log, bench.log, deepep-h100x2.json,
# gpu_checks.log, kit.log, cutlass_build.log. Each step has its own time limit (at most 4.7 minutes in
# all with DEEPEP_BUDGET=short, 8 otherwise; most important first) and a failing step does not stop the next.
set -u
out=${1:?usage: run_deepep_h100x2.sh OUT}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
run2() { timeout "$1" python3 -m torch.distributed.run --nproc-per-node 2 "${@:2}"; }
step() { echo "== $1: rc=$2 ($(( $(date +%s) - t0 )) s)" | tee -a "$out/summary.txt"; }
t0=$(date +%s)
{ date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, deep_ep; print('torch', torch.__version__, 'deep_ep', deep_ep.__file__)"; } > "$out/summary.txt" 2>&1

# the CUTLASS experts' library compiles at first use (~1-2 min of CPU): build it beside the first steps
# (a file lock makes the layer checks wait for it if they reach cutlass first)
# (off cores 0-3: the bench pins each rank's Python thread to cores 2 and 3, and waits for the build)
pin=(); command -v taskset > /dev/null && [ "$(nproc)" -gt 6 ] && pin=(taskset -c "4-$(( $(nproc) - 1 ))")
"${pin[@]}" python3 -c "from moe_plugin_cuda.cutlass import lib as c; print(c.missing() or c.library())" > "$out/cutlass_build.log" 2>&1 &
build=$!
# per-step limits in seconds: at most 4.7 minutes in all with DEEPEP_BUDGET=short (~3.5 expected: the
# steps after the equivalence cases took about 16, 50, 49 and 19 s on 2x H100), 8 otherwise
if [ "${DEEPEP_BUDGET:-}" = short ]; then lim=(75 25 80 70 30); else lim=(120 40 120 120 75); fi
# torch_a2a is the reference there: its layout eagerly (same results) rather than compiled per case shape
TORCH_COMPILE_DISABLE=1 run2 "${lim[0]}" plugins/cuda/scripts/deepep_vs_torch_a2a.py > "$out/vs_torch_a2a.log" 2>&1
step "deepep_vs_torch_a2a" $?
run2 "${lim[1]}" plugins/cuda/tests/emulation/deepep_fidelity.py > "$out/fidelity.log" 2>&1; step "fidelity (real deep_ep)" $?
# a quiet host for the bench: the build (1-2 min of CPU; the steps above take about as long), 60 s at most
for _ in $(seq 60); do kill -0 "$build" 2> /dev/null || break; sleep 1; done
kill -0 "$build" 2> /dev/null; step "cutlass build finished before the bench (rc=1: yes)" $?
run2 "${lim[2]}" benchmarks/ep/bench_deepep.py --out "$out/deepep-h100x2.json" > "$out/bench.log" 2>&1; step "bench_deepep" $?
run2 "${lim[3]}" plugins/cuda/scripts/deepep_gpu_checks.py > "$out/gpu_checks.log" 2>&1; step "layer/graph/overlap" $?
timeout "${lim[4]}" python3 plugins/cuda/scripts/deepep_kit_ep2.py > "$out/kit.log" 2>&1; step "conformance kit ep2" $?

# cases: the equivalence cases, the fidelity run, every layer/graph/overlap check that ran, the kit
python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, pathlib, re, sys
out = pathlib.Path(sys.argv[1])
def read(name): return (out / name).read_text(errors="replace") if (out / name).exists() else ""
m = re.findall(r"(\d+)/(\d+) cases passed", read("vs_torch_a2a.log"))
passed, total = (int(m[-1][0]), int(m[-1][1])) if m else (0, 18)
passed, total = passed + (read("fidelity.log").count("fidelity ok") == 2), total + 1
checks = [json.loads(l[7:]) for l in read("gpu_checks.log").splitlines() if l.startswith("RESULT ")]
ran = [c for c in checks if c["status"] != "refused"]
passed, total = passed + sum(c["status"] == "passed" for c in ran), total + max(len(ran), 8)
kit = re.findall(r"KIT (\w+)", read("kit.log"))
passed, total = passed + (kit == ["ok"]), total + 1
path = out / "deepep-h100x2.json"
if path.exists():
    doc = json.loads(path.read_text())
    doc.update(cases_passed=passed, cases_total=total)
    path.write_text(json.dumps(doc, indent=1))
print(f"cases passed {passed}/{total}")
PY
grep -h "^ok\|^FAIL\|cases passed" "$out/vs_torch_a2a.log" | cut -c1-300 | tail -25
grep -h "fidelity ok" "$out/fidelity.log" | cut -c1-200
grep -h '^{"mode"' "$out/bench.log"
grep -h "^RESULT" "$out/gpu_checks.log" | cut -c1-300
grep -h "^KIT" "$out/kit.log"; cat "$out/summary.txt"
