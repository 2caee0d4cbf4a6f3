"""Emulated AMD vendor ops (AITER, MoRI) for CI without AMD hardware. TEST SUPPORT ONLY.

``install(monkeypatch, arch)`` puts fake ``aiter`` and ``mori`` packages into ``sys.modules`` and
makes ``moe_plugin_rocm.platform.query_device`` report ``arch``; pytest's ``monkeypatch`` undoes
both after the test. The plugin itself never falls back to these.
"""

from __future__ import annotations

import importlib.machinery
import sys

from moe_core.plugin_api import DeviceKind

from . import aiter_emu, mori_emu

__all__ = ["install", "aiter_emu", "mori_emu"]


def install(monkeypatch, arch: str = "gfx942", *, aiter: bool = True, mori: bool = True) -> dict:
    import moe_plugin_rocm.platform as platform

    modules = {}
    if aiter:
        modules.update(aiter_emu.make_modules(arch))
    if mori:
        modules.update(mori_emu.make_modules(arch))
    for name, module in modules.items():
        # a spec, so that importlib.util.find_spec (the probes' NOT_INSTALLED test) sees a package
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=hasattr(module, "__path__"))
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(platform, "query_device", lambda: (arch, ""))
    # the planner refuses a device kind the machine lacks: this emulated machine has an AMD GPU
    real = DeviceKind.is_present
    monkeypatch.setattr(DeviceKind, "is_present", lambda kind: kind is DeviceKind.ROCM or real(kind))
    return modules
