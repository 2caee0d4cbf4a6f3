"""Fixtures of moe-plugin-npu's tests: the emulated Ascend stack is installed per test, never globally."""

from __future__ import annotations

import pathlib
import sys

import pytest

EMULATION_DIR = pathlib.Path(__file__).resolve().parent / "emulation"
if str(EMULATION_DIR) not in sys.path:  # spawned workers inherit sys.path and can import it too
    sys.path.insert(0, str(EMULATION_DIR))

import npu_emulation  # noqa: E402


@pytest.fixture
def ascend(monkeypatch):
    """Emulated torch_npu (an A3 SoC, one device) and DeepEP-Ascend in sys.modules."""
    return npu_emulation.install(monkeypatch)


@pytest.fixture
def manager(ascend):
    """A fresh plugin manager (probes are cached per manager) that sees the emulated stack."""
    from moe_core.plugins import PluginManager

    return PluginManager()
