"""MoELayer on the reference backends against the independent float64 oracle.

Quantized schemes are compared with the float64 computation of the scheme's definition
(dequantized weights, activations quantized as the scheme says), and with the plain float64
result of the dequantized weights (a looser bound: it includes activation rounding).
"""

import pytest
import torch

import moe_core as mc
from moe_core import quant
from moe_core.contracts import EPMaskedDispatch, EPNormalDispatch, QuantizedActivations
from moe_core.reference.experts import activation_quantizer
from moe_core.reference.oracle import moe_float64, relative_error

from .conftest import checkpoint, random_topk

E, K, H, I = 8, 3, 256, 128  # noqa: E741 (I: the intermediate size, as in the papers)
# vs the scheme's own float64 definition: only bf16 output rounding remains (NVFP4 with its static
# activation scales measured 1.6-1.9e-3, worst token; the e2m1 grid's rounding-boundary flips between
# float32 and float64 are rare at this size)
TOL_SCHEME = {"unquantized": 1e-2, "fp8_block": 3e-2, "fp8_per_token": 3e-2, "int8_w8a8": 3e-2, "w4a4": 3e-2,
              "nvfp4": 1e-2}
# vs plain float64 with dequantized weights: includes activation quantization error
TOL_PLAIN = {"unquantized": 1e-2, "fp8_block": 0.1, "fp8_per_token": 0.1, "int8_w8a8": 5e-2, "w4a4": 0.5,
             "nvfp4": 0.4}


def oracle(cfg, t, x, topk, scheme_acts: bool):
    d13, d2 = quant.dequantize_weights(t, cfg.quant)
    qa = activation_quantizer(cfg.quant) if scheme_acts else None
    gs = {"a13": t.get("a13_global_scale"), "a2": t.get("a2_global_scale")}
    return moe_float64(
        x, topk.weights, topk.ids, d13, d2, activation=cfg.activation,
        routed_scaling_factor=cfg.routed_scaling_factor,
        apply_router_weight_on_input=cfg.apply_router_weight_on_input,
        quantize_activation=None if qa is None else
        (lambda v, which, e: qa(v.float(), None if gs[which] is None else gs[which][e])))


def build(cfg, t):
    layer = mc.MoELayer(cfg)
    layer.load_weights(**t)
    layer.process_weights()
    return layer


@pytest.mark.parametrize("scheme", [str(s) for s in mc.QuantScheme])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_layer_matches_float64(scheme, tokens):
    cfg = mc.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant=scheme,
                       dispatch_dtype="bf16")
    t = checkpoint(cfg.quant, E, H, I)
    layer = build(cfg, t)
    x = torch.randn(tokens, H).to(torch.bfloat16)
    topk = random_topk(tokens, E, K, drop=0.2)
    out = layer(x, topk)
    assert out.shape == (tokens, H) and out.dtype == torch.bfloat16
    if tokens == 0:
        return
    assert relative_error(out, oracle(cfg, t, x, topk, True)) <= TOL_SCHEME[scheme]
    assert relative_error(out, oracle(cfg, t, x, topk, False)) <= TOL_PLAIN[scheme]


@pytest.mark.parametrize("wire", ["fp8", "int8"])
def test_quantized_wire_matches(wire):
    cfg = mc.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant="fp8_block",
                       dispatch_dtype=wire)
    t = checkpoint(cfg.quant, E, H, I)
    layer = build(cfg, t)
    assert layer.plan.dispatch_dtype == mc.WireDtype(wire)
    x = torch.randn(29, H).to(torch.bfloat16)
    topk = random_topk(29, E, K, drop=0.1)
    assert relative_error(layer(x, topk), oracle(cfg, t, x, topk, False)) <= 0.1


