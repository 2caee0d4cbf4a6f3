"""Start one ``worker.py`` process per rank on 127.0.0.1 and collect their results.

Each rank is a plain subprocess (not multiprocessing: nothing has to be importable by module
name in the children). A hard timeout kills every rank of a run that hangs.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "worker.py")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario: str, world: int, timeout: float, backend: str = "gloo", seed: int | None = None) -> list[dict]:
    """Run ``scenario`` on ``world`` ranks; return each rank's result dict (raises on hang/crash)."""
    seed = seed if seed is not None else int.from_bytes(os.urandom(3), "little") + 1
    env = dict(os.environ, MOE_EP_TEST_SEED=str(seed), OMP_NUM_THREADS="1")
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        procs = [subprocess.Popen([sys.executable, WORKER, scenario, str(world), str(r), str(port), out, backend],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for r in range(world)]
        try:
            logs = [p.communicate(timeout=timeout)[0] for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            tails = [(p.communicate()[0] or "")[-2000:] for p in procs]
            raise AssertionError(f"{scenario} on {world} ranks (seed {seed}) timed out after {timeout}s:\n"
                                 + "\n".join(tails)) from None
        results, errors = [], []
        for r, (p, log) in enumerate(zip(procs, logs, strict=True)):
            path = os.path.join(out, f"rank{r}.json")
            if not os.path.exists(path):
                errors.append(f"rank {r} exited {p.returncode} without a result:\n{log[-4000:]}")
                continue
            with open(path) as f:
                res = json.load(f)
            if "error" in res:  # a rank's own failure first: the others often only see the lost peer
                errors.insert(0, f"rank {r} failed:\n{res['error']}")
            res["rank"] = r
            results.append(res)
        if errors:
            raise AssertionError(f"{scenario} on {world} ranks (seed {seed}):\n" + "\n".join(errors))
        return results
