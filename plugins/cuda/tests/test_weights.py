"""Reading and laying out the expert weights (``weights``): the gate/up interleave and its idempotence."""

from __future__ import annotations

import pytest
import torch
from cuda_layer_cases import TOL, layers, needs_gpu, random_topk, random_weights

from moe_core.reference.oracle import relative_error

cuda = torch.cuda.is_available()


def test_interleave_gate_up_layout():
    from moe_plugin_cuda.weights import deinterleave_gate_up, interleave_gate_up, interleave_gate_up_

    E, inter, H = 3, 5, 4
    w13 = torch.randn(E, 2 * inter, H)
    il = interleave_gate_up(w13)
    for j in range(inter):
        assert torch.equal(il[:, 2 * j], w13[:, j]) and torch.equal(il[:, 2 * j + 1], w13[:, inter + j])
    assert torch.equal(deinterleave_gate_up(il), w13)
    in_place = w13.clone()
    assert interleave_gate_up_(in_place) is in_place and torch.equal(in_place, il)


def test_process_weights_interleaves_once():
    """Idempotent: a second call, or a re-wrapped Parameter over the same storage, is not
    interleaved again; a reload (in-place copy, as MoELayer.load_weights does) is."""
    import types

    from moe_plugin_cuda.triton.experts import TritonExperts
    from moe_plugin_cuda.weights import InterleavedW13, interleave_gate_up

    E, inter, H = 2, 6, 8
    ckpt = torch.randn(E, 2 * inter, H)
    layer = torch.nn.Module()
    layer.w13 = torch.nn.Parameter(ckpt.clone(), requires_grad=False)
    layer.w2 = torch.nn.Parameter(torch.randn(E, H, inter), requires_grad=False)
    # process_weights only uses these; the weight-descriptor cache and the recorded calls are emptied (the weights
    # may have moved)
    backend = types.SimpleNamespace(w13_layout=InterleavedW13(), _descriptors={"stale": object()},
                                    _programs={"stale": None})
    process = TritonExperts.process_weights
    want = interleave_gate_up(ckpt)
    process(backend, layer)
    assert torch.equal(layer.w13, want) and backend._descriptors == {} and backend._programs == {}
    process(backend, layer)
    assert torch.equal(layer.w13, want)
    layer.w13 = torch.nn.Parameter(layer.w13.data, requires_grad=False)  # re-wrapped
    process(backend, layer)
    assert torch.equal(layer.w13, want)
    with torch.no_grad():
        layer.w13.copy_(ckpt)  # reload
    process(backend, layer)
    assert torch.equal(layer.w13, want)
    layer.w13 = torch.nn.Parameter(ckpt.clone(), requires_grad=False)  # a new checkpoint tensor
    process(backend, layer)
    assert torch.equal(layer.w13, want)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad"])
def test_interleave_mark_works_for_inference_tensors(mode):
    """Inference tensors have no version counter (issue 28 item 2): the mark must still tell a
    processed w13 from one reloaded in place."""
    from moe_plugin_cuda.weights import InterleavedW13, interleave_gate_up_

    context = torch.inference_mode if mode == "inference_mode" else torch.no_grad
    with context():
        w13 = torch.nn.Parameter(torch.randn(3, 8, 16), requires_grad=False)
        mark = InterleavedW13()
        assert not mark.is_interleaved(w13)
        interleave_gate_up_(w13)
        mark.mark(w13)
        assert mark.is_interleaved(w13)
        w13.copy_(torch.randn(3, 8, 16))  # load_weights copies a new checkpoint in place
        assert not mark.is_interleaved(w13)


EVERY_BACKEND = [("triton", "unquantized"), ("triton", "fp8_block"), ("grouped_mm", "unquantized"),
                 ("grouped_mm", "fp8_per_token"), ("cutlass", "fp8_block"), ("cutlass", "unquantized")]
MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "plain": torch.enable_grad}


@needs_gpu
@pytest.mark.parametrize("backend,quant", EVERY_BACKEND)
@pytest.mark.parametrize("mode", list(MODES))
def test_build_load_process_run_under_inference_mode(backend, quant, mode):
    """Engines create weights, load, process and run under torch.inference_mode(): inference tensors
    have no version counter (issue 28 item 2: process_weights read ``t._version`` and raised). Reloading
    a new checkpoint in place must still be processed again."""
    with MODES[mode]():
        cfg, layer, ref = layers(backend, quant)
        x, topk = torch.randn(77, cfg.hidden_size, device="cuda").to(cfg.params_dtype), random_topk(77, cfg)
        assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]
        layer.process_weights()  # idempotent
        assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]
        w = random_weights(cfg, torch.Generator(device="cuda").manual_seed(11))
        for lay in (layer, ref):
            lay.load_weights(**w)
            lay.process_weights()
        assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]
