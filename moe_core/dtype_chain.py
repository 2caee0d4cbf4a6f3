"""The dispatch-dtype chain's vocabulary and the core's own steps of it.

The chain (DESIGN section 5) runs once per planning candidate through the firstresult hook
``select_dispatch_dtype``: user choice -> what the experts require -> platform default -> core
default, then hardware validation by plugin hook wrappers. This module holds what the chain
speaks (``DtypeRequest`` in, ``DtypeDecision`` of ``DtypeStep``s out) and the core's rules
(``CoreDtypeRules`` first, ``CoreDtypeDefault`` last), below both the plugin manager, which
registers the rules, and the planner, which runs the chain (docs/decisions.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from moe_core.backends import BackendSpec, Code, Reason
from moe_core.config import AUTO, MoEConfig
from moe_core.contracts import Format, QuantScheme, WireDtype
from moe_core.hookspecs import hookimpl

__all__ = ["DtypeStep", "DtypeDecision", "DtypeRequest", "NATURAL_DTYPE", "CoreDtypeRules", "CoreDtypeDefault"]


@dataclass(frozen=True)
class DtypeStep:
    source: str  # who decided: "user", "core", a plugin name
    dtype: Optional[WireDtype]
    reason: str
    warning: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "dtype": None if self.dtype is None else str(self.dtype),
                "reason": self.reason, "warning": self.warning}

    def __str__(self) -> str:
        mark = "WARNING " if self.warning else ""
        return f"{mark}[{self.source}] {self.dtype}: {self.reason}"


@dataclass(frozen=True)
class DtypeDecision:
    """Result of the dtype chain: the dtype, every step that led to it, or a rejection."""

    dtype: Optional[WireDtype]
    steps: tuple[DtypeStep, ...]
    rejection: Optional[Reason] = None

    def then(self, dtype: WireDtype, reason: str, *, source: str, warning: bool = False) -> "DtypeDecision":
        """A validation step replacing (or confirming) the dtype; used by hook wrappers."""
        dtype = WireDtype(dtype)
        return dataclasses.replace(self, dtype=dtype, steps=self.steps + (DtypeStep(source, dtype, reason, warning),))

    def reject(self, code: Code, message: str, hint: str = "", *, source: str) -> "DtypeDecision":
        """Refuse the candidate (e.g. NVFP4 on a device that cannot carry it)."""
        return dataclasses.replace(self, dtype=None, rejection=Reason(code, message, hint),
                                   steps=self.steps + (DtypeStep(source, None, message, True),))


@dataclass(frozen=True)
class DtypeRequest:
    """What ``select_dispatch_dtype`` implementations decide from."""

    config: MoEConfig
    dispatcher: Optional[BackendSpec]  # None for a fused backend
    experts: BackendSpec  # experts or fused spec
    format: Format
    common: tuple[WireDtype, ...]  # dtypes both sides carry, in the experts' preference order

    def decide(self, dtype: WireDtype, reason: str, *, source: str) -> DtypeDecision:
        dtype = WireDtype(dtype)
        return DtypeDecision(dtype, (DtypeStep(source, dtype, reason),))


# the weight scheme's natural activation dtype (core default, step 4)
NATURAL_DTYPE = {
    QuantScheme.UNQUANTIZED: WireDtype.BF16,
    QuantScheme.FP8_BLOCK: WireDtype.FP8,
    # the FP8 wire carries 1x128 group scales: per-token experts would requantize it (decisions.md)
    QuantScheme.FP8_PER_TOKEN: WireDtype.BF16,
    QuantScheme.INT8_W8A8: WireDtype.INT8,
    QuantScheme.W4A4: WireDtype.BF16,
    # the NVFP4 wire's global scale is one per batch (from its amax), the scheme's is the checkpoint's
    # calibrated static scale per expert: the experts quantize a BF16 wire with it (decision 45)
    QuantScheme.NVFP4: WireDtype.BF16,
}


class CoreDtypeRules:
    """The core's steps of the dtype chain (user choice, internal quantization, default)."""

    @hookimpl(tryfirst=True)
    def select_dispatch_dtype(self, request: DtypeRequest) -> Optional[DtypeDecision]:
        cfg = request.config
        if cfg.dispatch_dtype != AUTO:
            return request.decide(WireDtype(cfg.dispatch_dtype), "explicit user choice", source="user")
        if request.experts.quantizes_internally and WireDtype.BF16 in request.common:
            return request.decide(WireDtype.BF16, f"experts {request.experts.name} quantize internally",
                                  source="core")
        return None


class CoreDtypeDefault:
    @hookimpl(trylast=True)
    def select_dispatch_dtype(self, request: DtypeRequest) -> Optional[DtypeDecision]:
        natural = NATURAL_DTYPE[request.config.quant]
        if natural in request.common:
            return request.decide(natural, f"core default: natural activation dtype of {request.config.quant}",
                                  source="core")
        if WireDtype.BF16 in request.common:
            return request.decide(WireDtype.BF16, f"core default: {natural} not carried by both sides, BF16",
                                  source="core")
        if request.common:
            return request.decide(request.common[0], "core default: experts' most preferred common dtype",
                                  source="core")
        return None
