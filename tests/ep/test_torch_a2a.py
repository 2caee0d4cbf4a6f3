"""``torch_a2a`` on gloo: 2 and 4 spawned ranks on 127.0.0.1, each run under a hard timeout.

The ranks run ``worker.py`` scenarios and report numbers; the checks are here so a failure
names the case (``mode/wire/routing``), the rank and the seed (replay with MOE_EP_TEST_SEED).
"""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest

from moe_core import MoEConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import run_ranks, run_scenarios  # noqa: E402

pytestmark = pytest.mark.multiproc

# Tolerances against the single-process reference layer with the same wire dtype (both sides
# quantize identically; the rest is bf16 rounding and summation order).
TOL = {"bf16": 1e-2, "fp8": 3e-2, "int8": 3e-2}
# Against the single-process *bf16* reference the wire quantization itself shows: e4m3 keeps 3
# mantissa bits (about 3.7% relative error on these O(1) inputs), int8 per token about 1%.
TOL_VS_BF16 = {"bf16": 1e-2, "fp8": 6e-2, "int8": 3e-2}
SEED = int(os.environ.get("MOE_EP_TEST_SEED", "0")) or None
TIMEOUT = 150


# The scenarios without Triton run in one spawned world per world size, each test reading its own scenario's results:
# a rank's spawn, torch import and gloo init cost seconds of CPU, most of what these scenarios took one world each
SHARED = {2: ("layer", "comm", "ops", "input_rule", "errors", "layer_bad_ids", "mismatch", "overflow"),
          4: ("layer", "comm", "ops", "layer_bad_ids", "overflow")}
_SHARED_RESULTS: dict[int, dict] = {}


def shared_world(test):
    """A test reading ``shared_ranks``: under pytest-xdist on the worker that runs its world (``--dist loadgroup``), and
    with the time limit of the first one to run, which pays for the whole world."""
    return pytest.mark.xdist_group("torch_a2a_shared_worlds")(pytest.mark.timeout(TIMEOUT * len(SHARED[2]))(test))


def shared_ranks(scenario: str, world: int) -> list[dict]:
    """``run_ranks(scenario, world, ...)``'s results, from the one world that runs ``SHARED[world]``."""
    if world not in _SHARED_RESULTS:
        # (what every later test reads if this run never returns, e.g. cut by the test's timeout: no second try)
        _SHARED_RESULTS[world] = dict.fromkeys(SHARED[world], f"the world of {world} ranks running {SHARED[world]} "
                                                              "did not finish (see the first test that ran it)")
        _SHARED_RESULTS[world] = run_scenarios(SHARED[world], world, TIMEOUT * len(SHARED[world]), seed=SEED)
    results = _SHARED_RESULTS[world][scenario]
    if isinstance(results, str):
        raise AssertionError(results)
    return results


def _cases(results):
    for res in results:
        for name, case in res["cases"].items():
            yield f"rank {res['rank']} {name} (seed {res['seed']})", name, case


@shared_world
@pytest.mark.parametrize("world", [2, 4])
def test_layer_matches_single_process(world):
    """MoELayer + torch_a2a (normal and masked, bf16/fp8/int8 wire) == single-process reference."""
    results = shared_ranks("layer", world)
    seen = set()
    for where, name, case in _cases(results):
        mode, wire, routing = name.split("/")
        seen.add((mode, wire, routing))
        assert case["shape_ok"] and case["finite"], where
        assert case["err"] <= TOL[wire], f"{where}: rel err {case['err']:.3g} > {TOL[wire]}"
        assert case["err_vs_bf16"] <= TOL_VS_BF16[wire], f"{where}: rel err vs bf16 {case['err_vs_bf16']:.3g}"
    assert {m for m, _, _ in seen} == {"ep_normal", "ep_normal_worst_case", "ep_masked"}
    assert {w for _, w, _ in seen} == set(TOL)
    assert {r for _, _, r in seen} == {"uniform", "skewed", "zero_ranks", "idle", "full"}
    # T = 0 ranks really had no tokens, and some ranks did
    tokens = {(res["rank"], n): c["tokens"] for res in results for n, c in res["cases"].items()}
    assert tokens[(1, "ep_normal/bf16/zero_ranks")] == 0 and tokens[(0, "ep_normal/bf16/zero_ranks")] == 1
    assert all(tokens[(r, "ep_masked/int8/idle")] == 0 for r in range(world))


