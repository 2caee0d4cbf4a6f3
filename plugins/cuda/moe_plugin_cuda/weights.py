"""Reading the expert weights a ``MoELayer`` owns (names per ``QuantScheme``'s docstring)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch


@dataclass(frozen=True)
class ExpertWeights:
    w13: torch.Tensor  # [E, 2I, H], gate rows first
    w2: torch.Tensor  # [E, H, I]
    w13_scale: Optional[torch.Tensor] = None  # fp8_block: [E, ceil(2I/128), ceil(H/128)]
    w2_scale: Optional[torch.Tensor] = None  # fp8_block: [E, ceil(H/128), ceil(I/128)]


def _get(layer: Any, name: str) -> Optional[torch.Tensor]:
    t = getattr(layer, name, None)
    return t.data if isinstance(t, torch.nn.Parameter) else t


def expert_weights(layer: Any, scaled: bool) -> ExpertWeights:
    w13, w2 = _get(layer, "w13"), _get(layer, "w2")
    if w13 is None or w2 is None:
        raise ValueError("the layer has no expert weights (w13, w2): load_weights() first")
    if not scaled:
        return ExpertWeights(w13, w2)
    s13, s2 = _get(layer, "w13_scale"), _get(layer, "w2_scale")
    if s13 is None or s2 is None:
        raise ValueError("fp8_block weights need w13_scale and w2_scale on the layer")
    return ExpertWeights(w13, w2, s13, s2)
