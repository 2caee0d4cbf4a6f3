"""The quantizers against their written definitions, element by element."""

import pytest
import torch

from moe_core import quant
from moe_core.contracts import FP8_DTYPE, QuantScheme, WireDtype


def test_fp8_group_scale_is_group_amax_over_448():
    x = torch.randn(3, 300)  # odd hidden size: the last group has 44 channels
    q, s = quant.quantize_fp8_per_token_group(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.shape == (3, 3)
    for g in range(3):
        blk = x[:, g * 128:(g + 1) * 128]
        torch.testing.assert_close(s[:, g], blk.abs().amax(dim=1) / 448.0)
        expected = (blk / s[:, g:g + 1]).clamp(-448, 448).to(FP8_DTYPE)
        assert torch.equal(q[:, g * 128:(g + 1) * 128].view(torch.uint8), expected.view(torch.uint8))
    rel = (quant.dequantize_fp8_per_token_group(q, s) - x).norm() / x.norm()
    assert 0 < rel < 0.04


def test_fp8_ue8m0_scales_are_powers_of_two_covering_amax():
    x = torch.randn(4, 256) * 3
    q, s = quant.quantize_fp8_per_token_group(x, ue8m0=True)
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    assert (s * 448 >= x.view(4, 2, 128).abs().amax(-1)).all()


@pytest.mark.parametrize("qmax,fn", [(127, quant.quantize_int8_per_token), (7, quant.quantize_int4_per_token)])
def test_int_per_token(qmax, fn):
    x = torch.randn(5, 33)
    q, s = fn(x)
    torch.testing.assert_close(s.squeeze(1), x.abs().amax(1) / qmax)
    assert torch.equal(q, torch.round(x / s).clamp(-qmax, qmax).to(torch.int8))
    assert q.abs().max() == qmax


def test_e2m1_rounding_ties_to_even_code_and_packing():
    # magnitudes at every tie and a few others; the block amax 6 makes the block scale exactly 1 * gs/gs
    vals = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.3, -6.0, 0.0, 1.0, 4.0, -1.5, 2.0, 3.0])
    gs = torch.tensor(1.0)
    packed, scale = quant.quantize_nvfp4(vals.unsqueeze(0), gs)
    assert scale.float().item() == 1.0
    expected = torch.tensor([6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.5, -6.0, 0.0, 1.0, 4.0, -1.5, 2.0, 3.0])
    torch.testing.assert_close(quant.dequantize_nvfp4(packed, scale, gs).squeeze(0), expected)
    # even element in the low nibble: codes of 6.0 (7) and 0.25 (0)
    assert packed[0, 0].item() == 0x07
    assert packed[0, 4].item() & 0x0F == 0x8 | 1  # -0.3 -> -0.5 = sign | code 1


@pytest.mark.parametrize("dtype", list(WireDtype))
def test_activation_round_trip(dtype):
    x = torch.randn(7, 256)
    qa = quant.quantize_activations(x, dtype)
    assert qa.dtype is dtype and tuple(qa.shape) == (7, 256)
    rel = ((qa.dequantize() - x).norm() / x.norm()).item()
    assert rel < {WireDtype.BF16: 1e-6, WireDtype.FP8: 0.04, WireDtype.INT8: 0.01, WireDtype.NVFP4: 0.12}[dtype]


@pytest.mark.parametrize("scheme", list(QuantScheme))
def test_weight_round_trip_and_shapes(scheme):
    w13, w2 = torch.randn(3, 64, 48) / 7, torch.randn(3, 48, 32) / 6
    t = quant.quantize_weights(w13, w2, scheme)
    shapes = quant.weight_shapes(scheme, 3, 48, 32, torch.float32)
    assert set(t) == set(shapes)
    for name, (shape, dtype) in shapes.items():
        assert tuple(t[name].shape) == shape and t[name].dtype == dtype, name
    d13, d2 = quant.dequantize_weights(t, scheme)
    bound = {QuantScheme.UNQUANTIZED: 1e-7, QuantScheme.FP8_BLOCK: 0.04, QuantScheme.FP8_PER_TOKEN: 0.04,
             QuantScheme.INT8_W8A8: 0.01,
             QuantScheme.W4A4: 0.15, QuantScheme.NVFP4: 0.12}[scheme]
    assert ((d13 - w13).norm() / w13.norm()).item() <= bound
    assert ((d2 - w2).norm() / w2.norm()).item() <= bound


def test_fp8_per_token_activations_and_per_channel_weights_follow_their_definition():
    x = torch.randn(5, 300) * 3  # odd hidden size: one scale per row, whatever H is
    q, s = quant.quantize_fp8_per_token(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape and s.shape == (5, 1) and s.dtype == torch.float32
    torch.testing.assert_close(s, x.abs().amax(dim=1, keepdim=True) / 448.0)
    assert torch.equal(q.view(torch.uint8), (x / s).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8))
    assert torch.equal(quant.dequantize_fp8_per_token(q, s), q.float() * s)
    assert q.float().abs().amax(dim=1).eq(448).all()  # each row's amax lands on the top of the grid
    q0, s0 = quant.quantize_fp8_per_token(torch.zeros(2, 64))  # all-zero row: finite scale, zeros
    assert torch.equal(q0.float(), torch.zeros(2, 64)) and (s0 > 0).all()
    assert quant.quantize_fp8_per_token(torch.randn(0, 64))[1].shape == (0, 1)  # T = 0
    # weights: one fp32 scale per output channel (row of [E, N, K]), the int8_w8a8 layout
    w13, w2 = torch.randn(3, 64, 48), torch.randn(3, 48, 32)
    t = quant.quantize_weights(w13, w2, QuantScheme.FP8_PER_TOKEN)
    for name, w in (("w13", w13), ("w2", w2)):
        scale = w.abs().amax(dim=-1) / 448.0
        torch.testing.assert_close(t[f"{name}_scale"], scale)
        expected = (w / scale.unsqueeze(-1)).clamp(-448, 448).to(FP8_DTYPE)
        assert torch.equal(t[name].view(torch.uint8), expected.view(torch.uint8))
    d13, _ = quant.dequantize_weights(t, QuantScheme.FP8_PER_TOKEN)
    assert torch.equal(d13, t["w13"].float() * t["w13_scale"].unsqueeze(-1))
