"""The experts backend ``simple``: what a vendor replaces with calls into its kernels.

The contract (``moe_core.contracts``): ``apply`` receives a ``StandardDispatch`` or an
``EPNormalDispatch`` (tokens, local expert ids with -1 = not here, top-k weights) and returns the
matching ``*Combine`` whose ``hidden`` is, per token, ``routed_scaling_factor * sum_k w_k *
expert_k(x)`` over the local experts (or ``expert_k(w_k * x)`` with
``apply_router_weight_on_input``). Tokens with no local expert give exactly zero.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from moe_core.plugin_api import (
    Activation,
    BackendContext,
    DispatchOutput,
    EPNormalCombine,
    EPNormalDispatch,
    Experts,
    QuantizedActivations,
    QuantScheme,
    StandardCombine,
    WireDtype,
    quant,
)

if TYPE_CHECKING:
    from moe_core.plugin_api import MoELayer

_ACT = {Activation.SILU: F.silu, Activation.GELU: F.gelu}


class SimpleExperts(Experts):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        # Everything a call needs is decided here, once, from the context (never from env vars).
        self.act = _ACT[cfg.activation]
        self.w8a8 = cfg.quant is QuantScheme.INT8_W8A8
        self.scale = cfg.routed_scaling_factor
        self.weight_on_input = cfg.apply_router_weight_on_input
        self.out_dtype = cfg.params_dtype

    # ------------------------------------------------------------------ weights

    def process_weights(self, layer: "MoELayer") -> None:
        """Convert the checkpoint layout to ours: GEMM operands transposed to ``[E, K, N]``.

        Idempotent by construction: it always reads the loaded tensors (``layer.w13``, ``layer.w2``,
        untouched) and overwrites its own buffers, so a second call or a reload gives the same result.
        """
        dtype = torch.float32  # int8 values and bf16 weights are exact in fp32
        layer.register_buffer("simple_w13", layer.w13.detach().to(dtype).transpose(1, 2).contiguous(), persistent=False)
        layer.register_buffer("simple_w2", layer.w2.detach().to(dtype).transpose(1, 2).contiguous(), persistent=False)
        if self.w8a8:  # per-output-channel scales [E, N] -> [E, 1, N] to scale GEMM output columns
            layer.register_buffer("simple_w13_scale", layer.w13_scale.detach().float().unsqueeze(1), persistent=False)
            layer.register_buffer("simple_w2_scale", layer.w2_scale.detach().float().unsqueeze(1), persistent=False)

    # ------------------------------------------------------------------ forward

    def _gemm(self, x: torch.Tensor, layer: "MoELayer", which: str, e: int) -> torch.Tensor:
        """``x [n, K]`` (fp32) @ weight ``[K, N]`` of expert ``e``; W8A8 quantizes ``x`` per token to
        int8 and multiplies integer values, then applies both scales (what an int8 kernel does)."""
        w = getattr(layer, f"simple_{which}")[e]
        if not self.w8a8:
            return x @ w
        xq, xs = quant.quantize_int8_per_token(x)
        return (xq.float() @ w) * xs * getattr(layer, f"simple_{which}_scale")[e]

    def _inputs(self, hidden: QuantizedActivations) -> torch.Tensor:
        if hidden.dtype not in (WireDtype.BF16, WireDtype.INT8):
            raise ValueError(f"simple experts accept bf16 or int8 activations, got {hidden.dtype}")
        return hidden.dequantize(torch.float32)

    def apply(self, layer: "MoELayer", dispatched: DispatchOutput):
        x = self._inputs(dispatched.hidden)
        ids, weights = dispatched.topk.ids, dispatched.topk.weights
        num_tokens, top_k = ids.shape
        out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)
        flat = ids.reshape(-1)
        for e in range(layer.simple_w13.shape[0]):  # local experts
            pairs = (flat == e).nonzero().flatten()  # (token, k) slots routed to expert e
            if pairs.numel() == 0:
                continue
            tokens = pairs // top_k
            w = weights.reshape(-1)[pairs].unsqueeze(-1)
            xe = x[tokens] * w if self.weight_on_input else x[tokens]
            gate, up = self._gemm(xe, layer, "w13", e).chunk(2, dim=-1)
            y = self._gemm(self.act(gate) * up, layer, "w2", e)
            out.index_add_(0, tokens, y if self.weight_on_input else y * w)
        out = (out * self.scale).to(self.out_dtype)
        if isinstance(dispatched, EPNormalDispatch):
            return EPNormalCombine(out, dispatched.handle)  # the handle goes back to combine
        return StandardCombine(out)
