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

_TESTS_DIR = pathlib.Path(__file__).resolve().parent
# the tests' shared helpers (cuda_layer_cases) and the emulations; spawned EP workers inherit sys.path
for _path in (str(_TESTS_DIR), str(_TESTS_DIR / "emulation")):
    if _path not in sys.path:
        sys.path.insert(0, _path)


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


# --- triton: what align_block_size must produce, checked the same way in the interpreter and on the GPU
@pytest.fixture
def check_alignment():
    return _check_alignment


def _check_alignment(ids: torch.Tensor, E: int, bm: int, tails: bool, al) -> None:
    """Every valid slot once, in a block of its expert; padding holds the sentinel; blocks past the
    last -1. With ``tails`` (buckets padded to bm/2): each expert's blocks tile exactly its padded
    rows, the last one a half tile where bm/2 rows are left."""
    flat = ids.reshape(-1).cpu()
    sorted_ids, expert_ids = al.sorted_ids.cpu(), al.expert_ids.cpu()
    pad = bm // 2 if tails else bm
    n = flat.numel()
    counts = torch.bincount(flat[flat >= 0].long(), minlength=E)
    padded = (counts + pad - 1) // pad * pad
    total = int(al.post_pad)
    assert total == int(padded.sum())
    assert al.max_blocks * bm == sorted_ids.numel() >= total and expert_ids.numel() == al.max_blocks
    seen = sorted_ids[:total]
    assert (seen <= n).all() and (seen >= 0).all()  # slots or the sentinel, nothing undefined
    real = seen[seen < n]
    assert torch.equal(real.sort().values, torch.nonzero(flat >= 0).flatten().int())  # every valid slot once
    n_blocks = int(((counts + bm - 1) // bm).sum())
    assert (expert_ids[:n_blocks] >= 0).all() and (expert_ids[n_blocks:] == -1).all()
    sizes = torch.full((n_blocks,), bm)
    if tails:
        starts = al.tile_starts.cpu()[:n_blocks].long()
        sizes[starts % 2 == 1] = pad
        assert torch.equal(starts - starts % 2, torch.cumsum(sizes, 0) - sizes)  # blocks in order, no gap
    else:
        assert al.tile_starts is None
    assert int(sizes.sum()) == total
    row_expert = torch.repeat_interleave(expert_ids[:n_blocks].long(), sizes)
    assert torch.equal(torch.bincount(row_expert, minlength=E), padded)  # each expert's padded rows
    ok = seen < n
    assert torch.equal(flat[seen[ok].long()], row_expert[ok].int())  # every slot in a block of its expert
