"""MoRI with real processes: EP world sizes 2 and 4 on gloo (emulated MoRI moves the data)."""

from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest

WORKER = pathlib.Path(__file__).parent / "emulation" / "ep_worker.py"
TIMEOUT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(case: str, arch: str, world: int, tmp_path) -> list[dict]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    outs = [tmp_path / f"rank{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, str(WORKER), case, arch, str(r), str(world), str(port), str(outs[r])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=TIMEOUT_S)[0].decode(errors="replace"))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"{case} world={world} timed out after {TIMEOUT_S}s")
    results = []
    for r, out in enumerate(outs):
        assert out.exists(), f"rank {r} wrote no result:\n{logs[r][-3000:]}"
        res = json.loads(out.read_text())
        assert res["ok"], f"rank {r} failed:\n{res.get('error')}"
        results.append(res)
    return results


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_emulated_mori_op(world, tmp_path):
    for r, res in enumerate(run_ranks("op", "gfx942", world, tmp_path)):
        for quant in ("none", "fp8_direct_cast"):
            assert res[f"{quant}_recv_ok"], f"rank {r}: received rows are not each token once per PE"
            out_shape, w_shape, no_scales, total_shape, total_dtype = res[f"{quant}_shapes"]
            assert out_shape == [world * 8, 64] and w_shape == [world * 8, 2] and no_scales
            assert total_shape == [1] and total_dtype == "torch.int32"
            assert res[f"{quant}_combine_w_err"] < 1e-6
            assert res[f"{quant}_reset_enforced"]
        assert res["none_combine_err"] < 1e-2  # bf16 rounding of the sum only
        if res["T"]:  # direct FP8 cast (no scale) of O(1) values: 3 mantissa bits, <= 6.25% per element
            assert 1e-3 < res["fp8_direct_cast_combine_err"] < 6e-2


# gfx942 requantizes the intermediate activation on the e4m3fnuz grid (amax/240), the core
# reference on e4m3fn (amax/448): two valid roundings whose difference (~3%, measured) is inherent.
# Each side is held to 3e-2 against the float64 of its own definition (rocm_emulation.arch_oracle).
CROSS_FLAVOUR_TOL = 5e-2


@pytest.mark.multiproc
@pytest.mark.parametrize("world,arch", [(2, "gfx942"), (2, "gfx950"), (4, "gfx942")])
def test_mori_layer_matches_reference(world, arch, tmp_path):
    for r, res in enumerate(run_ranks("layer", arch, world, tmp_path)):
        assert res["overflow_rejected"]
        for key, v in res.items():
            if not isinstance(v, dict):
                continue
            scheme, wire, experts = key.split("/")
            fp8 = scheme != "unquantized"
            tol = 3e-2 if fp8 else 1e-2
            # MoRI buffers hold more rows than were received: only total_recv rows may be read
            assert v["exact"] < tol, f"rank {r} {key}: rel err {v['exact']:.4f} vs its float64 definition (tol {tol})"
            ref_tol = CROSS_FLAVOUR_TOL if fp8 and experts == "aiter" and arch == "gfx942" else tol
            assert v["err"] < ref_tol, f"rank {r} {key}: rel err {v['err']:.4f} vs the core reference (tol {ref_tol})"
            # no less accurate than the reference itself, against the float64 oracle
            assert v["oracle"] < 1.25 * v["ref_oracle"] + 1e-2, f"rank {r} {key}: {v}"
            assert v["shuffled"] == (experts == "aiter"), f"rank {r} {key}: shuffle applied by the wrong backend"
            fp8_wire = wire == "fp8" or (scheme == "fp8_block" and wire == "auto")
            assert v["dtype"] == ("fp8" if fp8_wire else "bf16"), f"rank {r} {key}: {v['dtype']}"
