"""Emulated FlashInfer 0.7.2.post1: the CuteDSL NVFP4 MoE ops the ``cutedsl`` experts call (test support only).

Pure PyTorch on CPU, following ``shared/reference/vendor-apis.md`` sections 2 and 8; never shipped and
never a fallback. ``install(monkeypatch)`` puts a ``flashinfer`` package (with ``flashinfer.gemm``)
into ``sys.modules`` and makes the plugin's probe see an SM100 GPU; ``install_into_process()`` does
the same in a spawned worker.

Emulated ops (names and arguments as FlashInfer's):

- ``scaled_fp4_grouped_quantize(a [l, m, k], mask int32 [l], a_global_sf fp32 [l])`` -> packed e2m1,
  logical ``(m, k/2, l)`` (physically ``(l, m, k/2)``), and e4m3 block scales, logical
  ``(32, 4, rm, 4, rk, l)`` (physically ``(l, rm, rk, 32, 4, 4)``, the 128x4 swizzle).
- ``silu_and_mul_scaled_nvfp4_experts_quantize(a [l, m, 2n], mask, a_global_sf)``: ``silu(a[..., :n]) *
  a[..., n:]`` computed in fp32 and rounded to ``a``'s dtype (the kernel packs it back into its
  input type before quantizing), then quantized as above.
- ``gemm.grouped_gemm_nt_masked((A, SFA), (B, SFB), out, masked_m, *, ab_dtype, sf_dtype, c_dtype,
  sf_vec_size, alpha, alpha_dtype, ...)``: ``out[l, :masked_m[l]] = alpha[l] * A @ B^T`` from the
  dequantized operands (fp32 accumulation); rows at and beyond ``masked_m`` are filled with NaN.

NVFP4 recipe: ``s = e4m3(clamp(gs * amax_block / 6, 448))``, ``q = e2m1(clamp(x * gs / s, +-6))``
(round to nearest, ties to the even code), even element in the low nibble, bit 3 the sign.
Rows at and beyond ``mask`` (and the scale rows padding ``m`` to 128) are left as garbage (NaN
scales), as the kernels leave them unwritten. Layouts are checked the way the real kernels read
memory: a tensor whose physical order is not the documented one raises.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any, Optional

import torch
import torch.nn.functional as F

from moe_core.plugin_api import DeviceKind

SF_VEC = 16  # elements per NVFP4 block scale
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E4M3_MAX = 448.0
E2M1_MAX = 6.0
GARBAGE_SF = 0x7F  # e4m3fn NaN: unwritten scale bytes
GARBAGE_Q = 0x77  # e2m1 pair (6, 6): unwritten data bytes
SUPPORTED_ARCHS = ((10, 0), (10, 3), (10, 7))
SM100 = (10, 0)
C_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# --------------------------------------------------------------------------- NVFP4 numerics


def e2m1_codes(mag: torch.Tensor) -> torch.Tensor:
    """Magnitudes in [0, 6] -> e2m1 codes 0..7: the nearest grid value, ties to the even code."""
    grid = E2M1_GRID.to(mag.device)
    dist = (mag.unsqueeze(-1) - grid).abs()
    nearest = dist == dist.min(dim=-1, keepdim=True).values
    even = (torch.arange(8, device=mag.device) % 2 == 0)
    # among the nearest grid points prefer the even code (a tie has one even and one odd neighbour)
    return (nearest.to(torch.int64) * (1 + even.to(torch.int64))).argmax(dim=-1)


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 ``[..., k/2]`` -> fp32 ``[..., k]`` (even element in the low nibble, bit 3 the sign)."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    grid = E2M1_GRID.to(packed.device)
    return grid[codes & 7] * torch.where(codes >= 8, -1.0, 1.0)


def quantize_rows(x: torch.Tensor, global_sf: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[l, m, k]`` with one global scale per ``l`` -> (uint8 ``[l, m, k/2]``, e4m3 ``[l, m, k/16]``)."""
    l, m, k = x.shape
    gs = global_sf.float().view(l, 1, 1, 1)
    xb = x.view(l, m, k // SF_VEC, SF_VEC)
    s = (gs * xb.abs().amax(dim=-1, keepdim=True) / E2M1_MAX).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sf = s.float()
    scaled = torch.where(sf > 0, xb * gs / torch.where(sf > 0, sf, 1.0), 0.0).clamp(-E2M1_MAX, E2M1_MAX)
    codes = (e2m1_codes(scaled.abs()) | ((scaled < 0).to(torch.int64) << 3)).view(l, m, k).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), s.view(l, m, k // SF_VEC)


# --------------------------------------------------------------------------- the 128x4 scale swizzle


def swizzle_offsets(rows: int, cols: int) -> torch.Tensor:
    """Storage offset of scale ``(r, c)`` inside one batch, from the documented order
    ``[r/128][c/4][r%32][(r%128)/32][c%4]`` (``rk = ceil(cols/4)`` column groups)."""
    rk = _cdiv(cols, 4)
    r = torch.arange(rows).view(-1, 1)
    c = torch.arange(cols).view(1, -1)
    return ((r // 128) * rk + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)


def swizzle(sf: torch.Tensor) -> torch.Tensor:
    """Linear e4m3 ``[l, rows, cols]`` -> the physical ``(l, rm, rk, 32, 4, 4)`` buffer; padding is garbage."""
    l, rows, cols = sf.shape
    rm, rk = _cdiv(rows, 128), _cdiv(cols, 4)
    flat = torch.full((l, rm * rk * 512), GARBAGE_SF, dtype=torch.uint8, device=sf.device)
    flat[:, swizzle_offsets(rows, cols).flatten().to(sf.device)] = sf.reshape(l, -1).view(torch.uint8)
    return flat.view(torch.float8_e4m3fn).view(l, rm, rk, 32, 4, 4)


def unswizzle(sf_logical: torch.Tensor, rows: int, cols: int, what: str) -> torch.Tensor:
    """The kernel's read of a scale operand: logical ``(32, 4, rm, 4, rk, l)`` whose physical order
    must be ``(l, rm, rk, 32, 4, 4)`` -> linear e4m3 ``[l, rows, cols]``."""
    if sf_logical.dim() != 6:
        raise ValueError(f"{what}: scale factors must be the 6-D logical view (32, 4, rm, 4, rk, l), got shape "
                         f"{tuple(sf_logical.shape)}")
    phys = sf_logical.permute(5, 2, 4, 0, 1, 3)
    rm, rk = _cdiv(rows, 128), _cdiv(cols, 4)
    if tuple(phys.shape[1:]) != (rm, rk, 32, 4, 4):
        raise ValueError(f"{what}: scale factors for {rows}x{cols} blocks need logical shape (32, 4, {rm}, 4, {rk}, l), "
                         f"got {tuple(sf_logical.shape)}")
    if not phys.is_contiguous():
        raise ValueError(f"{what}: scale factors are not physically (l, rm, rk, 32, 4, 4): the kernel would read "
                         "the wrong bytes")
    if phys.dtype != torch.float8_e4m3fn:
        raise TypeError(f"{what}: scale factors must be float8_e4m3fn, got {phys.dtype}")
    flat = phys.reshape(phys.shape[0], -1).view(torch.uint8)
    return flat[:, swizzle_offsets(rows, cols).flatten().to(flat.device)].view(torch.float8_e4m3fn).view(-1, rows, cols)


# --------------------------------------------------------------------------- the ops


class FlashInferEmulator:
    """The emulated ops of one installation; ``arch`` is the compute capability the kernels see and
    ``calls`` records every op call by name."""

    def __init__(self, arch: tuple[int, int] = SM100) -> None:
        self.arch = tuple(arch)
        self.calls: list[str] = []

    def _grouped_quantize(self, x: torch.Tensor, mask: torch.Tensor, global_sf: torch.Tensor, what: str):
        l, m, k = x.shape
        if k % SF_VEC:
            raise ValueError(f"{what}: k must be a multiple of 16, got {k}")
        if mask.dtype != torch.int32 or tuple(mask.shape) != (l,):
            raise ValueError(f"{what}: mask must be int32 [{l}], got {mask.dtype} {tuple(mask.shape)}")
        if global_sf.dtype != torch.float32 or tuple(global_sf.shape) != (l,):
            raise ValueError(f"{what}: global scale must be float32 [{l}], got {global_sf.dtype} "
                             f"{tuple(global_sf.shape)}")
        q, sf = quantize_rows(x, global_sf)
        unwritten = torch.arange(m, device=x.device).view(1, m) >= mask.view(l, 1).to(x.device)
        q[unwritten] = GARBAGE_Q
        sf.view(torch.uint8)[unwritten] = GARBAGE_SF
        return q.permute(1, 2, 0), swizzle(sf).permute(3, 4, 1, 5, 2, 0)

    def scaled_fp4_grouped_quantize(self, a: torch.Tensor, mask: torch.Tensor, a_global_sf: torch.Tensor):
        self.calls.append("scaled_fp4_grouped_quantize")
        if a.dim() != 3 or a.dtype not in (torch.float16, torch.bfloat16):
            raise ValueError(f"scaled_fp4_grouped_quantize: a must be fp16/bf16 [l, m, k], got {a.dtype} "
                             f"{tuple(a.shape)}")
        return self._grouped_quantize(a.float(), mask, a_global_sf, "scaled_fp4_grouped_quantize")

    def silu_and_mul_scaled_nvfp4_experts_quantize(self, a: torch.Tensor, mask: torch.Tensor,
                                                   a_global_sf: torch.Tensor):
        self.calls.append("silu_and_mul_scaled_nvfp4_experts_quantize")
        what = "silu_and_mul_scaled_nvfp4_experts_quantize"
        if a.dim() != 3 or a.dtype not in (torch.float16, torch.bfloat16) or a.shape[-1] % 2:
            raise ValueError(f"{what}: a must be fp16/bf16 [l, m, 2n], got {a.dtype} {tuple(a.shape)}")
        if not a.is_contiguous():  # the kernel views it as [l * m, 2n]
            raise ValueError(f"{what}: a must be contiguous [l, m, 2n]")
        n = a.shape[-1] // 2
        h = (F.silu(a[..., :n].float()) * a[..., n:].float()).to(a.dtype)
        return self._grouped_quantize(h.float(), mask, a_global_sf, what)

    def grouped_gemm_nt_masked(self, lhs, rhs, out: torch.Tensor, masked_m: torch.Tensor, *, ab_dtype: str,
                               sf_dtype: str, c_dtype: str, sf_vec_size: int, alpha: Optional[torch.Tensor] = None,
                               alpha_dtype: Optional[str] = None, mma_tiler_mn=(128, 128), cluster_shape_mn=(1, 1),
                               sm_count: Optional[int] = None, **kwargs: Any) -> None:
        self.calls.append("grouped_gemm_nt_masked")
        if self.arch == (11, 0):
            raise ValueError("SM110 is not supported for cute-dsl backend.")
        if self.arch not in SUPPORTED_ARCHS:
            raise ValueError(f"Masked grouped GEMM is only supported on SM100/SM103/SM107, got "
                             f"SM{self.arch[0]}{self.arch[1]}")
        if kwargs:
            raise ValueError(f"Unsupported kwargs: {sorted(kwargs)}")
        if (ab_dtype, sf_dtype, sf_vec_size) != ("float4_e2m1fn", "float8_e4m3fn", SF_VEC):
            raise NotImplementedError(f"the emulation covers NVFP4 only (float4_e2m1fn, float8_e4m3fn, 16), got "
                                      f"{ab_dtype}, {sf_dtype}, {sf_vec_size}")
        (a, sfa), (b, sfb) = lhs, rhs
        if a.dim() != 3 or b.dim() != 3 or out.dim() != 3:
            raise ValueError("A, B and out must be 3-D logical (m, k/2, l), (n, k/2, l), (m, n, l)")
        m, k2, l = a.shape
        n = b.shape[0]
        k = 2 * k2
        for name, t, shape in (("A", a, (m, k2, l)), ("B", b, (n, k2, l)), ("out", out, (m, n, l))):
            if tuple(t.shape) != shape:
                raise ValueError(f"{name} must have logical shape {shape}, got {tuple(t.shape)}")
            if not t.permute(2, 0, 1).is_contiguous():
                raise ValueError(f"{name} must be physically (l, rows, cols) contiguous (pass a permute(1, 2, 0) view)")
        if a.dtype != torch.uint8 or b.dtype != torch.uint8:
            raise TypeError(f"FP4 operands are uint8 (two e2m1 per byte), got {a.dtype} and {b.dtype}")
        if C_DTYPES.get(c_dtype) != out.dtype:
            raise TypeError(f"c_dtype={c_dtype!r} but out is {out.dtype}")
        if masked_m.dtype != torch.int32 or tuple(masked_m.shape) != (l,):
            raise ValueError(f"masked_m must be int32 [{l}], got {masked_m.dtype} {tuple(masked_m.shape)}")
        if int(masked_m.max()) > m or int(masked_m.min()) < 0:
            raise ValueError(f"masked_m must be in [0, {m}], got {masked_m.tolist()}")
        if alpha is not None and (alpha.dtype != torch.float32 or alpha.numel() != l or alpha_dtype != "float32"):
            raise ValueError(f"alpha must be float32 with {l} values and alpha_dtype='float32', got {alpha.dtype} "
                             f"{tuple(alpha.shape)} {alpha_dtype!r}")
        sfa_lin = unswizzle(sfa, m, k // SF_VEC, "SFA").float()
        sfb_lin = unswizzle(sfb, n, k // SF_VEC, "SFB").float()
        a_deq = decode_e2m1(a.permute(2, 0, 1)) * sfa_lin.repeat_interleave(SF_VEC, dim=-1)
        b_deq = decode_e2m1(b.permute(2, 0, 1)) * sfb_lin.repeat_interleave(SF_VEC, dim=-1)
        res = torch.bmm(a_deq, b_deq.transpose(1, 2))
        if alpha is not None:
            res = res * alpha.reshape(l, 1, 1).float()
        valid = torch.arange(m, device=res.device).view(1, m, 1) < masked_m.view(l, 1, 1).to(res.device)
        out.permute(2, 0, 1).copy_(torch.where(valid, res, float("nan")).to(out.dtype))


# --------------------------------------------------------------------------- installation


def _module(name: str, package: bool = False) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=package)
    if package:
        mod.__path__ = []
    return mod


def modules(arch: tuple[int, int] = SM100) -> dict[str, Any]:
    emu = FlashInferEmulator(arch)
    fi, gemm = _module("flashinfer", package=True), _module("flashinfer.gemm")
    fi.__version__ = "0.7.2.post1"
    fi.EMULATED = True
    fi.emulator = emu
    fi.scaled_fp4_grouped_quantize = emu.scaled_fp4_grouped_quantize
    fi.silu_and_mul_scaled_nvfp4_experts_quantize = emu.silu_and_mul_scaled_nvfp4_experts_quantize
    gemm.grouped_gemm_nt_masked = emu.grouped_gemm_nt_masked
    fi.gemm = gemm
    return {"flashinfer": fi, "flashinfer.gemm": gemm}


def _fake_capability(arch: tuple[int, int]):
    return lambda: (tuple(arch), None)  # what moe_plugin_cuda.probes reads from the device


def install(monkeypatch: Any, arch: tuple[int, int] = SM100) -> FlashInferEmulator:
    """Emulated flashinfer in ``sys.modules`` and a GPU of compute capability ``arch`` for the probe."""
    from moe_plugin_cuda import probes

    mods = modules(arch)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(probes, "_cuda_capability", _fake_capability(arch))
    _real_present = DeviceKind.is_present  # the planner refuses absent device kinds: this machine "has" a GPU
    monkeypatch.setattr(DeviceKind, "is_present", lambda k: k is DeviceKind.CUDA or _real_present(k))
    return mods["flashinfer"].emulator


def install_into_process(arch: tuple[int, int] = SM100) -> FlashInferEmulator:
    """As ``install`` in a spawned worker (no monkeypatch there: the process ends with the test)."""
    from moe_plugin_cuda import probes

    mods = modules(arch)
    sys.modules.update(mods)
    probes._cuda_capability = _fake_capability(arch)
    _real_present = DeviceKind.is_present
    DeviceKind.is_present = lambda k: k is DeviceKind.CUDA or _real_present(k)
    return mods["flashinfer"].emulator
