"""One bad plugin never takes the core down (issue 28 items 11, 12; decision 44).

Each fault becomes a listed LOAD_ERROR / API_MISMATCH record with the plugin's name (or a
rejection in the plan), and planning and ``MoELayer(experts="reference")`` keep working.
"""

import pytest
import torch

import moe_core as mc
from moe_core import plugins
from moe_core.plugins import PluginLoadError, PluginManager, plugin_filter_from_env

from .conftest import checkpoint, random_topk

CFG = mc.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)

HEADER = """
import sys
import moe_core as mc
from moe_core import BackendSpec, Role, hookimpl, BackendPlugin, DtypeDecision
"""


def spec_source(name="bad_experts", priority=99, impl="moe_core.reference.experts:ReferenceExperts", extra=""):
    return (f"BackendSpec(name={name!r}, role=Role.EXPERTS, impl={impl!r}, formats=(mc.Format.STANDARD,), "
            f"devices=frozenset({{'cpu'}}), wire_dtypes=(mc.WireDtype.BF16,), priority={priority}{extra})")


def plugin_source(body="", version="mc.HOOKSPEC_VERSION", specs=None):
    specs = specs if specs is not None else f"[{spec_source()}]"
    return HEADER + f"""
class P(BackendPlugin):
    moe_core_hookspec_version = {version}
    def backends(self):
        return {specs}
{body}
plugin = P()
"""


def _layer_works(manager):
    layer = mc.MoELayer(CFG.replace(experts="reference"), manager=manager)
    layer.load_weights(**checkpoint(CFG.quant, 4, 32, 16))
    layer.process_weights()
    assert layer(torch.randn(3, 32).bfloat16(), random_topk(3, 4, 2)).shape == (3, 32)


def _record(manager, name):
    return next(r for r in manager.records if r.name == name)


@pytest.mark.parametrize("version", ["1", "()", "'1.0'", "(1.5,)"])
def test_malformed_hookspec_version_is_api_mismatch(install_dist, version):
    install_dist("moe-plugin-v", "v_plugin", plugin_source(version=version), entry="vbad")
    manager = PluginManager(allow=["vbad"])
    assert _record(manager, "vbad").status.code is mc.Code.API_MISMATCH
    assert "vbad" in _record(manager, "vbad").status.message
    _layer_works(manager)


@pytest.mark.parametrize("extra", [", priority='50'", ", formats='standard'", ", quant_schemes=None"])
def test_bad_spec_fields_are_load_errors(install_dist, extra):
    specs = f"[{spec_source(priority=1)}]" if "priority" not in extra else \
        f"[{spec_source(priority=1).replace(', priority=1', extra)}]"
    if "priority" not in extra:
        specs = specs.replace(", formats=(mc.Format.STANDARD,)", "") if "formats" in extra else specs
        specs = specs.replace(")]", extra + ")]")
    install_dist("moe-plugin-s", "s_plugin", plugin_source(specs=specs), entry="sbad")
    manager = PluginManager(allow=["sbad"])
    status = _record(manager, "sbad").status
    assert status.code is mc.Code.LOAD_ERROR and "bad_experts" in status.message, status
    assert manager.spec("bad_experts") is None
    _layer_works(manager)


@pytest.mark.parametrize("rule", [
    "    @hookimpl\n    def select_dispatch_dtype(self, request):\n        raise RuntimeError('rule exploded')\n",
    "    @hookimpl\n    def select_dispatch_dtype(self, request):\n        return 'bf16'\n",
])
def test_faulty_dtype_rule_is_disabled_and_plans_go_on(install_dist, rule):
    install_dist("moe-plugin-r", "r_plugin", plugin_source(body=rule, specs="[]"), entry="rbad")
    manager = PluginManager(allow=["rbad"])
    p = mc.plan(CFG, manager=manager)
    assert p.experts.name == "reference"
    status = _record(manager, "rbad").status
    assert status.code is mc.Code.API_MISMATCH and "rbad" in status.message and "select_dispatch_dtype" in status.message
    _layer_works(manager)
    with pytest.raises(PluginLoadError, match="rbad"):
        mc.plan(CFG, manager=PluginManager(allow=["rbad"], strict=True))


