"""Refusals name the argument, the value and what was expected (issue 28, items 6, 7, 9)."""

import math

import pytest
import torch

import moe_core as mc
from moe_core import quant

from .conftest import checkpoint, random_weights

CFG = mc.MoEConfig(num_experts=6, top_k=2, hidden_size=64, intermediate_size=32)


@pytest.fixture
def layer():
    layer = mc.MoELayer(CFG)
    layer.load_weights(**checkpoint(CFG.quant, 6, 64, 32))
    layer.process_weights()
    return layer


@pytest.mark.parametrize("logits,match", [
    (lambda: torch.randn(5, 5), r"router_logits must be \[T=5, num_experts=6\].*got \(5, 5\)"),
    (lambda: torch.randn(5, 9), r"router_logits must be \[T=5, num_experts=6\].*got \(5, 9\)"),
    (lambda: torch.randn(5, 7), r"router_logits must be \[T=5, num_experts=6\].*got \(5, 7\)"),
    (lambda: torch.randn(4, 6), r"router_logits must be \[T=5, num_experts=6\].*got \(4, 6\)"),
    (lambda: torch.randn(5, 6, device="meta"), "router_logits is on meta"),
    (lambda: torch.ones(5, 6, dtype=torch.int64), "router_logits must be a floating-point tensor"),
    (lambda: [[0.0] * 6] * 5, "router_logits must be a torch.Tensor, got list"),
])
def test_router_logits_are_validated(layer, logits, match):
    with pytest.raises((ValueError, TypeError), match=match):
        layer(torch.randn(5, 64).bfloat16(), router_logits=logits())


@pytest.mark.parametrize("groups,kept,e,k,match", [
    (8, 1, 16, 4, r"topk_group=1 of num_expert_group=8 keeps 2 of num_experts=16 experts, fewer than top_k=4"),
    (4, 5, 16, 2, "topk_group=5 exceeds num_expert_group=4"),
    (5, 2, 16, 2, "num_expert_group=5 does not divide num_experts=16"),
    (0, 0, 16, 2, "num_expert_group must be a positive int"),
])
def test_unsatisfiable_grouped_routing_is_rejected_at_config_time(groups, kept, e, k, match):
    with pytest.raises(ValueError, match=match):
        mc.MoEConfig(num_experts=e, top_k=k, hidden_size=64, intermediate_size=32,
                     router=mc.RouterConfig(num_expert_group=groups, topk_group=kept))


