"""Plans the machine cannot run are refused with a reason and a hint (issue 28 items 4, 13)."""

import pytest

import moe_core as mc
from moe_core.backends import Code
from moe_core.devices import DeviceKind

ABSENT = [k for k in DeviceKind if not k.is_present()]


@pytest.mark.parametrize("kind", ABSENT or [pytest.param(None, marks=pytest.mark.skip("every kind present"))])
def test_absent_device_is_no_device_with_a_hint(kind):
    cfg = mc.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, device=str(kind))
    for attempt in (lambda: mc.plan(cfg), lambda: mc.MoELayer(cfg)):
        with pytest.raises(mc.PlanError) as info:
            attempt()
        reasons = [r for rej in info.value.rejected for r in rej.reasons]
        assert [r.code for r in reasons] == [Code.NO_DEVICE], reasons
        assert f"targets device {kind}" in reasons[0].message and "dry_run=True" in reasons[0].hint
    # planning for a target machine still works
    assert mc.plan(cfg, dry_run=True).dry_run


def test_nvfp4_wire_needs_hidden_multiple_of_16_at_plan_time():
    cfg = mc.MoEConfig(num_experts=8, top_k=2, hidden_size=100, intermediate_size=32, dispatch_dtype="nvfp4",
                       dispatcher="standard", experts="reference")
    with pytest.raises(mc.PlanError) as info:
        mc.plan(cfg)
    reasons = [r for rej in info.value.rejected for r in rej.reasons]
    assert any(r.code is Code.UNSUPPORTED_SHAPE and "hidden_size=100 is not a multiple of 16" in r.message
               for r in reasons), reasons
    assert mc.plan(cfg.replace(hidden_size=112)).dispatch_dtype == "nvfp4"
