"""``deepep`` on the real DeepEP with 2 GPUs (skipped elsewhere): the repo's device scripts run under
``torch.distributed.run`` and their verdicts asserted. ``benchmarks/ep/run_deepep_h100x2.sh`` runs
the same scripts (plus the benchmark) in one command and keeps their logs."""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (importlib.util.find_spec("deep_ep") is not None and torch.cuda.is_available()
         and torch.cuda.device_count() >= 2), reason="needs the real deep_ep (built from source) and 2 GPUs")]


def _run2(script: str, *args: str, timeout: int = 280) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.timeout(300)
def test_deepep_matches_torch_a2a_on_gpus():
    out = _run2("deepep_vs_torch_a2a.py")
    assert out.returncode == 0 and "18/18 cases passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.timeout(300)
def test_layer_per_experts_backend_graph_and_hook():
    """MoELayer(deepep x triton / grouped_mm / cutlass) against the single-GPU reference, a
    low-latency layer in a CUDA graph, the async receive hook: every check that ran passed (a
    combination the planner refuses, e.g. grouped_mm with FP8 block, is reported, not failed)."""
    out = _run2("deepep_gpu_checks.py")
    results = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    ran = [r for r in results if r["status"] != "refused"]
    assert any(r["check"] == "cuda_graph" for r in ran) and any(r.get("experts") == "triton" for r in ran), results
    hook = next(r for r in ran if r["check"] == "async_overlap")
    others = [r for r in ran if r is not hook]
    assert all(r["status"] == "passed" for r in others), [r for r in others if r["status"] != "passed"]
    assert hook.get("same_result"), hook
    if hook["status"] != "passed":  # seen on 2x H100: over NVLink the send kernel moves the data itself
        pytest.xfail(f"the receive hook hid no time: {hook}")


@pytest.mark.timeout(200)
def test_conformance_kit_ep2_on_gpus():
    out = subprocess.run([sys.executable, str(SCRIPTS / "deepep_kit_ep2.py")], capture_output=True, text=True,
                         timeout=190)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
