"""Discovery, availability probes and dry-run planning of the npu plugin (CPU only, no emulation needed
for planning: the issue's "how it will be checked" items)."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
from moe_plugin_npu import probes

from moe_core.backends import Code, Role
from moe_core.config import MoEConfig
from moe_core.planner import PlanError, plan
from moe_core.plugins import PluginManager


def npu_config(**kw) -> MoEConfig:
    base = dict(num_experts=64, top_k=8, hidden_size=4096, intermediate_size=1536, ep_size=8,
                max_tokens_per_rank=128, device="npu")
    base.update(kw)
    return MoEConfig(**base)


@pytest.fixture(scope="module")
def pm():
    return PluginManager()


def reasons_of(p_or_err, name: str) -> list:
    return [r for rej in p_or_err.rejected if rej.experts.endswith(name) for r in rej.reasons]


# --------------------------------------------------------------------------- discovery


def test_entry_point_registers_three_backends(pm):
    record = next(r for r in pm.records if r.name == "npu")
    assert record.status.ok, record.status
    specs = {s.name: s for s in pm.specs if s.plugin == "npu"}
    assert {n: s.role for n, s in specs.items()} == {
        "npu_gmm": Role.EXPERTS, "deepep_npu": Role.DISPATCHER, "fuseep": Role.FUSED}
    assert all(s.devices == frozenset({"npu"}) for s in specs.values())


def test_plugin_import_does_not_import_vendor_libraries():
    code = ("import sys, moe_plugin_npu.plugin as p; p.plugin.backends(); "
            "print(sorted(m for m in ('torch_npu', 'deep_ep') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


# --------------------------------------------------------------------------- planning (dry run)


def test_fuseep_chosen_for_w8a8_int8_with_ep(pm):
    p = plan(npu_config(quant="int8_w8a8"), manager=pm, dry_run=True)
    assert (p.experts.name, p.dispatcher, str(p.dispatch_dtype)) == ("fuseep", None, "int8")
    assert p.dtype_trail[-1].source == "npu"


@pytest.mark.parametrize("quant", ["unquantized", "w4a4"])
def test_fuseep_rejected_for_other_schemes_and_bf16_dispatch(pm, quant):
    p = plan(npu_config(quant=quant), manager=pm, dry_run=True)
    assert (p.dispatcher_name, p.experts.name, str(p.dispatch_dtype)) == ("deepep_npu", "npu_gmm", "bf16")
    quant_reasons = [r for r in reasons_of(p, "fuseep") if r.code is Code.UNSUPPORTED_QUANT]
    assert quant_reasons and "int8_w8a8" in quant_reasons[0].hint


def test_w8a8_int8_dispatch_without_ep(pm):
    p = plan(npu_config(quant="int8_w8a8", ep_size=1), manager=pm, dry_run=True)
    assert (p.dispatcher_name, p.experts.name, str(p.dispatch_dtype)) == ("standard", "npu_gmm", "int8")
    assert any(r.code is Code.UNSUPPORTED_PARALLEL for r in reasons_of(p, "fuseep"))


def test_masked_format_when_graph_safe_plan_is_required(pm):
    p = plan(npu_config(quant="unquantized", cuda_graph=True), manager=pm, dry_run=True)
    assert (p.dispatcher_name, p.experts.name, str(p.format)) == ("deepep_npu", "npu_gmm", "ep_masked")


def test_fp8_requested_becomes_int8_with_a_warning(pm):
    p = plan(npu_config(quant="int8_w8a8", dispatch_dtype="fp8"), manager=pm, dry_run=True)
    assert str(p.dispatch_dtype) == "int8"
    steps = [(s.source, str(s.dtype), s.warning) for s in p.dtype_trail]
    assert steps == [("user", "fp8", False), ("npu", "int8", True)]


def test_nvfp4_requested_is_an_error_with_a_hint():
    # only this plugin and the core: the count below must not depend on other installed plugins
    pm = PluginManager(allow=["npu"])
    with pytest.raises(PlanError) as info:
        plan(npu_config(quant="unquantized", dispatch_dtype="nvfp4"), manager=pm, dry_run=True)
    npu_rejections = [r for rej in info.value.rejected for r in rej.reasons
                      if r.code is Code.UNSUPPORTED_QUANT and "NVFP4 dispatch" in r.message]
    pair = next(rej for rej in info.value.rejected if rej.dispatcher.endswith("deepep_npu")
                and rej.experts.endswith("npu_gmm"))
    assert [r.code for r in pair.reasons] == [Code.UNSUPPORTED_QUANT]
    assert len(npu_rejections) >= len(info.value.rejected) - 2  # all but pairs failing on format first
    assert "int8" in npu_rejections[0].hint


def test_rules_do_not_apply_off_npu(pm):
    p = plan(npu_config(quant="int8_w8a8", device="cpu", dispatch_dtype="fp8"), manager=pm, dry_run=True)
    assert str(p.dispatch_dtype) == "fp8" and all(s.source != "npu" for s in p.dtype_trail)
    assert all(r.code is Code.NO_DEVICE for r in reasons_of(p, "fuseep") if r.code is Code.NO_DEVICE)


def test_fuseep_config_checks(pm):
    with pytest.raises(PlanError) as info:
        plan(npu_config(quant="int8_w8a8", hidden_size=256, max_tokens_per_rank=None, experts="fuseep",
                        backend_options={"fuseep": {"fuse_mode": 2}}), manager=pm, dry_run=True)
    codes = [(r.code, r.message) for r in reasons_of(info.value, "fuseep")]
    assert any(c is Code.UNSUPPORTED_SHAPE and "hidden_size" in m for c, m in codes)
    assert any(c is Code.UNSUPPORTED_SHAPE and "max_tokens_per_rank" in m for c, m in codes)
    mode2 = [r for r in reasons_of(info.value, "fuseep") if r.code is Code.DISABLED]
    assert len(mode2) == 1 and "fuse_mode=2" in mode2[0].message and "'fuse_mode': 1" in mode2[0].hint


def test_cli_plan_dry_run_json():
    """The issue's "how it will be checked", through the CLI (this interpreter's moe_core.cli)."""
    def run(*args):
        cmd = [sys.executable, "-m", "moe_core.cli", "plan", "--preset", "deepseek-v3", "--ep", "8",
               "--max-tokens-per-rank", "128", "--device", "npu", "--dry-run", "--json", *args]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        return out.returncode, json.loads(out.stdout)

    def fuseep_codes(d):
        return [r["code"] for rej in d["rejected"] if rej["experts"] == "npu.fuseep" for r in rej["reasons"]]

    rc, d = run("--quant", "int8_w8a8")
    assert rc == 0 and (d["plan"]["experts"], d["plan"]["dispatch_dtype"]) == ("fuseep", "int8")
    for quant in ("w4a4", "unquantized"):
        rc, d = run("--quant", quant)
        assert rc == 0 and (d["plan"]["dispatcher"], d["plan"]["experts"], d["plan"]["dispatch_dtype"]) == \
            ("deepep_npu", "npu_gmm", "bf16"), d["plan"]
        assert "UNSUPPORTED_QUANT" in fuseep_codes(d), quant
    rc, d = run("--quant", "int8_w8a8", "--dispatch-dtype", "fp8")
    trail = [(s["source"], s["dtype"], s["warning"]) for s in d["plan"]["dtype_trail"]]
    assert rc == 0 and d["plan"]["dispatch_dtype"] == "int8" and trail == [("user", "fp8", False), ("npu", "int8", True)]
    rc, d = run("--quant", "unquantized", "--dispatch-dtype", "nvfp4")
    assert rc != 0 and d["ok"] is False
    pair = next(r for r in d["rejected"] if (r["dispatcher"], r["experts"]) == ("npu.deepep_npu", "npu.npu_gmm"))
    assert [(r["code"], "NVFP4" in r["message"], "int8" in r["hint"]) for r in pair["reasons"]] == \
        [("UNSUPPORTED_QUANT", True, True)]


# --------------------------------------------------------------------------- probes


def _probe_codes(monkeypatch, mods: dict) -> dict:
    for name in ("torch_npu", "deep_ep", "deep_ep.buffer"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return {"npu_gmm": probes.probe_npu_gmm(), "deepep_npu": probes.probe_deepep_npu(),
            "fuseep": probes.probe_fuseep()}


@pytest.mark.skipif(probes._installed("torch_npu"), reason="a real torch_npu is installed")
def test_probe_torch_npu_not_installed(monkeypatch):
    got = _probe_codes(monkeypatch, {})
    assert {k: r.code for k, r in got.items()} == dict.fromkeys(got, Code.NOT_INSTALLED)
    assert "torch-npu" in got["npu_gmm"].hint or "torch_npu" in got["npu_gmm"].message


def test_probe_cann_missing_is_load_error(monkeypatch):
    def broken_import(name):
        if name == "torch_npu":
            raise ImportError("libascendcl.so: cannot open shared object file: No such file or directory")
        return __import__(name)

    monkeypatch.setattr(probes, "_installed", lambda name: True)
    monkeypatch.setattr(probes, "_import", broken_import)
    r = probes.probe_npu_gmm()
    assert r.code is Code.LOAD_ERROR and "CANN" in r.message and "set_env.sh" in r.hint and r.traceback


def test_probe_no_device_unsupported_soc_and_deep_ep(monkeypatch):
    import npu_emulation

    got = _probe_codes(monkeypatch, npu_emulation.modules(device_count=0))
    assert {k: r.code for k, r in got.items()} == dict.fromkeys(got, Code.NO_DEVICE)

    got = _probe_codes(monkeypatch, npu_emulation.modules(soc="Ascend310P3"))
    assert {k: r.code for k, r in got.items()} == dict.fromkeys(got, Code.UNSUPPORTED_ARCH)

    got = _probe_codes(monkeypatch, npu_emulation.modules(soc="Ascend910B3"))  # A2: no fused_deep_moe
    assert (got["npu_gmm"].ok, got["deepep_npu"].ok, got["fuseep"].code) == (True, True, Code.UNSUPPORTED_ARCH)

    got = _probe_codes(monkeypatch, npu_emulation.modules(with_deep_ep=False))
    if not probes._installed("deep_ep"):
        assert got["npu_gmm"].ok and got["deepep_npu"].code is Code.NOT_INSTALLED
        assert got["fuseep"].code is Code.NOT_INSTALLED and "sgl-kernel-npu" in got["fuseep"].hint

    mods = npu_emulation.modules()
    old_buffer = types.ModuleType("deep_ep")
    old_buffer.Buffer = type("Buffer", (), {"dispatch": lambda self: None})  # no low-latency / fused API
    mods["deep_ep"] = old_buffer
    got = _probe_codes(monkeypatch, mods)
    assert got["deepep_npu"].code is Code.API_MISMATCH and got["fuseep"].code is Code.API_MISMATCH

    got = _probe_codes(monkeypatch, npu_emulation.modules())
    assert all(r.ok for r in got.values()), got


def test_cli_backends_lists_npu_reasons():
    out = subprocess.run([sys.executable, "-m", "moe_core.cli", "backends", "--json"], capture_output=True, text=True,
                         timeout=120)
    rows = {r["backend"]: r for r in json.loads(out.stdout) if r["plugin"] == "npu"}
    assert set(rows) == {"npu_gmm", "deepep_npu", "fuseep"}
    for row in rows.values():  # usable, or a structured reason with a hint (here: no Ascend stack)
        assert row["available"] or (row["code"] and row["message"] and row["hint"]), row
