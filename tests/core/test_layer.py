"""MoELayer behaviour: bad input, weight loading and slicing, idempotence, tracing."""

import logging

import pytest
import torch

import moe_core as mc
from moe_core.reference.oracle import relative_error

from .conftest import checkpoint, random_topk

CFG = mc.MoEConfig(num_experts=6, top_k=2, hidden_size=64, intermediate_size=32)


@pytest.fixture
def layer():
    layer = mc.MoELayer(CFG)
    layer.load_weights(**checkpoint(CFG.quant, 6, 64, 32))
    layer.process_weights()
    return layer


def x_bf16(t=5, h=64):
    return torch.randn(t, h).to(torch.bfloat16)


@pytest.mark.parametrize("bad,match", [
    (lambda: (torch.randn(5, 63).bfloat16(), random_topk(5, 6, 2)), r"hidden_states must be a \[T, 64\]"),
    (lambda: (torch.randn(5, 64), random_topk(5, 6, 2)), "hidden_states must be torch.bfloat16"),
    (lambda: (x_bf16(), random_topk(4, 6, 2)), r"topk.ids must be \[T=5, top_k=2\]"),
    (lambda: (x_bf16(), random_topk(5, 6, 3)), r"topk.ids must be \[T=5, top_k=2\]"),
    (lambda: (x_bf16(), mc.TopK(torch.ones(5, 2), torch.full((5, 2), 6, dtype=torch.int32))),
     r"topk.ids must be in \[-1, 6\)"),
    (lambda: (x_bf16(), mc.TopK(torch.ones(5, 2), torch.full((5, 2), -2, dtype=torch.int32))),
     r"topk.ids must be in \[-1, 6\)"),
    (lambda: (x_bf16(), (torch.ones(5, 2), torch.zeros(5, 2, dtype=torch.int32))), "topk must be a moe_core.TopK"),
])
def test_bad_input_names_the_argument(layer, bad, match):
    x, topk = bad()
    with pytest.raises((ValueError, TypeError), match=match):
        layer(x, topk)


def test_id_check_modes(layer):
    bad = mc.TopK(torch.ones(5, 2), torch.full((5, 2), 6, dtype=torch.int32))
    with pytest.raises(ValueError, match="check_ids must be"):
        mc.MoELayer(CFG, check_ids="always")
    # the accelerator path (device-side assert, no host sync), exercised on CPU where it raises at once
    layer._sync_check = False
    with pytest.raises(RuntimeError, match=r"topk.ids must be in \[-1, 6\)"):
        layer(x_bf16(), bad)
    assert layer(x_bf16(), random_topk(5, 6, 2)).shape == (5, 64)
    off = mc.MoELayer(CFG, check_ids=False)
    assert not off.check_ids and mc.MoELayer(CFG, check_ids="sync")._sync_check


def test_torch_compile_matches_eager_and_keeps_the_id_check(layer):
    """Under torch.compile the id check is the device-side assert on every device (the CPU's host read
    would break the graph on data): same output as eager, bad ids still fail with the message."""
    compiled = torch.compile(layer)
    x, topk = x_bf16(7), random_topk(7, 6, 2)
    assert torch.equal(compiled(x, topk), layer(x, topk))
    bad = mc.TopK(topk.weights, topk.ids.clone())
    bad.ids[3, 1] = 6
    with pytest.raises(RuntimeError, match=r"topk.ids must be in \[-1, 6\)"):
        compiled(x, bad)


def test_topk_dtypes_are_checked_at_construction():
    with pytest.raises(TypeError, match="TopK.ids must be torch.int32"):
        mc.TopK(torch.ones(2, 2), torch.zeros(2, 2, dtype=torch.int16))
    with pytest.raises(TypeError, match="TopK.weights must be torch.float32"):
        mc.TopK(torch.ones(2, 2, dtype=torch.float64), torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"both be \[T, K\]"):
        mc.TopK(torch.ones(2, 2), torch.zeros(2, 3, dtype=torch.int32))


