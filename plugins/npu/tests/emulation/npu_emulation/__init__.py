"""Emulated Ascend vendor libraries for moe-plugin-npu's tests (never shipped, never a fallback).

``install(monkeypatch)`` puts an emulated ``torch_npu`` and ``deep_ep`` (DeepEP for Ascend, with
``deep_ep.buffer.FuseMode``) into ``sys.modules``; ``install_into_process()`` does the same in a
spawned worker (no monkeypatch there: the process ends with the test).
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

import torch

from . import deep_ep_ascend, torch_npu_ops

A3_SOC = "Ascend910_9392"


def make_deep_ep() -> tuple[types.ModuleType, types.ModuleType]:
    mod = types.ModuleType("deep_ep")
    mod.__spec__ = importlib.machinery.ModuleSpec("deep_ep", loader=None, is_package=True)
    mod.__path__ = []
    mod.EMULATED = True
    buf = types.ModuleType("deep_ep.buffer")
    buf.__spec__ = importlib.machinery.ModuleSpec("deep_ep.buffer", loader=None)
    for name in ("Buffer", "FuseMode", "EventOverlap"):
        setattr(mod, name, getattr(deep_ep_ascend, name))
        setattr(buf, name, getattr(deep_ep_ascend, name))
    mod.buffer = buf
    return mod, buf


def modules(soc: str = A3_SOC, device_count: int = 1, with_deep_ep: bool = True) -> dict[str, Any]:
    mods: dict[str, Any] = {"torch_npu": torch_npu_ops.make_module(soc, device_count)}
    if with_deep_ep:
        mods["deep_ep"], mods["deep_ep.buffer"] = make_deep_ep()
    return mods


def install(monkeypatch: Any, **kwargs: Any) -> dict[str, Any]:
    mods = modules(**kwargs)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    # as ``import torch_npu`` does: torch.npu is how the planner sees that an NPU is present
    monkeypatch.setattr(torch, "npu", mods["torch_npu"].npu, raising=False)
    return mods


def install_into_process(**kwargs: Any) -> dict[str, Any]:
    mods = modules(**kwargs)
    sys.modules.update(mods)
    torch.npu = mods["torch_npu"].npu
    return mods
