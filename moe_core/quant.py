"""Quantization in pure PyTorch: activations (wire dtypes) and expert weights (quant schemes).

These are the definitions the reference backend computes with and the emulated vendor ops
are checked against. Rounding: round-half-to-even everywhere (``torch.round``); FP8 casts are
clamped first because torch turns overflow into NaN.
"""

from __future__ import annotations

from typing import Optional

import torch

from moe_core.contracts import (  # the decoders live with the wire contract; re-exported here
    E2M1_GRID,  # noqa: F401  (re-exported: its old home)
    FP8_DTYPE,
    FP8_GROUP,
    FP8_MAX,
    NVFP4_BLOCK,
    QuantizedActivations,
    QuantScheme,
    WireDtype,
    dequantize_fp8_per_token_group,
    dequantize_nvfp4,
)

__all__ = [
    "quantize_fp8_per_token_group",
    "dequantize_fp8_per_token_group",
    "quantize_fp8_per_token",
    "dequantize_fp8_per_token",
    "quantize_int_per_token",
    "quantize_int8_per_token",
    "quantize_int4_per_token",
    "quantize_nvfp4",
    "dequantize_nvfp4",
    "nvfp4_global_scale",
    "quantize_activations",
    "dequantize_activations",
    "quantize_weights",
    "dequantize_weights",
    "weight_shapes",
    "FP8_AMAX_FLOOR",
    "INT_AMAX_FLOOR",
]

FP8_AMAX_FLOOR = 1e-4  # DeepEP's floor, so all-zero groups get a finite scale
INT_AMAX_FLOOR = 1e-10
E2M1_MAX = 6.0
_E2M1_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def _pad_last(x: torch.Tensor, multiple: int) -> torch.Tensor:
    pad = (-x.shape[-1]) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


# --------------------------------------------------------------------------- FP8


