"""MoRI with real processes: EP world sizes 2 and 4 on gloo (emulated MoRI moves the data)."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent / "emulation"))
from ep_worker import run_world  # noqa: E402


@pytest.mark.multiproc
@pytest.mark.parametrize("world", [2, 4])
def test_emulated_mori_op(world):
    for r, res in enumerate(run_world("op", "gfx942", world)):
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
def test_mori_layer_matches_reference(world, arch):
    for r, res in enumerate(run_world("layer", arch, world)):
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
