"""Planner negotiation, structured reasons, and every step of the dispatch-dtype chain."""

import dataclasses
import logging
import os

import pytest

import moe_core as mc
from moe_core import hookimpl
from moe_core.distributed.torch_a2a import normal_buffers
from moe_core.plugins import PluginManager

BASE = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128)


def spec(name, role, **kw):
    defaults = dict(impl="moe_core.reference.experts:ReferenceExperts", formats=(mc.Format.STANDARD,),
                    devices=frozenset({"cpu"}))
    return mc.BackendSpec(name=name, role=role, **{**defaults, **kw})


class FakePlugin(mc.BackendPlugin):
    def __init__(self, specs, rules=()):
        self._specs = specs
        for rule in rules:
            setattr(self, rule.__name__, rule)

    def backends(self):
        return self._specs


def manager_with(*plugins):
    manager = PluginManager(entry_points=[])
    for i, p in enumerate(plugins):
        manager.register(p, f"fake{i}")
    return manager


def test_auto_plan_on_cpu_is_the_reference_and_is_logged(caplog):
    with caplog.at_level(logging.INFO, logger="moe_core"):
        plan = mc.plan(mc.MoEConfig(**BASE), manager=PluginManager(entry_points=[]))
    assert (plan.dispatcher.name, plan.experts.name, plan.format, plan.dispatch_dtype) == \
        ("standard", "reference", mc.Format.STANDARD, mc.WireDtype.BF16)
    assert "standard x reference" in caplog.text
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.format = mc.Format.EP_NORMAL  # immutable
    assert "dispatch dtype: bf16" in plan.explain()


def test_every_reason_of_every_candidate_is_reported():
    fast = spec("fast", mc.Role.EXPERTS, devices=frozenset({"cuda"}), priority=50,
                quant_schemes=frozenset({mc.QuantScheme.UNQUANTIZED}),
                probe=lambda: mc.unavailable(mc.Code.NOT_INSTALLED, "fastlib missing", "pip install fastlib"))
    masked_only = spec("masked_only", mc.Role.EXPERTS, formats=(mc.Format.EP_MASKED,), priority=40,
                       quant_schemes=frozenset(mc.QuantScheme))
    manager = manager_with(FakePlugin([fast, masked_only]))
    cfg = mc.MoEConfig(**BASE, quant="fp8_block", experts="fast")
    with pytest.raises(mc.PlanError) as err:
        mc.plan(cfg, manager=manager)
    [rejection] = [r for r in err.value.rejected if r.dispatcher.endswith("standard")]
    codes = {r.code for r in rejection.reasons}
    assert codes == {mc.Code.NOT_INSTALLED, mc.Code.NO_DEVICE, mc.Code.UNSUPPORTED_QUANT}
    assert "pip install fastlib" in str(err.value)
    # auto falls back and records the rejections
    plan = mc.plan(cfg.replace(experts="auto"), manager=manager)
    assert plan.experts.name == "reference"
    rejected = {(r.dispatcher, r.experts): {x.code for x in r.reasons} for r in plan.rejected}
    assert mc.Code.FORMAT_MISMATCH in rejected[("reference.standard", "fake0.masked_only")]


def test_explicit_unknown_backend_fails_closed():
    with pytest.raises(mc.PlanError, match="unknown backend: dispatcher 'nope'") as err:
        mc.plan(mc.MoEConfig(**BASE, dispatcher="nope"), manager=PluginManager(entry_points=[]))
    assert err.value.rejected[0].reasons[0].code is mc.Code.NOT_INSTALLED


def test_graph_mode_parallelism_and_capacity_reasons():
    manager = PluginManager(entry_points=[])
    with pytest.raises(mc.PlanError) as err:
        mc.plan(mc.MoEConfig(**BASE, cuda_graph=True), manager=manager)
    assert {r.code for rej in err.value.rejected for r in rej.reasons} >= {mc.Code.NOT_GRAPH_SAFE}
    with pytest.raises(mc.PlanError) as err:
        mc.plan(mc.MoEConfig(**BASE, dispatcher="torch_a2a"), manager=manager)
    assert err.value.rejected[0].reasons[0].code is mc.Code.UNSUPPORTED_PARALLEL
    ep = mc.plan(mc.MoEConfig(**BASE, ep_size=2, ep_rank=1), manager=manager)
    assert ep.dispatcher.name == "torch_a2a" and ep.format is mc.Format.EP_NORMAL  # masked needs a capacity
    safe = spec("safe", mc.Role.EXPERTS, formats=(mc.Format.EP_NORMAL, mc.Format.EP_MASKED), priority=9,
                graph_safe_formats=frozenset({mc.Format.EP_MASKED}), ep="any")
    masked = mc.plan(mc.MoEConfig(**BASE, ep_size=2, max_tokens_per_rank=64, cuda_graph=True),
                     manager=manager_with(FakePlugin([safe])))
    assert masked.format is mc.Format.EP_MASKED and masked.graph_safe


