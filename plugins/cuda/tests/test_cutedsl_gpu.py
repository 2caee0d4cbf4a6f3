"""The ``cutedsl`` experts on a real Blackwell GPU (SM100/SM103) with the real FlashInfer: the conformance
kit (EP_MASKED numerics vs the reference, T = 0/1/odd/large, bf16 and nvfp4 wire, garbage rows, repeat,
process_weights idempotent, CUDA-graph capture and replay). Skipped elsewhere (never run here: no Blackwell)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = pytest.mark.gpu


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and \
        torch.cuda.get_device_capability() in ((10, 0), (10, 3))


@pytest.mark.skipif(not _blackwell(), reason="needs an SM100/SM103 GPU")
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="pip install 'moe-plugin-cuda[flashinfer]'")
def test_conformance_kit_on_blackwell():
    from moe_core.testing import run_kit

    report = run_kit("cuda.cutedsl")
    print(report.text())
    assert report.ok, report.text()
    assert any(r.case_id == "graph-ep_masked" and r.status == "passed" for r in report.results), report.text()