@pytest.mark.parametrize("world", [2, 4])
def test_fused_normal_matches_torch(world):
    """Every mode with the cuda plugin's fused kernels (decision 63; Triton's interpreter on the CPU): the
    received bytes, ids, weights and counts are the torch path's (masked: the slab's valid rows); combine's too."""
    pytest.importorskip("moe_plugin_cuda.triton.a2a", exc_type=ImportError)
    # world 4: the exact mode only (its rows depend on the world in the kernels; the fixed-capacity modes' slots
    # come from the torch layout), the interpreter being slow
    n = 0
    # (the interpreter runs every program in Python: ~2 minutes on two loaded cores)
    for where, _name, case in _cases(run_ranks("comm_fused" if world == 2 else "comm_fused_exact", world,
                                               3 * TIMEOUT, seed=SEED)):
        n += 1
        assert all(case["checks"].values()), f"{where}: differs in {[k for k, v in case['checks'].items() if not v]}"
        assert case["combine_same"] is not False and case["combine_err"] <= 1e-2, \
            f"{where}: combine differs (rel err {case['combine_err']:.3g})"
        assert case.get("ref_err", 0.0) <= TOL["bf16"], f"{where}: masked combine vs float64: {case['ref_err']:.3g}"
    assert n == world * (3 if world == 2 else 1) * 3 * 5  # every rank, mode, wire and routing


@pytest.mark.timeout(900)  # the Triton interpreter on two shared cores
def test_fused_direct_exchange_matches_torch():
    """Every mode with the plugin's direct exchanges (decision 66), emulated on gloo (the fixed-capacity rows in one
    reused receive buffer): the same bytes as the torch path, with another dispatch between each dispatch and its
    checks."""
    pytest.importorskip("moe_plugin_cuda.triton.a2a", exc_type=ImportError)
    n = 0
    for where, _name, case in _cases(run_ranks("comm_fused_direct", 2, 3 * TIMEOUT, seed=SEED)):
        n += 1
        assert all(case["checks"].values()), f"{where}: differs in {[k for k, v in case['checks'].items() if not v]}"
        assert case["combine_same"] is not False and case["combine_err"] <= 1e-2, \
            f"{where}: combine differs (rel err {case['combine_err']:.3g})"
        assert case.get("ref_err", 0.0) <= TOL["bf16"], f"{where}: masked combine vs float64: {case['ref_err']:.3g}"
    assert n == 2 * 3 * 2 * 5  # every rank, mode, wire (bf16, fp8) and routing


def test_direct_exchange_overflow_falls_back_on_every_rank():
    """Exact normal mode's direct exchange with one rank over max_tokens_per_rank (decision 66): every rank reads the
    overflow in the counts and moves the rows again by all_to_all_single; the result is the torch path's."""
    pytest.importorskip("moe_plugin_cuda.triton.a2a", exc_type=ImportError)
    for where, _name, case in _cases(run_ranks("direct_overflow", 2, 3 * TIMEOUT, seed=SEED)):
        assert all(case["checks"].values()), f"{where}: differs in {[k for k, v in case['checks'].items() if not v]}"


@shared_world
@pytest.mark.parametrize("world", [2, 4])
def test_dispatch_layout(world):
    """Dispatched layouts are exactly DeepEP's, and combine inverts them (stand-in float64 experts).

    Normal: each token once per destination rank, grouped by source rank in token order, local ids
    (-1 / weight 0 elsewhere), per-expert counts on device and host. Masked: masked_m per expert,
    valid rows = the wire-dequantized tokens in (source, token) order; rows past masked_m are NaN
    in the experts' output and must not leak; combine with a re-created TopK gives the same result.
    """
    results = shared_ranks("comm", world)
    n = 0
    for where, _name, case in _cases(results):
        n += 1
        assert case["shape_ok"], where
        assert all(case["checks"].values()), f"{where}: failed {[k for k, v in case['checks'].items() if not v]}"
        assert case["data_err"] <= 1e-6, f"{where}: received rows differ from the sent ones ({case['data_err']:.3g})"
        assert case["err"] <= 1e-2, f"{where}: combined output rel err {case['err']:.3g}"
    assert n == world * 3 * 3 * 5


