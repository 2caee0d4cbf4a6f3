"""``benchmarks/cuda/vs_bar.py``: the score of a benchmark run against the issue's bars."""

from __future__ import annotations

import torch

cuda = torch.cuda.is_available()


def test_vs_bar_scores_the_planners_pick_against_the_issue_bar(tmp_path, capsys):
    """benchmarks/cuda/vs_bar.py counts a cell slower than SGLang's figure, a T >= 4096 cell under the floor
    bar and a missing cell, reads only the planner's pick, and exits 1 unless every run meets both bars."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "vs_bar", Path(__file__).parents[3] / "benchmarks" / "cuda" / "vs_bar.py")
    vs_bar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_bar)

    def bench(slower=None, under_floor=None, drop=None):
        results, plan = [], {}
        for (preset, quant), bars in vs_bar.SGLANG_US.items():
            plan[f"{preset}/{quant}"] = "cutlass"
            for T, bar in zip(vs_bar.TOKENS, bars, strict=True):
                cell = (preset, quant, T)
                us = bar * (1.05 if cell == slower else 0.9)
                frac = vs_bar.FLOOR_BAR[quant] * (0.9 if cell == under_floor else 1.1)
                if cell != drop:
                    results.append({"preset": preset, "quant": quant, "T": T, "backend": "cutlass",
                                    "best_us": us, "frac_floor": frac})
                # a faster backend the planner did not pick must not count
                results.append({"preset": preset, "quant": quant, "T": T, "backend": "triton",
                                "best_us": 0.5 * bar, "frac_floor": 1.0})
        return {"meta": {"auto_plan": plan}, "results": results}

    runs = {"ok": bench(), "slow": bench(slower=("qwen3-30b-a3b", "unquantized", 4096)),
            "floor": bench(under_floor=("qwen3-235b-a22b", "fp8_block", 4096)),
            "small_t": bench(under_floor=("qwen3-235b-a22b", "fp8_block", 1024)),  # no floor bar below 4096
            "gap": bench(drop=("deepseek-v3", "fp8_block", 1))}
    paths = {}
    for name, b in runs.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(b))
    assert vs_bar.main([str(paths["ok"]), str(paths["small_t"])]) == 0
    assert vs_bar.score(vs_bar.picked_cells(runs["slow"]))[:2] == (34, 14)
    assert vs_bar.score(vs_bar.picked_cells(runs["floor"]))[:2] == (35, 13)
    assert vs_bar.score(vs_bar.picked_cells(runs["gap"]))[2] == ["deepseek-v3 fp8_block T=1"]
    for bad in ("slow", "floor", "gap"):
        assert vs_bar.main([str(paths["ok"]), str(paths[bad])]) == 1
    out = capsys.readouterr().out
    assert "| qwen3-30b-a3b bf16 |" in out and "**" in out
