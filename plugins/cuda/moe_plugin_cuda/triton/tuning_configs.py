"""Tuned Triton launch configurations, stored as JSON package data, and the fallback heuristic.

File name: ``E={E},N={inter},H={H},device_name={device},dtype={dtype},kernel={KERNEL_VERSION}.json``
(``dtype`` is ``bf16``, ``fp16``, ``fp32`` or ``fp8_block``) under ``moe_plugin_cuda/configs/`` or a
directory given in ``backend_options={"triton": {"config_dir": ...}}``. Content: ``{"<M>": {"gemm1":
{...}, "gemm2": {...}}}`` for token counts M, each a dict of BLOCK_M/BLOCK_N/BLOCK_K/GROUP_M/
num_warps/num_stages (GEMM1 may add ``TWO_ACC: 1``, the two-accumulator fallback; either GEMM
``B_TMA: 1``, weight tiles through a TMA descriptor, Hopper and later; GEMM2 ``A_TMA: 1``, GEMM1
writes its output in the sorted rows' order and GEMM2 reads it through TMA instead of gathering
rows); both GEMMs share BLOCK_M and ``TAIL_TILES`` (1: each expert's last BLOCK_M/2 rows as a half
tile; the alignment is done once). GEMM1's BLOCK_N counts rows of the interleaved w13,
i.e. BLOCK_N/2 output columns. Lookup takes the nearest M, as SGLang does.

The ``cutlass`` backend keeps its own tables (``kernel=cutlass-v1``; FP8: the same content on the
checkpoint w13 layout, i.e. two-accumulator GEMM1 configs) whose entries add ``"path": "triton" |
"cutlass" | "deepgemm"`` (which ran fastest at that M) and the grouped GEMMs' kernels; its bf16 tables
hold the path and DeepGEMM's kernels only (its Triton path runs the triton table's configs).

``KERNEL_VERSION`` changes whenever a config's meaning or the best configs change with the
kernels (v2: one-accumulator GEMM1 over interleaved gate/up rows); files of other versions are
never read.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from moe_core.plugin_api import QuantScheme

CONFIG_DIR = Path(__file__).parent.parent / "configs"  # the package's configs/: triton's and cutlass's tables
KERNEL_VERSION = 2
KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")
OPTIONAL_KEYS = {"TWO_ACC": 0, "B_TMA": 0, "TAIL_TILES": 0, "A_TMA": 0}
TRITON_TABLE = f"v{KERNEL_VERSION}"
CUTLASS_TABLE = "cutlass-v1"
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
# A device with no table of its own reads the tables of the same processor measured on another part: the H200 is the
# H100's chip (same SMs, shared memory and clocks) with faster memory (docs/decisions.md, "Tables of a stand-in
# device"). Its own tables, once swept, win. ``lookup`` returns the file it read.
TABLE_STAND_INS = {"NVIDIA H200": "NVIDIA H100 80GB HBM3"}


def table_devices(device_name: str) -> tuple[str, ...]:
    """The device names whose tables a device reads, its own first."""
    stand_in = TABLE_STAND_INS.get(device_name)
    return (device_name,) if stand_in is None else (device_name, stand_in)


def _table_paths(file_name: Callable[[str], str], device_name: Optional[str],
                 config_dir: Optional[str]) -> Iterator[str]:
    """The table files a device reads, in order: ``file_name(device)`` for its own name, then its stand-in's; each in
    ``config_dir`` before the package's ``configs/``."""
    for dev in table_devices(device_name) if device_name else ():
        for d in ([config_dir] if config_dir else []) + [str(CONFIG_DIR)]:
            yield os.path.join(d, file_name(dev))


def table_dtype(quant: QuantScheme, params_dtype: torch.dtype) -> str:
    """The tables' ``dtype`` key for a layer, triton's and cutlass's alike: ``fp8_block`` for FP8 block weights
    (the kernels run W8A8 whatever the params dtype), else the params dtype's name."""
    return "fp8_block" if quant is QuantScheme.FP8_BLOCK else _DTYPE_NAMES[params_dtype]


def config_file_name(E: int, inter: int, H: int, device_name: str, dtype: str, kernel: str = TRITON_TABLE) -> str:
    return (f"E={E},N={inter},H={H},device_name={device_name.replace(' ', '_')},dtype={dtype},"
            f"kernel={kernel}.json")


@functools.lru_cache(maxsize=64)
def _load(path: str) -> Optional[dict[int, dict[str, dict[str, int]]]]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        raw = json.load(f)
    return {int(m): v for m, v in raw.items()}


def _c(bm: int, bn: int, bk: int, g: int, w: int, s: int, **extra) -> dict[str, int]:
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=s, **extra)


SMEM_BYTES = 227 * 1024  # H100's shared memory per block (the smallest budget we target)