@pytest.mark.parametrize("activation", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_activation_dtypes_scaling_and_input_weights(activation, dtype):
    cfg = mc.MoEConfig(num_experts=5, top_k=1, hidden_size=48, intermediate_size=40, activation=activation,
                       params_dtype=dtype, routed_scaling_factor=2.5, apply_router_weight_on_input=True)
    t = checkpoint(cfg.quant, 5, 48, 40)
    t = {k: v.to(dtype) for k, v in t.items()}
    layer = build(cfg, t)
    x = torch.randn(23, 48).to(dtype)
    topk = random_topk(23, 5, 1)
    out = layer(x, topk)
    assert out.dtype == dtype
    assert relative_error(out, oracle(cfg, t, x, topk, False)) <= (1e-2 if dtype != torch.float32 else 1e-5)


def test_router_logits_path_matches_explicit_topk():
    cfg = mc.preset("deepseek-v3", hidden_size=64, intermediate_size=32)
    t = checkpoint(cfg.quant, cfg.num_experts, 64, 32)
    t["correction_bias"] = torch.randn(cfg.num_experts) * 0.1
    layer = build(cfg, t)
    x = torch.randn(9, 64).to(torch.bfloat16)
    logits = torch.randn(9, cfg.num_experts)
    topk = mc.route(logits, cfg.top_k, cfg.router, t["correction_bias"])
    assert torch.equal(layer(x, router_logits=logits), layer(x, topk))
    assert relative_error(layer(x, topk), oracle(cfg, t, x, topk, False)) <= 1e-2


def _experts(cfg, fmt, t):
    plan = mc.plan(cfg)
    ctx = mc.BackendContext(cfg, mc.get_plugin_manager().spec("reference"), fmt, mc.WireDtype.BF16)
    from moe_core.reference.experts import ReferenceExperts

    layer = build(cfg, t)
    assert plan.experts.name == "reference"
    experts = ReferenceExperts(ctx)
    experts.process_weights(layer)
    return layer, experts


def test_reference_experts_ep_normal_format():
    cfg = mc.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I)
    t = checkpoint(cfg.quant, E, H, I)
    layer, experts = _experts(cfg, mc.Format.EP_NORMAL, t)
    x = torch.randn(19, H).to(torch.bfloat16)
    topk = random_topk(19, E, K, drop=0.3)
    counts = torch.bincount(topk.ids[topk.ids >= 0].long(), minlength=E).to(torch.int32)
    out = experts.apply(layer, EPNormalDispatch(QuantizedActivations(x), topk, counts, handle="h"))
    assert isinstance(out, mc.EPNormalCombine) and out.handle == "h"
    assert relative_error(out.hidden, oracle(cfg, t, x, topk, False)) <= 1e-2


def test_reference_experts_ep_masked_format_is_unweighted_and_ignores_rows_past_masked_m():
    cfg = mc.MoEConfig(num_experts=4, top_k=2, hidden_size=64, intermediate_size=32, routed_scaling_factor=1.5)
    t = checkpoint(cfg.quant, 4, 64, 32)
    layer, experts = _experts(cfg, mc.Format.EP_MASKED, t)
    cap = 6
    slab = torch.randn(4, cap, 64).to(torch.bfloat16)
    masked_m = torch.tensor([0, 6, 3, 1], dtype=torch.int32)
    slab[2, 3:] = float("nan")  # garbage past masked_m must not be read
    sender = random_topk(3, 4, 2)
    out = experts.apply(layer, EPMaskedDispatch(QuantizedActivations(slab), masked_m, sender))
    assert isinstance(out, mc.EPMaskedCombine) and not out.weighted
    d13, d2 = quant.dequantize_weights(t, cfg.quant)
    for e, m in enumerate(masked_m.tolist()):
        for row in range(m):
            one = mc.TopK(torch.ones(1, 1), torch.tensor([[e]], dtype=torch.int32))
            ref = moe_float64(slab[e, row:row + 1], one.weights, one.ids, d13, d2, routed_scaling_factor=1.5)
            assert relative_error(out.hidden[e, row:row + 1], ref) <= 1e-2
    assert torch.isfinite(out.hidden[2]).all()


