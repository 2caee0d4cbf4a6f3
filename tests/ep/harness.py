"""Run a ``worker.py`` scenario on ``world`` ranks on 127.0.0.1 and collect their results.

The ranks are started by the core's one launcher (``moe_core.testing.spawn_world``, bounded by a
hard timeout); ``worker`` is importable in them because spawned ranks inherit ``sys.path``.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import worker  # noqa: E402

from moe_core.testing import spawn_world  # noqa: E402


def run_ranks(scenario: str, world: int, timeout: float, backend: str = "gloo", seed: int | None = None) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks; return each rank's result dict (raises on hang/crash)."""
    results = run_scenarios((scenario,), world, timeout, backend, seed)[scenario]
    if isinstance(results, str):
        raise AssertionError(results)
    return results


def run_scenarios(scenarios: tuple[str, ...], world: int, timeout: float, backend: str = "gloo",
                  seed: int | None = None) -> dict[str, list[dict] | str]:
    """Run ``scenarios`` one after the other on the same ``world`` ranks (one spawn and process group: a rank's start
    costs seconds of CPU); ``{scenario: each rank's result dict, or the message of its failure}``."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(3), "little") + 1
    outcomes = spawn_world(worker.run_rank_scenarios, world, scenarios, seed, backend, timeout=timeout, backend=backend)
    lost = [f"rank {outcome.rank}: {outcome.error}" for outcome in outcomes if not outcome.ok]
    out: dict[str, list[dict] | str] = {}
    for scenario in scenarios:
        results, errors = [], list(lost)
        for outcome in outcomes:
            if not outcome.ok:
                continue
            res = json.loads(json.dumps(outcome.value[scenario]))  # plain JSON data, as the checks expect
            if "error" in res:  # a rank's own failure first: the others often only see the lost peer
                errors.insert(0, f"rank {outcome.rank} failed:\n{res['error']}")
            res["rank"] = outcome.rank
            results.append(res)
        out[scenario] = f"{scenario} on {world} ranks (seed {seed}):\n" + "\n".join(errors) if errors else results
    return out
