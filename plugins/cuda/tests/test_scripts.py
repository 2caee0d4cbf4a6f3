"""The GPU comparison scripts on CPU (gloo): what does not need a GPU (issue 28 item 15)."""

import pathlib
import socket
import subprocess
import sys

import pytest

SCRIPTS = pathlib.Path(__file__).resolve().parents[1] / "scripts"

RANK = """
import sys, torch.distributed as dist
sys.path.insert(0, {scripts!r})
from deepep_vs_torch_a2a import agreed_seed
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", world_size=2, rank={rank})
print("SEED", agreed_seed(None), agreed_seed(5))
dist.destroy_process_group()
"""


@pytest.mark.multiproc
def test_deepep_comparison_agrees_on_one_seed_across_ranks():
    """Without --seed every rank must draw the same data (each checks the others' routing)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, "-c", RANK.format(scripts=str(SCRIPTS), port=port, rank=r)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    try:
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    seeds = [next(line.split()[1:] for line in out.splitlines() if line.startswith("SEED")) for out in outs]
    assert seeds[0] == seeds[1] and seeds[0][1] == "5", outs
