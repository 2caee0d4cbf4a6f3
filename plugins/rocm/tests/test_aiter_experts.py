"""``aiter`` experts against the core reference, on emulated AITER (single process)."""

from __future__ import annotations

import pytest
import rocm_emulation
import torch
from moe_plugin_rocm.aiter_experts import AiterExperts
from rocm_emulation.arch_oracle import aiter_float64
from torch import nn

from moe_core import (
    BackendContext,
    EPMaskedDispatch,
    EPNormalDispatch,
    Format,
    MoEConfig,
    MoELayer,
    PluginManager,
    QuantScheme,
    TopK,
    WireDtype,
    quant,
)
from moe_core.reference.experts import ReferenceExperts
from moe_core.reference.oracle import moe_float64
from moe_core.testing.data import make_float_weights, make_hidden, make_topk, rel_error

E, K, H, INTER = 8, 3, 256, 128
RSF = 1.7
FP8_SCHEMES = (QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN)
# gfx942 requantizes the intermediate activation on the e4m3fnuz grid (amax/240) inside the kernel,
# the core reference on e4m3fn (amax/448): two valid roundings whose difference (~3%, measured) is
# inherent. Each side is held to the scheme tolerance against the float64 of its own definition.
CROSS_FLAVOUR_TOL = 5e-2


def tol(scheme: QuantScheme) -> float:
    return 1e-2 if scheme is QuantScheme.UNQUANTIZED else 3e-2


def ref_tol(scheme: QuantScheme, arch: str) -> float:
    """Tolerance against the core reference backend."""
    return CROSS_FLAVOUR_TOL if scheme in FP8_SCHEMES and arch == "gfx942" else tol(scheme)


def check(out, expect, exact, scheme, arch, what=""):
    """``exact``: float64 of aiter's definition on ``arch``; ``expect``: the core reference."""
    assert rel_error(out, exact) < tol(scheme), (what, "vs its float64 definition", rel_error(out, exact))
    assert rel_error(out, expect) < ref_tol(scheme, arch), (what, "vs the reference", rel_error(out, expect))


def arrived(x, wire):
    """The activations as the experts receive them (the wire's dequantized values)."""
    return quant.quantize_activations(x, wire).dequantize() if wire is WireDtype.FP8 else x


def checkpoint(scheme, gen):
    w13, w2 = make_float_weights(E, H, INTER, gen)
    if scheme is QuantScheme.UNQUANTIZED:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
    return quant.quantize_weights(w13, w2, scheme)


def layers(scheme, wire="auto", **overrides):
    pm = PluginManager()
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, quant=scheme, device="rocm",
                    routed_scaling_factor=RSF, dispatch_dtype=wire, **overrides)
    layer = MoELayer(cfg, manager=pm, device="cpu")
    ref = MoELayer(cfg.replace(experts="reference"), manager=pm, device="cpu")
    return layer, ref


@pytest.mark.parametrize("scheme,wire,planned", [
    (QuantScheme.UNQUANTIZED, "auto", WireDtype.BF16),
    (QuantScheme.FP8_BLOCK, "auto", WireDtype.FP8),
    (QuantScheme.FP8_BLOCK, "bf16", WireDtype.BF16),
    (QuantScheme.FP8_PER_TOKEN, "auto", WireDtype.BF16),  # natural dtype: the FP8 wire's groups are 1x128
    (QuantScheme.FP8_PER_TOKEN, "fp8", WireDtype.FP8),  # explicit: requantized per token
])
def test_standard_matches_reference(emulated, scheme, wire, planned):
    g = torch.Generator().manual_seed(1)
    layer, ref = layers(scheme, wire)
    assert layer.plan.experts.name == "aiter" and layer.plan.dispatcher.name == "standard"
    assert layer.plan.dispatch_dtype is planned
    ckpt = checkpoint(scheme, g)
    for m in (layer, ref):
        m.load_weights(**ckpt)
        m.process_weights()
    d13, d2 = quant.dequantize_weights(ckpt, scheme)
    for T in (0, 1, 37):
        x = make_hidden(T, H, torch.bfloat16, g)
        topk = make_topk(T, K, E, g, neg_fraction=0.3, empty_token=T > 1)
        out, expect = layer(x, topk), ref(x, topk)
        assert out.shape == (T, H) and out.dtype == torch.bfloat16
        exact = aiter_float64(scheme, emulated, arrived(x, planned), topk.weights, topk.ids, ckpt,
                              routed_scaling_factor=RSF)
        check(out, expect, exact, scheme, emulated, f"T={T}")
        if T > 1:
            assert torch.equal(out[0].float(), torch.zeros(H))  # token with no expert
            oracle = moe_float64(x, topk.weights, topk.ids, d13, d2, routed_scaling_factor=RSF)
            assert rel_error(out, oracle) < 1.25 * rel_error(expect, oracle) + 1e-2


