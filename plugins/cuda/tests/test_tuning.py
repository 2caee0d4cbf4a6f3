"""The tuned launch tables (``triton.tuning_configs``) and the tuner's search space (``tune``)."""

from __future__ import annotations

import pytest
import torch

cuda = torch.cuda.is_available()


@pytest.mark.parametrize("fp8", [False, True])
def test_tuner_candidates_and_heuristic_fit_hopper(fp8):
    """Every tuner candidate and every heuristic config fits an H100 SM (227 KB shared memory,
    <= 128 accumulator registers per thread) and respects the kernels' rules (shared BLOCK_M,
    FP8 BLOCK_K dividing 128, even GEMM1 BLOCK_N)."""
    from moe_plugin_cuda import tune
    from moe_plugin_cuda.triton import tuning_configs

    def fits(c, gemm1):
        two = gemm1 and bool(c.get("TWO_ACC"))
        assert tune.smem_bytes(c, fp8, two) <= tune.SMEM_BYTES, c
        assert tune.acc_registers(c, fp8, two) <= 128, c
        assert not fp8 or 128 % c["BLOCK_K"] == 0, c
        assert not gemm1 or c["BLOCK_N"] % 2 == 0, c

    for bm in (16, 32, 64, 128):
        c1s, c2s = tune.candidates(bm, fp8, tma=True)
        assert any(c.get("TWO_ACC") for c in c1s) and not all(c.get("TWO_ACC") for c in c1s)
        assert not any(c.get("TWO_ACC") and c.get("B_TMA") for c in c1s)
        assert any(c.get("B_TMA") for c in c1s) and any(c.get("B_TMA") for c in c2s)
        assert not any(c.get("B_TMA") for c in sum(tune.candidates(bm, fp8, tma=False), []))
        for c in c1s + c2s:
            assert c["BLOCK_M"] == bm
        for c in c1s:
            fits(c, True)
        for c in c2s:
            fits(c, False)
        if fp8:  # the cutlass backend's Triton path: two accumulators on the checkpoint layout, TMA allowed
            k1s, k2s = tune.candidates(bm, fp8, tma=True, checkpoint=True)
            assert all(c.get("TWO_ACC") for c in k1s) and any(c.get("B_TMA") for c in k1s)
            assert len(k1s) == len({tuple(sorted(c.items())) for c in k1s}), "duplicate candidates"
            assert k2s == c2s
            for c in k1s:
                assert c["BLOCK_M"] == bm
                fits(c, True)
    seen_bm = set()
    for E, K, inter, H in [(8, 2, 14336, 4096), (128, 8, 768, 2048), (256, 8, 2048, 7168), (128, 8, 1536, 4096)]:
        for M in (1, 16, 64, 256, 1024, 4096, 16384):
            cfg = tuning_configs.heuristic(M, E, K, inter, H, fp8)
            assert cfg["gemm1"]["BLOCK_M"] == cfg["gemm2"]["BLOCK_M"]
            fits(cfg["gemm1"], True)
            fits(cfg["gemm2"], False)
            seen_bm.add(cfg["gemm1"]["BLOCK_M"])
    assert 128 in seen_bm and 16 in seen_bm  # large M gets BLOCK_M=128 again


def test_heuristic_fits_fp32_tiles():
    """fp32 tiles take twice bf16's shared memory: the heuristic shrinks BLOCK_K/stages to fit
    (an fp32 layer on the H100 ran out of shared memory before this)."""
    from moe_plugin_cuda.triton import tuning_configs

    for M in (1, 77, 1024, 16384):
        cfg = tuning_configs.heuristic(M, 8, 2, 136, 200, False, elem_bytes=4)
        for c in cfg.values():
            assert c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 4 <= tuning_configs.SMEM_BYTES, c


def test_tuned_config_files_carry_the_kernel_version(tmp_path):
    """Configs of another kernel version are never read; files of this version are."""
    import json

    from moe_plugin_cuda.triton import tuning_configs

    name = tuning_configs.config_file_name(8, 64, 128, "Some GPU", "bf16")
    assert f"kernel=v{tuning_configs.KERNEL_VERSION}" in name
    c = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    old = name.replace(f",kernel=v{tuning_configs.KERNEL_VERSION}", "")
    (tmp_path / old).write_text(json.dumps({"100": {"gemm1": c, "gemm2": c}}))
    _, src = tuning_configs.get_config(100, 8, 2, 64, 128, "bf16", "Some GPU", str(tmp_path))
    assert src == "heuristic"
    tuning_configs.save_table(tmp_path / name, {100: {"gemm1": {**c, "TWO_ACC": 1}, "gemm2": c}})
    cfg, src = tuning_configs.get_config(90, 8, 2, 64, 128, "bf16", "Some GPU", str(tmp_path))
    assert src == name and cfg["gemm1"]["TWO_ACC"] == 1 and cfg["gemm2"]["TWO_ACC"] == 0
    assert cfg["gemm1"]["BLOCK_M"] == 32