def quantize_fp8_per_token_group(
    x: torch.Tensor, group: int = FP8_GROUP, ue8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> (e4m3fn ``[..., H]``, fp32 scales ``[..., ceil(H/group)]``).

    ``scale = max(amax, 1e-4) / 448`` per group (rounded up to a power of two with ``ue8m0``);
    ``q = clamp(x / scale, +-448)``; dequantize as ``q * scale``.
    """
    h = x.shape[-1]
    xf = x.float()
    scale = _pad_last(xf, group).unflatten(-1, (-1, group)).abs().amax(dim=-1).clamp(min=FP8_AMAX_FLOOR) / FP8_MAX
    if ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    # each channel divided by its group's scale, indexed (torch_a2a compiles this function on CUDA;
    # inductor 2.13 on CPU miscompiled the broadcast-then-slice form when H % group != 0)
    group_of = torch.arange(h, device=x.device) // group
    q = (xf / scale[..., group_of]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` -> (e4m3fn ``[..., H]``, fp32 scale ``[..., 1]``): one group per row.

    ``scale = max(amax_row, 1e-4) / 448``; ``q = clamp(x / scale, +-448)``; dequantize as
    ``q * scale`` (the activations of ``fp8_per_token``).
    """
    return quantize_fp8_per_token_group(x, group=max(x.shape[-1], 1))


def dequantize_fp8_per_token(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale


# --------------------------------------------------------------------------- INT8 / INT4


def quantize_int_per_token(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row quantization to ``[-qmax, qmax]``: (int8 values, fp32 scale ``[..., 1]``)."""
    xf = x.float()
    scale = xf.abs().amax(dim=-1, keepdim=True).clamp(min=INT_AMAX_FLOOR) / qmax
    q = torch.round(xf / scale).clamp(-qmax, qmax).to(torch.int8)
    return q, scale


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_int_per_token(x, 127)


def quantize_int4_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int4 values in [-7, 7], one per int8 (packing is a vendor layout detail)."""
    return quantize_int_per_token(x, 7)


# --------------------------------------------------------------------------- NVFP4


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """Global scale that maps ``amax`` to the top of the e4m3 x e2m1 range: ``448 * 6 / amax``."""
    return torch.as_tensor(FP8_MAX * E2M1_MAX, dtype=torch.float32) / torch.as_tensor(amax, dtype=torch.float32)


def _e2m1_codes(a: torch.Tensor) -> torch.Tensor:
    """Magnitude ``a`` (already clamped to [0, 6]) -> e2m1 code 0..7, ties to the even code."""
    mid = _E2M1_MIDPOINTS.to(a.device)
    lo = torch.searchsorted(mid, a, right=False)
    hi = torch.searchsorted(mid, a, right=True)
    return torch.where((lo == hi) | (lo % 2 == 0), lo, hi)


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [..., H]`` (H % 16 == 0) -> (uint8 ``[..., H/2]`` packed e2m1, e4m3fn ``[..., H/16]`` block scales).

    Block scale ``s = e4m3(gs * amax_block / 6)``; ``q = e2m1(x * gs / s)``; dequantize as
    ``q * s / gs``. Even element in the low nibble; bit 3 is the sign.
    """
    h = x.shape[-1]
    if h % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs the last dim to be a multiple of {NVFP4_BLOCK}, got {h}")
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=x.device)
    xb = x.float().unflatten(-1, (-1, NVFP4_BLOCK))
    block_amax = xb.abs().amax(dim=-1)
    s = (gs * block_amax / E2M1_MAX).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    sf = s.float().unsqueeze(-1)
    gs_b = gs.unsqueeze(-1) if gs.dim() else gs  # broadcast over the block's elements
    scaled = torch.where(sf > 0, xb * gs_b / torch.where(sf > 0, sf, 1.0), torch.zeros_like(xb))
    scaled = scaled.clamp(-E2M1_MAX, E2M1_MAX)
    codes = _e2m1_codes(scaled.abs()) | ((scaled < 0).to(torch.int64) << 3)
    codes = codes.flatten(-2).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, s


# --------------------------------------------------------------------------- activations


def quantize_activations(
    x: torch.Tensor,
    dtype: WireDtype,
    *,
    ue8m0: bool = False,
    global_scale: Optional[torch.Tensor] = None,
) -> QuantizedActivations:
    """Quantize ``x [..., H]`` for the wire. NVFP4 uses ``global_scale`` (default: from the data)."""
    dtype = WireDtype(dtype)
    if dtype is WireDtype.BF16:
        return QuantizedActivations(x)
    if dtype is WireDtype.FP8:
        q, s = quantize_fp8_per_token_group(x, ue8m0=ue8m0)
        return QuantizedActivations(q, dtype, s, ue8m0=ue8m0)
    if dtype is WireDtype.INT8:
        q, s = quantize_int8_per_token(x)
        return QuantizedActivations(q, dtype, s)
    if global_scale is None:
        amax = x.abs().amax() if x.numel() else torch.ones((), device=x.device)  # T = 0: any scale will do
        global_scale = nvfp4_global_scale(amax.clamp(min=INT_AMAX_FLOOR))
    q, s = quantize_nvfp4(x, global_scale)
    return QuantizedActivations(q, dtype, s, global_scale=torch.as_tensor(global_scale, dtype=torch.float32))


def dequantize_activations(qa: QuantizedActivations, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return qa.dequantize(out_dtype)


# --------------------------------------------------------------------------- weights


def _blocks(w: torch.Tensor, b: int) -> torch.Tensor:
    """``[E, N, K]`` -> ``[E, N/b, b, K/b, b]`` (zero padded)."""
    e, n, k = w.shape
    wp = torch.nn.functional.pad(w.float(), (0, (-k) % b, 0, (-n) % b))
    return wp.view(e, wp.shape[1] // b, b, wp.shape[2] // b, b)


def _quantize_fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    e, n, k = w.shape
    wb = _blocks(w, FP8_GROUP)
    scale = wb.abs().amax(dim=(2, 4)).clamp(min=INT_AMAX_FLOOR) / FP8_MAX  # [E, N/b, K/b]
    q = (wb / scale[:, :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.flatten(3, 4).flatten(1, 2)[:, :n, :k].contiguous(), scale


def _dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    e, n, k = q.shape
    wb = _blocks(q.float(), FP8_GROUP) * scale[:, :, None, :, None]
    return wb.flatten(3, 4).flatten(1, 2)[:, :n, :k]


def _quantize_per_channel(w: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_int_per_token(w, qmax)  # per output channel = per row of [E, N, K]
    return q, s.squeeze(-1)


def _quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[E, N, K]`` -> (e4m3fn, fp32 ``[E, N]``): ``scale = max(amax_row, 1e-10) / 448``."""
    wf = w.float()
    scale = wf.abs().amax(dim=-1, keepdim=True).clamp(min=INT_AMAX_FLOOR) / FP8_MAX
    q = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.squeeze(-1)


def _quantize_nvfp4_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gs = nvfp4_global_scale(w.float().abs().amax(dim=(1, 2)).clamp(min=INT_AMAX_FLOOR))  # [E]
    q, s = quantize_nvfp4(w, gs[:, None, None])
    return q, s, 1.0 / gs


def quantize_weights(
    w13: torch.Tensor,
    w2: torch.Tensor,
    scheme: QuantScheme,
    *,
    a13_amax: float = 10.0,
    a2_amax: float = 10.0,
) -> dict[str, torch.Tensor]:
    """Quantize full-precision ``w13 [E, 2I, H]`` and ``w2 [E, H, I]`` to ``scheme``.

    Returns the checkpoint tensors named as in ``QuantScheme``'s docstring. For NVFP4, the static
    activation global scales come from the expected activation amax (``a13_amax``, ``a2_amax``),
    as a calibrated checkpoint would carry them.
    """
    scheme = QuantScheme(scheme)
    if scheme is QuantScheme.UNQUANTIZED:
        return {"w13": w13, "w2": w2}
    out: dict[str, torch.Tensor] = {}
    for name, w in (("w13", w13), ("w2", w2)):
        if scheme is QuantScheme.FP8_BLOCK:
            out[name], out[f"{name}_scale"] = _quantize_fp8_block(w)
        elif scheme is QuantScheme.FP8_PER_TOKEN:
            out[name], out[f"{name}_scale"] = _quantize_fp8_per_channel(w)
        elif scheme is QuantScheme.INT8_W8A8:
            out[name], out[f"{name}_scale"] = _quantize_per_channel(w, 127)
        elif scheme is QuantScheme.W4A4:
            out[name], out[f"{name}_scale"] = _quantize_per_channel(w, 7)
        else:
            out[name], out[f"{name}_scale"], out[f"{name}_scale_2"] = _quantize_nvfp4_weight(w)
    if scheme is QuantScheme.NVFP4:
        e = w13.shape[0]
        out["a13_global_scale"] = nvfp4_global_scale(a13_amax).expand(e).clone()
        out["a2_global_scale"] = nvfp4_global_scale(a2_amax).expand(e).clone()
    return out


def dequantize_weights(t: dict[str, torch.Tensor], scheme: QuantScheme) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 weights ``(w13, w2)`` that ``t`` (named as ``quantize_weights`` returns) encode."""
    scheme = QuantScheme(scheme)
    result = []
    for name in ("w13", "w2"):
        w = t[name]
        if scheme is QuantScheme.UNQUANTIZED:
            result.append(w.float())
        elif scheme is QuantScheme.FP8_BLOCK:
            result.append(_dequantize_fp8_block(w, t[f"{name}_scale"].float()))
        elif scheme in (QuantScheme.FP8_PER_TOKEN, QuantScheme.INT8_W8A8, QuantScheme.W4A4):
            result.append(w.float() * t[f"{name}_scale"].float().unsqueeze(-1))
        else:
            scale_2 = t[f"{name}_scale_2"].float()
            result.append(dequantize_nvfp4(w, t[f"{name}_scale"], 1.0 / scale_2[:, None, None]))
    return result[0], result[1]


def weight_shapes(
    scheme: QuantScheme, num_experts: int, hidden: int, intermediate: int, params_dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype) of every weight tensor of ``scheme`` for ``num_experts`` experts."""
    scheme = QuantScheme(scheme)
    e, h, i, n1 = num_experts, hidden, intermediate, 2 * intermediate
    f32 = torch.float32

    def cdiv(a: int, b: int) -> int:
        return -(-a // b)

    if scheme is QuantScheme.UNQUANTIZED:
        return {"w13": ((e, n1, h), params_dtype), "w2": ((e, h, i), params_dtype)}
    if scheme is QuantScheme.FP8_BLOCK:
        b = FP8_GROUP
        return {"w13": ((e, n1, h), FP8_DTYPE), "w2": ((e, h, i), FP8_DTYPE),
                "w13_scale": ((e, cdiv(n1, b), cdiv(h, b)), f32), "w2_scale": ((e, cdiv(h, b), cdiv(i, b)), f32)}
    if scheme is QuantScheme.FP8_PER_TOKEN:
        return {"w13": ((e, n1, h), FP8_DTYPE), "w2": ((e, h, i), FP8_DTYPE),
                "w13_scale": ((e, n1), f32), "w2_scale": ((e, h), f32)}
    if scheme in (QuantScheme.INT8_W8A8, QuantScheme.W4A4):
        return {"w13": ((e, n1, h), torch.int8), "w2": ((e, h, i), torch.int8),
                "w13_scale": ((e, n1), f32), "w2_scale": ((e, h), f32)}
    if h % NVFP4_BLOCK or i % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs hidden and intermediate sizes divisible by {NVFP4_BLOCK}, got {h} and {i}")
    return {"w13": ((e, n1, h // 2), torch.uint8), "w2": ((e, h, i // 2), torch.uint8),
            "w13_scale": ((e, n1, h // NVFP4_BLOCK), FP8_DTYPE), "w2_scale": ((e, h, i // NVFP4_BLOCK), FP8_DTYPE),
            "w13_scale_2": ((e,), f32), "w2_scale_2": ((e,), f32),
            "a13_global_scale": ((e,), f32), "a2_global_scale": ((e,), f32)}
