"""Reading the expert weights a ``MoELayer`` owns (names per ``QuantScheme``'s docstring)."""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple, Optional

import torch


class ExpertWeights(NamedTuple):  # (a tuple: built on every forward, a frozen dataclass costs several times more)
    w13: torch.Tensor  # [E, 2I, H], gate rows first (the triton backend interleaves them: see below)
    w2: torch.Tensor  # [E, H, I]
    w13_scale: Optional[torch.Tensor] = None  # fp8_block: [E, ceil(2I/128), ceil(H/128)]
    w2_scale: Optional[torch.Tensor] = None  # fp8_block: [E, ceil(H/128), ceil(I/128)]


def _get(layer: Any, name: str, detach: bool = True) -> Optional[torch.Tensor]:
    t = getattr(layer, name, None)
    return t.data if detach and isinstance(t, torch.nn.Parameter) else t


def expert_weights(layer: Any, scaled: bool, detach: bool = True) -> ExpertWeights:
    """The layer's expert weights; ``detach``: Parameters as plain tensors (``.data``, a torch op each: what torch
    ops and custom ops need when a weight requires grad; a Triton launch reads only the pointer)."""
    params = None if detach else getattr(layer, "_parameters", None)
    if params is not None:  # (an nn.Module's Parameters: its own dict, not four trips through Module.__getattr__)
        w13, w2 = params.get("w13"), params.get("w2")
        if w13 is not None and w2 is not None:
            if not scaled:
                return ExpertWeights(w13, w2)
            s13, s2 = params.get("w13_scale"), params.get("w2_scale")
            if s13 is not None and s2 is not None:
                return ExpertWeights(w13, w2, s13, s2)
    w13, w2 = _get(layer, "w13", detach), _get(layer, "w2", detach)
    if w13 is None or w2 is None:
        raise ValueError("the layer has no expert weights (w13, w2): load_weights() first")
    if not scaled:
        return ExpertWeights(w13, w2)
    s13, s2 = _get(layer, "w13_scale", detach), _get(layer, "w2_scale", detach)
    if s13 is None or s2 is None:
        raise ValueError("fp8_block weights need w13_scale and w2_scale on the layer")
    return ExpertWeights(w13, w2, s13, s2)


# ---------------------------------------------------------------- the triton backend's w13 layout


def interleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """``[E, 2I, H]`` = [gate rows | up rows] -> row 2j = gate j, row 2j+1 = up j (a new tensor).

    With this layout a GEMM1 tile of BLOCK_N rows holds BLOCK_N/2 whole (gate, up) pairs, so one
    accumulator serves both halves (triton.kernels, ``GATE == 1``)."""
    E, n, H = w13.shape
    return w13.reshape(E, 2, n // 2, H).transpose(1, 2).reshape(E, n, H).contiguous()


@torch.no_grad()
def interleave_gate_up_(w13: torch.Tensor) -> torch.Tensor:
    """In place, one expert at a time (no second copy of every expert's weights); returns ``w13``."""
    for e in range(w13.shape[0]):
        w13[e:e + 1].copy_(interleave_gate_up(w13[e:e + 1]))
    return w13


def deinterleave_gate_up(w13: torch.Tensor) -> torch.Tensor:
    """Inverse of ``interleave_gate_up``."""
    E, n, H = w13.shape
    return w13.reshape(E, n // 2, 2, H).transpose(1, 2).reshape(E, n, H).contiguous()


class InterleavedW13:
    """Remembers which ``w13`` this backend interleaved, so ``process_weights`` is idempotent.

    The mark is the tensor's storage (a weak reference: no memory kept alive) plus the version
    counter of the Parameter that held it. Same Parameter, same version: done. Same Parameter,
    newer version: ``load_weights`` copied a checkpoint into it in place, interleave again. Another
    Parameter over the same storage (re-wrapped, e.g. ``nn.Parameter(p.data)``): already done.
    """

    def __init__(self) -> None:
        self._storage: Optional[weakref.ref] = None
        self._param: Optional[weakref.ref] = None
        self._version = -1
        self._rows: Optional[torch.Tensor] = None

    def is_interleaved(self, t: torch.Tensor) -> bool:
        storage = self._storage() if self._storage is not None else None
        if storage is None or t.untyped_storage() is not storage:
            return False
        if self._param is not None and self._param() is t:
            if t.is_inference():  # no version counter: compare the first rows this backend wrote
                return self._rows is not None and torch.equal(t[:1, :2], self._rows)
            return t._version == self._version
        self.mark(t)  # a re-wrap of the storage this backend wrote
        return True

    def mark(self, t: torch.Tensor) -> None:
        """Remember ``t`` as interleaved. Tensors made under ``torch.inference_mode()`` (engines load
        and run there) have no version counter; for them the mark is a copy of the first two rows
        (gate 0, up 0 once interleaved; an in-place reload writes gate 0, gate 1 there)."""
        self._storage = weakref.ref(t.untyped_storage())
        self._param = weakref.ref(t)
        self._version = -1 if t.is_inference() else t._version
        self._rows = t[:1, :2].clone() if t.is_inference() else None
