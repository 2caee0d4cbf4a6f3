"""The conformance kit on the ``mori`` dispatcher at EP world 2, on emulated MoRI.

The kit spawns its EP workers itself; its ``setup`` hook (``rocm_kit_setup:gfx942``) installs the
emulation in each of them (and MoRI's shmem once their process group exists). The kit runs in a
child process so that the process-wide installation never leaks into this pytest session.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

EMULATION = pathlib.Path(__file__).parent / "emulation"
TIMEOUT_S = 240
SCRIPT = """
import json
from moe_core.testing import run_kit
r = run_kit("rocm.mori", setup="rocm_kit_setup:gfx942", device="cpu", device_kind="rocm", ep_sizes=(2,),
            ep_timeout_s=150)
print("KIT-REPORT " + json.dumps({"seed": r.seed, "results": [[x.case_id, x.status, x.message] for x in r.results]}))
"""


@pytest.mark.multiproc
def test_kit_runs_mori_at_ep2_on_emulated_mori():
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(EMULATION), *sys.path])}  # spawned workers import rocm_kit_setup
    try:
        proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the kit on mori did not finish within {TIMEOUT_S}s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("KIT-REPORT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(lines[-1][len("KIT-REPORT "):])
    results = report["results"]
    failed = [r for r in results if r[1] == "failed"]
    assert not failed, f"seed {report['seed']}:\n" + "\n".join(f"{c}: {m}" for c, _, m in failed)
    ran = {c for c, status, _ in results if status == "passed" and c.startswith("dispatcher-ep2-")}
    # every declared wire dtype x scenario (uniform, skewed routing, a rank with no tokens)
    assert ran == {f"dispatcher-ep2-ep_normal-{w}-{s}" for w in ("bf16", "fp8")
                   for s in ("uniform", "skewed", "empty-rank")}, results
