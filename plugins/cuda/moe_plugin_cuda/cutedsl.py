"""Experts ``cutedsl``: FlashInfer's CuteDSL NVFP4 masked grouped GEMM on ``EP_MASKED`` slabs (SM100/SM103).

The pipeline is the one sglang and vLLM wrap as ``flashinfer_cutedsl_moe_masked``, built here from
FlashInfer's own ops (``shared/reference/vendor-apis.md`` section 2):

1. activations to NVFP4: a BF16 (or fp16) slab is quantized by ``scaled_fp4_grouped_quantize`` with the
   checkpoint's per-expert ``a13_global_scale``; an NVFP4 slab (the dispatcher already quantized it)
   is used as it is, its linear e4m3 block scales swizzled here, GEMM1's alpha using its global scale;
2. GEMM1 ``grouped_gemm_nt_masked`` -> ``[E, C, 2I]`` (gate columns first), ``alpha = w13_scale_2 / a_gs``;
3. ``silu_and_mul_scaled_nvfp4_experts_quantize`` with ``a2_global_scale``: SiLU(gate) * up, requantized;
4. GEMM2 -> ``[E, C, H]``, ``alpha = routed_scaling_factor * w2_scale_2 / a2_global_scale`` (the scaling
   factor is linear, so it rides on GEMM2's alpha for free).

The output is unweighted (the EP_MASKED contract: combine applies the top-k weights); rows at and
beyond ``masked_m`` are left as the kernel leaves them (garbage). Nothing is read on the host, so the
plan is graph-safe.

Weights: the core's nvfp4 checkpoint already stores packed e2m1 as FlashInfer reads it (``[E, N, K/2]``
uint8, even element in the low nibble, gate rows first), so ``process_weights`` keeps ``w13``/``w2``
and converts only the block scales from linear ``[E, N, K/16]`` to the 128x4 swizzle, stored
physically ``(E, rn, rk, 32, 4, 4)`` in place of ``w13_scale``/``w2_scale``. The 6-D shape marks the
conversion: a second call is a no-op, and ``MoELayer.load_weights`` restores the checkpoint layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from moe_core.plugin_api import BackendContext, EPMaskedCombine, EPMaskedDispatch, Experts, WireDtype

if TYPE_CHECKING:
    from moe_core.plugin_api import MoELayer

SF_VEC = 16  # NVFP4 elements per block scale
_C_DTYPE = {torch.bfloat16: "bfloat16", torch.float16: "float16"}
# the dtype arguments of every NVFP4 grouped_gemm_nt_masked call
_GEMM_ARGS = dict(ab_dtype="float4_e2m1fn", sf_dtype="float8_e4m3fn", sf_vec_size=SF_VEC, alpha_dtype="float32")


def swizzle_block_scales(sf: torch.Tensor) -> torch.Tensor:
    """Linear e4m3 block scales ``[L, rows, cols]`` -> physical ``(L, rm, rk, 32, 4, 4)``: rows padded to
    128, columns to 4 (zeros), stored ``[r/128][c/4][r%32][(r%128)/32][c%4]`` (the layout the Blackwell
    block-scaled MMA reads)."""
    L, rows, cols = sf.shape
    rm, rk = -(-rows // 128), -(-cols // 4)
    padded = torch.zeros(L, rm * 128, rk * 4, dtype=torch.uint8, device=sf.device)
    padded[:, :rows, :cols] = sf.view(torch.uint8)
    # row r = 128 * i + 32 * a + b, column c = 4 * j + d  ->  (L, i, j, b, a, d)
    out = padded.view(L, rm, 4, 32, rk, 4).permute(0, 1, 4, 3, 2, 5).contiguous()
    return out.view(torch.float8_e4m3fn)


def logical_sf(physical: torch.Tensor) -> torch.Tensor:
    """The ``(32, 4, rm, 4, rk, L)`` view of a physical ``(L, rm, rk, 32, 4, 4)`` scale buffer."""
    return physical.permute(3, 4, 1, 5, 2, 0)


@dataclass(frozen=True)
class CuteDSLDecision:
    """What the cutedsl experts take from the plan, decided once at construction and passed down by name."""

    out_dtype: torch.dtype  # the params dtype: GEMM1's and the layer's output
    c_dtype: str  # the same, as FlashInfer's GEMM names it
    num_local: int  # local experts: the slab's first dimension
    hidden: int
    inter: int


class CuteDSLExperts(Experts):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        if cfg.params_dtype not in _C_DTYPE:
            raise ValueError(f"cutedsl computes in bf16/fp16, params_dtype is {cfg.params_dtype}")
        if ctx.dispatch_dtype not in (WireDtype.BF16, WireDtype.NVFP4):
            raise ValueError(f"cutedsl takes bf16 or nvfp4 activations, the plan says {ctx.dispatch_dtype}")
        import flashinfer
        from flashinfer.gemm import grouped_gemm_nt_masked

        self._quantize = flashinfer.scaled_fp4_grouped_quantize
        self._silu_quantize = flashinfer.silu_and_mul_scaled_nvfp4_experts_quantize
        self._gemm = grouped_gemm_nt_masked
        self.decision = CuteDSLDecision(out_dtype=cfg.params_dtype, c_dtype=_C_DTYPE[cfg.params_dtype],
                                        num_local=cfg.num_local_experts, hidden=cfg.hidden_size,
                                        inter=cfg.intermediate_size)

    # ------------------------------------------------------------------ weights

    def process_weights(self, layer: "MoELayer") -> None:
        d = self.decision
        for name, rows, cols in (("w13", 2 * d.inter, d.hidden), ("w2", d.hidden, d.inter)):
            sf = getattr(layer, f"{name}_scale")
            if sf.dim() == 3:  # checkpoint layout: swizzle once (a 6-D scale is already converted)
                if tuple(sf.shape) != (d.num_local, rows, cols // SF_VEC) or sf.dtype != torch.float8_e4m3fn:
                    raise ValueError(f"{name}_scale must be float8_e4m3fn {(d.num_local, rows, cols // SF_VEC)}, "
                                     f"got {sf.dtype} {tuple(sf.shape)}")
                setattr(layer, f"{name}_scale", nn.Parameter(swizzle_block_scales(sf.data), requires_grad=False))
        w13_s2, w2_s2 = layer.w13_scale_2.float(), layer.w2_scale_2.float()
        self._a13_gs = layer.a13_global_scale.float().contiguous()
        self._a2_gs = layer.a2_global_scale.float().contiguous()
        self._w13_scale_2 = w13_s2
        # alpha = 1 / (a_gs * w_gs), with w13_scale_2 = 1 / w_gs (the checkpoint's dequant scale)
        self._alpha13 = (w13_s2 / self._a13_gs).contiguous()
        self._alpha2 = (self.config.routed_scaling_factor * w2_s2 / self._a2_gs).contiguous()

    # ------------------------------------------------------------------ forward

    def apply(self, layer: "MoELayer", dispatched: EPMaskedDispatch) -> EPMaskedCombine:
        if not isinstance(dispatched, EPMaskedDispatch):
            raise TypeError(f"cutedsl takes EPMaskedDispatch, got {type(dispatched).__name__}")
        d = self.decision
        qa, masked_m = dispatched.hidden, dispatched.masked_m
        e, cap, h = qa.shape
        if (e, h) != (d.num_local, d.hidden):
            raise ValueError(f"cutedsl: the slab must be [E_local={d.num_local}, C, H={d.hidden}], got "
                             f"{tuple(qa.shape)}")
        if masked_m.dtype != torch.int32 or tuple(masked_m.shape) != (e,):
            raise ValueError(f"masked_m must be int32 [{e}], got {masked_m.dtype} {tuple(masked_m.shape)}")
        out = torch.empty(e, cap, h, dtype=d.out_dtype, device=qa.device)
        if cap == 0:
            return EPMaskedCombine(out, dispatched.topk, dispatched.handle)
        if qa.dtype is WireDtype.BF16:
            a, a_sf = self._quantize(qa.data.contiguous(), masked_m, self._a13_gs)
            alpha13 = self._alpha13
        elif qa.dtype is WireDtype.NVFP4:
            a = qa.data.contiguous().permute(1, 2, 0)  # logical (m, k/2, l)
            a_sf = logical_sf(swizzle_block_scales(qa.scale))
            # the dispatcher's global scale (a scalar, or one per local expert)
            alpha13 = self._w13_scale_2 / qa.global_scale.float().reshape(-1)
            alpha13 = alpha13.expand(e).contiguous()
        else:
            raise TypeError(f"cutedsl takes bf16 or nvfp4 activations, got {qa.dtype}")
        gate_up = torch.empty(e, cap, 2 * d.inter, dtype=d.out_dtype, device=qa.device)
        self._gemm((a, a_sf), (layer.w13.permute(1, 2, 0), logical_sf(layer.w13_scale)), gate_up.permute(1, 2, 0),
                   masked_m, c_dtype=d.c_dtype, alpha=alpha13, **_GEMM_ARGS)
        hq, hq_sf = self._silu_quantize(gate_up, masked_m, self._a2_gs)
        self._gemm((hq, hq_sf), (layer.w2.permute(1, 2, 0), logical_sf(layer.w2_scale)), out.permute(1, 2, 0),
                   masked_m, c_dtype=d.c_dtype, alpha=self._alpha2, **_GEMM_ARGS)
        return EPMaskedCombine(out, dispatched.topk, dispatched.handle)
