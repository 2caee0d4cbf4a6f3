"""Weight layouts and index helpers shared by the Ascend backends (plain torch, device-agnostic).

Nothing here imports a vendor library: these ops run wherever the tensors live (NPU or CPU).
"""

from __future__ import annotations

import contextlib
import os
from typing import Iterator, Optional

import torch
from torch import nn

ACL_FORMAT_FRACTAL_NZ = 29
TILE = 64  # fused_deep_moe's gate/up interleave width


@contextlib.contextmanager
def scoped_env(name: str, value: str) -> Iterator[None]:
    """Set ``name`` only for the duration of one vendor call that reads it, then restore it.

    The Ascend DeepEP build reads ``DEEP_NORMAL_MODE_USE_INT8_QUANT`` inside ``Buffer.dispatch``;
    scoping it to that call lets two layers in one process (a model and its draft) differ.
    """
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def interleave_64(t: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` = [gate | up] -> gate and up alternating in 64-column tiles (``I % 64 == 0``):
    view ``[..., 2, I/64, 64]``, swap the two middle axes, flatten (vendor-apis section 7)."""
    n = t.shape[-1]
    if n % (2 * TILE):
        raise ValueError(f"the 64-column interleave needs 2I divisible by 128, got {n}")
    return t.unflatten(-1, (2, n // (2 * TILE), TILE)).transpose(-3, -2).flatten(-3).contiguous()


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values in [-8, 7] (one per int8) -> int32 words of 8 values along the last dim, low nibble
    first (the order npu_dynamic_quant's quint4x2 output uses; the references infer it, unverified)."""
    if q.shape[-1] % 8:
        raise ValueError(f"int4 packing needs the last dim to be a multiple of 8, got {q.shape[-1]}")
    nib = (q.to(torch.int32) & 0xF).unflatten(-1, (-1, 8))
    words = torch.zeros(nib.shape[:-1], dtype=torch.int32, device=q.device)
    for j in range(8):
        words |= nib[..., j] << (4 * j)
    return words


def slab_to_packed_index(counts: torch.Tensor, capacity: int, rows: int) -> torch.Tensor:
    """For a ``[E, capacity, H]`` slab with ``counts[e]`` valid rows per expert: the slab row of each of
    ``rows`` packed rows (valid rows first, expert by expert; later packed rows point at row 0 and are
    garbage). Device ops only, fixed shapes: no host sync."""
    counts = counts.to(torch.int64)
    ends = torch.cumsum(counts, 0)
    starts = ends - counts
    p = torch.arange(rows, device=counts.device)
    e = torch.searchsorted(ends, p, right=True).clamp(max=counts.numel() - 1)
    src = e * capacity + (p - starts[e])
    return torch.where(p < ends[-1], src, torch.zeros_like(src)) if counts.numel() else src


def packed_to_slab_index(counts: torch.Tensor, capacity: int) -> torch.Tensor:
    """Inverse view: for each slab row ``(e, c)``, the packed row holding it (row 0 where ``c >= counts[e]``:
    those slab rows are garbage by contract). Flattened ``[E * capacity]``."""
    counts = counts.to(torch.int64)
    starts = torch.cumsum(counts, 0) - counts
    c = torch.arange(capacity, device=counts.device)
    src = starts[:, None] + c[None, :]
    return torch.where(c[None, :] < counts[:, None], src, torch.zeros_like(src)).flatten()


class LayoutTracker:
    """Remembers which layer parameters this backend produced, so ``process_weights`` is idempotent:
    a parameter is converted again only if it was replaced or written in place (``load_weights``)."""

    def __init__(self) -> None:
        self._done: dict[str, tuple[torch.Tensor, int]] = {}

    def is_current(self, layer: nn.Module, names: tuple[str, ...]) -> bool:
        for name in names:
            rec: Optional[tuple[torch.Tensor, int]] = self._done.get(name)
            param = getattr(layer, name)
            if rec is None or rec[0] is not param or rec[1] != param._version:
                return False
        return True

    def replace(self, layer: nn.Module, name: str, value: torch.Tensor) -> None:
        param = nn.Parameter(value, requires_grad=False)
        setattr(layer, name, param)
        self._done[name] = (param, param._version)