@shared_world
@pytest.mark.parametrize("world", [2])
def test_errors(world):
    results = shared_ranks("errors", world)
    for res in results:
        c = res["cases"]
        assert c["overflow"]["raised"] and "max_tokens_per_rank=40" in c["overflow"]["message"], c["overflow"]
        # rank 0 had a bad id: every rank raises (no rank left waiting in a collective)
        assert c["bad_ids"]["raised"] and "rank(s) [0]" in c["bad_ids"]["message"], c["bad_ids"]
        assert c["bad_ids_masked"]["raised"] and "out of range [-1, 16)" in c["bad_ids_masked"]["message"], c
        assert c["overflow_worst_case"]["raised"] and "max_tokens_per_rank=40" in c["overflow_worst_case"]["message"]
        assert c["bad_ids_worst_case"]["raised"] and "out of range [-1, 16)" in c["bad_ids_worst_case"]["message"], c
        assert c["after_error"]["rows"] > 0
        assert c["bad_shape"]["raised"] and "[T, 256]" in c["bad_shape"]["message"]


@shared_world
@pytest.mark.parametrize("world", [2, 4])
def test_overflow_on_one_rank_raises_everywhere(world):
    """Masked capacity overflow on rank 0 only: every rank raises an error naming the limit, at
    once (well within the harness timeout, far below the process-group timeout of 30 min)."""
    for res in shared_ranks("overflow", world):
        c = res["cases"]["overflow_rank0"]
        assert c["raised"] and c["type"] == "ValueError", (res["rank"], c)
        assert "max_tokens_per_rank=40" in c["message"], c
        assert ("43 tokens on EP rank 0" in c["message"]) == (res["rank"] == 0), c
        assert c["seconds"] < 20, c


@shared_world
def test_host_syncs_and_kernel_counts():
    """Normal dispatch with exact buffers reads the host exactly once; with worst-case buffers
    (graph-safe, decision 56) never, masked mode never, combine never; the kernel and collective
    counts do not grow with the world size (no loops over ranks or experts)."""
    counts = {}
    for world in (2, 4):
        for res in shared_ranks("ops", world):
            for name, case in res["cases"].items():
                for stage, s in case.items():
                    where = f"world {world} rank {res['rank']} {name} {stage}"
                    syncs = 1 if (name.startswith("ep_normal/") and stage == "dispatch") else 0
                    assert s["host_syncs"] == syncs, f"{where}: {s['host_reads']} {s['sync_ops']}"
                    counts.setdefault((name, stage), set()).add((s["kernels"], s["collectives"]))
    for key, seen in counts.items():
        assert len(seen) == 1, f"{key}: (kernels, collectives) differ between ranks or worlds: {seen}"
    # exact normal mode's launches and collectives, counted on CPU (the quantizing wires run their
    # quantization eagerly here, one compiled call on CUDA): ceilings, so that a change adding some shows (decision 58)
    for key, most in {("ep_normal/bf16", "dispatch"): (22, 3), ("ep_normal/bf16", "combine"): (3, 1),
                      ("ep_normal/fp8", "dispatch"): (34, 3), ("ep_normal/int8", "dispatch"): (32, 3)}.items():
        ((kernels, collectives),) = counts[key]
        assert kernels <= most[0] and collectives <= most[1], f"{key}: {kernels} kernels, {collectives} collectives"


@shared_world
@pytest.mark.parametrize("world", [2, 4])
def test_layer_bad_id_on_one_rank_raises_on_every_rank(world):
    """Default check_ids on CPU: rank 0's bad id reaches every rank, in every dispatcher and mode."""
    for res in shared_ranks("layer_bad_ids", world):
        for name, c in res["cases"].items():
            if name.endswith("/after"):
                assert not c["raised"], (res["rank"], name, c)
                continue
            kind = "RuntimeError" if name.endswith("/async") else "ValueError"  # _assert_async's error
            assert c["raised"] and c["type"] == kind, (res["rank"], name, c)
            assert "[-1, 16)" in c["message"] and "rank" in c["message"], (res["rank"], name, c)
            assert c["seconds"] < 20, (res["rank"], name, c)


@shared_world
def test_ranks_with_different_layers_all_raise_at_build():
    results = shared_ranks("mismatch", 2)
    for res in results:
        c = res["cases"]
        assert not c["same"]["raised"], c["same"]
        for name, field in (("wire", "dispatch_dtype: rank 0 fp8, rank 1 int8"),
                            ("quant", "quant: rank 0 fp8_block, rank 1 unquantized"),
                            ("capacity", "max_tokens_per_rank: rank 0 40, rank 1 41"),
                            ("top_k", "top_k: rank 0 4, rank 1 3"), ("hidden", "hidden_size: rank 0 256, rank 1 384")):
            assert c[name]["raised"] and field in c[name]["message"], (res["rank"], name, c[name])
        failed = c["plan_fails_on_one_rank"]
        assert failed["raised"] and ("no_such_backend" in failed["message"]), (res["rank"], failed)