def _fit_smem(c: dict[str, int], elem_bytes: int) -> dict[str, int]:
    """Shrink BLOCK_K, then stages, until the pipelined A and B tiles fit in shared memory
    (fp32 tiles are twice bf16's: the shapes below are sized for 1-2 byte elements)."""
    c = dict(c)
    def need(c):
        return c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * elem_bytes
    while need(c) > SMEM_BYTES and c["BLOCK_K"] > 32:
        c["BLOCK_K"] //= 2
    while need(c) > SMEM_BYTES and c["num_stages"] > 2:
        c["num_stages"] -= 1
    return c


def heuristic(M: int, E: int, top_k: int, inter: int, H: int, fp8: bool,
              elem_bytes: int = 2) -> dict[str, dict[str, int]]:
    """Untuned default: BLOCK_M from the mean rows per expert; wide tiles once M is large.

    Register budget (why these shapes): GEMM1 keeps one fp32 BLOCK_M x BLOCK_N accumulator (FP8: plus
    the scaled-dot temporary of the same size), i.e. BM*BN/(32*warps) registers per thread each;
    <= 128 for the accumulator leaves room for the pipeline. GEMM1 BLOCK_N=256 gives 128 output
    columns per program: FP8 then quantizes in the epilogue (no separate kernel).
    """
    rows_per_expert = max(1.0, M * top_k / E)
    if rows_per_expert <= 16:
        bm = 16
    elif rows_per_expert <= 32:
        bm = 32
    elif rows_per_expert <= 96:
        bm = 64
    else:
        bm = 128
    g = 16 if bm >= 64 else 1
    if fp8:
        if bm <= 32:  # weight streaming: narrow tiles, deep pipeline, many programs
            g1, g2 = _c(bm, 128, 128, g, 4, 4), _c(bm, 128, 128, g, 4, 4)
        elif bm == 64:
            g1, g2 = _c(bm, 256, 128, g, 8, 3), _c(bm, 128, 128, g, 4, 3)
        else:  # 128x128 acc + 128x128 temporary over 8 warps: 128 registers per thread
            g1, g2 = _c(bm, 128, 128, g, 8, 3), _c(bm, 128, 128, g, 8, 3)
    else:
        if bm <= 32:
            g1, g2 = _c(bm, 128, 128, g, 4, 4), _c(bm, 64, 128, g, 4, 4)
        elif bm == 64:
            g1, g2 = _c(bm, 256, 64, g, 8, 3), _c(bm, 128, 64, g, 4, 4)
        else:
            g1, g2 = _c(bm, 256, 64, g, 8, 3), _c(bm, 128, 64, g, 8, 4)
    return {"gemm1": _fit_smem(g1, 1 if fp8 else elem_bytes), "gemm2": _fit_smem(g2, 1 if fp8 else elem_bytes)}


