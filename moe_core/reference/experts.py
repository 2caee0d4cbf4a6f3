"""Experts ``reference``: every format and quant scheme in plain PyTorch (float32 math).

Vectorized by expert: the (token, k) pairs are sorted by expert id once and each expert's
contiguous segment goes through GEMM1 -> gated activation -> GEMM2 in one batch. Quantized
schemes use the dequantized weights and quantize activations exactly as the scheme defines
(``moe_core.quant``), so a kernel that quantizes the same way matches it closely.

Contract (``moe_core.contracts``): STANDARD and EP_NORMAL outputs are weighted by the top-k
weights and summed over local experts; EP_MASKED outputs are unweighted per slot. Every format
multiplies by ``routed_scaling_factor`` (linear, so it commutes with the combine's weighting).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.nn.functional as F

from moe_core import quant
from moe_core.contracts import (
    Activation,
    DispatchOutput,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    QuantScheme,
    StandardCombine,
    StandardDispatch,
    WireDtype,
)
from moe_core.runtime import BackendContext, Experts

if TYPE_CHECKING:
    from moe_core.layer import MoELayer

ACTIVATIONS: dict[Activation, Callable[[torch.Tensor], torch.Tensor]] = {
    Activation.SILU: F.silu,
    Activation.GELU: F.gelu,
}


def gated_activation(activation: Activation, alpha: float = 1.702,
                     limit: float = 7.0) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``fn(gate, up) -> h`` for ``activation``; ``alpha`` / ``limit`` parametrize ``swiglu_oai``."""
    activation = Activation(activation)
    if activation is Activation.SWIGLU_OAI:
        def swiglu_oai(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            g = gate.clamp(max=limit)
            return (up.clamp(-limit, limit) + 1) * g * torch.sigmoid(alpha * g)
        return swiglu_oai
    act = ACTIVATIONS[activation]
    return lambda gate, up: act(gate) * up


# the wire dtype that carries activations already quantized as the scheme quantizes them
# (W4A4's int4 has no wire dtype: it always arrives unquantized or as INT8 and is requantized;
# fp8_per_token's per-row scale is not the FP8 wire's 1x128 groups: requantized per token)
ACTIVATION_WIRE_DTYPE = {QuantScheme.FP8_BLOCK: WireDtype.FP8, QuantScheme.INT8_W8A8: WireDtype.INT8,
                         QuantScheme.NVFP4: WireDtype.NVFP4}


def activation_quantizer(scheme: QuantScheme) -> Optional[Callable[..., torch.Tensor]]:
    """How ``scheme`` quantizes GEMM inputs: ``fn(x_f32, global_scale) -> dequantized x``, or None."""

    def fp8(x, gs):
        return quant.dequantize_fp8_per_token_group(*quant.quantize_fp8_per_token_group(x))

    def fp8_per_token(x, gs):
        return quant.dequantize_fp8_per_token(*quant.quantize_fp8_per_token(x))

    def int8(x, gs):
        q, s = quant.quantize_int8_per_token(x)
        return q.float() * s

    def int4(x, gs):
        q, s = quant.quantize_int4_per_token(x)
        return q.float() * s

    def nvfp4(x, gs):
        return quant.dequantize_nvfp4(*quant.quantize_nvfp4(x, gs), gs)

    return {QuantScheme.UNQUANTIZED: None, QuantScheme.FP8_BLOCK: fp8,
            QuantScheme.FP8_PER_TOKEN: fp8_per_token, QuantScheme.INT8_W8A8: int8,
            QuantScheme.W4A4: int4, QuantScheme.NVFP4: nvfp4}[scheme]


class ReferenceExperts(Experts):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.glu = gated_activation(cfg.activation, cfg.swiglu_alpha, cfg.swiglu_limit)
        self.quantize = activation_quantizer(cfg.quant)
        # Activations that arrive already quantized in the scheme's own format are the GEMM1
        # input as they are; quantizing them again (with other scales) would add error.
        self.quantize_input = self.quantize is not None and ctx.dispatch_dtype is not ACTIVATION_WIRE_DTYPE.get(cfg.quant)
        self.scale = cfg.routed_scaling_factor
        self.weight_on_input = cfg.apply_router_weight_on_input
        self.out_dtype = cfg.params_dtype
        self._apply = {
            StandardDispatch: self._apply_token_list,
            EPNormalDispatch: self._apply_token_list,
            EPMaskedDispatch: self._apply_masked,
        }

    def process_weights(self, layer: "MoELayer") -> None:
        # The reference reads the checkpoint layout; it only caches the float32 weights
        # (recomputed from the loaded tensors on every call, so calling twice is harmless).
        w13, w2 = quant.dequantize_weights(layer.weight_tensors(), self.config.quant)
        self.w13, self.w2 = w13, w2
        # expert biases (MoEConfig.expert_bias), added after each GEMM
        b13, b2 = getattr(layer, "w13_bias", None), getattr(layer, "w2_bias", None)
        self.b13 = None if b13 is None else b13.float()
        self.b2 = None if b2 is None else b2.float()
        self.gs13 = getattr(layer, "a13_global_scale", None)
        self.gs2 = getattr(layer, "a2_global_scale", None)

    def apply(self, layer: "MoELayer", dispatched: DispatchOutput):
        return self._apply[type(dispatched)](dispatched)

    # ------------------------------------------------------------------ one expert

    def _expert(self, x: torch.Tensor, e: int) -> torch.Tensor:
        """``x [n, H]`` float32 through expert ``e`` -> ``[n, H]`` float32 (unweighted)."""
        if self.quantize_input:
            x = self.quantize(x, None if self.gs13 is None else self.gs13[e])
        gate_up = x @ self.w13[e].t()
        if self.b13 is not None:
            gate_up = gate_up + self.b13[e]
        gate, up = gate_up.chunk(2, dim=-1)
        h = self.glu(gate, up)
        if self.quantize is not None:
            h = self.quantize(h, None if self.gs2 is None else self.gs2[e])
        y = h @ self.w2[e].t()
        return y if self.b2 is None else y + self.b2[e]

    # ------------------------------------------------------------------ formats

    def _apply_token_list(self, d):
        x = d.hidden.dequantize(torch.float32)
        ids, weights = d.topk.ids, d.topk.weights
        n, k = ids.shape
        num_experts = self.w13.shape[0]
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= num_experts):
            raise ValueError(f"topk.ids must be in [-1, {num_experts}) (local experts), got values in "
                             f"[{int(flat.min())}, {int(flat.max())}]")
        counts = torch.bincount(flat + 1, minlength=num_experts + 1).tolist()  # slot 0: the -1 ids
        order = torch.argsort(flat, stable=True)
        flat_w = weights.reshape(-1)
        out = torch.zeros(n, x.shape[-1], dtype=torch.float32, device=x.device)
        start = counts[0]
        for e, c in enumerate(counts[1:]):
            if c == 0:
                continue
            pairs = order[start:start + c]
            start += c
            tokens = pairs // k
            w = flat_w[pairs].unsqueeze(-1)
            xs = x[tokens]
            if self.weight_on_input:
                y = self._expert(xs * w, e)
            else:
                y = self._expert(xs, e) * w
            out.index_add_(0, tokens, y)
        out = (out * self.scale).to(self.out_dtype)
        if isinstance(d, StandardDispatch):
            return StandardCombine(out)
        return EPNormalCombine(out, d.handle)

    def _apply_masked(self, d: EPMaskedDispatch) -> EPMaskedCombine:
        x = d.hidden.dequantize(torch.float32)  # [E_local, C, H]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, m in enumerate(d.masked_m.tolist()):
            if m > x.shape[1]:
                raise ValueError(f"masked_m[{e}]={m} exceeds the slab capacity {x.shape[1]}")
            if m:
                out[e, :m] = self._expert(x[e, :m], e)
        return EPMaskedCombine((out * self.scale).to(self.out_dtype), d.topk, d.handle)
