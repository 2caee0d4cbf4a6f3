"""Helpers for the core tests: random O(1) data (fresh each run) and test plugin distributions."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from moe_core import quant
from moe_core.contracts import QuantScheme, TopK


def random_weights(e: int, h: int, i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-precision weights scaled so that every GEMM output is O(1)."""
    return torch.randn(e, 2 * i, h) / h ** 0.5, torch.randn(e, h, i) / i ** 0.5


def random_topk(t: int, e: int, k: int, *, drop: float = 0.0) -> TopK:
    """Distinct experts per token; a fraction ``drop`` of slots set to -1 (weights stay O(1))."""
    ids = torch.rand(t, e).argsort(dim=1)[:, :k].to(torch.int32)
    if drop and t:
        ids[torch.rand(t, k) < drop] = -1
        ids[0, 0] = -1  # at least one padding slot whenever there is a token
    weights = torch.rand(t, k) + 0.5
    return TopK(weights, ids)


def checkpoint(scheme: QuantScheme, e: int, h: int, i: int) -> dict[str, torch.Tensor]:
    w13, w2 = random_weights(e, h, i)
    return quant.quantize_weights(w13, w2, scheme)


@pytest.fixture
def install_dist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Install a plugin distribution for the duration of a test: a module plus a real
    ``*.dist-info`` with an entry point in ``moe_core.plugins``, found by importlib.metadata."""

    def install(dist: str, module: str, source: str, entry: str = "plugin", version: str = "1.0") -> None:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[moe_core.plugins]\n{entry} = {module}:plugin\n")
        monkeypatch.syspath_prepend(str(tmp_path))

    return install


# Property-based tests (hypothesis): a small, bounded profile by default so the whole CI suite stays
# well under its budget; HYPOTHESIS_PROFILE=thorough for a longer local hunt. No deadline: the
# first example of a shape pays for lazy initialisation, and the CI machines are shared.
settings.register_profile("ci", max_examples=30, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=1000, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