def test_probe_or_import_calling_sys_exit_does_not_end_the_process(install_dist):
    probe = HEADER + "\ndef probe():\n    sys.exit(7)\n"
    install_dist("moe-plugin-p", "p_probe", probe + plugin_source(
        specs=f"[{spec_source(extra=', probe=probe')}]").replace(HEADER, ""), entry="pexit")
    install_dist("moe-plugin-i", "i_exit", "import sys\nsys.exit(7)\n", entry="iexit")
    manager = PluginManager(allow=["pexit", "iexit"])
    assert _record(manager, "iexit").status.code is mc.Code.LOAD_ERROR
    p = mc.plan(CFG, manager=manager)
    assert p.experts.name == "reference"
    codes = {r.code for rej in p.rejected if rej.experts == "pexit.bad_experts" for r in rej.reasons}
    assert mc.Code.LOAD_ERROR in codes


def test_auto_falls_back_past_a_backend_that_fails_to_import_or_build(install_dist):
    missing = spec_source(name="ghost", impl="no_such_module_anywhere:Experts")
    broken = spec_source(name="brittle", priority=98, impl="f_plugin:Brittle")
    source = plugin_source(specs=f"[{missing}, {broken}]") + """
class Brittle(mc.Experts):
    def __init__(self, ctx):
        raise RuntimeError('no workspace for you')
"""
    install_dist("moe-plugin-f", "f_plugin", source, entry="fbad")
    manager = PluginManager(allow=["fbad"])
    p = mc.plan(CFG, manager=manager)  # the import failure is found at plan time
    assert p.experts.name == "brittle"
    assert any(rej.experts == "fbad.ghost" and rej.reasons[0].code is mc.Code.LOAD_ERROR for rej in p.rejected)
    layer = mc.MoELayer(CFG, manager=manager)  # the constructor failure when the layer is built
    assert layer.plan.experts.name == "reference"
    assert any(rej.experts == "fbad.brittle" and "no workspace for you" in rej.reasons[0].message
               for rej in layer.plan.rejected)
    # an explicit choice fails closed
    with pytest.raises(mc.PlanError, match="no_such_module_anywhere"):
        mc.plan(CFG.replace(experts="ghost"), manager=PluginManager(allow=["fbad"]))
    with pytest.raises(RuntimeError, match="no workspace for you"):
        mc.MoELayer(CFG.replace(experts="brittle"), manager=PluginManager(allow=["fbad"]))


def test_a_plugin_cannot_take_over_a_core_backend_name(install_dist):
    install_dist("moe-plugin-t", "t_plugin", plugin_source(specs=f"[{spec_source(name='reference')}]"), entry="thief")
    manager = PluginManager(allow=["thief"])
    assert manager.spec("reference").plugin == "reference"
    assert manager.spec("thief.reference").plugin == "thief"
    assert mc.MoELayer(CFG.replace(experts="reference"), manager=manager).plan.experts.plugin == "reference"


def test_strict_mode_names_the_failure_not_the_last_record(install_dist):
    source = HEADER + """
class P(BackendPlugin):
    moe_core_hookspec_version = mc.HOOKSPEC_VERSION
    def backends(self):
        raise RuntimeError('cannot list')
plugin = P()
"""
    install_dist("moe-plugin-a", "a_plugin", source, entry="abad")
    install_dist("moe-plugin-z", "z_plugin", plugin_source(specs="[]"), entry="zgood")
    with pytest.raises(PluginLoadError, match="abad.*cannot list"):
        PluginManager(allow=["abad", "zgood"], strict=True)


