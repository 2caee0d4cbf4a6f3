"""The emulated ``deep_ep`` reproduces DeepEP v1.2.1 where moe-core relies on it: the same cases
(``emulation/deepep_fidelity.py``) on the emulation (gloo, CPU) and, where the real ``deep_ep`` is
importable with 2 GPUs, on the real library (NCCL)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from deepep_fidelity import on_cpu

from moe_core.testing.world import run_gloo_world

HERE = pathlib.Path(__file__).resolve().parent


CHECKED = ["bf16", "fp8", "fp8-round", "fp8-round-ue8m0", "fresh-results", "runtime-wrapper", "normal-fp8-passthrough"]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_emulation_matches_deepep_contract():
    for r in run_gloo_world(on_cpu, 2, setup="deep_ep_emulation:install_into_process", timeout=240):
        assert r["emulated"] and r["checked"] == CHECKED, r
        assert not r["order_sorted"], "the emulation must shuffle the receive order (real DeepEP does not keep it)"


def _real_deep_ep() -> bool:
    return importlib.util.find_spec("deep_ep") is not None and torch.cuda.is_available() \
        and torch.cuda.device_count() >= 2


@pytest.mark.gpu
@pytest.mark.timeout(300)
@pytest.mark.skipif(not _real_deep_ep(), reason="needs the real deep_ep (built from source) and 2 GPUs")
def test_real_deepep_matches_the_same_cases():
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          str(HERE / "emulation" / "deepep_fidelity.py")], capture_output=True, text=True,
                         timeout=280, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert out.stdout.count("fidelity ok") == 2 and "'emulated': False" in out.stdout, out.stdout[-2000:]
    for name in CHECKED:
        assert name in out.stdout
