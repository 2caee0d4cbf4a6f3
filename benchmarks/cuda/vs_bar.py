"""The planner's pick in ``moe-core bench`` JSON files against issue #5's performance bar (H100 80GB).

    python3 benchmarks/cuda/vs_bar.py bench_run1.json [bench_run2.json ...]

The bar: SGLang's Triton fused MoE on the same H100 (µs per call, ``SGLANG_US``) must never be beaten by
it, and at T >= 4096 the layer must reach ``FLOOR_BAR`` of the floor (0.7 bf16, 0.6 FP8 block). Prints one
markdown table (each cell: the runs' µs and fraction of the floor, ** where slower than SGLang) and, per run,
how many of the 35 cells are not slower and how many of the 14 T >= 4096 cells reach the floor bar. Exit
status 1 when a run misses either bar (or lacks a cell), 0 when every run meets both.
"""

from __future__ import annotations

import argparse
import json
import sys

TOKENS = (1, 64, 1024, 4096, 16384)
SGLANG_US = {  # issue #5, "Performance bar"
    ("mixtral-8x7b", "unquantized"): (301, 978, 1705, 5720, 20899),
    ("qwen3-30b-a3b", "unquantized"): (43, 420, 515, 892, 2981),
    ("deepseek-v3", "unquantized"): (267, 6594, 11779, 21430, 57407),
    ("qwen3-235b-a22b", "unquantized"): (118, 1632, 3075, 6348, 22689),
    ("qwen3-30b-a3b", "fp8_block"): (31, 239, 363, 914, 3184),
    ("deepseek-v3", "fp8_block"): (145, 3263, 4299, 6822, 20289),
    ("qwen3-235b-a22b", "fp8_block"): (75, 843, 1149, 2681, 9466),
}
FLOOR_BAR = {"unquantized": 0.7, "fp8_block": 0.6}
FLOOR_FROM_T = 4096


def picked_cells(bench: dict) -> dict[tuple[str, str, int], dict]:
    """The planner's pick's result per (preset, quant, T), as ``meta.auto_plan`` names the pick."""
    plan = bench["meta"]["auto_plan"]
    return {(r["preset"], r["quant"], r["T"]): r for r in bench["results"]
            if plan.get(f"{r['preset']}/{r['quant']}") == r["backend"]}


def score(cells: dict) -> tuple[int, int, list[str]]:
    """(cells not slower than SGLang, T >= 4096 cells at the floor bar, cells missing from the run)."""
    not_slower = at_floor = 0
    missing = []
    for (preset, quant), bars in SGLANG_US.items():
        for T, bar in zip(TOKENS, bars, strict=True):
            r = cells.get((preset, quant, T))
            if r is None:
                missing.append(f"{preset} {quant} T={T}")
                continue
            not_slower += r["best_us"] <= bar
            at_floor += T >= FLOOR_FROM_T and r["frac_floor"] >= FLOOR_BAR[quant]
    return not_slower, at_floor, missing


def table(runs: list[dict]) -> str:
    lines = ["| preset | " + " | ".join(f"T={T}" for T in TOKENS) + " |", "|---" * (len(TOKENS) + 1) + "|"]
    for (preset, quant), bars in SGLANG_US.items():
        row = []
        for T, bar in zip(TOKENS, bars, strict=True):
            reads = []
            for cells in runs:
                r = cells.get((preset, quant, T))
                if r is None:
                    reads.append("-")
                    continue
                us = f"**{r['best_us']:.0f}**" if r["best_us"] > bar else f"{r['best_us']:.0f}"
                reads.append(f"{us} ({r['frac_floor']:.2f})" if T >= FLOOR_FROM_T else us)
            row.append(" / ".join(reads) + f" vs {bar}")
        lines.append(f"| {preset} {'bf16' if quant == 'unquantized' else 'FP8'} | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("json", nargs="+", help="moe-core bench --json files (runs of one machine)")
    args = p.parse_args(argv)
    runs = []
    for path in args.json:
        with open(path) as f:
            runs.append(picked_cells(json.load(f)))
    print(table(runs))
    total = len(SGLANG_US) * len(TOKENS)
    floor_total = len(SGLANG_US) * sum(T >= FLOOR_FROM_T for T in TOKENS)
    met = True
    for path, cells in zip(args.json, runs, strict=True):
        not_slower, at_floor, missing = score(cells)
        met &= not_slower == total and at_floor == floor_total and not missing
        print(f"{path}: never slower {not_slower}/{total}; floor bar at T>={FLOOR_FROM_T} {at_floor}/{floor_total}"
              + (f"; missing {', '.join(missing)}" if missing else ""))
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
