"""Inputs, routing and weights for the conformance kit, plus the error measure and tolerances.

Everything is O(1) random data drawn from a seeded generator (a fresh seed per kit run, printed in
the report, so a failure can be replayed): never zeros, never near-zero data that would make a
relative error meaningless.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from moe_core.contracts import QuantScheme, TopK, WireDtype

__all__ = ["Shape", "TOLERANCE_BY_SCHEME", "TOLERANCE_BY_WIRE", "tolerance", "rel_error", "make_hidden",
           "make_topk", "make_float_weights"]


@dataclass(frozen=True)
class Shape:
    """Layer sizes used by the kit. Hidden and intermediate sizes are multiples of 128 (FP8 block
    scales and activation groups need it); token counts are where odd sizes are exercised."""

    num_experts: int = 8
    top_k: int = 4
    hidden_size: int = 256
    intermediate_size: int = 256
    tokens_odd: int = 37
    tokens_large: int = 257

    @classmethod
    def parse(cls, text: str) -> "Shape":
        """``"E,K,H,I"`` (the ``--moe-kit-shape`` option)."""
        parts = [int(p) for p in text.split(",")]
        if len(parts) != 4:
            raise ValueError(f"expected E,K,H,I (four integers), got {text!r}")
        return cls(*parts)


# Relative-error tolerances (norm(out - ref) / norm(ref)) against the reference backend run with the
# same weights, scheme and wire dtype. Both sides quantize identically, so differences come from
# accumulation order and the bf16/fp16 rounding of intermediates (and the requantization of the
# intermediate activation that rounding can push across a quantization step).
TOLERANCE_BY_SCHEME: dict[QuantScheme, float] = {
    QuantScheme.UNQUANTIZED: 1e-2,
    QuantScheme.FP8_BLOCK: 3e-2,
    QuantScheme.FP8_PER_TOKEN: 3e-2,
    QuantScheme.INT8_W8A8: 3e-2,
    QuantScheme.W4A4: 3e-2,
    # e2m1 has one mantissa bit: when bf16 rounding of the intermediate activation moves an element
    # across a rounding boundary its requantized value jumps by up to 1/3 of its magnitude (4 <-> 6).
    QuantScheme.NVFP4: 1e-1,
}
TOLERANCE_BY_WIRE: dict[WireDtype, float] = {
    WireDtype.BF16: 1e-2,
    WireDtype.FP8: 3e-2,
    WireDtype.INT8: 3e-2,
    WireDtype.NVFP4: 1e-1,
}


def tolerance(scheme: QuantScheme, wire: WireDtype) -> float:
    return max(TOLERANCE_BY_SCHEME[QuantScheme(scheme)], TOLERANCE_BY_WIRE[WireDtype(wire)])


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """``norm(out - ref) / norm(ref)`` in float64 (0.0 when both are empty; inf when ``out`` has
    NaN/Inf)."""
    if ref.numel() == 0:
        return 0.0
    o = out.detach().to("cpu", torch.float64)
    r = ref.detach().to("cpu", torch.float64)
    if not torch.isfinite(o).all():
        return math.inf
    denom = r.norm().item()
    diff = (o - r).norm().item()
    return diff / denom if denom > 0 else (0.0 if diff == 0 else math.inf)


def make_hidden(num_tokens: int, hidden_size: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """``[T, H]`` standard-normal activations (O(1), never zero)."""
    return torch.randn(num_tokens, hidden_size, generator=gen).to(dtype)


def make_topk(num_tokens: int, top_k: int, num_experts: int, gen: torch.Generator, *,
              neg_fraction: float = 0.0, empty_token: bool = False,
              experts_subset: Optional[range] = None) -> TopK:
    """Random routing: ``top_k`` distinct experts per token, positive weights normalized to sum 1.

    :param neg_fraction: share of (token, slot) entries replaced by -1 (no expert); every token
        keeps at least one expert unless ``empty_token``.
    :param empty_token: make token 0 route to no expert at all (all -1): its output must be zero.
    :param experts_subset: draw experts only from this range (skewed routing: every token goes to
        the experts of one rank).
    """
    pool = torch.arange(num_experts) if experts_subset is None else torch.tensor(list(experts_subset))
    if top_k > len(pool):
        raise ValueError(f"top_k={top_k} exceeds the {len(pool)} experts routing may use")
    order = torch.rand(num_tokens, len(pool), generator=gen).argsort(dim=1)[:, :top_k]
    ids = pool[order].to(torch.int32)
    weights = torch.rand(num_tokens, top_k, generator=gen) + 0.25
    weights = weights / weights.sum(dim=1, keepdim=True)
    if neg_fraction > 0 and num_tokens > 0:
        drop = torch.rand(num_tokens, top_k, generator=gen) < neg_fraction
        drop[:, 0] = False  # keep one expert per token
        ids = ids.masked_fill(drop, -1)
    if empty_token and num_tokens > 0:
        ids[0] = -1
    return TopK(weights.float().contiguous(), ids.contiguous())


def make_float_weights(num_experts: int, hidden_size: int, intermediate_size: int,
                       gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``w13 [E, 2I, H]`` (gate rows, then up rows) and ``w2 [E, H, I]`` scaled so that every
    GEMM output is O(1) for O(1) inputs."""
    w13 = torch.randn(num_experts, 2 * intermediate_size, hidden_size, generator=gen) / math.sqrt(hidden_size)
    w2 = torch.randn(num_experts, hidden_size, intermediate_size, generator=gen) / math.sqrt(intermediate_size)
    return w13, w2