def as_two_acc(cfg: dict[str, dict[str, int]], keep_tma: bool = False) -> dict[str, dict[str, int]]:
    """The same launch with GEMM1 on the two-accumulator fallback kernel: BLOCK_N halved, so each
    program still writes the same output columns and holds the same accumulator registers.
    ``keep_tma``: w13 is in the checkpoint layout, whose gate and up tiles TMA can load."""
    g1 = cfg["gemm1"]
    if g1.get("TWO_ACC", 0):
        return cfg
    return {**cfg, "gemm1": {**g1, "BLOCK_N": max(16, g1["BLOCK_N"] // 2), "TWO_ACC": 1,
                             "B_TMA": g1.get("B_TMA", 0) if keep_tma else 0}}


def lookup(M: int, E: int, inter: int, H: int, dtype: str, device_name: Optional[str],
           config_dir: Optional[str] = None, kernel: str = TRITON_TABLE) -> tuple[Optional[dict[str, Any]], str]:
    """(entry of the tuned table nearest to M, file name), or (None, "") when no table exists."""
    for path in _table_paths(lambda dev: config_file_name(E, inter, H, dev, dtype, kernel), device_name, config_dir):
        table = _load(path)
        if table:
            cfg = table[min(table, key=lambda m: abs(m - M))]
            entry: dict[str, Any] = {k: {**{kk: int(cfg[k][kk]) for kk in KEYS},
                                         **{kk: int(cfg[k].get(kk, v)) for kk, v in OPTIONAL_KEYS.items()}}
                                     for k in ("gemm1", "gemm2") if k in cfg}
            if "path" in cfg:  # the cutlass table's: which path, and which CUTLASS kernels
                entry["path"] = str(cfg["path"])
            for key in ("cutlass_variants", "deepgemm_variants"):
                if key in cfg:
                    entry[key] = [int(v) for v in cfg[key]]
            return entry, os.path.basename(path)
    return None, ""


def get_config(M: int, E: int, top_k: int, inter: int, H: int, dtype: str, device_name: Optional[str],
               config_dir: Optional[str] = None) -> tuple[dict[str, dict[str, int]], str]:
    """(config, source) where source is the JSON file used or ``"heuristic"``."""
    entry, name = lookup(M, E, inter, H, dtype, device_name, config_dir)
    if entry is not None:
        return entry, name
    return heuristic(M, E, top_k, inter, H, dtype == "fp8_block", elem_bytes=4 if dtype == "fp32" else 2), "heuristic"


def save_table(path: Path, table: dict[int, dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        json.dump({str(m): table[m] for m in sorted(table)}, f, indent=1, sort_keys=True)
    _load.cache_clear()


# --------------------------------------------------------------------------- decode path
# Token lists of up to a shape's ``max_tokens`` run the decode kernels (``triton.decode``) instead of the pipeline,
# in the triton experts and the cutlass experts' Triton path alike: where the device measured them faster
# (docs/decisions.md, "A decode path: two GEMV launches, no alignment"). Per device, one table
# ``device_name=...,kernel=decode-v1.json`` in ``configs/`` (or ``config_dir``): {"E=..,K=..,N=..,H=..,dtype=..":
# {"max_tokens": N, "config": the decode launch}}, written by ``benchmarks/cuda/decode_sweep.py``; a shape it does
# not hold runs the decode kernels up to DECODE_MAX_TOKENS (bf16) with ``decode_config``'s launch, and FP8 block the
# pipeline (DECODE_MAX_TOKENS_FP8: on the H100 the FP8 decode kernels win on qwen3-30b-a3b at T = 1 only, the table's
# one FP8 entry that runs them, and tie or lose elsewhere; docs/decisions.md, "FP8 decode kernels, form 2"). A
# config's parts may name the form-2 kernels (``"FORM": 2``, see ``triton.decode``). Option ``decode_max_tokens``
# overrides the limit.
DECODE_TABLE = "decode-v1"
DECODE_MAX_TOKENS, DECODE_MAX_TOKENS_FP8 = 1, 0
DECODE_SMS = 132  # the H100's SMs: the heuristic's grids are sized to fill them


def decode_table_name(device_name: str) -> str:
    return f"device_name={device_name.replace(' ', '_')},kernel={DECODE_TABLE}.json"


def decode_shape(E: int, top_k: int, inter: int, H: int, dtype: str) -> str:
    return f"E={E},K={top_k},N={inter},H={H},dtype={dtype}"


@functools.lru_cache(maxsize=16)
def _load_decode(path: str) -> Optional[dict[str, Any]]:
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def decode_table_entry(E: int, top_k: int, inter: int, H: int, dtype: str, device_name: Optional[str],
                       config_dir: Optional[str] = None) -> Optional[dict[str, Any]]:
    """The shape's entry (``{"max_tokens", "config"}``) in the decode table the device reads, or None."""
    shape = decode_shape(E, top_k, inter, H, dtype)
    for path in _table_paths(decode_table_name, device_name, config_dir):
        table = _load_decode(path)
        if table and shape in table:
            return table[shape]
    return None


def decode_plan(T: int, E: int, top_k: int, inter: int, H: int, dtype: str, device_name: Optional[str],
                config_dir: Optional[str] = None, max_tokens: Optional[int] = None) -> Optional[dict[str, Any]]:
    """The decode kernels' launch for T tokens of this shape, or None where the pipeline runs (T past the shape's
    ``max_tokens``, or past ``max_tokens`` when given). The same object for every T of a shape (callers key
    recorded launches on it by identity and cache it per T)."""
    entry = decode_table_entry(E, top_k, inter, H, dtype, device_name, config_dir)
    if max_tokens is not None:
        limit = max_tokens
    elif entry is not None:
        limit = entry["max_tokens"]
    else:
        limit = DECODE_MAX_TOKENS_FP8 if dtype == "fp8_block" else DECODE_MAX_TOKENS
    if T > limit:
        return None
    if entry is not None and "config" in entry:
        return entry["config"]
    return decode_config(T, top_k, inter, H, dtype == "fp8_block")


def decode_config(T: int, top_k: int, inter: int, H: int, fp8: bool) -> dict[str, Any]:
    """The heuristic decode launch for T tokens: GEMM1 I-blocks and GEMM2 H-blocks small enough that each grid
    has a few programs per SM (the weights are the whole cost: every SM must stream them), GROUPS 128-column
    groups a loop step."""
    block_i = 64
    while block_i > 8 and T * top_k * -(-inter // block_i) < 4 * DECODE_SMS:
        block_i //= 2
    block_h = 64
    while block_h > 8 and T * -(-H // block_h) < 2 * DECODE_SMS:
        block_h //= 2
    return {"decode": dict(BLOCK_I=block_i, GROUPS=2, num_warps=4, num_stages=3),
            "down": dict(BLOCK_H=block_h, GROUPS=2, FLAT=1, num_warps=4, num_stages=3), "PDL": 0}
