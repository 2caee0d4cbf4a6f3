"""moe-core conformance kit: certify any backend against the core ``reference`` backend.

Two ways to run it (both documented in ``examples/moe-plugin-example/README.md``):

- pytest, from any directory, for installed plugins (the ``pytest11`` entry point
  ``moe_core_testing`` is inert unless ``--moe-backend`` is given)::

      pytest --moe-backend example.simple
      pytest plugins/npu/tests --moe-backend npu_gmm      # that conftest installs emulations first

  A conftest (or a ``-p`` plugin) may implement ``pytest_moe_kit_configure(config, options)`` to
  adjust the kit's options (``setup``, ``manager_factory``, ``device``...) before cases are made.

- in-process from Python (e.g. inside a plugin's own test, after its fixtures installed emulated
  vendor ops)::

      report = moe_core.testing.run_kit("npu_gmm", device="cpu", device_kind="npu")
      assert report.ok, report.text()
"""

from moe_core.testing.cases import Case, CaseResult, KitContext, KitFailure, KitOptions, KitSkip
from moe_core.testing.data import Shape, rel_error, tolerance
from moe_core.testing.kit import KitReport, generate_cases, run_kit
from moe_core.testing.world import RankOutcome, free_port, run_gloo_world, spawn_world

__all__ = ["Case", "CaseResult", "KitContext", "KitFailure", "KitOptions", "KitReport", "KitSkip", "RankOutcome",
           "Shape", "free_port", "generate_cases", "rel_error", "run_gloo_world", "run_kit", "spawn_world",
           "tolerance"]