def test_graph_safe_on_request_torch_a2a_normal_mode():
    """torch_a2a's normal mode is graph-safe only under cuda_graph (worst-case buffers, decision 56):
    planned there when asked for, ranked after the always graph-safe masked mode, never claimed
    graph-safe without the request, and refused without a capacity or with a bad option."""
    safe = spec("safe", mc.Role.EXPERTS, formats=(mc.Format.EP_NORMAL, mc.Format.EP_MASKED), priority=9,
                graph_safe_formats=frozenset({mc.Format.EP_NORMAL, mc.Format.EP_MASKED}), ep="any")
    manager = manager_with(FakePlugin([safe]))
    ep = dict(BASE, ep_size=2, experts="safe", max_tokens_per_rank=64)
    masked = mc.plan(mc.MoEConfig(**ep, cuda_graph=True), manager=manager)
    assert masked.format is mc.Format.EP_MASKED and masked.graph_safe
    normal = mc.plan(mc.MoEConfig(**ep, cuda_graph=True, dispatch_format="ep_normal"), manager=manager)
    assert normal.format is mc.Format.EP_NORMAL and normal.graph_safe and normal_buffers(normal.config) == "worst_case"
    eager = mc.plan(mc.MoEConfig(**ep), manager=manager)
    assert eager.format is mc.Format.EP_NORMAL and not eager.graph_safe and normal_buffers(eager.config) == "exact"
    opted = mc.MoEConfig(**ep, backend_options={"torch_a2a": {"normal_buffers": "worst_case"}})
    assert normal_buffers(mc.plan(opted, manager=manager).config) == "worst_case"
    bad = {"no capacity": mc.MoEConfig(**dict(ep, max_tokens_per_rank=None), cuda_graph=True),
           "bad option": mc.MoEConfig(**ep, backend_options={"torch_a2a": {"normal_buffers": "huge"}}),
           "exact under graphs": mc.MoEConfig(**ep, cuda_graph=True,
                                              backend_options={"torch_a2a": {"normal_buffers": "exact"}}),
           "unknown key": mc.MoEConfig(**ep, backend_options={"torch_a2a": {"buffers": "exact"}})}
    expect = {"no capacity": "max_tokens_per_rank is None", "bad option": "got 'huge'",
              "exact under graphs": "cuda_graph=True", "unknown key": "unknown keys ['buffers']"}
    for name, cfg in bad.items():
        with pytest.raises(mc.PlanError) as err:
            mc.plan(cfg, manager=manager)
        messages = [r.message for rej in err.value.rejected if rej.dispatcher.endswith("torch_a2a") for r in rej.reasons]
        assert any(expect[name] in m for m in messages), (name, messages)


def test_no_common_dtype():
    narrow = spec("fp8_only", mc.Role.EXPERTS, wire_dtypes=(mc.WireDtype.NVFP4,), priority=9,
                  formats=(mc.Format.EP_NORMAL,), ep="any")
    manager = manager_with(FakePlugin([narrow]))
    with pytest.raises(mc.PlanError) as err:
        mc.plan(mc.MoEConfig(**BASE, experts="fp8_only", dispatcher="torch_a2a", ep_size=2), manager=manager)
    assert mc.Code.NO_COMMON_DTYPE in {r.code for r in err.value.rejected[0].reasons}


def test_dtype_chain_user_choice_then_core_default():
    manager = PluginManager(entry_points=[])
    user = mc.plan(mc.MoEConfig(**BASE, dispatch_dtype="int8"), manager=manager)
    assert user.dispatch_dtype is mc.WireDtype.INT8 and user.dtype_trail[0].source == "user"
    default = mc.plan(mc.MoEConfig(**BASE, quant="fp8_block"), manager=manager)
    assert default.dispatch_dtype is mc.WireDtype.FP8 and default.dtype_trail[0].source == "core"
    w4 = mc.plan(mc.MoEConfig(**BASE, quant="w4a4"), manager=manager)
    assert w4.dispatch_dtype is mc.WireDtype.BF16
    # the FP8 wire's 1x128 group scales are not per-token scales: BF16 is the natural wire
    per_token = mc.plan(mc.MoEConfig(**BASE, quant="fp8_per_token"), manager=manager)
    assert per_token.dispatch_dtype is mc.WireDtype.BF16 and "natural activation dtype" in per_token.dtype_trail[0].reason