def test_satisfiable_grouped_routing_picks_only_kept_groups():
    cfg = mc.MoEConfig(num_experts=16, top_k=4, hidden_size=64, intermediate_size=32,
                       router=mc.RouterConfig(num_expert_group=8, topk_group=2))
    topk = mc.route(torch.randn(50, 16), 4, cfg.router)
    assert all(len(set((row // 2).tolist())) <= 2 for row in topk.ids)  # 2 experts a group, 2 groups kept


@pytest.mark.parametrize("field,value", [
    ("num_experts", True), ("top_k", 2.0), ("hidden_size", "64"), ("ep_rank", 0.0),
    ("routed_scaling_factor", math.nan), ("routed_scaling_factor", math.inf), ("routed_scaling_factor", 0.0),
    ("routed_scaling_factor", -1.0), ("routed_scaling_factor", True), ("max_tokens_per_rank", 2.5),
])
def test_config_rejects_non_numbers_and_nan(field, value):
    with pytest.raises(ValueError, match=f"MoEConfig.{field} must be .*got {value!r}"):
        CFG.replace(**{field: value})


def _nvfp4_layer():
    cfg = CFG.replace(quant="nvfp4")
    return mc.MoELayer(cfg), checkpoint(cfg.quant, 6, 64, 32)


@pytest.mark.parametrize("name", ["a2_global_scale", "a13_global_scale", "w13_scale_2", "w2_scale_2"])
@pytest.mark.parametrize("bad", [0.0, math.nan, -1.0, math.inf])
def test_nvfp4_scales_must_be_finite_and_positive(name, bad):
    layer, ckpt = _nvfp4_layer()
    ckpt[name] = ckpt[name].clone()
    ckpt[name][1] = bad
    with pytest.raises(ValueError, match=f"load_weights: {name} must be finite and positive"):
        layer.load_weights(**ckpt)
    assert not layer._loaded


def test_fp8_tensors_into_an_unquantized_layer_are_refused():
    w13, w2 = random_weights(6, 64, 32)
    fp8 = quant.quantize_weights(w13, w2, "fp8_block")
    with pytest.raises(TypeError, match=r"load_weights: w13 must be torch.bfloat16, got torch.float8_e4m3fn"):
        mc.MoELayer(CFG).load_weights(w13=fp8["w13"], w2=fp8["w2"])
    # a wide float is still accepted (a cast that loses nothing the layer keeps)
    mc.MoELayer(CFG).load_weights(w13=w13.double(), w2=w2.half())


@pytest.mark.parametrize("value,exc,match", [
    (lambda w: w.tolist(), TypeError, "w13 must be a torch.Tensor, got list"),
    (lambda w: w.numpy(), TypeError, "w13 must be a torch.Tensor, got ndarray"),
    (lambda w: torch.tensor(1.0), ValueError, "w13 must be a .num_experts, ....* got a 0-d tensor"),
    (lambda w: w.to("meta"), ValueError, "w13 is on the meta device"),
    (lambda w: w[:, :3], ValueError, r"w13 must have shape \(6, 64, 64\)"),
])
def test_bad_weight_containers_name_the_weight(value, exc, match):
    w13, w2 = random_weights(6, 64, 32)
    layer = mc.MoELayer(CFG)
    with pytest.raises(exc, match=match):
        layer.load_weights(w13=value(w13), w2=w2)


def test_quantized_activations_refuse_a_missing_or_extra_scale():
    from moe_core.contracts import QuantizedActivations, WireDtype

    x, s = torch.randn(3, 256), torch.rand(3, 2)
    QuantizedActivations(x), QuantizedActivations(x, WireDtype.FP8, s)  # accepted
    with pytest.raises(ValueError, match="bf16 activations carry no scale"):
        QuantizedActivations(x, WireDtype.BF16, s)
    for wire in (WireDtype.FP8, WireDtype.INT8, WireDtype.NVFP4):
        with pytest.raises(ValueError, match=f"{wire} activations need a scale tensor"):
            QuantizedActivations(x, wire)
    with pytest.raises(ValueError, match="nvfp4 activations need a global_scale"):
        QuantizedActivations(x, WireDtype.NVFP4, s)


def test_quantized_activations_is_a_frozen_dataclass_of_its_fields():
    import dataclasses

    from moe_core.contracts import QuantizedActivations, WireDtype

    x, s = torch.randn(3, 256), torch.rand(3, 2)
    q = QuantizedActivations(x, WireDtype.FP8, s, ue8m0=True)
    assert [f.name for f in dataclasses.fields(q)] == ["data", "dtype", "scale", "global_scale", "ue8m0"]
    assert (q.data, q.dtype, q.scale, q.global_scale, q.ue8m0) == (x, WireDtype.FP8, s, None, True)
    assert QuantizedActivations(x) == QuantizedActivations(data=x, dtype=WireDtype.BF16)
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.scale = None
    r = dataclasses.replace(q, ue8m0=False)
    assert r.ue8m0 is False and r.scale is s and q.ue8m0 is True
    with pytest.raises(ValueError, match="fp8 activations need a scale tensor"):
        dataclasses.replace(q, scale=None)


def test_hand_written_contract_inits_trace_under_fullgraph_compile():
    """QuantizedActivations and EPMaskedDispatch write their fields by hand (decisions 60, 61); under dynamo
    they take the generated init's per-field path (torch 2.11's dynamo could not trace the eager one)."""
    from moe_core.contracts import EPMaskedDispatch, QuantizedActivations, TopK, WireDtype

    def build(x, s, counts, w, ids):
        q = QuantizedActivations(x, WireDtype.FP8, s, ue8m0=True)
        d = EPMaskedDispatch(q, counts, TopK(w, ids), None)
        return d.hidden.data * d.hidden.scale[..., :1], d.masked_m + 1, d.topk.weights * 2, d.hidden.ue8m0

    x, s, counts = torch.randn(2, 3, 256), torch.rand(2, 3, 2), torch.randint(0, 3, (2,), dtype=torch.int32)
    w, ids = torch.rand(4, 2), torch.randint(-1, 4, (4, 2), dtype=torch.int32)
    torch._dynamo.reset()
    got = torch.compile(build, fullgraph=True, backend="eager")(x, s, counts, w, ids)
    want = build(x, s, counts, w, ids)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)) and got[3] is True


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
def test_masked_dispatch_unchecked_is_the_checked_result(wire):
    """``masked_dispatch_unchecked`` (a dispatcher's hot path, decision 64) builds the same public objects as
    the checked constructors: equal, the same fields in ``__dict__``, frozen, replaceable (which checks again),
    picklable; and it traces under ``torch.compile(fullgraph=True)``."""
    import dataclasses
    import pickle

    from moe_core.contracts import EPMaskedDispatch, QuantizedActivations, TopK, WireDtype, masked_dispatch_unchecked

    fp8 = wire == "fp8"
    x, counts = torch.randn(2, 5, 256), torch.randint(0, 5, (2,), dtype=torch.int32)
    s = torch.rand(2, 5, 2) if fp8 else None
    topk = TopK(torch.rand(3, 2), torch.randint(-1, 4, (3, 2)))
    dtype = WireDtype.FP8 if fp8 else WireDtype.BF16
    fast = masked_dispatch_unchecked(x, dtype, s, fp8, counts, topk, ("handle",))
    slow = EPMaskedDispatch(QuantizedActivations(x, dtype, s, None, fp8), counts, topk, ("handle",))
    assert type(fast) is EPMaskedDispatch and type(fast.hidden) is QuantizedActivations
    assert fast == slow and fast.hidden == slow.hidden and fast.handle == ("handle",)
    assert vars(fast) == vars(slow) and vars(fast.hidden) == vars(slow.hidden)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fast.hidden.data = x
    if fp8:
        with pytest.raises(ValueError, match="fp8 activations need a scale tensor"):
            dataclasses.replace(fast.hidden, scale=None)
    back = pickle.loads(pickle.dumps(fast))
    assert torch.equal(back.hidden.data, x) and back.hidden.dtype is dtype and back.masked_m.tolist() == counts.tolist()

    def build(x, s, counts, w, ids):
        d = masked_dispatch_unchecked(x, dtype, s, fp8, counts, TopK(w, ids), None)
        return d.hidden.data * 2, d.masked_m + 1, d.topk.weights * 2, d.hidden.ue8m0

    torch._dynamo.reset()
    got = torch.compile(build, fullgraph=True, backend="eager")(x, s, counts, topk.weights, topk.ids)
    want = build(x, s, counts, topk.weights, topk.ids)
    assert all(torch.equal(a, b) for a, b in zip(got[:3], want[:3], strict=True)) and got[3] is fp8
