"""Fixtures of the moe-plugin-rocm tests.

The emulation package lives next to the tests and is imported under a unique name
(``rocm_emulation``) so that it cannot clash with other plugins' test helpers when one pytest
session collects every plugin (the root config uses ``--import-mode=importlib``).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest

_HERE = pathlib.Path(__file__).parent


def _load_emulation():
    name = "rocm_emulation"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _HERE / "emulation" / "__init__.py",
                                                  submodule_search_locations=[str(_HERE / "emulation")])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


emulation = _load_emulation()


@pytest.fixture(params=["gfx942", "gfx950"])
def arch(request):
    return request.param


@pytest.fixture
def emulated(monkeypatch, arch):
    """Emulated AITER + MoRI for ``arch`` installed in ``sys.modules`` for one test."""
    emulation.install(monkeypatch, arch)
    return arch


@pytest.fixture
def emulated_gfx942(monkeypatch):
    emulation.install(monkeypatch, "gfx942")
    return "gfx942"