def test_routed_scaling_factor_is_applied_once(emulated_gfx942):
    g = torch.Generator().manual_seed(2)
    layer, _ = layers(QuantScheme.UNQUANTIZED)
    plain, _ = layers(QuantScheme.UNQUANTIZED)
    plain = MoELayer(plain.config.replace(routed_scaling_factor=1.0), manager=PluginManager(), device="cpu")
    ckpt = checkpoint(QuantScheme.UNQUANTIZED, g)
    for m in (layer, plain):
        m.load_weights(**ckpt)
        m.process_weights()
    x, topk = make_hidden(9, H, torch.bfloat16, g), make_topk(9, K, E, g)
    assert rel_error(layer(x, topk), plain(x, topk).float() * RSF) < 1e-2


def _ctx(layer, fmt, wire):
    return BackendContext(layer.config, layer.plan.experts, fmt, wire)


@pytest.mark.parametrize("scheme,wire", [(QuantScheme.UNQUANTIZED, WireDtype.BF16),
                                         (QuantScheme.FP8_BLOCK, WireDtype.FP8),
                                         (QuantScheme.FP8_BLOCK, WireDtype.BF16),
                                         (QuantScheme.FP8_PER_TOKEN, WireDtype.BF16),
                                         (QuantScheme.FP8_PER_TOKEN, WireDtype.FP8)])
def test_ep_normal_and_masked_adapters(emulated, scheme, wire):
    """DeepEP-style EP_NORMAL (local ids with -1 -> sink expert) and EP_MASKED (slab with garbage
    past masked_m), on a rank owning 4 of 8 experts, against the reference experts."""
    g = torch.Generator().manual_seed(3)
    ep = dict(ep_size=2, ep_rank=1, max_tokens_per_rank=16, dispatcher="standard")  # layers only hold weights
    layer, ref = layers(scheme, str(wire), **ep)
    ckpt = checkpoint(scheme, g)
    for m in (layer, ref):
        m.load_weights(**ckpt)
        m.process_weights()
    E_l = E // 2
    # EP_NORMAL: 29 received rows, local ids (-1 for the other rank's experts and padding)
    R = 29
    x = make_hidden(R, H, torch.bfloat16, g)
    ids = torch.randint(-1, E_l, (R, K), generator=g).int()
    ids[0] = -1  # a row with no local expert
    w = torch.rand(R, K, generator=g)
    w = torch.where(ids >= 0, w, 0.0)
    hidden = quant.quantize_activations(x, wire)
    counts = torch.bincount(ids[ids >= 0].long(), minlength=E_l).int()
    d = EPNormalDispatch(hidden, TopK(w, ids), counts)
    ae, re = AiterExperts(_ctx(layer, Format.EP_NORMAL, wire)), ReferenceExperts(_ctx(ref, Format.EP_NORMAL, wire))
    ae.process_weights(layer)  # second processing of the same layer: must not shuffle again
    re.process_weights(ref)
    out, expect = ae.apply(layer, d).hidden, re.apply(ref, d).hidden
    mine = {k: v[E_l:] for k, v in ckpt.items()}  # rank 1's experts: local ids index them
    exact = aiter_float64(scheme, emulated, arrived(x, wire), w, ids, mine, routed_scaling_factor=RSF)
    check(out, expect, exact, scheme, emulated, "ep_normal")
    assert torch.equal(out[0].float(), torch.zeros(H))
    # EP_MASKED: [E_l, C, H] with masked_m valid rows; rows past masked_m hold NaN garbage
    C = 12
    slab = make_hidden(E_l * C, H, torch.bfloat16, g).view(E_l, C, H)
    masked_m = torch.tensor([5, 0, 12, 3], dtype=torch.int32)
    for e, m in enumerate(masked_m.tolist()):
        slab[e, m:] = float("nan")
    sender = make_topk(4, K, E, g)
    d = EPMaskedDispatch(quant.quantize_activations(slab, wire), masked_m, sender)
    ae, re = AiterExperts(_ctx(layer, Format.EP_MASKED, wire)), ReferenceExperts(_ctx(ref, Format.EP_MASKED, wire))
    ae.process_weights(layer)
    re.process_weights(ref)
    out_c, exp_c = ae.apply(layer, d), re.apply(ref, d)
    assert out_c.topk is sender and not out_c.weighted
    x_in = arrived(slab, wire)
    for e, m in enumerate(masked_m.tolist()):
        if m:  # unweighted: each valid row through its own expert, weight 1 (times rsf)
            one = torch.full((m, 1), e, dtype=torch.int32)
            exact = aiter_float64(scheme, emulated, x_in[e, :m], torch.ones(m, 1), one, mine,
                                  routed_scaling_factor=RSF)
            check(out_c.hidden[e, :m], exp_c.hidden[e, :m], exact, scheme, emulated, f"masked expert {e}")


