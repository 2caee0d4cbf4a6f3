"""Shared experts: one dense gated MLP that every token goes through beside the routed experts.

DeepSeek-V2/V3, GLM4-MoE, ERNIE-4.5, Llama-4 (``n_shared_experts`` experts of width ``I`` are one
MLP of width ``n * I``) and Qwen2-MoE (behind a per-token sigmoid gate). ``MoELayer`` owns one
when ``MoEConfig.shared_intermediate_size > 0`` and runs it after dispatch and before combine, so
that a dispatcher whose transfers run asynchronously (on another stream, or in hardware) overlaps
them with this GEMM; with the ``standard`` dispatcher there is nothing to overlap and the order is
immaterial. Weights are replicated on every EP rank and unquantized (``params_dtype``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from moe_core.config import MoEConfig
from moe_core.reference.experts import gated_activation

__all__ = ["SharedExperts"]


class SharedExperts(nn.Module):
    """``w13 [2*Is, H]`` (gate rows, then up rows), ``w2 [H, Is]``, optional ``gate [1, H]``."""

    def __init__(self, config: MoEConfig, device: torch.device) -> None:
        super().__init__()
        i, h, dtype = config.shared_intermediate_size, config.hidden_size, config.params_dtype

        def param(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)

        self.w13 = param(2 * i, h)
        self.w2 = param(h, i)
        self.gate: Optional[nn.Parameter] = param(1, h) if config.shared_expert_gate else None
        self.glu = gated_activation(config.activation, config.swiglu_alpha, config.swiglu_limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [T, H]`` -> ``[T, H]`` in the params dtype (the GEMMs run in it, as engines run them)."""
        gate, up = F.linear(x, self.w13).chunk(2, dim=-1)
        y = F.linear(self.glu(gate, up), self.w2)
        if self.gate is not None:
            y = y * torch.sigmoid(F.linear(x, self.gate))
        return y
