"""The ``grouped_mm`` experts (``torch._grouped_mm`` / ``torch._scaled_grouped_mm``) on the GPU."""

from __future__ import annotations

import pytest
import torch
from cuda_layer_cases import check_compiled, check_graph_replay, check_matches_reference, needs_gpu

cuda = torch.cuda.is_available()


GROUPED_MM_QUANTS = ["unquantized", "fp8_per_token"]


@needs_gpu
@pytest.mark.parametrize("quant", GROUPED_MM_QUANTS)
@pytest.mark.parametrize("T", [0, 1, 7, 133, 1031])
def test_matches_reference(quant, T):
    check_matches_reference("grouped_mm", quant, T)


@needs_gpu
@pytest.mark.parametrize("quant", GROUPED_MM_QUANTS)
def test_cuda_graph_capture_replay(quant):
    check_graph_replay("grouped_mm", quant, {})


@needs_gpu
@pytest.mark.parametrize("quant", GROUPED_MM_QUANTS)
def test_torch_compile(quant):
    check_compiled("grouped_mm", quant, {})


@needs_gpu
def test_conformance_kit_on_the_gpu():
    """The conformance kit, as a vendor runs it, on this GPU (every scheme the backend declares)."""
    from moe_core.testing import run_kit

    report = run_kit("cuda.grouped_mm")
    print(report.text())
    assert report.ok, report.text()
    assert sum(r.status == "passed" for r in report.results) > 20
