"""MoELayer as an nn.Module: device/dtype conversions, state dicts, composition (issue 28, item 1)."""

import pytest
import torch
from torch import nn

import moe_core as mc

from .conftest import checkpoint, random_topk, random_weights

CFG = mc.MoEConfig(num_experts=6, top_k=2, hidden_size=64, intermediate_size=32)


def loaded(cfg=CFG, weights=None):
    layer = mc.MoELayer(cfg)
    layer.load_weights(**(weights or checkpoint(cfg.quant, cfg.num_experts, cfg.hidden_size, cfg.intermediate_size)))
    layer.process_weights()
    return layer


@pytest.mark.parametrize("convert", [
    lambda m: m.to("cpu"), lambda m: m.cpu(), lambda m: m.share_memory(), lambda m: m.to(torch.device("cpu")),
    lambda m: nn.Sequential(m).to("cpu")[0], lambda m: m.to_empty(device="cpu") and None,
])
def test_device_conversions_keep_the_layer_working(convert):
    layer = loaded()
    x, topk = torch.randn(7, 64).bfloat16(), random_topk(7, 6, 2)
    before = layer(x, topk)
    out = convert(layer)
    if out is None:  # to_empty drops the data: the layer needs loading again
        with pytest.raises(RuntimeError, match="process_weights"):
            layer(x, topk)
        return
    assert out is layer
    assert torch.equal(layer(x, topk), before)


@pytest.mark.parametrize("scheme", ["unquantized", "fp8_block", "int8_w8a8"])
def test_half_and_float_change_params_dtype_and_keep_quantized_tensors(scheme):
    cfg = CFG.replace(quant=scheme)
    layer = loaded(cfg)
    kept = {n: t.dtype for n, t in layer.weight_tensors().items() if t.dtype != torch.bfloat16}
    x, topk = torch.randn(5, 64), random_topk(5, 6, 2)
    for convert, dtype in ((nn.Module.half, torch.float16), (nn.Module.float, torch.float32),
                           (lambda m: m.to(torch.bfloat16), torch.bfloat16)):
        weights = {n: t.clone() for n, t in layer.weight_tensors().items()}
        convert(layer)
        assert layer.config.params_dtype == dtype and layer.plan.config == layer.config
        # quantized weights and their scales keep their dtype; full-precision weights follow
        for name, t in layer.weight_tensors().items():
            assert t.dtype == kept.get(name, dtype), name
        with pytest.raises(TypeError, match=f"hidden_states must be {dtype}"):
            layer(x.to(torch.float64), topk)
        # the converted layer is the layer built in that dtype from the same weights
        built = loaded(cfg.replace(params_dtype=dtype), weights)
        assert torch.equal(layer(x.to(dtype), topk), built(x.to(dtype), topk))
    with pytest.raises(TypeError, match="params_dtype can become"):
        layer.double()


def test_state_dict_is_a_first_class_way_to_load():
    src = loaded()
    x, topk = torch.randn(5, 64).bfloat16(), random_topk(5, 6, 2)
    dst = mc.MoELayer(CFG)
    dst.load_state_dict(src.state_dict())
    dst.process_weights()
    assert torch.equal(dst(x, topk), src(x, topk))
    # inside a model, through the parent's state dict
    model = nn.Sequential(nn.Identity(), mc.MoELayer(CFG))
    model.load_state_dict(nn.Sequential(nn.Identity(), src).state_dict())
    model[1].process_weights()
    assert torch.equal(model[1](x, topk), src(x, topk))
    # an incomplete state dict does not count as loaded
    partial = mc.MoELayer(CFG)
    partial.load_state_dict({"w13": src.w13.clone()}, strict=False)
    with pytest.raises(RuntimeError, match="before load_weights"):
        partial.process_weights()


def test_meta_layer_refuses_with_a_hint_and_materializes():
    layer = mc.MoELayer(CFG, device="meta")
    w13, w2 = random_weights(6, 64, 32)
    layer.load_weights(w13=w13.bfloat16(), w2=w2.bfloat16())
    with pytest.raises(RuntimeError, match=r"meta device.*to_empty"):
        layer.process_weights()
    layer.to_empty(device="cpu")
    assert layer.device == torch.device("cpu") and layer.w13.device.type == "cpu"
    layer.load_weights(w13=w13.bfloat16(), w2=w2.bfloat16())
    layer.process_weights()
    assert layer(torch.randn(3, 64).bfloat16(), random_topk(3, 6, 2)).shape == (3, 64)


@pytest.mark.parametrize("scheme", ["unquantized", "fp8_block"])
def test_built_around_existing_weights_allocates_none(scheme, monkeypatch):
    cfg = CFG.replace(quant=scheme)
    dtypes = {n: t.dtype for n, t in mc.MoELayer(cfg).weight_tensors().items()}
    ck = {n: t.to(dtypes[n]) for n, t in checkpoint(cfg.quant, 6, 64, 32).items()}
    allocated = []
    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: allocated.append(a) or real_empty(*a, **k))
    layer = mc.MoELayer(cfg, weights=ck)
    monkeypatch.undo()
    assert not [a for a in allocated if a and a[0] not in ((6,), 0)], allocated  # no weight-sized torch.empty
    for name, t in layer.weight_tensors().items():
        assert t.data_ptr() == ck[name].data_ptr(), name  # views of the given tensors
    assert list(layer.state_dict())[:len(ck)] == list(mc.MoELayer(cfg).state_dict())[:len(ck)]  # same order
    layer.process_weights()
    x, topk = torch.randn(9, 64).bfloat16(), random_topk(9, 6, 2, drop=0.2)
    assert torch.equal(layer(x, topk), loaded(cfg, ck)(x, topk))
    bad = dict(ck, w2=ck["w2"][:, :, :16])
    with pytest.raises(ValueError, match=r"adopt_weights: w2 must be a \(6, 64, 32\)"):
        mc.MoELayer(cfg, weights=bad)


@pytest.mark.parametrize("mode", [torch.inference_mode, torch.no_grad, torch.enable_grad])
@pytest.mark.parametrize("scheme", ["unquantized", "fp8_block", "nvfp4"])
def test_reference_builds_loads_processes_and_runs_in_every_grad_mode(mode, scheme):
    """Engines build, load and run under torch.inference_mode() (issue 28 item 2)."""
    cfg = CFG.replace(quant=scheme)
    with mode():
        ckpt = checkpoint(cfg.quant, 6, 64, 32)
        layer = loaded(cfg, ckpt)
        x, topk = torch.randn(9, 64).bfloat16(), random_topk(9, 6, 2)
        out = layer(x, topk)
        layer.load_weights(**ckpt)
        layer.process_weights()
        assert torch.equal(layer(x, topk), out)
