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
