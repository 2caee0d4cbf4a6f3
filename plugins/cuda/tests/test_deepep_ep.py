"""``deepep`` over real processes (gloo on 127.0.0.1) and the emulated DeepEP V1: the emulated ops,
deepep vs torch_a2a at world sizes 2 and 4, MoELayer end to end against the single-process reference,
and the conformance kit at EP world 2. Fresh data every run (the seed is in every failure message)."""

from __future__ import annotations

import random

import pytest
from deep_ep_worker import run_world

from moe_core.testing.data import Shape

_RESULTS: dict[int, list[dict]] = {}


def _world(world: int) -> list[dict]:
    """One spawned world per size runs every part (starting processes costs more than the checks)."""
    if world not in _RESULTS:
        parts = ["ops", "equivalence", "layer"] if world == 2 else ["equivalence", "layer"]
        _RESULTS[world] = run_world(world, parts, random.randrange(1 << 30), timeout=240)
    return _RESULTS[world]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
def test_emulated_ops_match_their_documentation():
    for r in _world(2):
        assert r["ops"]["checked"] == ["get_dispatch_layout", "dispatch-bf16", "dispatch-fp8", "combine",
                                       "clean_low_latency_buffer", "low_latency-bf16", "low_latency-fp8-hook",
                                       "low_latency-fp8-ue8m0", "fresh-result-tensors"]


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_deepep_matches_torch_a2a(world):
    """Normal and low-latency x BF16 and FP8 x uniform / skewed / empty-rank routing (-1 ids, a token
    routed nowhere), UE8M0 scales and the async API (BF16 and FP8: the emulation refuses a payload
    written after the ``previous_event`` DeepEP is given); the checks themselves are in
    ``scripts/deepep_vs_torch_a2a.py`` (failures raise in the workers)."""
    results = _world(world)
    for rank, r in enumerate(results):
        cases = r["equivalence"]["results"]
        assert len(cases) == 18
        seen = {(c["mode"], c["wire"], c["scenario"]) for c in cases}
        assert len(seen) == 12
        assert any(c.get("ue8m0") for c in cases) and any(c.get("async") for c in cases)
        if rank == 1:
            assert all(c["tokens"] == 0 for c in cases if c["scenario"] == "empty-rank")
        for c in cases:
            assert c["err_ref"] <= (3e-2 if c["wire"] == "fp8" else 1e-2), c


@pytest.mark.multiproc
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 4])
def test_layer_end_to_end_and_shared_buffer(world):
    """MoELayer(deepep x reference) vs the single-process reference layer (errors are asserted in the
    workers against 1e-2 bf16 / 3e-2 fp8); every layer shares one buffer, created once, sized for the
    largest low-latency layer although a smaller one called first, and normal / low-latency layers
    alternate on it (the low-latency part is cleaned after normal kernels ran)."""
    for r in _world(world):
        lay = r["layer"]
        assert {(c["format_planned"], c["wire"]) for c in lay["cases"]} == {
            ("ep_normal", "bf16"), ("ep_normal", "fp8"), ("ep_masked", "bf16"), ("ep_masked", "fp8")}
        assert lay["buffers"] == 1 and lay["low_latency_mode"] and lay["qps"] == 8 // world
        assert lay["rdma_bytes"] == lay["ll_need"] and lay["nvl_bytes"] > 0
        assert lay["calls"]["clean_low_latency_buffer"] >= 1


@pytest.mark.multiproc
@pytest.mark.timeout(400)
def test_conformance_kit_ep2(deepep_manager):
    """The conformance kit on ``cuda.deepep`` at EP world 2; spawned workers install the emulation
    through the kit's ``setup`` hook. H=2048: the low-latency kernels exist for a few sizes only."""
    from moe_core.testing import run_kit

    report = run_kit("cuda.deepep", manager=deepep_manager, setup="deep_ep_emulation:install_into_process",
                     device="cpu", device_kind="cuda", ep_sizes=(2,), shape=Shape(8, 4, 2048, 128),
                     ep_timeout_s=300)
    assert report.ok, report.text()
    passed = {r.case_id for r in report.results if r.status == "passed"}
    for fmt in ("ep_normal", "ep_masked"):
        for wire in ("bf16", "fp8"):
            for scenario in ("uniform", "skewed", "empty-rank"):
                assert f"dispatcher-ep2-{fmt}-{wire}-{scenario}" in passed, report.text()
    assert "honesty-unclaimed-wire-nvfp4" in passed, report.text()


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_low_latency_in_flight_limit():
    for rank, r in enumerate(run_world(2, ["in_flight"], random.randrange(1 << 30))):
        r = r["in_flight"]
        assert r["third"] and "in flight" in r["third"] and "#166" in r["third"], (rank, r)
        assert r["third_sync"] and "in flight" in r["third_sync"], (rank, r)
        assert r["same_counts"] and r["combined_rows"] == 5, (rank, r)



@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_low_latency_hot_path_and_checked_path_agree():
    for rank, r in enumerate(run_world(2, ["hot_path"], random.randrange(1 << 30))):
        r = r["hot_path"]
        assert all(r["same"].values()), (rank, r)
        assert "hidden_states must be" in r["errors"].get("hidden", ""), (rank, r)
        for refused in ("rows", "top_k"):  # DeepEP's own check first, and after the launch
            assert "topk.ids must be" in r["errors"].get(refused, ""), (rank, refused, r)
        assert "EPMaskedCombine.topk must be" in r["errors"].get("weights", ""), (rank, r)
        assert r["after_refusal"] and r["hot_path_ready"], (rank, r)


@pytest.mark.multiproc
@pytest.mark.timeout(200)
def test_async_normal_mode_orders_casts_after_the_callers_event():
    for rank, r in enumerate(run_world(2, ["async_events"], random.randrange(1 << 30))):
        assert r["async_events"] == {"same_dispatch": True, "same_combine": True}, (rank, r)
