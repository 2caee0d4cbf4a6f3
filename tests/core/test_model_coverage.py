"""Model features in the core: expert biases, swiglu_oai, group scoring, shared experts, TopK
conversion, [..., H] inputs, per-expert loading (EP, FP8 block scales), state_dict round trip,
from_hf_config. Checked against independent float64 computations."""

from __future__ import annotations

import types

import pytest
import torch

import moe_core as mc
from moe_core import quant
from moe_core.loading import expert_params_mapping
from moe_core.plugins import PluginManager
from moe_core.reference.oracle import moe_float64, relative_error

from .conftest import random_topk, random_weights

E, K, H, I = 6, 2, 40, 24  # noqa: E741 (I: intermediate size, as in the vendors' notation); H not a multiple of 128


def _manager():
    return PluginManager(entry_points=[])


def _cfg(**kw):
    return mc.MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, params_dtype=torch.float32, **kw)


@pytest.mark.parametrize("t", [0, 1, 7, 33])
def test_biases_and_swiglu_oai_match_the_float64_oracle(t):
    cfg = _cfg(activation="swiglu_oai", expert_bias=True, swiglu_alpha=1.3, swiglu_limit=1.5)
    layer = mc.MoELayer(cfg, manager=_manager())
    w13, w2 = random_weights(E, H, I)
    w13 = w13 * 3  # gate/up beyond the clamp limit for many rows
    b13, b2 = torch.randn(E, 2 * I), torch.randn(E, H)
    layer.load_weights(w13=w13, w2=w2, w13_bias=b13, w2_bias=b2)
    layer.process_weights()
    x, topk = torch.randn(t, H), random_topk(t, E, K, drop=0.2)
    expected = moe_float64(x, topk.weights, topk.ids, w13, w2, activation="swiglu_oai", w13_bias=b13, w2_bias=b2,
                           swiglu_alpha=1.3, swiglu_limit=1.5)
    assert relative_error(layer(x, topk), expected) <= 1e-5
    if t:  # the clamp is exercised: gate values above the limit exist
        assert float((x @ w13[:, :I].transpose(1, 2)).max()) > 1.5


def test_backends_that_do_not_declare_biases_or_swiglu_oai_are_refused():
    from .test_planner import FakePlugin, manager_with, spec

    plain = spec("plain", mc.Role.EXPERTS, priority=50)  # declares neither
    manager = manager_with(FakePlugin([plain]))
    plan = mc.plan(_cfg(expert_bias=True, activation="swiglu_oai"), manager=manager)
    assert plan.experts.name == "reference"
    reasons = [r for rej in plan.rejected if rej.experts.endswith("plain") and rej.dispatcher.endswith("standard")
               for r in rej.reasons]
    codes = {r.code for r in reasons}
    assert codes == {mc.Code.UNSUPPORTED_FEATURE, mc.Code.UNSUPPORTED_SHAPE}, reasons
    assert any("swiglu_oai" in r.message for r in reasons) and any("bias" in r.message for r in reasons)
    with pytest.raises(mc.PlanError, match="UNSUPPORTED_FEATURE"):
        mc.plan(_cfg(expert_bias=True, experts="plain"), manager=manager)


