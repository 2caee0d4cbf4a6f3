"""An independent float64 MoE computation, written for clarity, to test every backend against.

It shares no code with the reference experts: a loop over experts, then over the (token, k)
slots routed to each, in float64. Quantized schemes are checked against it with their
dequantized weights; ``quantize_activation`` optionally applies the scheme's activation
quantization (to separate weight-path errors from activation rounding).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch

from moe_core.contracts import Activation


def _act(x: torch.Tensor, activation: Activation) -> torch.Tensor:
    if Activation(activation) is Activation.SILU:
        return x / (1.0 + torch.exp(-x))
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _glu(gate: torch.Tensor, up: torch.Tensor, activation: Activation, alpha: float, limit: float) -> torch.Tensor:
    if Activation(activation) is Activation.SWIGLU_OAI:  # gpt-oss, written out elementwise
        g = torch.minimum(gate, torch.full_like(gate, limit))
        u = torch.maximum(torch.minimum(up, torch.full_like(up, limit)), torch.full_like(up, -limit))
        return (u + 1.0) * g / (1.0 + torch.exp(-alpha * g))
    return _act(gate, activation) * up


def moe_float64(
    hidden_states: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    *,
    activation: Activation = Activation.SILU,
    routed_scaling_factor: float = 1.0,
    apply_router_weight_on_input: bool = False,
    quantize_activation: Optional[Callable[[torch.Tensor, str, int], torch.Tensor]] = None,
    w13_bias: Optional[torch.Tensor] = None,
    w2_bias: Optional[torch.Tensor] = None,
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """``out[t] = rsf * sum_k w[t,k] * W2[e] (act(W1[e] x) * (W3[e] x))`` with ``e = ids[t,k]``,
    skipping ``ids == -1``; ``w13 = [W1 (gate); W3 (up)]``. All in float64; returns float64.
    With expert biases: ``W1[e] x + b1[e]`` (``w13_bias = [b1; b3]``) and ``W2[e] h + b2[e]``."""
    x = hidden_states.double()
    w13, w2 = w13.double(), w2.double()
    inter = w2.shape[-1]
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        rows, slots = torch.nonzero(topk_ids == e, as_tuple=True)
        for t, k in zip(rows.tolist(), slots.tolist(), strict=True):
            weight = float(topk_weights[t, k])
            xt = x[t] * weight if apply_router_weight_on_input else x[t]
            if quantize_activation is not None:
                xt = quantize_activation(xt.unsqueeze(0), "a13", e).squeeze(0).double()
            gate = w13[e, :inter] @ xt
            up = w13[e, inter:] @ xt
            if w13_bias is not None:
                gate = gate + w13_bias[e, :inter].double()
                up = up + w13_bias[e, inter:].double()
            h = _glu(gate, up, activation, swiglu_alpha, swiglu_limit)
            if quantize_activation is not None:
                h = quantize_activation(h.unsqueeze(0), "a2", e).squeeze(0).double()
            y = w2[e] @ h
            if w2_bias is not None:
                y = y + w2_bias[e].double()
            out[t] += y if apply_router_weight_on_input else weight * y
    return out * routed_scaling_factor


def fp8_round_trip(v: torch.Tensor, group: Optional[int] = None, *, dtype: torch.dtype = torch.float8_e4m3fn,
                   amax_floor: float = 1e-4) -> torch.Tensor:
    """``v [..., N]`` quantized to the FP8 grid of ``dtype`` and back, in float64: one scale
    ``max(amax, amax_floor) / finfo(dtype).max`` per row (``group=None``) or per ``group``
    channels (the last group may be shorter), rounded to float32 as the formats store it (a scale one
    float32 ulp away moves every value tied on the e4m3 grid: at one token that is percents of the
    output; decision 67); values clamped to the format's range before the cast. ``dtype`` is the
    grid: e4m3fn (448) is the core's, e4m3fnuz (240) that of some GPUs."""
    v = v.double()
    fmax = torch.finfo(dtype).max
    n = v.shape[-1]
    step = n if group is None else group
    out = torch.empty_like(v)
    for start in range(0, n, max(step, 1)):
        part = v[..., start:start + step]
        scale = (part.abs().amax(dim=-1, keepdim=True).clamp(min=amax_floor) / fmax).float().double()
        out[..., start:start + step] = (part / scale).clamp(-fmax, fmax).to(dtype).double() * scale
    return out


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """``||actual - expected|| / ||expected||`` in float64 (0 when both are empty)."""
    a, b = actual.double(), expected.double()
    if b.numel() == 0:
        return 0.0
    denom = b.norm().item()
    if not math.isfinite(a.norm().item()):
        return math.inf
    return (a - b).norm().item() / max(denom, 1e-300)
