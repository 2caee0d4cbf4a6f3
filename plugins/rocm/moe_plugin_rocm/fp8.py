"""FP8 flavour conversion: OCP e4m3fn (the core's wire and checkpoint format) -> e4m3fnuz (gfx942).

The two formats share the bit layout except for the exponent bias (fnuz's is one larger) and
the special values: a bit pattern means half as much in fnuz, and 0x80 (-0 in fn) is NaN in
fnuz. So ``q_fn * s`` equals ``bits(q_fn with 0x80 -> 0x00) as fnuz * (2 * s)`` exactly, for
every finite value fn can hold (fn's largest, 448, becomes 224 <= 240).
"""

from __future__ import annotations

import torch

__all__ = ["fn_to_fnuz", "clear_negative_zero_"]

_NEG_ZERO = 0x80


def clear_negative_zero_(q: torch.Tensor) -> torch.Tensor:
    """In place: replace -0 (0x80) by +0 in an e4m3fn tensor. The values are unchanged, and the
    bits can then be read as e4m3fnuz (see ``fn_to_fnuz``)."""
    bits = q.view(torch.uint8)
    bits.masked_fill_(bits == _NEG_ZERO, 0)
    return q


def fn_to_fnuz(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3fn data and its fp32 scales -> the same values as e4m3fnuz data and scales (new tensors)."""
    if q.dtype != torch.float8_e4m3fn:
        raise TypeError(f"fn_to_fnuz expects float8_e4m3fn data, got {q.dtype}")
    bits = q.view(torch.uint8)
    bits = torch.where(bits == _NEG_ZERO, torch.zeros_like(bits), bits)
    return bits.view(torch.float8_e4m3fnuz), scale * 2.0
