"""Without a GPU, Triton kernels run in Triton's CPU interpreter (test support only; it must be
set before the kernels module is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# --- cutedsl: the emulated FlashInfer (tests/emulation/flashinfer_emulation.py), installed per test
import pathlib  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

_EMULATION_DIR = str(pathlib.Path(__file__).resolve().parent / "emulation")
if _EMULATION_DIR not in sys.path:  # spawned EP workers inherit sys.path and import it too
    sys.path.insert(0, _EMULATION_DIR)


@pytest.fixture
def flashinfer_emu(monkeypatch):
    """Emulated flashinfer in sys.modules and an SM100 GPU as the cutedsl probe sees it; the emulator."""
    import flashinfer_emulation

    return flashinfer_emulation.install(monkeypatch)


@pytest.fixture
def cutedsl_manager(flashinfer_emu):
    """A fresh plugin manager (availability is cached per manager) that sees the emulation."""
    from moe_core.plugins import PluginManager

    return PluginManager()


# --- deepep: the emulated DeepEP V1 (tests/emulation/deep_ep_emulation), installed per test
@pytest.fixture
def deep_ep_emu(monkeypatch):
    """Emulated deep_ep in sys.modules, an SM90 GPU as the probes see it, a fresh buffer registry."""
    import deep_ep_emulation

    return deep_ep_emulation.install(monkeypatch)


@pytest.fixture
def deepep_manager(deep_ep_emu):
    """A fresh plugin manager that sees the emulated deep_ep."""
    from moe_core.plugins import PluginManager

    return PluginManager()
