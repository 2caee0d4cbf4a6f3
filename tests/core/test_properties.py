"""Property-based tests: ``MoELayer`` against the float64 oracle over schemes, dtypes and shapes.

Hypothesis draws the layer (scheme, params dtype, activation, sizes, scaling, weighting on the
input) and the batch (T from 0, -1 ids, duplicate-free routing) and the seed of the O(1) random
data; every example is compared with the float64 computation of the scheme's definition
(``moe_core.reference.oracle.moe_float64`` with the scheme's activation quantization). The number
of examples is bounded by the settings profile in ``conftest.py`` (CI: small, no deadline).
"""

import torch
from hypothesis import given
from hypothesis import strategies as st

import moe_core as mc
from moe_core import quant
from moe_core.contracts import TopK
from moe_core.reference.experts import activation_quantizer
from moe_core.reference.oracle import moe_float64, relative_error

# vs the scheme's float64 definition; the output dtype's rounding is the floor. Over a few tokens a
# single activation rounding-boundary flip (float32 vs float64 GEMM1) weighs more: 2x there (as the
# conformance kit allows over 1-4 token slots)
TOL = {"unquantized": 1e-2, "fp8_block": 3e-2, "fp8_per_token": 3e-2, "int8_w8a8": 3e-2, "w4a4": 3e-2,
       "nvfp4": 1e-2}
OUTPUT_ROUNDING = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 1e-5}


@st.composite
def layers(draw):
    scheme = draw(st.sampled_from([str(s) for s in mc.QuantScheme]))
    e = draw(st.integers(1, 9))
    k = draw(st.integers(1, min(e, 4)))
    step = 16 if scheme == "nvfp4" else 1  # NVFP4 blocks of 16 channels
    h = draw(st.integers(1, 10).map(lambda n: n * 16)) if step == 16 else draw(st.integers(2, 160))
    i = draw(st.integers(1, 6).map(lambda n: n * 16)) if step == 16 else draw(st.integers(2, 96))
    return mc.MoEConfig(
        num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, quant=scheme,
        params_dtype=draw(st.sampled_from([torch.bfloat16, torch.float16, torch.float32])),
        activation=draw(st.sampled_from(["silu", "gelu"])),
        routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 0.37])),
        apply_router_weight_on_input=draw(st.booleans()),
    )


def _data(cfg, t, seed, drop):
    gen = torch.Generator().manual_seed(seed)
    e, h, i, k = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    w13 = torch.randn(e, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(e, h, i, generator=gen) / i ** 0.5
    ckpt = quant.quantize_weights(w13, w2, cfg.quant)
    if cfg.quant == "unquantized":
        ckpt = {n: w.to(cfg.params_dtype) for n, w in ckpt.items()}
    x = torch.randn(t, h, generator=gen).to(cfg.params_dtype)
    ids = torch.rand(t, e, generator=gen).argsort(dim=1)[:, :k].to(torch.int32)
    ids[torch.rand(t, k, generator=gen) < drop] = -1
    return ckpt, x, TopK(torch.rand(t, k, generator=gen) + 0.5, ids)


def _oracle(cfg, ckpt, x, topk):
    d13, d2 = quant.dequantize_weights(ckpt, cfg.quant)
    qa = activation_quantizer(cfg.quant)
    gs = {"a13": ckpt.get("a13_global_scale"), "a2": ckpt.get("a2_global_scale")}
    return moe_float64(x, topk.weights, topk.ids, d13, d2, activation=cfg.activation,
                       routed_scaling_factor=cfg.routed_scaling_factor,
                       apply_router_weight_on_input=cfg.apply_router_weight_on_input,
                       quantize_activation=None if qa is None else
                       (lambda v, which, e: qa(v.float(), None if gs[which] is None else gs[which][e])))


@given(cfg=layers(), t=st.integers(0, 24), seed=st.integers(0, 2**31 - 1), drop=st.sampled_from([0.0, 0.3]))
def test_layer_matches_the_float64_definition(cfg, t, seed, drop):
    ckpt, x, topk = _data(cfg, t, seed, drop)
    layer = mc.MoELayer(cfg)
    layer.load_weights(**ckpt)
    layer.process_weights()
    out = layer(x, topk)
    assert out.shape == (t, cfg.hidden_size) and out.dtype == cfg.params_dtype
    if t == 0:
        return
    ref = _oracle(cfg, ckpt, x, topk)
    routed = (topk.ids >= 0).any(dim=1)
    assert bool((out[~routed] == 0).all()), "a token routed to no expert got a non-zero output"
    if not routed.any():
        return
    tol = max(TOL[cfg.quant], OUTPUT_ROUNDING[cfg.params_dtype]) * (2 if t <= 4 else 1)
    assert relative_error(out[routed], ref[routed]) <= tol


@given(cfg=layers(), t=st.integers(1, 12), seed=st.integers(0, 2**31 - 1))
def test_tokens_are_independent_of_the_batch(cfg, t, seed):
    """Each token's output is the same alone as in any batch (no cross-token coupling: scales, ...)."""
    ckpt, x, topk = _data(cfg, t, seed, 0.2)
    layer = mc.MoELayer(cfg)
    layer.load_weights(**ckpt)
    layer.process_weights()
    out = layer(x, topk)
    j = seed % t
    alone = layer(x[j:j + 1], TopK(topk.weights[j:j + 1], topk.ids[j:j + 1]))
    assert relative_error(alone, out[j:j + 1]) <= OUTPUT_ROUNDING[cfg.params_dtype] * 2