def test_out_of_range_local_ids_in_reference_experts_raise():
    cfg = mc.MoEConfig(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16)
    layer, experts = _experts(cfg, mc.Format.STANDARD, checkpoint(cfg.quant, 4, 32, 16))
    bad = mc.TopK(torch.ones(2, 2), torch.tensor([[0, 4], [1, 2]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"topk.ids must be in \[-1, 4\)"):
        experts.apply(layer, mc.StandardDispatch(QuantizedActivations(torch.randn(2, 32).bfloat16()), bad))


@pytest.mark.parametrize("wire", ["bf16", "fp8"])
@pytest.mark.parametrize("tokens", [0, 1, 37])
def test_fp8_per_token_matches_its_float64_definition(wire, tokens):
    """fp8_per_token against float64 written from its definition (``oracle.fp8_round_trip``, no
    code shared with ``moe_core.quant``): per-channel weights; each GEMM input rounded per token on
    the e4m3fn grid (amax/448). FP8 wire input (1x128 groups) is requantized per token."""
    from moe_core.reference.oracle import fp8_round_trip

    h, i = 200, 72  # not multiples of 128: per-token needs no block alignment
    cfg = mc.MoEConfig(num_experts=E, top_k=K, hidden_size=h, intermediate_size=i, quant="fp8_per_token",
                       dispatch_dtype=wire, routed_scaling_factor=1.3)
    t = checkpoint(cfg.quant, E, h, i)
    layer = build(cfg, t)
    assert layer.plan.dispatch_dtype is mc.WireDtype(wire)
    x = torch.randn(tokens, h).to(torch.bfloat16)
    topk = random_topk(tokens, E, K, drop=0.25)
    out = layer(x, topk)
    assert out.shape == (tokens, h) and out.dtype == torch.bfloat16
    if tokens == 0:
        return
    w13 = t["w13"].double() * t["w13_scale"].double()[..., None]
    w2 = t["w2"].double() * t["w2_scale"].double()[..., None]
    x_in = x.double() if wire == "bf16" else fp8_round_trip(x, 128)  # what arrives over the wire
    expect = moe_float64(x_in, topk.weights, topk.ids, w13, w2, routed_scaling_factor=1.3,
                         quantize_activation=lambda v, which, e: fp8_round_trip(v))
    # bf16 output rounding, plus fp8 rounding flips where float32 and float64 GEMMs differ
    assert relative_error(out, expect) <= TOL_SCHEME["fp8_per_token"]
    empty = (topk.ids < 0).all(dim=1)
    assert torch.equal(out[empty].float(), torch.zeros(int(empty.sum()), h))


def test_nvfp4_default_plan_uses_the_static_scales_and_keeps_tokens_apart():
    """Issue 28 item 5: the default single-process NVFP4 plan quantizes with the checkpoint's static
    per-expert scales (decision 8), as under EP: every token within the definition's bf16 rounding,
    and a NaN or huge token does not change the others (a per-batch wire scale coupled them)."""
    cfg = mc.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant="nvfp4")
    t = checkpoint(cfg.quant, E, H, I)
    layer = build(cfg, t)
    assert layer.plan.dispatch_dtype == mc.WireDtype.BF16
    x = torch.randn(23, H).to(torch.bfloat16)
    topk = random_topk(23, E, K)
    out = layer(x, topk)
    ref = oracle(cfg, t, x, topk, True)
    for i in range(23):  # per token, not only overall
        assert relative_error(out[i:i + 1], ref[i:i + 1]) <= TOL_SCHEME["nvfp4"], i
    for poison in (float("nan"), 1e6):
        bad = x.clone()
        bad[3] *= poison
        assert torch.equal(layer(bad, topk)[:3], out[:3]) and torch.equal(layer(bad, topk)[4:], out[4:])
    # the static scales are the ones used: changing them changes the result
    t2 = dict(t, a13_global_scale=t["a13_global_scale"] * 4)
    assert not torch.equal(build(cfg, t2)(x, topk), out)
