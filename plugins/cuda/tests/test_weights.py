"""Reading and laying out the expert weights (``weights``): the gate/up interleave and its idempotence."""

from __future__ import annotations

import torch

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
    # process_weights only uses these; the weight-descriptor cache is emptied (the weights may have moved)
    backend = types.SimpleNamespace(w13_layout=InterleavedW13(), _descriptors={"stale": object()})
    process = TritonExperts.process_weights
    want = interleave_gate_up(ckpt)
    process(backend, layer)
    assert torch.equal(layer.w13, want) and backend._descriptors == {}
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
