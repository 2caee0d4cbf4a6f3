"""Unit tests of the emulated AITER ops against straightforward computations from their docs."""

from __future__ import annotations

import pytest
import rocm_emulation
import torch

aiter_emu = rocm_emulation.aiter_emu


def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def make_weights(E, H, inter, dtype=torch.bfloat16):
    w1 = (torch.randn(E, 2 * inter, H) / H**0.5).to(dtype)
    w2 = (torch.randn(E, H, inter) / inter**0.5).to(dtype)
    return w1, w2


def block_quant(w, fp8):
    """128x128 block FP8 quantization of [E, N, K]: (q, scale [E, N/128, K/128])."""
    E, N, K = w.shape
    fmax = torch.finfo(fp8).max
    blocks = w.float().view(E, N // 128, 128, K // 128, 128)
    s = blocks.abs().amax(dim=(2, 4)) / fmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (blocks / s[:, :, None, :, None]).clamp(-fmax, fmax).to(fp8).view(E, N, K)
    return q, s


# ----------------------------------------------------------------------------- shuffle


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fnuz, torch.float8_e4m3fn])
def test_shuffle_weight_is_the_documented_permutation(dtype):
    E, N, K = 2, 32, 64
    x = torch.randn(E, N, K).to(dtype)
    y = aiter_emu.shuffle_weight(x)
    assert y.is_shuffled is True and y.shape == x.shape and y.dtype == dtype
    # independent index formula: element (e, n, k) lands at (e, n//16, k//32, (k%32)//P, n%16, k%P)
    P = 16 // x.element_size()
    e, n, k = torch.meshgrid(torch.arange(E), torch.arange(N), torch.arange(K), indexing="ij")
    dest = y.view(torch.uint8).view(E, N // 16, K // 32, 32 // P, 16, P) if dtype != torch.bfloat16 else \
        y.view(E, N // 16, K // 32, 32 // P, 16, P)
    src = x.view(torch.uint8) if dtype != torch.bfloat16 else x
    moved = dest[e, n // 16, k // 32, (k % 32) // P, n % 16, k % P]
    assert torch.equal(moved, src)
    # and the emulation's inverse recovers the input bit for bit
    back = aiter_emu.unshuffle_weight(y)
    assert torch.equal(back.view(torch.uint8), x.view(torch.uint8))
    assert not torch.equal(y.view(torch.uint8), x.view(torch.uint8))


def test_shuffle_weight_rejects_unaligned_shapes():
    with pytest.raises(AssertionError):
        aiter_emu.shuffle_weight(torch.randn(1, 24, 64).bfloat16())
    with pytest.raises(AssertionError):
        aiter_emu.shuffle_weight(torch.randn(1, 32, 48).bfloat16())


# ----------------------------------------------------------------------------- fused_moe


def test_fused_moe_bf16_matches_loop():
    E, H, inter, M, K = 4, 64, 32, 7, 2
    w1, w2 = make_weights(E, H, inter)
    x = torch.randn(M, H).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)]).int()
    w = torch.rand(M, K)
    out = aiter_emu.fused_moe(x, w1, w2, w, ids, _arch="gfx942")
    ref = aiter_emu.torch_moe_reference(x, w1, w2, w, ids)
    assert out.dtype == torch.bfloat16
    assert rel(out, ref) < 1e-2


def test_fused_moe_gelu_and_doweight_stage1():
    E, H, inter, M, K = 3, 32, 32, 5, 2
    w1, w2 = make_weights(E, H, inter)
    x = torch.randn(M, H).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)]).int()
    w = torch.rand(M, K)
    out = aiter_emu.fused_moe(x, w1, w2, w, ids, activation=aiter_emu.ActivationType.Gelu, _arch="gfx942")
    ref = aiter_emu.torch_moe_reference(x, w1, w2, w, ids, aiter_emu.ActivationType.Gelu)
    assert rel(out, ref) < 1e-2
    # weighting after stage 1 is the same linear map for unquantized weights
    out1 = aiter_emu.fused_moe(x, w1, w2, w, ids, doweight_stage1=True, _arch="gfx942")
    assert rel(out1, aiter_emu.torch_moe_reference(x, w1, w2, w, ids)) < 1e-2