def _group_reference(scores, bias, groups, topk_group, top_k, top2):
    """Written out per token, in float64."""
    t, e = scores.shape
    ids = []
    for row, b in zip(scores.double(), [bias.double()] * t, strict=True):
        choice = row + b
        per = e // groups
        gscore = [sorted(choice[g * per:(g + 1) * per].tolist(), reverse=True) for g in range(groups)]
        gscore = [s[0] + s[1] if top2 else s[0] for s in gscore]
        keep = sorted(range(groups), key=lambda g: -gscore[g])[:topk_group]
        masked = [choice[j].item() if j // per in keep else float("-inf") for j in range(e)]
        ids.append(sorted(sorted(range(e), key=lambda j: -masked[j])[:top_k]))
    return ids


@pytest.mark.parametrize("scoring,bias", [("top2_sum", False), ("max", True), ("top2_sum", True), ("max", False)])
def test_group_scoring_is_independent_of_the_bias(scoring, bias):
    t, e, groups = 64, 16, 4
    logits = torch.randn(t, e)
    cb = torch.randn(e) * 0.3 if bias else torch.zeros(e)
    router = mc.RouterConfig(scoring="sigmoid", num_expert_group=groups, topk_group=2, use_correction_bias=bias,
                             group_scoring=scoring)
    got = mc.route(logits, 4, router, cb if bias else None)
    expected = _group_reference(torch.sigmoid(logits), cb, groups, 2, 4, scoring == "top2_sum")
    assert sorted(map(sorted, got.ids.tolist())) == sorted(expected)
    with pytest.raises(ValueError, match="group_scoring"):
        mc.RouterConfig(group_scoring="mean")


@pytest.mark.parametrize("gated", [False, True])
def test_shared_experts_are_part_of_the_layer(gated):
    cfg = _cfg(shared_intermediate_size=20, shared_expert_gate=gated)
    layer = mc.MoELayer(cfg, manager=_manager())
    w13, w2 = random_weights(E, H, I)
    layer.load_weights(w13=w13, w2=w2)
    s13, s2, g = torch.randn(40, H) / H ** 0.5, torch.randn(H, 20) / 20 ** 0.5, torch.randn(1, H) / H ** 0.5
    layer.weight_loader("shared_experts.w13", s13[:20], shard="gate")
    layer.weight_loader("shared_experts.w13", s13[20:], shard="up")
    layer.weight_loader("shared_experts.w2", s2)
    if gated:
        layer.weight_loader("shared_experts.gate", g[0])
    layer.process_weights()
    x, topk = torch.randn(9, H), random_topk(9, E, K)
    xd = x.double()
    gate, up = xd @ s13[:20].double().t(), xd @ s13[20:].double().t()
    shared = (gate / (1 + torch.exp(-gate)) * up) @ s2.double().t()
    if gated:
        shared = shared / (1 + torch.exp(-(xd @ g.double().t())))
    expected = moe_float64(x, topk.weights, topk.ids, w13, w2) + shared
    assert relative_error(layer(x, topk), expected) <= 1e-5
    with pytest.raises(ValueError, match="shared_expert_gate=True needs shared experts"):
        _cfg(shared_expert_gate=True)


def test_topk_from_bf16_weights_and_int64_ids_and_any_leading_shape():
    layer = mc.MoELayer(_cfg(), manager=_manager())
    w13, w2 = random_weights(E, H, I)
    layer.load_weights(w13=w13, w2=w2)
    layer.process_weights()
    x = torch.randn(2, 3, H)
    topk = random_topk(6, E, K, drop=0.2)
    hf_style = mc.TopK(topk.weights.bfloat16(), topk.ids.long())
    assert hf_style.weights.dtype == torch.float32 and hf_style.ids.dtype == torch.int32
    assert torch.equal(hf_style.ids, topk.ids)
    out = layer(x, hf_style)
    assert out.shape == (2, 3, H)
    expected = moe_float64(x.reshape(6, H), hf_style.weights, topk.ids, w13, w2).reshape(2, 3, H)
    assert relative_error(out, expected) <= 1e-5
    logits = torch.randn(2, 3, E)
    routed = layer(x, router_logits=logits)
    flat = mc.route(logits.reshape(6, E), K, layer.config.router)
    assert relative_error(routed, layer(x.reshape(6, H), flat).reshape(2, 3, H)) == 0.0
    assert layer(torch.randn(H), random_topk(1, E, K)).shape == (H,)


def test_topk_keeps_a_routers_int64_ids_until_either_tensor_changes():
    """``ids_int64`` (what DeepEP takes): the router's own int64 tensor, no cast, while it and ``ids``
    are as they were; a cast of ``ids`` after an in-place change of either, or for int32-made TopK."""
    ids64 = random_topk(7, E, K, drop=0.2).ids.long()
    topk = mc.TopK(torch.rand(7, K), ids64)
    assert topk.ids.dtype == torch.int32 and topk.ids_int64() is ids64 and topk.ids_int64(cast=False) is ids64
    assert mc.route(torch.randn(5, E), K).ids_int64(cast=False) is not None  # the reference router hands int64 over
    topk.ids[0, 0] = -1  # a graph user refilling ids in place
    assert topk.ids_int64(cast=False) is None
    assert torch.equal(topk.ids_int64(), topk.ids.long()) and topk.ids_int64()[0, 0] == -1
    kept = mc.TopK(torch.rand(7, K), ids64)
    ids64.add_(0)  # the source changed after the TopK was made
    assert kept.ids_int64(cast=False) is None and kept.ids_int64().dtype == torch.int64
    assert mc.TopK(torch.rand(7, K), ids64.int()).ids_int64(cast=False) is None
    assert torch.equal(mc.TopK(torch.rand(7, K), ids64.int()).ids_int64(), ids64)


def test_topk_ids_int64_is_a_cast_while_dynamo_traces():
    """Traced by dynamo, ``ids_int64`` is ``ids`` cast (a graph reads ``ids``, as a captured CUDA graph
    does), whatever the version counters say; eager, the router's own tensor again."""
    ids64 = random_topk(6, E, K).ids.long()
    topk = mc.TopK(torch.rand(6, K), ids64)
    got = torch.compile(lambda t: t.ids_int64(), backend="eager", fullgraph=True)(topk)
    assert got is not ids64 and got.dtype == torch.int64 and torch.equal(got, ids64)
    assert topk.ids_int64(cast=False) is ids64


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_per_expert_per_shard_loading_keeps_this_ranks_experts(ep_rank):
    cfg = _cfg(ep_size=2, ep_rank=ep_rank, dispatcher="standard")
    layer = mc.MoELayer(cfg, manager=_manager())
    w13, w2 = random_weights(E, H, I)
    kept = []
    for name, infix, e, shard in expert_params_mapping(E):
        proj = infix.split(".")[2]
        full = {"gate_proj": w13[:, :I], "up_proj": w13[:, I:], "down_proj": w2}[proj]
        kept.append(layer.weight_loader(name, full[e], expert_id=e, shard=shard))
    local = cfg.local_expert_range
    assert sum(kept) == 3 * len(local)
    assert torch.equal(layer.w13, w13[local.start:local.stop]) and torch.equal(layer.w2, w2[local.start:local.stop])
    with pytest.raises(ValueError, match="expert_id=6 not in"):
        layer.weight_loader("w2", w2[0], expert_id=6)
    with pytest.raises(ValueError, match="shard must be"):
        layer.weight_loader("w13", w13[0, :I], expert_id=local.start, shard="down")
    with pytest.raises(ValueError, match="must have shape"):
        layer.weight_loader("w2", w2[0, :, :5], expert_id=local.start)


def test_fp8_block_scales_per_expert_and_state_dict_round_trip():
    i = 128  # FP8 block checkpoints: the intermediate size is a multiple of the 128 block
    cfg = _cfg(quant="fp8_block").replace(intermediate_size=i, hidden_size=136)
    w13, w2 = random_weights(E, 136, i)
    ckpt = quant.quantize_weights(w13, w2, "fp8_block")
    layer = mc.MoELayer(cfg, manager=_manager())
    for e in range(E):
        for shard, rows in (("gate", slice(0, i)), ("up", slice(i, 2 * i))):
            layer.weight_loader("w13_weight", ckpt["w13"][e, rows], expert_id=e, shard=shard)
            layer.weight_loader("w13_weight_scale_inv", ckpt["w13_scale"][e, rows.start // 128:rows.stop // 128],
                                expert_id=e, shard=shard)
        layer.weight_loader("w2_weight", ckpt["w2"][e], expert_id=e)
        layer.weight_loader("w2_weight_scale_inv", ckpt["w2_scale"][e], expert_id=e)
    for name, t in ckpt.items():
        assert torch.equal(getattr(layer, name).view(torch.uint8) if t.dtype.itemsize == 1 else getattr(layer, name),
                           t.view(torch.uint8) if t.dtype.itemsize == 1 else t), name
    layer.process_weights()
    x, topk = torch.randn(5, 136), random_topk(5, E, K)
    out = layer(x, topk)
    # round trip through state_dict into a fresh layer
    again = mc.MoELayer(cfg, manager=_manager())
    again.load_state_dict(layer.state_dict())
    again.load_weights(**{n: getattr(again, n) for n in again.weight_tensors()})
    again.process_weights()
    assert torch.equal(again(x, topk), out)
    w13_odd = _cfg(quant="fp8_block")  # I = 24: block scales cannot be split by shard
    odd = mc.MoELayer(w13_odd, manager=_manager())
    with pytest.raises(ValueError, match="multiple of 128"):
        odd.weight_loader("w13_scale", torch.ones(1, 1), expert_id=0, shard="gate")


def test_correction_bias_from_a_1xE_checkpoint_and_vllm_names():
    cfg = _cfg(router=mc.RouterConfig(scoring="softmax", use_correction_bias=True))
    layer = mc.MoELayer(cfg, manager=_manager())
    bias = torch.randn(1, E)
    assert layer.weight_loader("e_score_correction_bias", bias)
    assert torch.equal(layer.correction_bias, bias[0])


# --------------------------------------------------------------------------- from_hf_config


def _hf(model_type, **kw):
    return types.SimpleNamespace(**{**dict(model_type=model_type, hidden_size=64, num_hidden_layers=4, hidden_act="silu",
                                           num_experts_per_tok=2, dtype=torch.bfloat16), **kw})


def test_from_hf_config_families():
    ds = _hf("deepseek_v3", n_routed_experts=16, moe_intermediate_size=32, n_group=4, topk_group=2,
             routed_scaling_factor=2.5, norm_topk_prob=True, n_shared_experts=1, first_k_dense_replace=1)
    assert mc.MoEConfig.from_hf_config(ds, layer_idx=0) is None
    c = mc.MoEConfig.from_hf_config(ds, layer_idx=2, quant="fp8_block")
    assert (c.num_experts, c.intermediate_size, c.routed_scaling_factor, c.shared_intermediate_size, c.quant) == \
        (16, 32, 2.5, 32, mc.QuantScheme.FP8_BLOCK)
    assert c.router == mc.RouterConfig(scoring="sigmoid", renormalize=True, num_expert_group=4, topk_group=2,
                                       use_correction_bias=True, group_scoring="top2_sum")
    v2 = _hf("deepseek_v2", n_routed_experts=16, moe_intermediate_size=32, n_group=4, topk_group=2,
             topk_method="group_limited_greedy", routed_scaling_factor=1.5, n_shared_experts=2, first_k_dense_replace=0)
    c = mc.MoEConfig.from_hf_config(v2)
    assert c.router.group_scoring == "max" and not c.router.renormalize and c.shared_intermediate_size == 64
    oss = _hf("gpt_oss", num_local_experts=8, intermediate_size=48, swiglu_limit=7.0)
    c = mc.MoEConfig.from_hf_config(oss)
    assert c.activation is mc.Activation.SWIGLU_OAI and c.expert_bias and c.swiglu_limit == 7.0
    q2 = _hf("qwen2_moe", num_experts=8, moe_intermediate_size=16, shared_expert_intermediate_size=40,
             norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3])
    assert mc.MoEConfig.from_hf_config(q2, layer_idx=0) is None  # (0 + 1) % 2
    assert mc.MoEConfig.from_hf_config(q2, layer_idx=3) is None  # mlp_only_layers
    c = mc.MoEConfig.from_hf_config(q2, layer_idx=1)
    assert c.shared_intermediate_size == 40 and c.shared_expert_gate and not c.router.renormalize
    llama = types.SimpleNamespace(text_config=_hf("llama4_text", num_local_experts=4, intermediate_size=32,
                                                  moe_layers=[1, 3]), model_type="llama4")
    c = mc.MoEConfig.from_hf_config(llama)
    assert c.apply_router_weight_on_input and c.router.scoring == "sigmoid" and c.shared_intermediate_size == 32
    assert mc.MoEConfig.from_hf_config(llama, layer_idx=2) is None
    with pytest.raises(ValueError, match="model_type='dbrx' is not supported"):
        mc.MoEConfig.from_hf_config(_hf("dbrx"))
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        mc.MoEConfig.from_hf_config(_hf("mixtral", num_local_experts=4, intermediate_size=8, hidden_act="relu"))


def test_topk_ids_int64_asks_the_capture_query_off_the_default_stream_only(monkeypatch):
    """On CUDA tensors ``ids_int64`` asks whether a graph is being captured only when the current stream is not
    the default one (whose handle is 0: CUDA cannot capture it), and casts while capturing (decisions 53, 64)."""
    import moe_core.contracts as contracts

    ids64 = random_topk(6, E, K).ids.long()
    topk = mc.TopK(torch.rand(6, K), ids64)
    object.__setattr__(topk, "_int64_cuda", True)  # as if made on a GPU (the queries are faked below)
    asked, state = [], {"stream": 0, "capturing": False}
    monkeypatch.setattr(contracts, "_current_raw_stream", lambda device: (asked.append(("stream", device)), state["stream"])[1])
    monkeypatch.setattr(contracts, "_cuda_capturing", lambda: (asked.append("capture"), state["capturing"])[1])
    assert topk.ids_int64(cast=False) is ids64 and asked == [("stream", -1)]  # the default stream: no query
    asked.clear()
    state["stream"] = 0x7F00
    assert topk.ids_int64(cast=False) is ids64 and asked == [("stream", -1), "capture"]  # a side stream: asked
    state["capturing"] = True
    assert topk.ids_int64(cast=False) is None  # captured: the graph must read ids, which users refill in place
    got = topk.ids_int64()
    assert got is not ids64 and torch.equal(got, ids64)
