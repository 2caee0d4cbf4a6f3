"""``moe-cuda-tune``: search Triton launch configs for model presets on this GPU and save them.

For each preset x quant x T: for each candidate BLOCK_M (from the mean rows per expert) it aligns
once, times GEMM1 alone over a short candidate list (FP8: including the activation quantization
kernel when the tile cannot quantize in its epilogue), then GEMM2 alone on that GEMM1's output;
the BLOCK_M with the lowest GEMM1 + GEMM2 wins. The winner and the heuristic are then timed as
the whole pipeline (align + GEMM1 + GEMM2 + reduce) on ``ROUTING_DRAWS`` routings and the faster
is kept. Times are
``triton.testing.do_bench_cudagraph`` medians (graph replay, as engines run decode). The table is written as
``E=..,N=..,H=..,device_name=..,dtype=..,kernel=vN.json`` (see ``triton.tuning_configs``) into
``--out-dir`` (default: the installed package's ``configs/``), where the backend finds it.

    moe-cuda-tune --presets qwen3-30b-a3b --quant unquantized fp8_block --out-dir ./configs

Why the space is pruned (the full grid BLOCK_M {16..128} x BLOCK_N {32..256} x BLOCK_K {64,128,256}
x stages 2-5 x warps 4/8 is ~500 configs per GEMM, hours of compiling): every candidate must fit the
H100's 227 KB of shared memory (stages x (BM + BN) x BK x bytes) and keep GEMM1's fp32 accumulator
(FP8: plus the scaled-dot temporary) at <= 128 registers per thread; small BLOCK_M (weight
streaming) wants narrow N, deep K and more stages, large BLOCK_M wants wide N and 8 warps. About
5 candidates per GEMM per BLOCK_M and 2 BLOCK_M per T keep the 4 presets x 2 quants x 7 T within
~10 minutes on an H100 (compiles are cached across T and presets); on Hopper every one-accumulator
candidate is also tried with TMA weight loads (``B_TMA``), and the winner once with half tiles
(``TAIL_TILES``) and once with GEMM2 reading h through TMA (``A_TMA``, as is and one stage deeper),
each kept if the whole pipeline runs faster. An existing table in ``--out-dir``
keeps its entries for the T not tuned this time, and an entry for a T that is tuned again stays unless
the new choice runs more than ``--keep-margin`` (3%) faster, timed in the same run: the tuner's ranking
noise (1-2%) must not move a committed entry. Each GEMM1 list holds one
``TWO_ACC`` candidate: if the one-accumulator epilogue fails to compile on some Triton, the
two-accumulator kernel still yields a table.

``--backend cutlass`` tunes the ``cutlass`` experts instead: FP8 block, the same search for its
Triton kernels on the checkpoint w13 layout (two-accumulator GEMM1); bf16 (``--quant unquantized``),
no search: its Triton path is the triton backend's own table (tune that first). Then its grouped
pipelines are timed too, on CUTLASS's kernels and (where the DeepGEMM headers are installed) on
DeepGEMM's, each on its fastest kernel pair, and the table entry says which path ran fastest at
that T (``"path": "triton" | "cutlass" | "deepgemm"``); the file is ``kernel=cutlass-v1`` (see
``triton.tuning_configs``). The CUTLASS library must build on this machine.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Optional

import torch

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
ROUTING_DRAWS = 3
SMEM_BYTES = 227 * 1024
# a re-tune replaces a table's entry only where its choice is this much faster: the tuner's short bursts rank
# pipelines within ~1-2%, below the run-to-run spread of the benchmark (docs/decisions.md, "The CUDA plugin's
# measured defaults")
KEEP_MARGIN = 0.03


def keep_committed(committed: Optional[dict], t_committed: float, chosen: dict, t_chosen: float,
                   margin: float = KEEP_MARGIN) -> tuple[dict, float]:
    """The entry to write for one T: the re-tune's ``chosen`` unless the ``committed`` entry (timed in the
    same run) is within ``margin`` of it."""
    if committed is None or committed == chosen or t_committed == float("inf"):
        return chosen, t_chosen
    return (committed, t_committed) if t_committed <= t_chosen * (1 + margin) else (chosen, t_chosen)


def _c(bm, bn, bk, w, s, g, two_acc=0):
    c = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=s)
    if two_acc:
        c["TWO_ACC"] = 1
    return c


# (BLOCK_N, BLOCK_K, warps, stages[, TWO_ACC]); GEMM1's BLOCK_N counts interleaved w13 rows
# (BLOCK_N/2 outputs; 256 lets FP8 quantize in the epilogue), with TWO_ACC it counts outputs.
_G1 = {
    ("bf16", "small"): [(128, 128, 4, 4), (64, 128, 4, 5), (256, 64, 4, 4), (128, 256, 4, 2), (64, 256, 4, 3),
                        (64, 128, 4, 4, 1), (128, 64, 4, 8), (64, 128, 4, 6)],
    ("bf16", 64): [(256, 64, 8, 3), (128, 64, 4, 4), (128, 128, 8, 3), (256, 64, 4, 4), (64, 64, 4, 4, 1)],
    ("bf16", 128): [(256, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 4), (64, 64, 8, 4, 1)],
    ("fp8", "small"): [(128, 128, 4, 4), (256, 128, 4, 3), (64, 128, 4, 5), (256, 128, 8, 4), (128, 128, 4, 3, 1),
                       (128, 128, 4, 8), (64, 128, 4, 8)],  # 8 stages: best weight streaming (H100)
    ("fp8", 64): [(256, 128, 8, 3), (128, 128, 4, 4), (128, 128, 8, 4), (256, 128, 8, 4), (128, 128, 8, 3, 1),
                  (128, 128, 4, 3), (256, 128, 8, 5)],
    ("fp8", 128): [(128, 128, 8, 3), (128, 128, 8, 4), (128, 64, 8, 5), (64, 128, 4, 4), (64, 128, 8, 3, 1)],
}
_G2 = {
    ("bf16", "small"): [(64, 128, 4, 4), (128, 128, 4, 4), (128, 64, 4, 5), (64, 256, 4, 3), (256, 64, 4, 4),
                        (128, 64, 4, 8)],
    ("bf16", 64): [(128, 64, 4, 4), (256, 64, 8, 3), (128, 128, 8, 3), (128, 64, 8, 4)],
    ("bf16", 128): [(128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4)],
    ("fp8", "small"): [(128, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 3), (256, 128, 4, 3), (128, 128, 4, 8)],
    ("fp8", 64): [(128, 128, 4, 3), (128, 128, 8, 4), (256, 128, 8, 3), (64, 128, 4, 4), (256, 128, 8, 4),
                  (256, 128, 8, 5), (128, 128, 4, 5)],
    ("fp8", 128): [(128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 4), (128, 64, 8, 5)],
}


def candidates(bm: int, fp8: bool, tma: bool = False,
               checkpoint: bool = False) -> tuple[list[dict], list[dict]]:
    """GEMM1 and GEMM2 candidates for BLOCK_M ``bm``; with ``tma`` (Hopper+) each one-accumulator
    candidate also once with its weight tiles loaded through TMA (``B_TMA``): at large BLOCK_M for
    compute-bound GEMMs, at small BLOCK_M for weight-streaming (bandwidth-bound) ones.
    ``checkpoint``: w13 in the checkpoint layout (the cutlass backend's Triton path), where GEMM1 runs
    two accumulators: every GEMM1 candidate as its two-accumulator twin (same output columns), TMA too."""
    from moe_plugin_cuda.triton.tuning_configs import as_two_acc

    key = ("fp8" if fp8 else "bf16", bm if bm >= 64 else "small")
    g = 16 if bm >= 64 else 1
    c1 = [_c(bm, *t[:4], g, *t[4:]) for t in _G1[key]]
    c2 = [_c(bm, *t[:4], g) for t in _G2[key]]
    if checkpoint:
        twins = [{k: v for k, v in as_two_acc({"gemm1": c})["gemm1"].items() if k != "B_TMA"} for c in c1]
        c1 = [c for i, c in enumerate(twins) if c not in twins[:i]]
        if tma:
            c1 += [{**c, "B_TMA": 1} for c in c1]
    elif tma:
        c1 += [{**c, "B_TMA": 1} for c in c1 if not c.get("TWO_ACC")]
    if tma:
        c2 += [{**c, "B_TMA": 1} for c in c2]
    return c1, c2


def smem_bytes(c: dict, fp8: bool, two_acc: bool = False) -> int:
    """Shared memory of the software pipeline: stages x (A tile + B tile(s))."""
    b_tiles = 2 if two_acc else 1
    return c["num_stages"] * (c["BLOCK_M"] + b_tiles * c["BLOCK_N"]) * c["BLOCK_K"] * (1 if fp8 else 2)


def acc_registers(c: dict, fp8: bool, two_acc: bool = False) -> int:
    """fp32 registers per thread of the live accumulator tiles (FP8: plus the scaled-dot temporary)."""
    tiles = (2 if two_acc else 1) + (1 if fp8 else 0)
    return tiles * c["BLOCK_M"] * c["BLOCK_N"] // (32 * c["num_warps"])


def block_ms(M: int, E: int, K: int) -> list[int]:
    r = M * K / E
    if r <= 8:
        return [16]
    if r <= 24:
        return [16, 32]
    if r <= 64:
        return [32, 64]
    return [64, 128]


def _make_weights(E, H, inter, fp8, g, dev, interleave):
    from moe_core.plugin_api import quant as q
    from moe_plugin_cuda.weights import interleave_gate_up_

    w13 = torch.empty((E, 2 * inter, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
    w2 = torch.empty((E, H, inter), dtype=w13.dtype, device=dev)
    s13 = s2 = None
    if fp8:
        s13 = torch.empty((E, math.ceil(2 * inter / 128), math.ceil(H / 128)), device=dev)
        s2 = torch.empty((E, math.ceil(H / 128), math.ceil(inter / 128)), device=dev)
    step = max(1, (1 << 28) // (3 * H * inter))
    for e0 in range(0, E, step):
        a = torch.randn((min(step, E - e0), 2 * inter, H), generator=g, device=dev) / math.sqrt(H)
        b = torch.randn((min(step, E - e0), H, inter), generator=g, device=dev) / math.sqrt(inter)
        if fp8:
            t = q.quantize_weights(a, b, "fp8_block")
            w13[e0:e0 + step], w2[e0:e0 + step] = t["w13"], t["w2"]
            s13[e0:e0 + step], s2[e0:e0 + step] = t["w13_scale"], t["w2_scale"]
        else:
            w13[e0:e0 + step], w2[e0:e0 + step] = a, b
    if interleave:
        interleave_gate_up_(w13)  # the triton backend's layout (scales stay in the checkpoint layout)
    return w13, w2, s13, s2


# FP8 GEMM1 kernels writing bf16 (h rounded before its requantization) are candidates from this many tokens:
# at one token a flipped e4m3 code of h can put the output past the conformance kit's allowance (DeepGEMM's
# test), and below T=1024 the grouped GEMMs never won anyway
MIN_BF16_H_TOKENS = 1024


def grouped_kernels(pipeline_time, t_triton: float, gemm_name: str, ns: tuple[int, int],
                    log=None, fp8: bool = True, *, tokens: int) -> tuple[tuple[int, int], float]:
    """The fastest (GEMM1, GEMM2) pair of ``gemm_name``'s kernels ("cutlass" or "deepgemm") for the
    grouped pipeline (GEMM1 and GEMM2 of ``ns`` columns), and its time: GEMM1's with GEMM2's default,
    then GEMM2's with that one. Only the default pair is timed where it is far (25%) behind the Triton
    path's ``t_triton``: the kernels differ by less."""
    from moe_plugin_cuda.cutlass import lib as cutlass_lib
    from moe_plugin_cuda.cutlass import ops as cutlass_ops
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    gemm = cutlass_ops.grouped_gemm(gemm_name, fp8)
    if gemm_name == "cutlass" and fp8:  # GEMM1 writes fp32 or (from MIN_BF16_H_TOKENS) bf16, GEMM2 bf16
        best = cutlass_lib.DEFAULT_VARIANTS["fp8"]
        choices = (cutlass_lib.variants_for("fp8", "fp32")
                   + (cutlass_lib.variants_for("fp8", "bf16") if tokens >= MIN_BF16_H_TOKENS else []),
                   cutlass_lib.variants_for("fp8", "bf16"))
    elif gemm_name == "cutlass":
        best = cutlass_lib.DEFAULT_VARIANTS["bf16"]
        choices = (cutlass_lib.variants_for("bf16", "bf16") + cutlass_lib.variants_for("bf16", "swiglu"),
                   cutlass_lib.variants_for("bf16", "bf16"))
    else:  # (a variant that cannot run N columns would run as variant 0: not a candidate)
        best, variants = ((deepgemm_lib.DEFAULT_FP8_VARIANTS, deepgemm_lib.FP8_VARIANTS) if fp8
                          else (deepgemm_lib.DEFAULT_BF16_VARIANTS, deepgemm_lib.BF16_VARIANTS))
        choices = tuple([k for k in range(len(variants)) if deepgemm_lib.runnable(k, n, variants)] for n in ns)
        if not all(deepgemm_lib.runnable(v, n, variants) for v, n in zip(best, ns, strict=True)):
            best = (choices[0][0], choices[1][0])

    def timed(v):
        t = pipeline_time(f"{gemm_name} {v}", partial(cutlass_ops.fused_experts, fp8_block=fp8, gemm=gemm,
                                                     w13_interleaved=not fp8), variants=v)
        if log:
            log(f"    {gemm_name} kernels {v} {t * 1e3:9.1f} us")
        return t

    t_best = timed(best)
    if t_best > 1.25 * t_triton:
        return best, t_best
    for i, ks in enumerate(choices):
        for k in ks:
            cand = (k, best[1]) if i == 0 else (best[0], k)
            if cand != best and (t := timed(cand)) < t_best:
                best, t_best = cand, t
    return best, t_best


def entry_time(entry: dict, pipeline, pipeline_time, triton_table: dict, fp8: bool) -> float:
    """One table entry's pipeline time: its grouped path on the kernels it names, or its Triton configs (the
    triton backend's table where the entry holds none: the cutlass backend's bf16 Triton path)."""
    from moe_plugin_cuda.cutlass import ops as cutlass_ops

    path = entry.get("path", "triton")
    if path == "triton":
        return pipeline(entry if "gemm1" in entry else triton_table)
    return pipeline_time(f"committed {path} {entry[f'{path}_variants']}",
                         partial(cutlass_ops.fused_experts, fp8_block=fp8, gemm=cutlass_ops.grouped_gemm(path, fp8),
                                 w13_interleaved=not fp8),
                         variants=tuple(entry[f"{path}_variants"]))


def tune_preset(name: str, quant: str, tokens, out_dir: Path, rep_ms: int, log, verbose: bool = False,
                backend: str = "triton", keep_margin: float = KEEP_MARGIN) -> Path:
    import triton.testing

    from moe_core.plugin_api import balanced_correction_bias, preset, route
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.triton import tuning_configs

    fp8 = quant == "fp8_block"
    interleaved = backend == "triton" or not fp8  # the cutlass backend keeps FP8 in the checkpoint layout
    cfg = preset(name, quant=quant, device="cuda")
    E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w13, w2, s13, s2 = _make_weights(E, H, inter, fp8, g, dev, interleaved)
    bias = balanced_correction_bias(E, g, dev) if cfg.router.use_correction_bias else None
    dtype_name, device_name = tuning_configs.table_dtype(cfg.quant, torch.bfloat16), torch.cuda.get_device_name()
    table_kind = tuning_configs.TRITON_TABLE if backend == "triton" else tuning_configs.CUTLASS_TABLE
    path = out_dir / tuning_configs.config_file_name(E, inter, H, device_name, dtype_name, table_kind)
    # re-tuning some T keeps the entries of the others
    table: dict[int, dict] = {int(m): c for m, c in json.loads(path.read_text()).items()} if path.exists() else {}
    tma = torch.cuda.get_device_capability(dev)[0] >= 9

    def timed(fn, what):
        try:
            # replayed from a CUDA graph: at small M the Python launch cost of a Triton kernel (tens of
            # microseconds) exceeds the kernel itself, and plain do_bench then ranks configs by noise
            # (measured on the H100: T=1 pipelines timed 3x slower than the benchmark's graph replay)
            # do_bench_cudagraph runs fn on a side stream that does not wait for the default stream,
            # where the inputs (weights, routing, alignment) were just produced: sync first (without
            # it the first candidate after a new preset read half-written indices: illegal address)
            torch.cuda.synchronize()
            return triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median")
        except Exception as exc:  # e.g. out of shared memory / registers for this tile shape
            log(f"    skip {what}: {type(exc).__name__}: {str(exc)[:100]}")
            return float("inf")

    def search(fn, key, cands, what):
        """Best of ``cands``, then of the winner with other GROUP_M (how many M-blocks share the
        weight tiles they stream through L2; it matters once an expert has many M-blocks)."""
        timings = [(timed(partial(fn, **{key: c}), f"{what} {c}"), i) for i, c in enumerate(cands)]
        if verbose:
            for t, i in sorted(timings):
                log(f"    {what} {t * 1e3:9.1f} us  {cands[i]}")
        t_best, i = min(timings)
        c_best = cands[i]
        if t_best < float("inf") and c_best["BLOCK_M"] >= 64:
            for gm in (4, 8, 32, 64):
                c = {**c_best, "GROUP_M": gm}
                t = timed(partial(fn, **{key: c}), f"{what} {c}")
                if verbose:
                    log(f"    {what} {t * 1e3:9.1f} us  {c}")
                if t < t_best:
                    t_best, c_best = t, c
        return t_best, c_best

    for M in tokens:
        x = torch.randn((M, H), generator=g, device=dev).to(torch.bfloat16)
        topk = route(torch.randn((M, E), generator=g, device=dev), K, cfg.router, bias)
        ids = topk.ids.contiguous()
        a, a_s = triton_ops.quantize_fp8_groups(x) if fp8 else (x, None)
        wts = topk.weights.reshape(-1).contiguous()
        y = torch.empty((M * K, H), dtype=torch.bfloat16, device=dev)
        t0 = time.time()
        best = (float("inf"), None)
        triton_own = backend == "cutlass" and not fp8  # bf16: its Triton path is the triton backend's, as tuned
        for bm in [] if triton_own else block_ms(M, E, K):
            align = triton_ops.align_block_size(ids, E, bm)
            kw = dict(align=align, masked_m=None, num_rows=M * K, capacity=0, num_m_blocks=align.max_blocks)
            g1 = partial(triton_ops.gemm1, a, a_s, w13, s13, a_row_div=K, activation="silu", fp8=fp8,
                         w13_interleaved=interleaved, out_dtype=torch.bfloat16, **kw)
            c1s, c2s = candidates(bm, fp8, tma, checkpoint=not interleaved)
            ms1, c1 = search(partial(g1, cfg1=None), "cfg1", c1s, "gemm1")
            if ms1 == float("inf"):
                continue
            h, h_s = g1(cfg1=c1)
            g2 = partial(triton_ops.gemm2, h, h_s, w2, s2, y, wts, out_scale=1.0, fp8=fp8, **kw)
            ms2, c2 = search(partial(g2, cfg2=None), "cfg2", c2s, "gemm2")
            if ms1 + ms2 < best[0]:
                best = (ms1 + ms2, {"gemm1": c1, "gemm2": c2})

        # whole pipelines are compared on ROUTING_DRAWS routings (mean): which experts get one row more
        # than a tile holds decides CUTLASS vs Triton near 128 rows per expert (deepseek T=4096 flipped)
        draws = [topk] + [route(torch.randn((M, E), generator=g, device=dev), K, cfg.router, bias)
                          for _ in range(ROUTING_DRAWS - 1)]

        def pipeline_time(what, run, x=x, draws=draws, **kw):  # (this T's inputs, bound: B023)
            return sum(timed(partial(run, x, None, w13, w2, s13, s2, d.weights, d.ids, routed_scaling_factor=1.0,
                                     out_dtype=torch.bfloat16, **kw), what) for d in draws) / len(draws)

        def pipeline(cfg_):
            return pipeline_time(f"triton {cfg_}", triton_ops.fused_experts, fp8_block=fp8, activation="silu",
                                 cfg=cfg_, w13_interleaved=interleaved)

        if triton_own:
            heur = tuning_configs.get_config(M, E, K, inter, H, dtype_name, device_name, str(out_dir))[0]
        elif interleaved:
            heur = tuning_configs.heuristic(M, E, K, inter, H, fp8)
        else:  # what the cutlass backend runs untuned: triton's table (or heuristic) on two accumulators
            heur = tuning_configs.as_two_acc(
                tuning_configs.get_config(M, E, K, inter, H, dtype_name, device_name, str(out_dir))[0], keep_tma=True)
        t_heur = pipeline(heur)
        if not triton_own and not interleaved:
            # a stand-in device's triton table is what runs untuned, and the heuristic may beat it (the H100's FP8
            # configs on the H200: docs/decisions.md, "Tables of a stand-in device"): the faster of the two
            plain = tuning_configs.as_two_acc(tuning_configs.heuristic(M, E, K, inter, H, fp8), keep_tma=True)
            if plain != heur and (t_plain := pipeline(plain)) < t_heur:
                heur, t_heur = plain, t_plain
        t_best = pipeline(best[1]) if best[1] is not None else float("inf")
        if best[1] is not None and best[1]["gemm1"]["BLOCK_M"] >= 64:
            # the same tiles with half tiles for the experts' last rows: where experts get about a whole
            # number of tiles, a full tile for a few rows past them is much of the work (see TAILS)
            halves = {k: {**c, "TAIL_TILES": 1} for k, c in best[1].items()}
            t_halves = pipeline(halves)
            if t_halves < t_best:
                best, t_best = (best[0], halves), t_halves
        if best[1] is not None and tma:
            # GEMM2 streaming h through TMA (GEMM1 writing it in row order): no per-row gather, which
            # frees registers for one more stage; on the H100 it paid at T >= 4096, not below
            g2 = best[1]["gemm2"]
            for stages in (g2["num_stages"], g2["num_stages"] + 1):
                a_tma = {**best[1], "gemm2": {**g2, "A_TMA": 1, "num_stages": stages}}
                if (t_a := pipeline(a_tma)) < t_best:
                    best, t_best = (best[0], a_tma), t_a
        chosen, t = (best[1], t_best) if t_best < t_heur else (heur, t_heur)
        if chosen is None or t == float("inf"):
            log(f"  {name} {quant} T={M}: nothing ran, no entry")
            continue
        note = ""
        if backend == "cutlass":  # the grouped GEMMs this machine can run, each on its fastest kernels
            gemms = ["cutlass"] + (["deepgemm"] if deepgemm_lib.missing() is None
                                   and E <= deepgemm_lib.MAX_EXPERTS else [])
            for gemm_name in gemms:
                variants, t_g = grouped_kernels(pipeline_time, t, gemm_name, (2 * inter, H), log if verbose else None,
                                                fp8, tokens=M)
                note += f", {gemm_name} {t_g * 1e3:.1f} on kernels {variants}"
                chosen = {**chosen, f"{gemm_name}_variants": list(variants)}
                if t_g < t:
                    chosen, t = {**chosen, "path": gemm_name}, t_g
        if triton_own:  # (the backend runs triton's table at every T: no copy of its configs)
            chosen = {k: v for k, v in chosen.items() if k not in ("gemm1", "gemm2")}
        committed = table.get(M)
        if committed is not None and committed != chosen:
            t_committed = entry_time(committed, pipeline, pipeline_time, heur, fp8)
            note += f", committed entry {t_committed * 1e3:.1f}"
            chosen, t = keep_committed(committed, t_committed, chosen, t, keep_margin)
            note += " (kept)" if chosen is committed else " (replaced)"
        table[M] = chosen
        shown = chosen if "gemm1" in chosen else heur  # (triton_own: the triton table's configs run)
        log(f"  {name} {quant} T={M}: {t * 1e3:.1f} us, mean of {ROUTING_DRAWS} routings (searched {t_best * 1e3:.1f}, "
            f"{'triton table' if triton_own else 'heuristic'} {t_heur * 1e3:.1f}"
            f"{note}) {chosen.get('path', 'triton')} {shown['gemm1']} / {shown['gemm2']}  [{time.time() - t0:.0f}s]")
        tuning_configs.save_table(path, table)  # after every T: a cut-off run keeps what it found
    return path


def main(argv: Optional[list[str]] = None) -> int:
    from moe_core.plugin_api import PRESETS
    from moe_plugin_cuda.triton import tuning_configs

    p = argparse.ArgumentParser(prog="moe-cuda-tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3"],
                   choices=sorted(PRESETS))
    p.add_argument("--quant", nargs="+", default=["unquantized", "fp8_block"], choices=["unquantized", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    p.add_argument("--out-dir", default=str(tuning_configs.CONFIG_DIR))
    p.add_argument("--rep-ms", type=int, default=20, help="do_bench repetition time per candidate")
    p.add_argument("--verbose", action="store_true", help="log every candidate's time")
    p.add_argument("--keep-margin", type=float, default=KEEP_MARGIN,
                   help="keep a table's entry for a re-tuned T unless the new choice is this much faster (0: fastest)")
    p.add_argument("--backend", default="triton", choices=["triton", "cutlass"],
                   help="whose table: triton's, or the cutlass experts' (its Triton path and where CUTLASS wins)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe-cuda-tune needs a CUDA GPU", file=sys.stderr)
        return 1

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"tuning on {torch.cuda.get_device_name()}")
    t0 = time.time()
    for name in args.presets:
        for quant in args.quant:
            path = tune_preset(name, quant, args.tokens, Path(args.out_dir), args.rep_ms, log, args.verbose,
                               args.backend, args.keep_margin)
            torch.cuda.empty_cache()  # this preset's weights are gone: room for the next one's
            log(f"wrote {path} [{time.time() - t0:.0f}s total]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
