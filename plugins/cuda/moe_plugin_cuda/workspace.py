"""One allocation for a forward's scratch tensors (docs/decisions.md, "Triton kernels are launched
through their compiled launcher; a forward's scratch is one allocation").

A decode forward allocated up to seven small tensors (alignment, activations, GEMM outputs): about 15% of
its host time on the H100. ``Layout`` places them in one flat byte buffer (each part at a multiple of
``ALIGN`` bytes: Triton specializes on 16-byte aligned pointers, TMA wants 16 bytes too) and ``carve``
makes the buffer and its views: one ``torch.empty`` per call. The buffer is new each call (the caching
allocator keeps streams and CUDA graphs safe); only the offsets are computed once, per the caller's key,
in a ``Layouts`` cache the experts object owns.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Optional, Sequence

import torch

ALIGN = 256  # bytes between part starts


class Layout:
    """Parts ``(dtype, shape)`` at increasing offsets of one buffer of ``nbytes`` bytes (contiguous views)."""

    def __init__(self, parts: Sequence[tuple[torch.dtype, tuple[int, ...]]]) -> None:
        self.parts: list[tuple[torch.dtype, tuple[int, ...], tuple[int, ...], int]] = []
        self.spans: list[tuple[int, int]] = []  # [start, end) bytes of each part
        offset = 0
        for dtype, shape in parts:
            shape = tuple(int(s) for s in shape)
            if any(s < 0 for s in shape):
                raise ValueError(f"workspace part shapes must be non-negative, got {shape}")
            itemsize = dtype.itemsize
            nbytes = math.prod(shape) * itemsize
            stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
            self.parts.append((dtype, shape, stride, offset // itemsize))
            self.spans.append((offset, offset + nbytes))
            offset += -(-nbytes // ALIGN) * ALIGN
        self.nbytes = max(offset, ALIGN)  # a multiple of ALIGN: viewable as any dtype

    def carve(self, device: torch.device) -> list[torch.Tensor]:
        """A new buffer on ``device`` and the parts' views of it, in order (values undefined)."""
        buf = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        typed: dict[torch.dtype, torch.Tensor] = {}
        out = []
        for dtype, shape, stride, offset in self.parts:
            view = typed.get(dtype)
            if view is None:
                view = typed[dtype] = buf.view(dtype)
            out.append(view.as_strided(shape, stride, offset))
        return out


class Layouts:
    """``Layout``s by key (e.g. T, device and dtypes), at most ``max_entries`` (emptied when full: decode
    runs a few T; a prefill of ever new T only ever costs the layout's computation again)."""

    def __init__(self, max_entries: int = 256) -> None:
        self.max_entries = max_entries
        self._layouts: dict[Hashable, Layout] = {}

    def get(self, key: Hashable, parts: Callable[[], Sequence[tuple[torch.dtype, tuple[int, ...]]]]) -> Layout:
        layout = self._layouts.get(key)
        if layout is None:
            if len(self._layouts) >= self.max_entries:
                self._layouts.clear()
            layout = self._layouts[key] = Layout(parts())
        return layout

    def __len__(self) -> int:
        return len(self._layouts)


def layout(layouts: Optional[Layouts], key: Hashable,
           parts: Callable[[], Sequence[tuple[torch.dtype, tuple[int, ...]]]]) -> Layout:
    """``layouts.get(key, parts)``, or without a cache a layout for this call only."""
    return Layout(parts()) if layouts is None else layouts.get(key, parts)