@pytest.mark.parametrize("scheme", [QuantScheme.UNQUANTIZED, QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN])
def test_process_weights_twice_rewrap_and_reload(emulated, scheme):
    g = torch.Generator().manual_seed(4)
    layer, ref = layers(scheme)
    ckpt = checkpoint(scheme, g)
    for m in (layer, ref):
        m.load_weights(**ckpt)
        m.process_weights()
    layer.process_weights()  # twice
    # shuffled exactly once: un-shuffling gives the checkpoint back (values; gfx942 cleared -0 only)
    un = rocm_emulation.aiter_emu.unshuffle_weight(layer.w13.data)
    assert torch.equal(un.float(), ckpt["w13"].float())
    assert layer.w13.is_shuffled and layer.w2.is_shuffled
    x, topk = make_hidden(21, H, torch.bfloat16, g), make_topk(21, K, E, g, neg_fraction=0.2)
    expect = ref(x, topk)
    exact = aiter_float64(scheme, emulated, arrived(x, layer.plan.dispatch_dtype), topk.weights, topk.ids, ckpt,
                          routed_scaling_factor=RSF)
    # re-wrap every weight in a new Parameter (drops the is_shuffled attribute)
    for name in ("w13", "w2"):
        setattr(layer, name, nn.Parameter(getattr(layer, name).data, requires_grad=False))
    assert not getattr(layer.w13, "is_shuffled", False)
    check(layer(x, topk), expect, exact, scheme, emulated, "re-wrapped")  # forward without reprocessing
    layer.process_weights()  # and reprocessing after the re-wrap does not shuffle again
    assert layer.w13.is_shuffled
    assert torch.equal(rocm_emulation.aiter_emu.unshuffle_weight(layer.w13.data).float(), ckpt["w13"].float())
    check(layer(x, topk), expect, exact, scheme, emulated, "re-wrapped and reprocessed")
    # reload a new checkpoint into the same storage (the stale is_shuffled attribute stays on it)
    ckpt2 = checkpoint(scheme, g)
    for m in (layer, ref):
        m.load_weights(**ckpt2)
        m.process_weights()
    out = layer(x, topk)
    exact = aiter_float64(scheme, emulated, arrived(x, layer.plan.dispatch_dtype), topk.weights, topk.ids, ckpt2,
                          routed_scaling_factor=RSF)
    check(out, ref(x, topk), exact, scheme, emulated, "reloaded")


def test_shuffle_never_applied_for_other_experts(emulated_gfx942):
    """The plan chose the reference experts on a ROCm layer: weights keep the checkpoint layout."""
    g = torch.Generator().manual_seed(5)
    _, ref = layers(QuantScheme.FP8_BLOCK)
    ckpt = checkpoint(QuantScheme.FP8_BLOCK, g)
    ref.load_weights(**ckpt)
    ref.process_weights()
    ref.process_weights()
    assert ref.plan.experts.name == "reference"
    assert torch.equal(ref.w13.data.view(torch.uint8), ckpt["w13"].view(torch.uint8))
    assert ref.w13.dtype == torch.float8_e4m3fn and not hasattr(ref.w13, "is_shuffled")


def test_fp8_flavour_is_decided_by_arch(emulated):
    layer, _ = layers(QuantScheme.FP8_BLOCK)
    want = {"gfx942": (torch.float8_e4m3fnuz, 240.0), "gfx950": (torch.float8_e4m3fn, 448.0)}[emulated]
    assert (layer.experts.fp8.dtype, layer.experts.fp8.max) == want
    ckpt = checkpoint(QuantScheme.FP8_BLOCK, torch.Generator().manual_seed(6))
    layer.load_weights(**ckpt)
    layer.process_weights()
    assert layer.experts._kw.w13.dtype == want[0] and layer.experts._kw.w13.is_shuffled
    assert layer.w13.dtype == torch.float8_e4m3fn  # the layer keeps the checkpoint dtype


def test_fp8_per_token_weights_reach_aiter_as_per_token(emulated):
    """fp8_per_token is QuantType.per_Token with [E, N, 1] scales (doubled with the fnuz view on gfx942)."""
    layer, _ = layers(QuantScheme.FP8_PER_TOKEN)
    ckpt = checkpoint(QuantScheme.FP8_PER_TOKEN, torch.Generator().manual_seed(7))
    layer.load_weights(**ckpt)
    layer.process_weights()
    kw, factor = layer.experts._kw, 2.0 if emulated == "gfx942" else 1.0
    assert layer.experts.quant_type is rocm_emulation.aiter_emu.QuantType.per_Token
    assert kw.w13_scale.shape == (E, 2 * INTER, 1) and kw.w2_scale.shape == (E, H, 1)
    assert torch.equal(kw.w13_scale.squeeze(-1), ckpt["w13_scale"] * factor)
    assert torch.equal(kw.w2_scale.squeeze(-1), ckpt["w2_scale"] * factor)
    # the values the kernel reads are the checkpoint's, whichever the flavour
    w13 = rocm_emulation.aiter_emu.unshuffle_weight(kw.w13).float() * kw.w13_scale
    assert torch.equal(w13, ckpt["w13"].float() * ckpt["w13_scale"][..., None])
