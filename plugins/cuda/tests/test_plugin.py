"""The plugin itself: its entry point and declarations, the probes and plan-time checks, the tuner's
registration, and what the planner picks on a GPU."""

from __future__ import annotations

import torch
from cuda_layer_cases import needs_gpu

from moe_core import MoEConfig, plan
from moe_core.backends import Code

cuda = torch.cuda.is_available()


def test_entry_point_and_specs():
    from moe_core.plugins import PluginManager

    pm = PluginManager()
    rec = {r.name: r for r in pm.records}
    assert rec["cuda"].status.ok
    names = {s.name for s in pm.specs if s.plugin == "cuda"}
    assert names == {"triton", "grouped_mm", "deepep", "cutedsl", "cutlass"}
    for s in pm.specs:
        if s.plugin == "cuda":
            r = pm.availability(s)  # probes never raise
            if not cuda:
                assert r.code in (Code.NO_DEVICE, Code.NOT_INSTALLED), r


def test_cutedsl_unsupported_arch_on_hopper(monkeypatch):
    from moe_plugin_cuda import probes

    monkeypatch.setattr(probes, "_cuda_capability", lambda: ((9, 0), None))
    r = probes.probe_cutedsl()
    assert r.code is Code.UNSUPPORTED_ARCH and "triton" in r.hint


def test_moe_core_tune_finds_the_cuda_tuner(capsys):
    """``moe-core tune`` lists the tuners plugins register (entry-point group ``moe_core.tuners``) and
    runs one with the arguments after ``--``."""
    from moe_core.cli import main

    assert main(["tune"]) == 0
    assert "cuda" in capsys.readouterr().out
    assert main(["tune", "cuda", "--", "--help"]) == 0
    assert "--presets" in capsys.readouterr().out
    assert main(["tune", "no-such-tuner"]) == 2
    assert "installed: cuda" in capsys.readouterr().err
    if not cuda:
        assert main(["tune", "cuda"]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_deepep_not_installed_hint():
    from moe_plugin_cuda import probes

    r = probes.probe_deepep()
    assert r.code is Code.NOT_INSTALLED and "DeepEP" in r.hint


def test_deepep_checks():
    from moe_plugin_cuda import probes

    from moe_core import MoEConfig

    cfg = MoEConfig(num_experts=18, top_k=2, hidden_size=1000, intermediate_size=64, ep_size=3, cuda_graph=True,
                    device="cuda")
    codes = [r.code for r in probes.check_deepep(cfg, None)]
    assert Code.UNSUPPORTED_PARALLEL in codes and codes.count(Code.UNSUPPORTED_SHAPE) >= 2


@needs_gpu
def test_planner_picks_on_this_gpu():
    from moe_plugin_cuda.probes import probe_cutlass

    for quant in ("unquantized", "fp8_block"):
        p = plan(MoEConfig(num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768, quant=quant,
                           device="cuda"))
        want = "cutlass" if probe_cutlass().ok else "triton"
        assert p.experts.name == want, p.explain()


@needs_gpu
def test_backends_listing_on_hopper():
    from moe_core.backends import Code
    from moe_core.plugins import PluginManager

    pm = PluginManager()
    verdict = {s.name: pm.availability(s) for s in pm.specs if s.plugin == "cuda"}
    assert verdict["triton"].ok and verdict["grouped_mm"].ok
    if torch.cuda.get_device_capability()[0] == 9:
        assert verdict["cutedsl"].code is Code.UNSUPPORTED_ARCH and verdict["cutedsl"].hint
        assert verdict["cutlass"].code in (Code.OK, Code.NOT_INSTALLED), verdict["cutlass"]
    assert verdict["deepep"].code in (Code.NOT_INSTALLED, Code.OK)


def test_moe_core_doctor_reports_the_cuda_vendor_packages(capsys):
    """The cuda backends declare the vendor packages they need (BackendSpec.packages), so
    ``moe-core doctor`` reports each one's version, or that it is absent, without importing it."""
    import json

    from moe_core.cli import main

    main(["doctor", "--json"])
    packages = json.loads(capsys.readouterr().out)["environment"]["packages"]
    assert {"triton", "deep_ep", "flashinfer", "cutlass_library", "deep_gemm"} <= set(packages)
    assert all(v is None or isinstance(v, str) and v for v in packages.values())  # a version, or absent
