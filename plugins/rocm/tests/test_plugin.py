"""Packaging, specs, probes and plan-time checks of moe-plugin-rocm."""

from __future__ import annotations

import subprocess
import sys

import moe_plugin_rocm.platform as platform
import pytest
import rocm_emulation
from moe_plugin_rocm.plugin import AITER_SPEC, MORI_SPEC, check_aiter, check_mori, probe_aiter, probe_mori

from moe_core import Code, MoEConfig, PluginManager, QuantScheme, plan


def test_entry_point_discovery_and_specs():
    pm = PluginManager()
    assert any(r.name == "rocm" and r.status.ok for r in pm.records)
    aiter, mori = pm.spec("aiter"), pm.spec("mori")
    assert aiter.plugin == "rocm" and mori.plugin == "rocm"
    assert aiter.devices == {"rocm"} and mori.devices == {"rocm"}
    assert set(aiter.quant_schemes) == {QuantScheme.UNQUANTIZED, QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN}
    assert [str(f) for f in mori.formats] == ["ep_normal"] and mori.ep == "required"


def test_listing_imports_no_vendor_library():
    code = ("import sys; from moe_core import PluginManager; pm = PluginManager(); "
            "[s.name for s in pm.specs]; assert 'aiter' not in sys.modules and 'mori' not in sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_probes_not_installed():
    if "aiter" in sys.modules or "mori" in sys.modules:
        pytest.skip("a real aiter/mori is importable here")
    a, m = probe_aiter(), probe_mori()
    assert a.code is Code.NOT_INSTALLED and "aiter" in a.hint
    assert m.code is Code.NOT_INSTALLED and "mori" in m.hint


def test_probes_no_device_and_arch(monkeypatch):
    rocm_emulation.install(monkeypatch, "gfx942")  # packages present
    monkeypatch.setattr(platform, "query_device", lambda: (None, "PyTorch 2.x is not a ROCm build"))
    assert probe_aiter().code is Code.NO_DEVICE and probe_mori().code is Code.NO_DEVICE
    monkeypatch.setattr(platform, "query_device", lambda: ("gfx90a", ""))
    r = probe_aiter()
    assert r.code is Code.UNSUPPORTED_ARCH and "gfx942" in r.hint
    monkeypatch.setattr(platform, "query_device", lambda: ("gfx950", ""))
    assert probe_aiter().ok and probe_mori().ok


def test_real_device_query_on_this_machine():
    arch, reason = platform.device_reason()  # CPU-only torch here: NO_DEVICE, never an exception
    if arch is None:
        assert reason.code is Code.NO_DEVICE


def test_probe_load_error_keeps_traceback(monkeypatch):
    rocm_emulation.install(monkeypatch, "gfx942")
    monkeypatch.delitem(sys.modules, "aiter.fused_moe")  # the package exists, the submodule fails to import
    r = probe_aiter()
    assert r.code is Code.LOAD_ERROR and "aiter.fused_moe" in r.message and r.traceback


def test_probe_query_failure_is_not_raised(monkeypatch):
    rocm_emulation.install(monkeypatch, "gfx942")

    def boom():
        raise RuntimeError("hipErrorNoDevice")

    monkeypatch.setattr(platform, "query_device", boom)
    assert probe_aiter().code is Code.NO_DEVICE


def _cfg(**kw):
    base = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=256, device="rocm")
    return MoEConfig(**{**base, **kw})


def test_checks():
    assert check_aiter(_cfg(), AITER_SPEC) == []
    assert [r.code for r in check_aiter(_cfg(hidden_size=240), AITER_SPEC)] == [Code.UNSUPPORTED_SHAPE]
    assert [r.code for r in check_aiter(_cfg(intermediate_size=96, quant="fp8_block"), AITER_SPEC)] == \
        [Code.UNSUPPORTED_SHAPE]
    # per-token FP8 has no 128x128 blocks: only the 16x32 shuffle tiles constrain it
    assert check_aiter(_cfg(intermediate_size=96, quant="fp8_per_token"), AITER_SPEC) == []
    import torch

    assert check_aiter(_cfg(params_dtype=torch.float32), AITER_SPEC)[0].code is Code.UNSUPPORTED_SHAPE
    assert check_aiter(_cfg(apply_router_weight_on_input=True, top_k=1), AITER_SPEC)
    assert check_mori(_cfg(ep_size=2), MORI_SPEC)[0].code is Code.UNSUPPORTED_SHAPE
    assert check_mori(_cfg(ep_size=2, max_tokens_per_rank=8), MORI_SPEC) == []
    bad = _cfg(ep_size=2, max_tokens_per_rank=8, backend_options={"mori": {"combine_quant": "fp4_blockwise"}})
    assert check_mori(bad, MORI_SPEC)[0].code is Code.UNSUPPORTED_QUANT


def test_planner_picks_rocm_backends(emulated):
    pm = PluginManager()
    single = plan(_cfg(quant="fp8_block"), manager=pm)
    assert (single.dispatcher.name, single.experts.name, str(single.dispatch_dtype)) == ("standard", "aiter", "fp8")
    ep = plan(_cfg(ep_size=2, max_tokens_per_rank=16), manager=PluginManager())
    assert (ep.dispatcher.name, ep.experts.name, str(ep.format)) == ("mori", "aiter", "ep_normal")
    with pytest.raises(Exception) as err:  # explicit choice fails closed, with the reason
        plan(_cfg(hidden_size=240, experts="aiter"), manager=PluginManager())
    assert "divisible by 32" in str(err.value)