@shared_world
def test_every_dispatcher_takes_each_ranks_own_tokens():
    """The EP input rule does not depend on the plan (decision 43): standard and torch_a2a both give
    the single-process result on each rank's own tokens (different counts per rank, one rank empty)."""
    for res in shared_ranks("input_rule", 2):
        for name, c in res["cases"].items():
            assert c["shape_ok"] and c["err"] < TOL["bf16"], (res["rank"], name, c)


def test_kernel_registry_and_option(monkeypatch):
    """The fused-kernel seam (decision 63): a lazy registration that fails to import warns and leaves the torch
    path; a bad registration or option is refused, naming what it got."""
    from moe_core.distributed import torch_a2a as ta
    from moe_core.plugin_api import register_torch_a2a_kernels

    monkeypatch.setattr(ta, "_KERNELS", {})
    register_torch_a2a_kernels("cpu", "no_such_module_xyz:KERNELS")
    with pytest.warns(RuntimeWarning, match="no_such_module_xyz"):
        assert ta._kernels_for("cpu") is None
    assert ta._kernels_for("cpu") is None and ta._kernels_for("cuda") is None  # warned once, then the torch path
    with pytest.raises(TypeError, match="TorchA2AKernels"):
        register_torch_a2a_kernels("cpu", object())
    kernels = ta.TorchA2AKernels(layout=ta._normal_layout, pack=None, unpack=None, reduce=None)
    register_torch_a2a_kernels("cpu", kernels)
    assert ta._kernels_for("cpu") is kernels
    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                    backend_options={"torch_a2a": {"kernels": "triton"}})
    with pytest.raises(ValueError, match=r"\['kernels'\] must be one of \('auto', 'torch'\), got 'triton'"):
        ta.kernels_option(cfg)
    assert ta.kernels_option(dataclasses.replace(cfg, backend_options={"torch_a2a": {"kernels": "torch"}})) == "torch"


def test_exchange_option_and_the_per_size_choice(monkeypatch):
    """``exchange`` (decision 66): a bad value is refused naming it; "collective" and "direct" force the transport
    (direct only where the plugin's ``direct_ok`` says the group can take it); "auto" takes the direct writes per
    mode over ``DIRECT_CAPACITIES`` (exact mode only with ``max_tokens_per_rank`` set)."""
    import types

    from moe_core.distributed import torch_a2a as ta

    cfg = MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32,
                    backend_options={"torch_a2a": {"exchange": "nvshmem"}})
    with pytest.raises(ValueError, match=r"\['exchange'\] must be one of \('auto', 'collective', 'direct'\), "
                                         r"got 'nvshmem'"):
        ta.exchange_option(cfg)
    assert ta.exchange_option(dataclasses.replace(cfg, backend_options={})) == "auto"
    shipped = dict(ta.DIRECT_CAPACITIES)
    monkeypatch.setattr(ta, "DIRECT_CAPACITIES", {"exact": (256, None), "worst_case": (1, 128), "masked": (64, 512)})

    def direct(exchange, masked=False, worst_case=False, capacity=None, reachable=True, world=2):
        mode = "masked" if masked else "worst_case" if worst_case else "exact"
        d = types.SimpleNamespace(_direct_wanted=ta.direct_wanted(exchange, mode, capacity, world), group=None)
        kernels = types.SimpleNamespace(direct_ok=lambda group, device: reachable)
        return ta.TorchA2ADispatcher._direct_exchange(d, kernels, "cuda")

    assert direct("direct") and not direct("collective", masked=True, capacity=4096)
    assert not direct("direct", reachable=False) and not direct("auto", masked=True, capacity=64, reachable=False)
    assert direct("auto", masked=True, capacity=64) and not direct("auto", masked=True, capacity=63)
    assert direct("auto", masked=True, capacity=512) and not direct("auto", masked=True, capacity=513)
    assert direct("auto", worst_case=True, capacity=128) and not direct("auto", worst_case=True, capacity=4096)
    assert direct("auto", capacity=4096) and not direct("auto", capacity=128) and not direct("auto")
    assert not direct("auto", masked=True, capacity=64, world=1) and direct("direct", world=1)
    # the shipped table (decisions 66, 70): exact mode wherever max_tokens_per_rank is set, masked at every size,
    # worst-case normal up to 1024
    monkeypatch.setattr(ta, "DIRECT_CAPACITIES", shipped)
    assert all(direct("auto", capacity=c) and direct("auto", masked=True, capacity=c) for c in (1, 128, 4096))
    assert not direct("auto") and direct("auto", worst_case=True, capacity=1024)
    assert not direct("auto", worst_case=True, capacity=2048)
