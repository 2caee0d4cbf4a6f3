"""Emulated DeepEP (V1 ``deep_ep``) for moe-plugin-cuda's tests: never shipped, never a fallback.

``install(monkeypatch)`` puts the emulated ``deep_ep`` into ``sys.modules`` for one test;
``install_into_process()`` does the same for a whole spawned worker (the conformance kit's ``setup``
hook: ``"deep_ep_emulation:install_into_process"``). Both also make the plugin's probes see an
SM90 GPU, since the emulation stands in for the GPUs as well (tensors stay on the CPU), and give
the plugin a fresh buffer registry. In spawned workers, ``buffer.StreamOrder`` stamps tensors with
the host's order so the normal ops can refuse inputs written after their ``previous_event``.
"""

from __future__ import annotations

import importlib.machinery
import sys
import types
from typing import Any

from moe_core.plugin_api import DeviceKind

from . import buffer

HOPPER = ((9, 0), None)  # what probes._cuda_capability returns on an H100


def make_module() -> types.ModuleType:
    mod = types.ModuleType("deep_ep")
    mod.__spec__ = importlib.machinery.ModuleSpec("deep_ep", loader=None)
    mod.EMULATED = True
    for name in ("Buffer", "Config", "EventOverlap", "topk_idx_t"):
        setattr(mod, name, getattr(buffer, name))
    return mod


def install(monkeypatch: Any) -> types.ModuleType:
    from moe_plugin_cuda import deepep, probes

    mod = make_module()
    monkeypatch.setitem(sys.modules, "deep_ep", mod)
    monkeypatch.setattr(probes, "_cuda_capability", lambda: HOPPER)
    _real_present = DeviceKind.is_present  # the planner refuses absent device kinds: this machine "has" a GPU
    monkeypatch.setattr(DeviceKind, "is_present", lambda k: k is DeviceKind.CUDA or _real_present(k))
    monkeypatch.setattr(deepep, "BUFFERS", deepep.BufferRegistry())
    return mod


def install_into_process(stream_order: bool = True) -> types.ModuleType:
    """``stream_order=False``: without the stamps (a torch function mode on every op), for host timings."""
    from moe_plugin_cuda import probes

    mod = make_module()
    sys.modules["deep_ep"] = mod
    probes._cuda_capability = lambda: HOPPER
    _real_present = DeviceKind.is_present
    DeviceKind.is_present = lambda k: k is DeviceKind.CUDA or _real_present(k)
    if stream_order:
        buffer.StreamOrder().__enter__()  # for the rest of the worker: stream-order checks need the stamps
    return mod