@pytest.mark.parametrize("value,allow,block", [
    (None, None, set()), ("", set(), set()), ("cuda,npu", {"cuda", "npu"}, set()),
    ("-rocm", None, {"rocm"}), (" cuda , -rocm ", {"cuda"}, {"rocm"}),
])
def test_moe_core_plugins_env_parsing(value, allow, block):
    a, b = plugin_filter_from_env(value)
    assert (a if a is None else set(a)) == allow and set(b) == block


def test_moe_core_plugins_env_controls_the_default_manager(install_dist, monkeypatch):
    install_dist("moe-plugin-r", "r_plugin", plugin_source(specs="[]"), entry="envplug")
    for value, loaded in (("", False), ("envplug", True), ("-envplug", False)):
        monkeypatch.setenv(plugins.PLUGINS_ENV, value)
        plugins.get_plugin_manager.cache_clear()
        try:
            records = {r.name: r for r in plugins.get_plugin_manager().records}
            assert records["reference"].status.ok
            assert ("envplug" in records and records["envplug"].status.ok) == loaded, value
        finally:
            plugins.get_plugin_manager.cache_clear()


def test_a_stage_hook_answering_for_everyone_does_not_hijack_trace_mode(install_dist):
    greedy = """
    @hookimpl
    def dispatch(self, backend, hidden_states, topk):
        raise AssertionError('greedy dispatch called for another plugin's backend')

    @hookimpl
    def apply(self, backend, layer, dispatched):
        raise AssertionError('greedy apply called for another plugin's backend')
"""
    install_dist("moe-plugin-g", "g_plugin", plugin_source(body=greedy, specs="[]"), entry="greedy")
    manager = PluginManager(allow=["greedy"])
    ckpt = checkpoint(CFG.quant, 4, 32, 16)
    plain, traced = mc.MoELayer(CFG, manager=manager), mc.MoELayer(CFG, manager=manager, trace=True)
    for layer in (plain, traced):
        layer.load_weights(**ckpt)
        layer.process_weights()
    x, topk = torch.randn(5, 32).bfloat16(), random_topk(5, 4, 2)
    assert torch.equal(traced(x, topk), plain(x, topk))


def test_a_slow_plugin_import_or_probe_is_reported(install_dist, caplog, monkeypatch):
    monkeypatch.setattr(plugins, "SLOW_SECONDS", 0.05)
    probe = "import time\ntime.sleep(0.1)\n" + HEADER + "\ndef probe():\n    time.sleep(0.1)\n    return mc.available()\n"
    install_dist("moe-plugin-slow", "slow_plugin", probe + plugin_source(
        specs=f"[{spec_source(extra=', probe=probe')}]").replace(HEADER, ""), entry="slow")
    manager = PluginManager(allow=["slow"])
    manager.availability(manager.spec("bad_experts"))
    assert "importing plugin 'slow'" in caplog.text and "probe of backend slow.bad_experts" in caplog.text


def test_planning_probes_only_backends_whose_declarations_fit(install_dist, tmp_path):
    """A probe can be slow (a driver query, a library import): planning runs it only for a backend
    that could serve the config by its declarations (issue 28 item 12)."""
    log = tmp_path / "probes.log"
    probe = HEADER + f"\ndef probe():\n    open({str(log)!r}, 'a').write('probed\\n')\n    return mc.available()\n"
    install_dist("moe-plugin-pc", "pc_plugin", probe + plugin_source(
        specs=f"[{spec_source(extra=', probe=probe, quant_schemes=frozenset({mc.QuantScheme.FP8_BLOCK})')}]").replace(HEADER, ""),
        entry="pcount")
    manager = PluginManager(allow=["pcount"])
    plan = mc.plan(CFG, manager=manager)  # unquantized: the fp8-only backend cannot serve it
    assert plan.experts.qualified_name != "pcount.bad_experts" and not log.exists()
    assert any("pcount.bad_experts" in str(r) and "quant" in str(r) for r in plan.rejected)
    plan = mc.plan(CFG.replace(quant="fp8_block"), manager=manager)
    assert log.read_text().count("probed") == 1 and plan.experts.qualified_name == "pcount.bad_experts"
