"""Base classes of backend implementations, and the context they are built with.

A backend's ``impl`` class is instantiated once per layer at plan time with a
``BackendContext``; the forward pass then calls its methods directly (no hook loop).
Subclass the one matching the backend's role:

- ``Dispatcher``: ``dispatch(hidden_states, topk) -> DispatchOutput`` and
  ``combine(combine_input) -> Tensor``;
- ``Experts``: ``process_weights(layer)`` and ``apply(layer, dispatched) -> CombineInput``;
- ``FusedMoE``: ``process_weights(layer)`` and ``forward(layer, hidden_states, topk) -> Tensor``.

Implementations own any workspace they need (allocated in ``__init__`` or ``prepare``), keep
no per-call state on ``self`` (state travels in the ``handle`` of the dispatch output), and
never read environment variables: everything comes from the context.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional

import torch

from moe_core.contracts import (
    CombineInput,
    DispatchOutput,
    Format,
    QuantizedActivations,
    StandardDispatch,
    TopK,
    WireDtype,
)

if TYPE_CHECKING:
    from moe_core.backends import BackendSpec
    from moe_core.config import MoEConfig
    from moe_core.layer import MoELayer

__all__ = ["BackendContext", "Dispatcher", "Experts", "FusedMoE"]


@dataclass(frozen=True)
class BackendContext:
    """What a backend is built with: the layer config and the negotiated plan choices."""

    config: "MoEConfig"
    spec: "BackendSpec"
    format: Format
    dispatch_dtype: WireDtype
    peer: "Optional[BackendSpec]" = None  # the other side of the pair (experts for a dispatcher, and back)

    @property
    def options(self) -> Mapping[str, Any]:
        """This backend's entry of ``config.backend_options``."""
        return self.config.options(self.spec.name)


class _Backend:
    def __init__(self, ctx: BackendContext) -> None:
        self.ctx = ctx
        self.config = ctx.config

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.ctx.spec.qualified_name} format={self.ctx.format}>"


class Dispatcher(_Backend):
    # True when dispatch itself makes every rank of the EP group raise on any rank's ids outside
    # [-1, num_experts) (decision 15); otherwise the layer exchanges its own check under EP
    checks_ids_on_every_rank: bool = False
    # True when, under EP, dispatch expects the same tokens on every rank (``standard``: local-id
    # remap, then an all-reduce of the output). MoELayer's rule is that every rank passes its own
    # tokens (decision 43): for such a dispatcher the layer gathers them first and keeps its rows
    expects_replicated_input: bool = False
    # True when dispatch only wraps the tokens and routing as they came into a ``StandardDispatch`` (bf16, no
    # remap, no communication) and combine only returns ``StandardCombine.hidden``: the layer then calls the
    # experts' ``apply_tokens`` instead of the three stages (the same result, no contract objects per forward)
    passes_tokens_through: bool = False

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> DispatchOutput:
        raise NotImplementedError

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        raise NotImplementedError


class Experts(_Backend):
    def process_weights(self, layer: "MoELayer") -> None:
        """Convert ``layer``'s loaded weights to this backend's layout. Must be idempotent:
        the layer calls it after every (re)load; a second call must change nothing."""

    def apply(self, layer: "MoELayer", dispatched: DispatchOutput) -> CombineInput:
        raise NotImplementedError

    def apply_tokens(self, layer: "MoELayer", hidden_states: torch.Tensor, topk: TopK) -> torch.Tensor:
        """``apply`` on a token list as a pass-through dispatcher hands it (``Dispatcher.passes_tokens_through``):
        ``[T, H]`` in the params dtype, local ids -> the weighted sum ``[T, H]``. A backend may override it with a
        shorter way to the same result (its decode hot path); the default builds the contracts."""
        return self.apply(layer, StandardDispatch(QuantizedActivations(hidden_states), topk)).hidden


class FusedMoE(_Backend):
    def process_weights(self, layer: "MoELayer") -> None:
        """As ``Experts.process_weights``."""

    def forward(self, layer: "MoELayer", hidden_states: torch.Tensor, topk: TopK) -> torch.Tensor:
        raise NotImplementedError
