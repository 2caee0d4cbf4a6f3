"""Plugin managers for the kit's own tests (importable by name, so spawned EP workers and pytest
subprocesses can build the same manager: ``--moe-kit-manager moe_kit_support:example_manager``)."""

from __future__ import annotations

import sys
from pathlib import Path

from moe_core.plugins import ENTRY_POINT_GROUP, PluginManager, metadata

EXAMPLE_DIR = Path(__file__).resolve().parents[2] / "examples" / "moe-plugin-example"


def example_entry_point():
    """The example plugin's entry point: the installed one if the distribution is installed, else
    the same declaration read from its pyproject (source checkout)."""
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name == "example":
            return ep
    if str(EXAMPLE_DIR) not in sys.path:
        sys.path.insert(0, str(EXAMPLE_DIR))
    return metadata.EntryPoint(name="example", value="moe_plugin_example.plugin:plugin", group=ENTRY_POINT_GROUP)


def example_manager() -> PluginManager:
    """Reference backends + the example plugin, nothing else installed."""
    return PluginManager(entry_points=[example_entry_point()], strict=True)
