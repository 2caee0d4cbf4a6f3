"""The conformance kit (``moe_core.testing``) on the npu backends that need an EP world, against
the emulated Ascend stack: ``deepep_npu`` (dispatcher) and ``fuseep`` (fused), each in a spawned
gloo world of 2 whose workers install the emulation through the kit's ``setup`` hook.
(``npu_gmm``, single-process, is run by tests/conformance/test_repo_plugins.py.)"""

from __future__ import annotations

import re

import pytest

from moe_core.testing import run_kit
from moe_core.testing.data import Shape

SETUP = "npu_emulation:install_into_process"  # tests/emulation, on sys.path (conftest) of every worker
FUSED_SHAPE = Shape.parse("8,4,512,1024")  # inside fused_deep_moe's limits (H >= 512, I >= 1024)
SCENARIOS = ("uniform", "skewed", "empty-rank")


def kit(backend: str, **options):
    from moe_core.plugins import PluginManager

    # the emulation is already in this process (the `ascend` fixture); `setup` is for the workers
    options = dict(dict(setup=SETUP, device="cpu", device_kind="npu", ep_sizes=(2,), ep_timeout_s=200), **options)
    return run_kit(backend, manager=PluginManager(), **options)


def statuses(report) -> dict[str, str]:
    return {r.case_id: r.status for r in report.results}


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_deepep_npu_passes_the_kit(ascend):
    report = kit("npu.deepep_npu")
    assert report.ok, report.text()
    got = statuses(report)
    for fmt in ("ep_normal", "ep_masked"):
        for wire in ("bf16", "int8"):
            for scenario in SCENARIOS:
                assert got[f"dispatcher-ep2-{fmt}-{wire}-{scenario}"] == "passed", report.text()


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_fuseep_passes_the_kit(ascend):
    report = kit("npu.fuseep", shape=FUSED_SHAPE)
    assert report.ok, report.text()
    got = statuses(report)
    for scenario in SCENARIOS:
        assert got[f"fused-ep2-int8_w8a8-{scenario}"] == "passed", report.text()
    assert got["honesty-unclaimed-quant-w4a4"] == "passed" and got["honesty-ep-required-rejects-ep1"] == "passed"


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_kit_fused_ep_cases_catch_a_wrong_fused_op(ascend):
    report = kit("npu.fuseep", shape=FUSED_SHAPE, setup="kit_faults:install_misweighted_fused",
                 select=("fused-ep2-int8_w8a8-uniform",))
    (result,) = report.results
    assert result.status == "failed", report.text()
    # the injected 10% weight error, give or take the INT8 noise (the message once read 0.09999)
    err = float(re.search(r"relative error ([0-9.e+-]+)", result.message).group(1))
    assert 0.08 <= err <= 0.12, report.text()