def test_expert_mask_cumsum_semantics():
    E_global, H, inter, M, K = 8, 32, 32, 9, 3
    mask = torch.tensor([0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.int32)
    E_local = int(mask.sum())
    w1, w2 = make_weights(E_local, H, inter)
    x = torch.randn(M, H).bfloat16()
    ids = torch.stack([torch.randperm(E_global)[:K] for _ in range(M)]).int()
    w = torch.rand(M, K)
    out = aiter_emu.fused_moe(x, w1, w2, w, ids, expert_mask=mask, _arch="gfx950")
    # straightforward: local index = number of local experts before it; others contribute 0
    loc_ids = torch.zeros_like(ids)
    loc_w = torch.zeros_like(w)
    for t in range(M):
        for k in range(K):
            g = int(ids[t, k])
            if mask[g]:
                loc_ids[t, k] = int(mask[:g].sum())
                loc_w[t, k] = w[t, k]
    ref = aiter_emu.torch_moe_reference(x, w1, w2, loc_w, loc_ids)
    assert rel(out, ref) < 1e-2
    # a token whose experts are all masked off gets zeros, not garbage
    ids2 = torch.tensor([[0, 2, 5]] * 2, dtype=torch.int32)
    z = aiter_emu.fused_moe(x[:2], w1, w2, w[:2], ids2, expert_mask=mask, _arch="gfx950")
    assert torch.equal(z.float(), torch.zeros(2, H))


def test_num_local_tokens_reads_only_valid_rows():
    E, H, inter, M, K, n = 4, 32, 32, 10, 2, 6
    w1, w2 = make_weights(E, H, inter)
    x = torch.randn(M, H).bfloat16()
    x[n:] = float("nan")  # garbage rows
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)]).int()
    ids[n:] = 12345  # out-of-range garbage ids must not be read either
    w = torch.rand(M, K)
    out = aiter_emu.fused_moe(x, w1, w2, w, ids, num_local_tokens=torch.tensor([n], dtype=torch.int32),
                              _arch="gfx942")
    ref = aiter_emu.torch_moe_reference(x[:n], w1, w2, w[:n], ids[:n])
    assert rel(out[:n], ref) < 1e-2
    assert torch.isnan(out[n:].float()).all()  # never written
    with pytest.raises(AssertionError):
        aiter_emu.fused_moe(x, w1, w2, w, ids, _arch="gfx942")  # without it the garbage ids are read


def test_minus_one_ids_are_rejected():
    w1, w2 = make_weights(2, 32, 32)
    ids = torch.tensor([[0, -1]], dtype=torch.int32)
    with pytest.raises(AssertionError):
        aiter_emu.fused_moe(torch.randn(1, 32).bfloat16(), w1, w2, torch.rand(1, 2), ids, _arch="gfx942")


