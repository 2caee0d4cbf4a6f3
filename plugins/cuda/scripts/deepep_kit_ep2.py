"""The conformance kit on ``cuda.deepep`` at EP world 2 on this machine's GPUs (NCCL):
``python3 plugins/cuda/scripts/deepep_kit_ep2.py``. A file, not ``python3 -`` (the kit's EP worlds
are spawned processes, which re-import the main module by path). Exit status 0 when the kit passes."""

from __future__ import annotations

import sys

from moe_core.testing import run_kit
from moe_core.testing.data import Shape

if __name__ == "__main__":
    # H=2048: DeepEP's low-latency kernels exist for a few hidden sizes only
    report = run_kit("cuda.deepep", ep_sizes=(2,), shape=Shape(8, 4, 2048, 128), ep_timeout_s=60)
    print(report.text())
    print("KIT", "ok" if report.ok else "FAILED", sum(r.status == "passed" for r in report.results), "passed of",
          len(report.results))
    sys.exit(0 if report.ok else 1)