def test_dtype_chain_internal_quantization_plugin_rule_platform_default_and_wrappers():
    internal = spec("internal", mc.Role.EXPERTS, priority=9, quantizes_internally=True,
                    quant_schemes=frozenset(mc.QuantScheme), wire_dtypes=(mc.WireDtype.BF16, mc.WireDtype.FP8))
    manager = manager_with(FakePlugin([internal]))
    plan = mc.plan(mc.MoEConfig(**BASE, quant="fp8_block"), manager=manager)
    assert plan.experts.name == "internal" and plan.dispatch_dtype is mc.WireDtype.BF16
    assert "quantize internally" in plan.dtype_trail[0].reason

    @hookimpl
    def select_dispatch_dtype(request):
        if request.config.quant is mc.QuantScheme.INT8_W8A8:
            return request.decide(mc.WireDtype.INT8, "W8A8 experts take INT8", source="vendor")
        return None

    @hookimpl(wrapper=True)
    def select_dispatch_dtype_validation(request):
        decision = yield
        if decision.dtype is mc.WireDtype.FP8:
            return decision.then(mc.WireDtype.INT8, "this device has no FP8: INT8", source="vendor", warning=True)
        if decision.dtype is mc.WireDtype.NVFP4:
            return decision.reject(mc.Code.UNSUPPORTED_QUANT, "NVFP4 cannot be dispatched here", "use INT8",
                                   source="vendor")
        return decision

    class Rules:
        moe_core_hookspec_version = mc.HOOKSPEC_VERSION

    rules = Rules()
    rules.select_dispatch_dtype = select_dispatch_dtype
    wrapper = Rules()
    wrapper.select_dispatch_dtype = select_dispatch_dtype_validation
    manager = manager_with(rules, wrapper)
    int8 = mc.plan(mc.MoEConfig(**BASE, quant="int8_w8a8"), manager=manager)
    assert int8.dispatch_dtype is mc.WireDtype.INT8 and int8.dtype_trail[0].source == "vendor"
    fp8 = mc.plan(mc.MoEConfig(**BASE, dispatch_dtype="fp8"), manager=manager)
    assert [s.dtype for s in fp8.dtype_trail] == [mc.WireDtype.FP8, mc.WireDtype.INT8]
    assert fp8.dispatch_dtype is mc.WireDtype.INT8 and fp8.dtype_trail[1].warning
    assert "WARNING" in fp8.explain()
    with pytest.raises(mc.PlanError, match="NVFP4 cannot be dispatched here"):
        mc.plan(mc.MoEConfig(**BASE, dispatch_dtype="nvfp4"), manager=manager)


def test_two_layers_in_one_process_keep_their_own_dtypes_and_env_is_untouched():
    env = dict(os.environ)
    manager = PluginManager(entry_points=[])
    base = mc.plan(mc.MoEConfig(**BASE, quant="fp8_block"), manager=manager)
    draft = mc.plan(mc.MoEConfig(**BASE, quant="fp8_block", dispatch_dtype="bf16"), manager=manager)
    assert (base.dispatch_dtype, draft.dispatch_dtype) == (mc.WireDtype.FP8, mc.WireDtype.BF16)
    assert dict(os.environ) == env


def test_dry_run_plans_for_a_device_this_machine_lacks():
    remote = spec("remote", mc.Role.EXPERTS, devices=frozenset({"npu"}), priority=9,
                  probe=lambda: mc.unavailable(mc.Code.NOT_INSTALLED, "torch_npu missing"))
    manager = manager_with(FakePlugin([remote]))
    cfg = mc.MoEConfig(**BASE, device="npu")
    plan = mc.plan(cfg, manager=manager, dry_run=True)
    assert plan.experts.name == "remote" and plan.dry_run and "NOT_INSTALLED" in plan.notes[0]
    with pytest.raises(RuntimeError, match="dry-run"):
        plan.build()
    # not a dry run: no NPU here, so no plan (the reference must not stand in for the absent device)
    with pytest.raises(mc.PlanError) as info:
        mc.plan(cfg, manager=manager)
    assert [r.code for rej in info.value.rejected for r in rej.reasons] == [mc.Code.NO_DEVICE]


def test_dispatch_format_choice_restricts_and_fails_closed():
    manager = PluginManager(entry_points=[])
    cfg = mc.MoEConfig(**BASE, ep_size=2, max_tokens_per_rank=32, dispatch_format="ep_masked")
    assert mc.plan(cfg, manager=manager).format is mc.Format.EP_MASKED
    with pytest.raises(mc.PlanError, match="dispatch format ep_masked requested"):
        mc.plan(cfg.replace(ep_size=1, ep_rank=0), manager=manager)