def test_is_shuffled_flag_selects_layout():
    E, H, inter, M, K = 2, 64, 32, 5, 1
    w1, w2 = make_weights(E, H, inter)
    x = torch.randn(M, H).bfloat16()
    ids = torch.randint(0, E, (M, K), dtype=torch.int32)
    w = torch.rand(M, K)
    plain = aiter_emu.fused_moe(x, w1, w2, w, ids, _arch="gfx942")
    s1, s2 = aiter_emu.shuffle_weight(w1), aiter_emu.shuffle_weight(w2)
    assert torch.equal(aiter_emu.fused_moe(x, s1, s2, w, ids, _arch="gfx942"), plain)
    lost = torch.nn.Parameter(s1.data, requires_grad=False)  # re-wrapping drops the attribute
    assert not getattr(lost, "is_shuffled", False)
    garbled = aiter_emu.fused_moe(x, lost, s2, w, ids, _arch="gfx942")
    assert rel(garbled, plain) > 0.5


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_fp8_block_matches_fp32_and_checks_flavour(arch):
    fp8 = aiter_emu.ARCH_FP8[arch]
    E, H, inter, M, K = 3, 256, 128, 9, 2
    w1, w2 = make_weights(E, H, inter, torch.float32)
    q1, s1 = block_quant(w1, fp8)
    q2, s2 = block_quant(w2, fp8)
    x = torch.randn(M, H).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)]).int()
    w = torch.rand(M, K)
    QT = aiter_emu.QuantType
    out = aiter_emu.fused_moe(x, q1, q2, w, ids, quant_type=QT.per_1x128, w1_scale=s1, w2_scale=s2, _arch=arch)
    # documented recipe: dequantized weights; amax/fp8max scales per 128 channels before each GEMM
    fmax = torch.finfo(fp8).max

    def q128(v):
        g = v.view(-1, 128)
        s = g.abs().amax(-1, keepdim=True) / fmax
        s = torch.where(s == 0, torch.ones_like(s), s)
        return ((g / s).clamp(-fmax, fmax).to(fp8).float() * s).view(-1)

    d1 = q1.float() * s1.repeat_interleave(128, 1).repeat_interleave(128, 2)
    d2 = q2.float() * s2.repeat_interleave(128, 1).repeat_interleave(128, 2)
    ref = aiter_emu.torch_moe_reference(x, d1, d2, w, ids, act_quant=q128)
    assert rel(out, ref) < 1e-2
    # and FP8 is FP8: within a few percent of the unquantized layer
    assert rel(out, aiter_emu.torch_moe_reference(x, w1, w2, w, ids)) < 0.1
    # pre-quantized input with its 1x128 scales gives the same result as dynamic quantization
    xq, xs = aiter_emu._fp8_quant(x.float(), fp8, 128)
    out_pre = aiter_emu.fused_moe(xq, q1, q2, w, ids, quant_type=QT.per_128x128, w1_scale=s1, w2_scale=s2,
                                  a1_scale=xs, dtype=torch.bfloat16, _arch=arch)
    assert torch.equal(out_pre, out)
    other = aiter_emu.ARCH_FP8["gfx950" if arch == "gfx942" else "gfx942"]
    with pytest.raises(AssertionError):
        aiter_emu.fused_moe(x, q1.float().to(other), q2.float().to(other), w, ids, quant_type=QT.per_1x128,
                            w1_scale=s1, w2_scale=s2, _arch=arch)


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
def test_fp8_per_token(arch):
    fp8 = aiter_emu.ARCH_FP8[arch]
    E, H, inter, M, K = 2, 64, 32, 6, 2
    w1, w2 = make_weights(E, H, inter, torch.float32)
    fmax = torch.finfo(fp8).max
    s1 = w1.abs().amax(-1, keepdim=True) / fmax
    s2 = w2.abs().amax(-1, keepdim=True) / fmax
    q1, q2 = (w1 / s1).to(fp8), (w2 / s2).to(fp8)
    x = torch.randn(M, H).bfloat16()
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(M)]).int()
    w = torch.rand(M, K)
    out = aiter_emu.fused_moe(x, q1, q2, w, ids, quant_type=aiter_emu.QuantType.per_Token, w1_scale=s1,
                              w2_scale=s2, _arch=arch)

    def qtok(v):
        s = v.abs().amax() / fmax
        return (v / s).clamp(-fmax, fmax).to(fp8).float() * s

    ref = aiter_emu.torch_moe_reference(x, q1.float() * s1, q2.float() * s2, w, ids, act_quant=qtok)
    assert rel(out, ref) < 1e-2
    # pre-quantized input with one scale per token ([M, 1]) gives the same result
    xs = x.float().abs().amax(-1, keepdim=True) / fmax
    xq = (x.float() / xs).clamp(-fmax, fmax).to(fp8)
    out_pre = aiter_emu.fused_moe(xq, q1, q2, w, ids, quant_type=aiter_emu.QuantType.per_Token, w1_scale=s1,
                                  w2_scale=s2, a1_scale=xs, dtype=torch.bfloat16, _arch=arch)
    assert torch.equal(out_pre, out)
