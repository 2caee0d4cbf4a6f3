"""The kit on this repo's vendor plugins, on CPU against their emulated vendor ops (test support
of each plugin: plugins/<x>/tests/emulation). On a GPU machine the CUDA backends run for real:
``pytest --moe-backend cuda.triton --moe-backend cuda.grouped_mm``."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from moe_core.testing import run_kit

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"


def _load(name: str, init: Path):
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _require(package: str, emulation: Path) -> None:
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (pip install --no-deps -e plugins/...)")
    if not emulation.exists():
        pytest.skip(f"no emulation at {emulation}")


def test_rocm_aiter_passes_the_kit_on_emulated_aiter(monkeypatch):
    init = PLUGINS / "rocm" / "tests" / "emulation" / "__init__.py"
    _require("moe_plugin_rocm", init)
    _load("rocm_emulation", init).install(monkeypatch, "gfx942")
    from moe_core.plugins import PluginManager

    report = run_kit("rocm.aiter", manager=PluginManager(), device="cpu", device_kind="rocm")
    assert report.ok, report.text()
    assert sum(r.status == "passed" for r in report.results) > 50


def test_npu_gmm_passes_the_kit_on_emulated_torch_npu(monkeypatch):
    emulation = PLUGINS / "npu" / "tests" / "emulation"
    _require("moe_plugin_npu", emulation / "npu_emulation")
    monkeypatch.syspath_prepend(str(emulation))
    import npu_emulation

    npu_emulation.install(monkeypatch)
    from moe_core.plugins import PluginManager

    report = run_kit("npu.npu_gmm", manager=PluginManager(), device="cpu", device_kind="npu")
    assert report.ok, report.text()
    assert sum(r.status == "passed" for r in report.results) > 50
