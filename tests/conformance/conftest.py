from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture
def kit_support(monkeypatch):
    """Make this directory's helper modules importable by name, here and in spawned workers
    (spawn copies the parent's sys.path)."""
    monkeypatch.syspath_prepend(str(HERE))
    return HERE
