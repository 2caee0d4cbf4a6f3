"""Tuned Triton launch configurations, stored as JSON package data, and the fallback heuristic.

File name: ``E={E},N={I},H={H},device_name={device},dtype={dtype}.json`` (``dtype`` is ``bf16``,
``fp16``, ``fp32`` or ``fp8_block``) under ``moe_plugin_cuda/configs/`` or a directory given in
``backend_options={"triton": {"config_dir": ...}}``. Content: ``{"<M>": {"gemm1": {...},
"gemm2": {...}}}`` for token counts M, each a dict of BLOCK_M/BLOCK_N/BLOCK_K/GROUP_M/
num_warps/num_stages; both GEMMs share BLOCK_M (the alignment is done once). Lookup takes the
nearest M, as SGLang does.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Optional

CONFIG_DIR = Path(__file__).parent / "configs"
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def config_file_name(E: int, I: int, H: int, device_name: str, dtype: str) -> str:
    return f"E={E},N={I},H={H},device_name={device_name.replace(' ', '_')},dtype={dtype}.json"


@functools.lru_cache(maxsize=64)
def _load(path: str) -> Optional[dict[int, dict[str, dict[str, int]]]]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    return {int(m): v for m, v in raw.items()}


def heuristic(M: int, E: int, top_k: int, I: int, H: int, fp8: bool) -> dict[str, dict[str, int]]:
    """Untuned default: BLOCK_M from the mean rows per expert; wide tiles once M is large."""
    rows_per_expert = max(1.0, M * top_k / E)
    if rows_per_expert <= 16:
        bm = 16
    elif rows_per_expert <= 32:
        bm = 32
    elif rows_per_expert <= 96:
        bm = 64
    else:
        bm = 128
    big = bm >= 64
    if fp8:
        g1 = dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128, GROUP_M=16 if big else 1,
                  num_warps=8 if bm == 128 else 4, num_stages=3)
        g2 = dict(BLOCK_M=bm, BLOCK_N=128, BLOCK_K=128, GROUP_M=16 if big else 1,
                  num_warps=8 if bm == 128 else 4, num_stages=3 if big else 4)
    else:
        g1 = dict(BLOCK_M=bm, BLOCK_N=64 if big else 64, BLOCK_K=64, GROUP_M=16 if big else 1,
                  num_warps=8 if bm == 128 else 4, num_stages=3 if big else 4)
        g2 = dict(BLOCK_M=bm, BLOCK_N=128 if big else 64, BLOCK_K=64, GROUP_M=16 if big else 1,
                  num_warps=8 if bm == 128 else 4, num_stages=3 if big else 4)
    return {"gemm1": g1, "gemm2": g2}


def get_config(M: int, E: int, top_k: int, I: int, H: int, dtype: str, device_name: Optional[str],
               config_dir: Optional[str] = None) -> tuple[dict[str, dict[str, int]], str]:
    """(config, source) where source is the JSON file used or ``"heuristic"``."""
    if device_name:
        name = config_file_name(E, I, H, device_name, dtype)
        for d in ([config_dir] if config_dir else []) + [str(CONFIG_DIR)]:
            table = _load(os.path.join(d, name))
            if table:
                nearest = min(table, key=lambda m: abs(m - M))
                cfg = table[nearest]
                return {k: {kk: int(cfg[k][kk]) for kk in KEYS} for k in ("gemm1", "gemm2")}, name
    return heuristic(M, E, top_k, I, H, dtype == "fp8_block"), "heuristic"


def save_table(path: Path, table: dict[int, dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({str(m): table[m] for m in sorted(table)}, f, indent=1, sort_keys=True)
    _load.cache_clear()