def test_forward_before_weights_and_bad_checkpoints():
    layer = mc.MoELayer(CFG)
    with pytest.raises(RuntimeError, match="load_weights"):
        layer(x_bf16(), random_topk(5, 6, 2))
    with pytest.raises(RuntimeError, match="before load_weights"):
        layer.process_weights()
    t = checkpoint(CFG.quant, 6, 64, 32)
    with pytest.raises(ValueError, match=r"missing \['w2'\]"):
        layer.load_weights(w13=t["w13"])
    with pytest.raises(ValueError, match=r"w13 must have shape \(6, 64, 64\)"):
        layer.load_weights(w13=t["w13"][:, :10], w2=t["w2"])
    fp8 = mc.MoELayer(CFG.replace(quant="fp8_block"))
    with pytest.raises(TypeError, match="w13 must be torch.float8_e4m3fn"):
        fp8.load_weights(**{**checkpoint(mc.QuantScheme.FP8_BLOCK, 6, 64, 32), "w13": t["w13"]})


def test_zero_tokens_and_idempotent_process_weights(layer):
    out = layer(x_bf16(0), random_topk(0, 6, 2))
    assert out.shape == (0, 64)
    x, topk = x_bf16(7), random_topk(7, 6, 2, drop=0.3)
    first = layer(x, topk)
    layer.process_weights()
    layer.process_weights()
    assert torch.equal(layer(x, topk), first)


def test_trace_mode_goes_through_pluggy_and_matches(layer, caplog):
    traced = mc.MoELayer(CFG, trace=True)
    traced.load_state_dict(layer.state_dict())
    traced.load_weights(**{k: v for k, v in layer.weight_tensors().items()})
    traced.process_weights()
    x, topk = x_bf16(), random_topk(5, 6, 2)
    with caplog.at_level(logging.DEBUG, logger="moe_core.trace"):
        out = traced(x, topk)
    assert torch.equal(out, layer(x, topk))
    assert "-> dispatch" in caplog.text and "-> apply" in caplog.text and "-> combine" in caplog.text


def test_pass_through_dispatcher_runs_the_experts_on_the_token_list(layer, monkeypatch):
    """Single rank, bf16 wire: the standard dispatcher only wraps and unwraps, so the layer calls the experts'
    ``apply_tokens`` (no contract objects per forward): the three stages' bytes, the default ``apply_tokens`` of
    an experts backend that only has ``apply`` included; traced layers and EP ranks keep the three stages."""
    assert layer.dispatcher.passes_tokens_through and layer._apply_tokens is not None
    x, topk = x_bf16(9), random_topk(9, 6, 2, drop=0.3)
    staged = layer._combine(layer._apply_experts(layer, layer._dispatch(x, topk)))
    assert torch.equal(layer(x, topk), staged)
    # the base class's apply_tokens (what a backend without its own hot path gets): the contracts, then apply
    calls = []
    apply = layer.experts.apply
    monkeypatch.setattr(layer.experts, "apply", lambda lay, d: calls.append(type(d).__name__) or apply(lay, d))
    assert torch.equal(mc.plugin_api.Experts.apply_tokens(layer.experts, layer, x, topk), staged)
    assert calls == ["StandardDispatch"]
    assert mc.MoELayer(CFG, trace=True)._apply_tokens is None


def test_ep_rank_loads_its_slice_of_a_full_checkpoint():
    t = checkpoint(mc.QuantScheme.INT8_W8A8, 8, 64, 32)
    cfg = mc.MoEConfig(num_experts=8, top_k=2, hidden_size=64, intermediate_size=32, quant="int8_w8a8",
                       ep_size=4, ep_rank=2, dispatcher="standard")
    layer = mc.MoELayer(cfg)
    layer.load_weights(**t)
    for name, full in t.items():
        assert torch.equal(getattr(layer, name), full[4:6]), name


def test_standard_dispatcher_under_ep_remaps_ids_and_sums_over_ranks_like_one_process(monkeypatch):
    """Two ranks simulated in one process: each computes its experts' share; the sum is the result."""
    import torch.distributed as dist

    t = checkpoint(mc.QuantScheme.UNQUANTIZED, 6, 64, 32)
    x, topk = x_bf16(9), random_topk(9, 6, 2, drop=0.2)
    full = mc.MoELayer(CFG)
    full.load_weights(**t)
    full.process_weights()
    partial = []
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: partial.append(tensor.float().clone()))
    for rank in range(2):
        layer = mc.MoELayer(CFG.replace(ep_size=2, ep_rank=rank, dispatcher="standard"))
        assert layer.plan.dispatcher.name == "standard"
        assert not layer.dispatcher.passes_tokens_through and layer._apply_tokens is None  # (remap, all-reduce)
        layer.load_weights(**t)
        layer.process_weights()
        layer(x, topk)
    assert relative_error(partial[0] + partial[1], full(x, topk)) < 1e-2
