"""Unit tests of the emulated FlashInfer ops (tests/emulation/flashinfer_emulation.py), each against a
straightforward computation from FlashInfer's documentation (vendor-apis.md section 2): the NVFP4
recipe element by element in Python, the logical (32, 4, rm, 4, rk, l) index of every block scale,
and a float64 GEMM of the dequantized operands."""

from __future__ import annotations

import math

import flashinfer_emulation as fe
import pytest
import torch
import torch.nn.functional as F

GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# --------------------------------------------------------------------------- straightforward NVFP4


def py_e2m1(t: float) -> int:
    """e2m1 code of ``t`` (clamped to +-6): nearest grid value, ties to the even code; bit 3 the sign."""
    mag = min(abs(t), 6.0)
    code = min(range(8), key=lambda c: (abs(mag - GRID[c]), c % 2))
    return code | (8 if t < 0 else 0)


def py_quantize(x: torch.Tensor, gs: torch.Tensor, rows: int) -> tuple[list[list[int]], list[list[float]]]:
    """The documented recipe on the first ``rows`` rows of ``x [m, k]`` (fp32): per 16-block
    ``s = e4m3(min(gs * amax / 6, 448))``, ``q = e2m1(x * gs / s)``; bytes with the even element low."""
    data, scales = [], []
    gs32 = gs.float().reshape(())
    for r in range(rows):
        row_bytes, row_scales = [], []
        for b in range(x.shape[1] // 16):
            blk = x[r, 16 * b:16 * b + 16].float()
            s = (gs32 * blk.abs().max() / 6.0).clamp(max=448.0).to(torch.float8_e4m3fn).float()
            row_scales.append(float(s))
            codes = [py_e2m1(float(v * gs32 / s)) if float(s) > 0 else 0 for v in blk]
            row_bytes += [codes[i] | (codes[i + 1] << 4) for i in range(0, 16, 2)]
        data.append(row_bytes)
        scales.append(row_scales)
    return data, scales


def py_dequantize(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 ``[m, k/2]`` and linear scales ``[m, k/16]`` -> float64 ``[m, k]``."""
    out = torch.zeros(packed.shape[0], packed.shape[1] * 2, dtype=torch.float64)
    for r in range(packed.shape[0]):
        for j, byte in enumerate(packed[r].tolist()):
            for half, code in ((0, byte & 0xF), (1, byte >> 4)):
                col = 2 * j + half
                value = GRID[code & 7] * (-1 if code & 8 else 1)
                out[r, col] = value * float(scales[r, col // 16].float())
    return out


def logical_scale(sf: torch.Tensor, layer: int, r: int, c: int) -> float:
    """Block scale ``(r, c)`` of batch ``layer`` read through the documented logical index
    ``(m32, m4, rm, k4, rk, l)`` with ``r = 128 * rm + 32 * m4 + m32`` and ``c = 4 * rk + k4``."""
    return float(sf[r % 32, (r % 128) // 32, r // 128, c % 4, c // 4, layer].float())


def unswizzle_by_index(sf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    l = sf.shape[-1]
    out = torch.empty(l, rows, cols)
    for layer in range(l):
        for r in range(rows):
            for c in range(cols):
                out[layer, r, c] = logical_scale(sf, layer, r, c)
    return out


# --------------------------------------------------------------------------- e2m1 and quantization


def test_e2m1_rounding_ties_and_clamp():
    # ties to the even code (vendor-apis: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4)
    mags = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.0, 0.26, 0.74, 2.49, 2.51, 4.99, 5.01, 6.0, 1.0]
    want = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 0.0, 0.5, 0.5, 2.0, 3.0, 4.0, 6.0, 6.0, 1.0]
    codes = fe.e2m1_codes(torch.tensor(mags))
    assert [GRID[c] for c in codes.tolist()] == want
    assert [GRID[py_e2m1(m) & 7] for m in mags] == want  # the test's own rule agrees


def test_packing_low_nibble_first_and_sign_bit():
    x = torch.tensor([[6.0, -0.5] + [0.0] * 14])  # gs chosen so that s = 1: values map to themselves
    q, sf = fe.quantize_rows(x.view(1, 1, 16), torch.tensor([1.0]))
    assert float(sf.float()) == 1.0
    assert q[0, 0, 0].item() == (0x7 | (0x9 << 4))  # 6.0 -> code 7 (low nibble), -0.5 -> 8|1 (high nibble)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_fp4_grouped_quantize_vs_recipe(dtype):
    l, m, k = 2, 5, 64
    x = (torch.randn(l, m, k) * torch.rand(l, m, k).add(0.5)).to(dtype)
    x[0, 1, 3] = 0.0
    x[1, 2, :16] = 0.0  # an all-zero block: scale 0, codes 0
    gs = 448 * 6 / x.float().abs().amax(dim=(1, 2))
    mask = torch.tensor([m, 3], dtype=torch.int32)
    emu = fe.FlashInferEmulator()
    q, sf = emu.scaled_fp4_grouped_quantize(x, mask, gs)
    assert q.shape == (m, k // 2, l) and q.permute(2, 0, 1).is_contiguous() and q.dtype == torch.uint8
    assert sf.shape == (32, 4, 1, 4, 1, l) and sf.dtype == torch.float8_e4m3fn
    for layer in range(l):
        rows = int(mask[layer])
        data, scales = py_quantize(x[layer].float(), gs[layer], rows)
        assert q[:rows, :, layer].tolist() == data
        assert [[logical_scale(sf, layer, r, c) for c in range(k // 16)] for r in range(rows)] == scales
        # rows at and beyond the mask are left unwritten (garbage), as the kernel leaves them
        for r in range(rows, m):
            assert all(math.isnan(logical_scale(sf, layer, r, c)) for c in range(k // 16))
    # the dequantized values are the input within the e2m1 step of each block
    lin = unswizzle_by_index(sf, m, k // 16)
    deq = py_dequantize(q[:, :, 0], lin[0].to(torch.float8_e4m3fn)) / gs[0].double()
    err = (deq - x[0].double()).abs()
    bound = x[0].double().abs().view(m, -1, 16).amax(-1, keepdim=True).expand(-1, -1, 16).reshape(m, k) / 6 * 1.07
    assert bool((err <= bound + 1e-6).all())


def test_silu_and_mul_quantize_vs_recipe():
    l, m, n = 3, 4, 32
    a = torch.randn(l, m, 2 * n).to(torch.bfloat16)
    gs = torch.tensor([600.0, 900.0, 1200.0])
    mask = torch.tensor([4, 0, 2], dtype=torch.int32)
    q, sf = fe.FlashInferEmulator().silu_and_mul_scaled_nvfp4_experts_quantize(a, mask, gs)
    assert q.shape == (m, n // 2, l) and sf.shape == (32, 4, 1, 4, 1, l)
    for layer in range(l):
        h = (F.silu(a[layer, :, :n].float()) * a[layer, :, n:].float()).to(torch.bfloat16)  # silu(first half) * second
        rows = int(mask[layer])
        data, scales = py_quantize(h.float(), gs[layer], rows)
        assert q[:rows, :, layer].tolist() == data
        assert [[logical_scale(sf, layer, r, c) for c in range(n // 16)] for r in range(rows)] == scales
    with pytest.raises(ValueError, match="contiguous"):
        fe.FlashInferEmulator().silu_and_mul_scaled_nvfp4_experts_quantize(a.transpose(0, 1).contiguous().transpose(0, 1),
                                                                           mask, gs)


def test_quantize_argument_checks():
    emu = fe.FlashInferEmulator()
    x = torch.randn(2, 3, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="mask"):
        emu.scaled_fp4_grouped_quantize(x, torch.tensor([3, 3]), torch.ones(2))  # int64 mask
    with pytest.raises(ValueError, match="global scale"):
        emu.scaled_fp4_grouped_quantize(x, torch.tensor([3, 3], dtype=torch.int32), torch.ones(1))
    with pytest.raises(ValueError, match="multiple of 16"):
        emu.scaled_fp4_grouped_quantize(x[..., :24], torch.tensor([3, 3], dtype=torch.int32), torch.ones(2))


# --------------------------------------------------------------------------- the scale swizzle


def test_swizzle_matches_the_documented_logical_index():
    l, rows, cols = 2, 130, 12  # two row tiles (the second padded), three column groups
    sf = torch.rand(l, rows, cols).mul(400).add(1).to(torch.float8_e4m3fn)
    phys = fe.swizzle(sf)
    assert phys.shape == (l, 2, 3, 32, 4, 4) and phys.is_contiguous()
    logical = phys.permute(3, 4, 1, 5, 2, 0)
    assert torch.equal(unswizzle_by_index(logical, rows, cols), sf.float())
    assert torch.equal(fe.unswizzle(logical, rows, cols, "SF").float(), sf.float())


def test_plugin_swizzle_is_the_layout_the_kernel_reads():
    from moe_plugin_cuda.cutedsl import logical_sf, swizzle_block_scales

    l, rows, cols = 3, 200, 8
    sf = torch.rand(l, rows, cols).mul(400).add(1).to(torch.float8_e4m3fn)
    logical = logical_sf(swizzle_block_scales(sf))
    assert torch.equal(unswizzle_by_index(logical, rows, cols), sf.float())


def test_unswizzle_rejects_wrong_layouts():
    l, rows, cols = 2, 128, 8
    sf = torch.rand(l, rows, cols).mul(400).add(1).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="6-D"):
        fe.unswizzle(sf, rows, cols, "SFA")  # linear scales
    wrong_order = fe.swizzle(sf).permute(3, 4, 1, 5, 2, 0).contiguous()  # right logical shape, wrong memory order
    with pytest.raises(ValueError, match="physically"):
        fe.unswizzle(wrong_order, rows, cols, "SFA")
    with pytest.raises(ValueError, match="logical shape"):
        fe.unswizzle(fe.swizzle(sf).permute(3, 4, 1, 5, 2, 0), 256, cols, "SFA")


# --------------------------------------------------------------------------- the masked GEMM


def _operands(l: int, rows: int, k: int, mask: torch.Tensor):
    x = torch.randn(l, rows, k).to(torch.bfloat16)
    gs = 448 * 6 / x.float().abs().amax(dim=(1, 2))
    q, sf = fe.FlashInferEmulator().scaled_fp4_grouped_quantize(x, mask, gs)
    return q, sf, gs


def _gemm_reference(q, sf, gs_a, qb, sfb, gs_b, alpha, masked_m):
    """float64: dequantize element by element through the documented logical indices, then alpha * A @ B^T."""
    m, k2, l = q.shape
    n = qb.shape[0]
    lin_a, lin_b = unswizzle_by_index(sf, m, 2 * k2 // 16), unswizzle_by_index(sfb, n, 2 * k2 // 16)
    out = torch.full((l, m, n), float("nan"), dtype=torch.float64)
    for layer in range(l):
        mm = int(masked_m[layer])
        a = py_dequantize(q[:mm, :, layer], lin_a[layer, :mm].to(torch.float8_e4m3fn))
        b = py_dequantize(qb[:, :, layer], lin_b[layer].to(torch.float8_e4m3fn))
        out[layer, :mm] = float(alpha[layer]) * (a @ b.t())
    return out


@pytest.mark.parametrize("c_dtype", ["float32", "bfloat16"])
def test_grouped_gemm_nt_masked_vs_float64(c_dtype):
    l, m, n, k = 3, 9, 20, 64
    masked_m = torch.tensor([9, 0, 4], dtype=torch.int32)  # a full expert, an empty one, a partial one
    qa, sfa, gs_a = _operands(l, m, k, masked_m)  # rows >= masked_m: garbage (NaN scales)
    qb, sfb, gs_b = _operands(l, n, k, torch.full((l,), n, dtype=torch.int32))
    alpha = (1.0 / (gs_a * gs_b)).float()
    out = torch.empty(l, m, n, dtype=fe.C_DTYPES[c_dtype])
    emu = fe.FlashInferEmulator()
    emu.grouped_gemm_nt_masked((qa, sfa), (qb, sfb), out.permute(1, 2, 0), masked_m, ab_dtype="float4_e2m1fn",
                               sf_dtype="float8_e4m3fn", c_dtype=c_dtype, sf_vec_size=16, alpha=alpha,
                               alpha_dtype="float32")
    ref = _gemm_reference(qa, sfa, gs_a, qb, sfb, gs_b, alpha, masked_m)
    valid = torch.arange(m).view(1, m) < masked_m.view(l, 1)
    tol = 1e-6 if c_dtype == "float32" else 1e-2
    o, r = out.double()[valid], ref[valid]
    assert ((o - r).norm() / r.norm()).item() < tol
    assert bool(out[~valid].isnan().all())  # rows beyond masked_m: NaN in the emulation


def test_grouped_gemm_checks_layouts_and_arch():
    l, m, n, k = 2, 4, 8, 32
    mask = torch.full((l,), m, dtype=torch.int32)
    qa, sfa, _ = _operands(l, m, k, mask)
    qb, sfb, _ = _operands(l, n, k, torch.full((l,), n, dtype=torch.int32))
    out = torch.empty(l, m, n, dtype=torch.bfloat16)
    kw = dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", c_dtype="bfloat16", sf_vec_size=16,
              alpha=torch.ones(l), alpha_dtype="float32")
    emu = fe.FlashInferEmulator()
    emu.grouped_gemm_nt_masked((qa, sfa), (qb, sfb), out.permute(1, 2, 0), mask, **kw)
    with pytest.raises(ValueError, match="physically"):  # A contiguous as (m, k/2, l): not the kernel's layout
        emu.grouped_gemm_nt_masked((qa.contiguous(), sfa), (qb, sfb), out.permute(1, 2, 0), mask, **kw)
    with pytest.raises(ValueError, match="physically"):  # out must be expert-outermost (flashinfer #3103)
        emu.grouped_gemm_nt_masked((qa, sfa), (qb, sfb), torch.empty(m, n, l, dtype=torch.bfloat16), mask, **kw)
    with pytest.raises(TypeError, match="c_dtype"):
        emu.grouped_gemm_nt_masked((qa, sfa), (qb, sfb), out.permute(1, 2, 0), mask, **dict(kw, c_dtype="float16"))
    with pytest.raises(ValueError, match="masked_m"):
        emu.grouped_gemm_nt_masked((qa, sfa), (qb, sfb), out.permute(1, 2, 0), mask + m, **kw)
    for arch in ((9, 0), (11, 0), (12, 0)):
        with pytest.raises(ValueError, match="SM"):
            fe.FlashInferEmulator(arch).grouped_gemm_nt_masked((qa, sfa), (qb, sfb), out.permute(1, 2, 0), mask, **kw)


def test_grouped_gemm_with_unswizzled_scales_gives_wrong_numbers():
    """Linear scales reinterpreted in the swizzled shape are accepted by shape but read wrongly: a backend
    that skipped the swizzle is caught by the numbers."""
    l, m, n, k = 2, 128, 128, 128
    mask = torch.full((l,), m, dtype=torch.int32)
    x = torch.randn(l, m, k) * torch.linspace(0.1, 4, m).view(1, m, 1)  # rows of different magnitudes
    w = torch.randn(l, n, k)
    gx = 448 * 6 / x.abs().amax(dim=(1, 2))
    gw = 448 * 6 / w.abs().amax(dim=(1, 2))
    qx, sx = fe.quantize_rows(x, gx)
    qw, sw = fe.quantize_rows(w, gw)
    kw = dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", c_dtype="float32", sf_vec_size=16,
              alpha=(1 / (gx * gw)).float(), alpha_dtype="float32")
    emu = fe.FlashInferEmulator()
    right, wrong = torch.empty(l, m, n), torch.empty(l, m, n)
    sfb = fe.swizzle(sw).permute(3, 4, 1, 5, 2, 0)
    emu.grouped_gemm_nt_masked((qx.permute(1, 2, 0), fe.swizzle(sx).permute(3, 4, 1, 5, 2, 0)),
                               (qw.permute(1, 2, 0), sfb), right.permute(1, 2, 0), mask, **kw)
    naive = sx.reshape(l, 1, 2, 32, 4, 4).permute(3, 4, 1, 5, 2, 0)  # linear bytes viewed as the swizzle
    emu.grouped_gemm_nt_masked((qx.permute(1, 2, 0), naive), (qw.permute(1, 2, 0), sfb), wrong.permute(1, 2, 0),
                               mask, **kw)
    exact = torch.bmm(x, w.transpose(1, 2))
    assert ((right - exact).norm() / exact.norm()).item() < 0.15  # NVFP4 x NVFP4 products
    assert ((wrong - exact).norm() / exact.norm()).item() > 0.5
