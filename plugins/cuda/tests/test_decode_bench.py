"""``benchmarks/cuda/decode.py --cpu-smoke``: the decode benchmark's rows, files and floor, on the CPU."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

BENCH = Path(__file__).parents[3] / "benchmarks" / "cuda" / "decode.py"


def _load():
    spec = importlib.util.spec_from_file_location("decode_bench", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _floor_us(quant: str, T: int, touched: int) -> float:
    """The memory floor written out by hand: touched experts' weights (+ fp32 128x128 block scales) and the
    bf16 activations in and out, at 3.0 TB/s (the FLOP floor is far below it at these sizes)."""
    H, inter = 256, 128
    if quant == "fp8_block":
        weights = 3 * H * inter + 4 * (math.ceil(2 * inter / 128) * math.ceil(H / 128)
                                       + math.ceil(H / 128) * math.ceil(inter / 128))
    else:
        weights = 3 * H * inter * 2
    return (touched * weights + 2 * T * H * 2) / 3.0e12 * 1e6


def test_cpu_smoke_writes_the_rows_and_table(tmp_path):
    decode = _load()
    tokens = [1, 3]
    assert decode.main(["--cpu-smoke", "--out-dir", str(tmp_path), "--tokens", *map(str, tokens), "--reps", "2",
                        "--date", "2000-01-02"]) == 0
    rows = json.loads((tmp_path / "decode-cpu-smoke-2000-01-02.json").read_text())
    assert [(r["quant"], r["T"]) for r in rows] == [(q, t) for q in ("unquantized", "fp8_block") for t in tokens]
    for r in rows:
        assert set(r) == {"preset", "quant", "T", "backend", "graph_us", "eager_us", "host_us", "floor_us"}
        assert r["preset"] == "smoke" and r["backend"] == "reference" and r["graph_us"] is None
        assert r["eager_us"] > 0 and r["host_us"] > 0
        # the routing is random: the floor is that of some count of touched experts within what T*K allows
        options = [_floor_us(r["quant"], r["T"], n) for n in range(1, min(r["T"] * 2, 8) + 1)]
        assert min(abs(r["floor_us"] - f) for f in options) < 0.01, (r, options)
    table = (tmp_path / "decode-cpu-smoke-2000-01-02.md").read_text()
    assert "| smoke | fp8_block | 3 | reference (pick) | - |" in table
    assert table.count("\n| smoke |") == len(rows)


def test_decode_sweep_table(monkeypatch):
    """``decode_sweep.py``'s decode table: per shape the swept launch, and max_tokens = the largest T up to which
    the decode path beat the pipeline in graph and eager time at every measured T."""
    monkeypatch.syspath_prepend(str(BENCH.parent))  # (its imports of decode.py and host_time.py)
    spec = importlib.util.spec_from_file_location("decode_sweep", BENCH.parent / "decode_sweep.py")
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    best = {"decode": {"BLOCK_I": 16}, "down": {"BLOCK_H": 8}, "PDL": 1}

    def row(preset, quant, T, graph, eager):
        return {"preset": preset, "quant": quant, "T": T, **({"kernels": {"best": best}} if T == 1 else {}),
                "decode": {"graph_us": graph, "eager_us": eager}, "pipeline": {"graph_us": 40.0, "eager_us": 100.0}}

    rows = [row("qwen3-30b-a3b", "unquantized", 1, 30.0, 90.0), row("qwen3-30b-a3b", "unquantized", 2, 35.0, 95.0),
            row("qwen3-30b-a3b", "unquantized", 4, 39.0, 101.0), row("qwen3-30b-a3b", "unquantized", 16, 30.0, 90.0),
            row("mixtral-8x7b", "fp8_block", 1, 41.0, 90.0), row("mixtral-8x7b", "fp8_block", 2, 30.0, 90.0)]
    table = sweep.decode_table(rows)
    assert table == {"E=128,K=8,N=768,H=2048,dtype=bf16": {"max_tokens": 2, "config": best},
                     "E=8,K=2,N=14336,H=4096,dtype=fp8_block": {"max_tokens": 0, "config": best}}