def test_a_stand_in_devices_tables_serve_until_the_device_has_its_own(tmp_path, monkeypatch):
    """An H200 reads the H100's tables (same chip) for the pipeline, the cutlass paths and the decode kernels; a
    table under its own name wins; a device with no stand-in gets the heuristics."""
    import json

    from moe_plugin_cuda.triton import tuning_configs as tc

    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert tc.TABLE_STAND_INS[h200] == h100 and tc.table_devices(h100) == (h100,)
    shape = dict(E=128, inter=768, H=2048)  # qwen3-30b-a3b: the package holds the H100's tables for it
    for kernel in (tc.TRITON_TABLE, tc.CUTLASS_TABLE):
        entry, name = tc.lookup(64, *shape.values(), "bf16", h200, kernel=kernel)
        assert entry is not None and name == tc.config_file_name(*shape.values(), h100, "bf16", kernel)
        assert entry == tc.lookup(64, *shape.values(), "bf16", h100, kernel=kernel)[0]
    # (the cutlass backend's FP8 tables were re-tuned on the H200: its own)
    assert tc.lookup(64, *shape.values(), "fp8_block", h200, kernel=tc.CUTLASS_TABLE)[1] == tc.config_file_name(
        *shape.values(), h200, "fp8_block", tc.CUTLASS_TABLE)
    assert tc.get_config(64, 128, 8, 768, 2048, "bf16", "Some GPU")[1] == "heuristic"
    h100_decode = tc.decode_plan(1, 128, 8, 768, 2048, "bf16", h100)
    assert h100_decode is not None and tc.decode_plan(1, 128, 8, 768, 2048, "bf16", h200) is h100_decode
    c = dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, GROUP_M=1, num_warps=2, num_stages=2)
    own = tc.config_file_name(*shape.values(), h200, "bf16")
    tc.save_table(tmp_path / own, {64: {"gemm1": c, "gemm2": c}})
    entry, name = tc.lookup(64, *shape.values(), "bf16", h200, str(tmp_path))
    assert name == own and entry["gemm1"]["BLOCK_N"] == 32
    own_decode = {"max_tokens": 4, "config": {"decode": {"BLOCK_I": 8}}}
    shape_key = tc.decode_shape(128, 8, 768, 2048, "bf16")
    (tmp_path / tc.decode_table_name(h200)).write_text(json.dumps({shape_key: own_decode}))
    assert tc.decode_plan(4, 128, 8, 768, 2048, "bf16", h200, str(tmp_path)) == own_decode["config"]
    monkeypatch.setattr(tc, "TABLE_STAND_INS", {})
    assert tc.lookup(64, *shape.values(), "fp8_block", h200) == (None, "")


def test_shipped_tables_follow_the_kernels_rules():
    """Every shipped table measured every T the benchmark runs (the lookup takes the nearest entry: a
    table starting at T=1024 ran its T=1024 path at T=1); every entry: both GEMMs share BLOCK_M and
    TAIL_TILES (one alignment), half tiles only where BLOCK_M >= 32, A_TMA on GEMM2 only (GEMM1 gathers
    token rows), and the lookup reads TAIL_TILES and A_TMA back (0 where an entry has none)."""
    import json

    from moe_plugin_cuda.triton import tuning_configs

    decode = f"kernel={tuning_configs.DECODE_TABLE}.json"  # (the decode tables: test_decode.py)
    files = sorted(f for f in tuning_configs.CONFIG_DIR.glob("*.json") if not f.name.endswith(decode))
    assert files
    for f in files:
        table = json.loads(f.read_text())
        assert {1, 16, 64, 256, 1024, 4096, 16384} <= set(map(int, table)), f.name
        for m, entry in table.items():
            if "gemm1" not in entry:
                continue
            g1, g2 = entry["gemm1"], entry["gemm2"]
            assert g1["BLOCK_M"] == g2["BLOCK_M"], (f.name, m)
            assert g1.get("TAIL_TILES", 0) == g2.get("TAIL_TILES", 0), (f.name, m)
            assert not g1.get("TAIL_TILES", 0) or g1["BLOCK_M"] >= 32, (f.name, m)
            assert not g1.get("A_TMA", 0), (f.name, m)
    name = next(f.name for f in files if f.name.endswith(f"kernel={tuning_configs.TRITON_TABLE}.json"))
    E, inter, H = (int(name.split(f"{k}=")[1].split(",")[0]) for k in ("E", "N", "H"))
    dtype, device = name.split("dtype=")[1].split(",")[0], name.split("device_name=")[1].split(",")[0]
    entry, _ = tuning_configs.lookup(4096, E, inter, H, dtype, device)
    assert entry["gemm1"]["TAIL_TILES"] in (0, 1) and entry["gemm2"]["A_TMA"] in (0, 1)


def test_as_two_acc_keeps_output_width():
    from moe_plugin_cuda.triton import tuning_configs

    for fp8 in (False, True):
        for M in (1, 4096):
            cfg = tuning_configs.heuristic(M, 128, 8, 768, 2048, fp8)
            two = tuning_configs.as_two_acc(cfg)
            assert two["gemm1"]["TWO_ACC"] == 1 and two["gemm2"] == cfg["gemm2"]
            assert two["gemm1"]["BLOCK_N"] * 2 == cfg["gemm1"]["BLOCK_N"]  # same output columns per program
            assert tuning_configs.as_two_acc(two) == two
