"""The triton decode kernels on the GPU (issue 31; docs/decisions.md, "A decode path: two GEMV launches, no
alignment"): which launch configs, and up to which T the decode path wins.

    python benchmarks/cuda/decode_sweep.py [--presets ...] [--quant ...] [--tokens 1 2 4 8 16] [--sweep-tokens 1 4]
        [--json FILE] [--table FILE] [--warm-only]

Per preset x quant (the preset's weights as the triton experts keep them, random routing as ``decode.py`` makes
it), at each of ``--sweep-tokens``: each decode kernel alone per candidate config, then the fastest together, with
and without programmatic dependent launch (PDL) (see ``sweep_kernels``). At each of ``--tokens``: the triton layer
with the decode path (``decode_max_tokens``; the nearest swept T's configs where there are some,
``tuning_configs.decode_config``'s otherwise) against the same layer running the pipeline (``decode_max_tokens=0``):
graph, eager (L2 flushed) and host time, as ``decode.py`` measures them. ``--table``: merge the decode table
(``tuning_configs.decode_plan``) these rows make into this file. ``--warm-only``: compile every candidate once on
small stand-in weights of the same specializations (parallel processes fill Triton's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import GRAPH_CALLS, eager_times, floor_us, graph_time  # noqa: E402
from host_time import build_layer, host_times, make_inputs, warm_up  # noqa: E402

from moe_core.bench import device_peaks  # noqa: E402
from moe_core.config import preset  # noqa: E402
from moe_core.contracts import QuantScheme, TopK  # noqa: E402

# (warps, stages) of gate/up; (warps, stages, FLAT) of down: form 1
LAUNCHES = {"decode": ((4, 1), (4, 3), (8, 3)), "down": ((4, 1, 0), (4, 3, 0), (4, 3, 1), (8, 3, 1))}


def candidates(part: str, fp8: bool = False, forms: tuple[int, ...] = (1, 2),
               warps: Optional[tuple[int, ...]] = None, stages: tuple[int, ...] = (1,)) -> list[dict[str, int]]:
    """Form 1: rows (BLOCK_I / BLOCK_H) x 128-column groups a step x launch, the fp32 registers bounded (gate/up:
    two accumulators and two tiles of BLOCK_I x GROUPS x 128; down: one and one) to ~160 a thread. Form 2
    (``FORM`` 2): gate/up rows (``SLOTS`` slots x ``BLOCK_I``, 2 to 16) x groups x warps x ``stages``, at most 256
    weights a thread a step; down rows x groups x warps x stages x ``SPLIT``, at most 128 weights a thread a step
    (stages > 1: Triton's software pipeline through shared memory); the step's columns need at least half the
    threads (16-byte loads: 8 threads a group in FP8, 16 in bf16). ``warps``: form 2's warp counts (default 1, 2,
    4)."""
    block = "BLOCK_I" if part == "decode" else "BLOCK_H"
    out = []
    if 1 in forms:
        per_thread = 4 if part == "decode" else 2
        out += [{block: b, "GROUPS": g, "num_warps": launch[0], "num_stages": launch[1],
                 **({"FLAT": launch[2]} if part == "down" else {})}
                for b in (8, 16, 32) for g in (1, 2, 4, 8) for launch in LAUNCHES[part]
                if per_thread * b * g * 128 <= 160 * 32 * launch[0]]
    if 2 in forms:
        lanes = 8 if fp8 else 16  # threads over one 128-column group
        launches = [(w, st) for w in (warps or (1, 2, 4)) for st in stages]
        if part == "decode":  # (rows: SLOTS x BLOCK_I (slot, I-row) pairs; SLOTS must divide the preset's top_k)
            for slots in (1, 2, 4, 8):
                for b in (1, 2, 4, 8):
                    for g in (2, 4, 8):
                        for w, st in launches:
                            threads, rows = 32 * w, slots * b
                            if not 2 <= rows <= 16 or g * lanes * 2 < threads or 2 * rows * g * 128 > 256 * threads:
                                continue
                            out.append({"BLOCK_I": b, "SLOTS": slots, "GROUPS": g, "FORM": 2, "num_warps": w,
                                        "num_stages": st})
        else:
            for b in (4, 8, 16, 32):
                for g in (2, 4, 8, 16):
                    for w, st in launches:
                        threads = 32 * w
                        if g * lanes * 2 < threads or b * g * 128 > 128 * threads:
                            continue
                        for split in (0, 1):
                            out.append({block: b, "GROUPS": g, "FORM": 2, "num_warps": w, "num_stages": st,
                                        "SPLIT": split})
    return out


TOP = 3  # the fastest of each kernel tried together


def sweep_kernels(tag: str, x, topk, w, fp8: bool, interleaved: bool, reps: int, warm_only: bool,
                  shard: tuple[int, int] = (0, 1), forms: tuple[int, ...] = (1, 2),
                  current: Optional[dict] = None, warps: Optional[tuple[int, ...]] = None,
                  stages: tuple[int, ...] = (1,), l2pf: tuple[float, ...] = ()) -> dict[str, Any]:
    """Each kernel per candidate, its GRAPH_CALLS launches each on another random routing (weights streamed from
    HBM, as consecutive layers' are); then the TOP x TOP fastest together on ``topk`` (as ``decode.py`` replays a
    forward), and the best pair with PDL: {"decode"/"down": top [us, cfg], "pairs": [[us, cfg]], "best":
    the fastest full config}. ``forms``, ``warps``, ``stages``: the kernel forms, form 2's warp counts and pipeline
    stages swept (``candidates``; ``forms`` () sweeps the current config alone); ``current``: a decode config (the
    shape's table entry) whose parts are candidates too; ``l2pf``: fractions of the down weights the best pair's
    gate/up programs prefetch into L2, tried as ``sweep_prefetch`` says (form-2 gate/up). A split down kernel alone
    reuses counters zeroed once (its last program
    sets them back to zero); the fastest split and non-split down configs both go on to the pairs."""
    from moe_plugin_cuda.triton import decode

    dev = x.device
    T, top_k, inter = x.shape[0], topk.ids.shape[1], w.w2.shape[2]
    E = w.w13.shape[0]
    h = torch.randn(T * top_k, inter, dtype=torch.float32, device=dev)
    out = torch.empty_like(x)
    part_buf = torch.empty(T * top_k, x.shape[1], dtype=torch.float32, device=dev)  # (a split down's partials)
    routings = [torch.stack([torch.randperm(E, device=dev)[:top_k] for _ in range(T)]).to(topk.ids.dtype)
                for _ in range(GRAPH_CALLS)]
    turn = [0]

    def ids():  # the next routing (each captured launch gets its own)
        turn[0] += 1
        return routings[turn[0] % len(routings)]

    res: dict[str, Any] = {}
    tops = {}
    for part in ("decode", "down"):
        timed = []
        cands = [c for c in candidates(part, fp8, forms, warps, stages) if top_k % c.get("SLOTS", 1) == 0]
        if current and current.get(part) and current[part] not in cands:
            cands.append(current[part])
        for c in cands[shard[0]::shard[1]]:
            if part == "decode":
                def call(c=c):
                    decode.gate_up(x, None, w.w13, w.w13_scale, ids(), h, fp8_block=fp8, activation="silu",
                                   w13_interleaved=interleaved, cfg=c)
            else:
                cnt = torch.zeros(T, -(-x.shape[1] // c["BLOCK_H"]), dtype=torch.int32, device=dev)

                def call(c=c, cnt=cnt):
                    decode.down(h, w.w2, w.w2_scale, ids(), topk.weights, out, fp8_block=fp8,
                                routed_scaling_factor=1.0, cfg=c, part=part_buf, cnt=cnt)
            try:
                call()
                torch.cuda.synchronize(dev)
                if not warm_only:
                    timed.append((graph_time(call, dev, reps) * 1e6, c))
            except Exception as exc:  # a config that does not compile or run: report it, keep the others
                print(f"  {tag} {part} {c}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        if timed:
            timed.sort(key=lambda r: r[0])
            tops[part] = [c for _, c in timed[:TOP]]
            if part == "down":  # (the best split and non-split alike: alone, a split kernel's tail is cheaper)
                tops[part] = ([c for _, c in timed if c.get("SPLIT")][:TOP]
                              + [c for _, c in timed if not c.get("SPLIT")][:TOP])
            res[part] = [[round(t, 2), c] for t, c in timed[:4]]
            print(f"  {tag} {part:6s} best {timed[0][0]:.2f} us {timed[0][1]}  next "
                  f"{[r[0] for r in res[part][1:]]} worst {timed[-1][0]:.1f}", file=sys.stderr, flush=True)
    if warm_only:
        combos = [{**candidate_default(), "PDL": 0}]
    elif len(tops) < 2:
        return res
    else:  # (without PDL: the kernels compiled above; PDL compiles another variant, tried on the best pair only)
        combos = [{"decode": a, "down": b, "PDL": 0} for a in tops["decode"] for b in tops["down"]
                  if not b.get("SPLIT") or a.get("FORM", 1) == 2]  # (a split down needs form 2's counters)
        if not combos:
            combos = [{"decode": a, "down": b, "PDL": 0} for a in tops["decode"] for b in tops["down"]
                      if not b.get("SPLIT")]

    def pair(cfg):
        return lambda: decode.decode_experts(x, None, w.w13, w.w2, w.w13_scale, w.w2_scale, topk.weights, topk.ids,
                                             fp8_block=fp8, activation="silu", routed_scaling_factor=1.0,
                                             out_dtype=x.dtype, cfg=cfg, w13_interleaved=interleaved, out=out)

    def rotated(cfg):  # each captured call on another routing: no call finds the previous one's weights in L2
        def call():
            decode.decode_experts(x, None, w.w13, w.w2, w.w13_scale, w.w2_scale, topk.weights, ids(), fp8_block=fp8,
                                  activation="silu", routed_scaling_factor=1.0, out_dtype=x.dtype, cfg=cfg,
                                  w13_interleaved=interleaved, out=out)
        return call

    pairs = []
    for cfg in combos:
        try:
            pair(cfg)()
            torch.cuda.synchronize(dev)
            if not warm_only:
                pairs.append((graph_time(pair(cfg), dev, reps) * 1e6, cfg))
        except Exception as exc:
            print(f"  {tag} pair {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
    if warm_only or not pairs:
        return res
    pairs.sort(key=lambda r: r[0])
    best_t, best = pairs[0]
    # the best two pairs with PDL: the down kernel released past the gate/up loop (1) or, form-2 gate/up, as its
    # programs start (2)
    for _, cfg in pairs[:2]:
        for level in ((1, 2) if cfg["decode"].get("FORM", 1) == 2 else (1,)):
            with_pdl = {**cfg, "PDL": level}
            try:
                pair(with_pdl)()
                torch.cuda.synchronize(dev)
                t1 = graph_time(pair(with_pdl), dev, reps) * 1e6
            except Exception as exc:
                print(f"  {tag} pair with PDL {level}: FAILED {type(exc).__name__}: {str(exc)[:300]}",
                      file=sys.stderr)
                continue
            pairs.append((t1, with_pdl))
            if t1 < best_t:
                best_t, best = t1, with_pdl
    if l2pf and best["decode"].get("FORM", 1) == 2:
        best, best_t = sweep_prefetch(tag, pair, rotated, best, best_t, l2pf, dev, reps, res)
    res["pairs"] = [[round(t, 2), c] for t, c in pairs]
    res["best"] = best
    print(f"  {tag} pairs {[round(t, 1) for t, _ in pairs]} -> {best_t:.2f} us {best}", file=sys.stderr, flush=True)
    return res


def prefetch_variants(best: dict, fractions: tuple[float, ...]) -> list[dict]:
    """The best pair (any prefetch taken out) first, then with the gate/up programs prefetching each fraction of
    the down weights into L2 (``"L2PF"``), with and without an evict_last policy (``"L2PF_KEEP"``), and with the
    weights read with an L2 evict_first policy (``"STREAM"`` of a part: gate/up; kept, gate/up and form-2 down); the
    largest fraction, kept, at the other PDL levels."""
    base = {k: v for k, v in best.items() if k not in ("L2PF", "L2PF_KEEP")}
    base["decode"] = {k: v for k, v in base["decode"].items() if k != "STREAM"}
    base["down"] = {k: v for k, v in base["down"].items() if k != "STREAM"}
    up_stream = {**base["decode"], "STREAM": 1}
    out = [base] + [{**base, "L2PF": f, "L2PF_KEEP": keep} for f in fractions for keep in (0, 1)]
    # the gate/up weights read evict_first (they do not push the prefetched lines out), and with the prefetch kept
    # the form-2 down kernel's reads evict_first too (a line read is not kept past its one use)
    out += [{**base, "decode": up_stream, "L2PF": f, "L2PF_KEEP": 0} for f in fractions]
    if base["down"].get("FORM", 1) == 2:
        out += [{**base, "decode": up_stream, "down": {**base["down"], "STREAM": 1}, "L2PF": f, "L2PF_KEEP": 1}
                for f in fractions]
    # the largest fraction, kept, at the PDL levels the pair does not use (the down kernel's start moves the overlap)
    out += [{**base, "PDL": level, "L2PF": max(fractions), "L2PF_KEEP": 1} for level in (0, 1, 2)
            if level != base.get("PDL", 0) and fractions]
    return out


def sweep_prefetch(tag: str, pair, rotated, best: dict, best_t: float, fractions: tuple[float, ...], dev,
                   reps: int, res: dict[str, Any]) -> tuple[dict, float]:
    """``prefetch_variants`` of the best pair, each timed on the same routing every call (as ``decode.py`` replays
    a forward) and rotating the routing every call (``rotated``: the weights from HBM, as consecutive layers'). A
    prefetch variant wins only where it is faster both ways (a prefetch could otherwise win by leaving the next
    replay's weights in L2); the fastest rotated winner is kept. Returns the (config, same-routing time) to keep;
    ``res["prefetch"]``: [[same, rotated us], config] per variant, the pair without first."""
    timed = []
    variants = prefetch_variants(best, fractions)
    for cfg in variants:
        try:
            pair(cfg)()
            torch.cuda.synchronize(dev)
            same, rot = graph_time(pair(cfg), dev, reps) * 1e6, graph_time(rotated(cfg), dev, reps) * 1e6
        except Exception as exc:
            print(f"  {tag} prefetch {cfg}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            continue
        timed.append(((same, rot), cfg))
    res["prefetch"] = [[[round(a, 2), round(b, 2)], c] for (a, b), c in timed]
    print(f"  {tag} prefetch (same/rotated us): " + "  ".join(
        f"{_pf_label(c)} {a:.2f}/{b:.2f}" for (a, b), c in timed), file=sys.stderr, flush=True)
    if not timed or timed[0][1] is not variants[0]:
        return best, best_t
    (same0, rot0), _ = timed[0]
    wins = [(rot, same, c) for (same, rot), c in timed[1:] if rot < rot0 and same < min(same0, best_t)]
    if not wins:
        return best, best_t
    rot, same, cfg = min(wins, key=lambda r: r[0])
    return cfg, same


def _pf_label(cfg: dict) -> str:
    parts = [f"L2PF {cfg['L2PF']}{'k' if cfg.get('L2PF_KEEP') else ''}"] if cfg.get("L2PF") else []
    parts += [f"{p} ef" for p in ("decode", "down") if cfg[p].get("STREAM")]
    return "+".join(parts or ["none"]) + f" PDL {cfg.get('PDL', 0)}"


def candidate_default() -> dict:
    return {"decode": candidates("decode")[0], "down": candidates("down")[0]}


def stand_in(cfg, T: int, dev):
    """Small weights of the preset's specializations (row lengths, dtypes, expert count class): warm-only."""
    from moe_plugin_cuda.weights import ExpertWeights

    from moe_core.quant import quantize_weights

    E = 16 if cfg.num_experts % 16 == 0 else cfg.num_experts
    H, inter, K = cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    w13 = torch.randn(E, 2 * inter, H, device=dev) * 0.02
    w2 = torch.randn(E, H, inter, device=dev) * 0.02
    fp8 = cfg.quant is QuantScheme.FP8_BLOCK
    if fp8:
        q = quantize_weights(w13, w2, cfg.quant)
        w = ExpertWeights(q["w13"], q["w2"], q["w13_scale"], q["w2_scale"])
    else:
        w = ExpertWeights(w13.to(cfg.params_dtype), w2.to(cfg.params_dtype), None, None)
    ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).int()
    topk = TopK(torch.rand(T, K, device=dev), ids)
    return torch.randn(T, H, device=dev).to(cfg.params_dtype), topk, w


def main(argv: Optional[list[str]] = None) -> int:
    from moe_plugin_cuda.weights import expert_weights

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # (the presets furthest from the memory floor at T=1 first)
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b", "deepseek-v3"])
    p.add_argument("--quant", nargs="+", default=["unquantized", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    p.add_argument("--sweep-tokens", nargs="+", type=int, default=[1])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--table", default=None, help="merge the decode table (tuning_configs.decode_plan) into this file")
    p.add_argument("--warm-only", action="store_true")
    p.add_argument("--shard", default="0/1", help="warm-only: candidates i, i+n, ... (i/n)")
    p.add_argument("--forms", nargs="+", type=int, default=[1, 2], help="the kernel forms swept (1, 2); the "
                   "shape's current table config is a candidate either way")
    p.add_argument("--warps", nargs="+", type=int, default=None, help="form 2's warp counts swept (default 1 2 4)")
    p.add_argument("--stages", nargs="+", type=int, default=[1, 3], help="form 2's pipeline stages swept")
    p.add_argument("--current-only", action="store_true", help="the shape's table config as the only candidate "
                   "(its PDL levels and L2 prefetch still tried)")
    p.add_argument("--l2pf", nargs="*", type=float, default=[0.25, 0.5, 1.0], help="fractions of the down weights "
                   "the best pair's gate/up programs prefetch into L2 (sweep_prefetch; form-2 gate/up; none: not "
                   "tried)")
    args = p.parse_args(argv)
    p_args = dict(warps=tuple(args.warps) if args.warps else None, stages=tuple(args.stages),
                  l2pf=tuple(args.l2pf))
    forms = () if args.current_only else tuple(args.forms)
    dev = torch.device("cuda", torch.cuda.current_device())
    peaks = device_peaks(torch.cuda.get_device_name(dev))
    rows = []
    for name in args.presets:
        for q in args.quant:
            cfg = preset(name, quant=q, device="cuda", experts="triton")
            fp8 = cfg.quant is QuantScheme.FP8_BLOCK
            current = current_config(cfg, args.table)
            if args.warm_only:
                for T in args.sweep_tokens:
                    x, topk, w = stand_in(cfg, T, dev)
                    sweep_kernels(f"{name} {q} T={T}", x, topk, w, fp8, True, args.reps, True,
                                  tuple(int(v) for v in args.shard.split("/")), forms, current, **p_args)
                continue
            layer = build_layer(cfg, dev)
            experts = layer.experts
            w = expert_weights(layer, fp8)
            swept = {}
            for T in args.tokens:
                tag = f"{name:16s} {q:11s} T={T:<3d}"
                x, topk, touched = make_inputs(cfg, layer, T)
                floor = floor_us(cfg, T, touched, peaks)
                row: dict[str, Any] = {"preset": name, "quant": q, "T": T,
                                       "floor_us": None if floor is None else round(floor, 2)}
                try:
                    if T in args.sweep_tokens:
                        row["kernels"] = sweep_kernels(tag, x, topk, w, fp8, experts.decision.w13_interleaved,
                                                       args.reps, False, forms=forms, current=current,
                                                       **p_args)
                        swept[T] = row["kernels"].get("best")
                    # the nearest swept T's configs (their grids only grow with T), else the heuristic's
                    near = min(swept, key=lambda s: abs(s - T)) if swept else None
                    for label, max_t, dcfg in (("decode", T, swept.get(near)), ("pipeline", 0, None)):
                        experts.decode_max_tokens, experts.decode_config = max_t, dcfg
                        experts._fused_configs.clear()

                        def fwd(layer=layer, x=x, topk=topk):
                            return layer(x, topk)

                        with torch.no_grad():
                            warm_up(fwd, dev)
                            g = graph_time(fwd, dev, args.reps) * 1e6
                            e = statistics.median(eager_times(fwd, dev, args.reps)) * 1e6
                            hst = statistics.median(host_times(fwd, dev, args.reps)) * 1e6
                        row[label] = {"graph_us": round(g, 2), "eager_us": round(e, 2), "host_us": round(hst, 2),
                                      "config": experts.fused_config(T, dev)}
                        print(f"  {tag} layer {label:8s} graph {g:.1f} eager {e:.1f} host {hst:.1f} floor "
                              f"{row['floor_us']} frac {(row['floor_us'] or float('nan')) / g:.2f}", file=sys.stderr,
                              flush=True)
                except Exception as exc:
                    print(f"  {tag}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
                rows.append(row)
            layer = experts = w = None
            torch.cuda.empty_cache()
            write(rows, args)  # (after each preset and quant: a run stopped by a time limit keeps what it measured)
    if args.table:
        print(f"decode table: {json.dumps({k: v['max_tokens'] for k, v in decode_table(rows).items()})}",
              file=sys.stderr)
    return 0


def current_config(cfg, table_path: Optional[str]) -> Optional[dict]:
    """The shape's config in the decode table at ``table_path`` (else the package's for this device), if any."""
    from moe_plugin_cuda.triton import tuning_configs

    dtype = tuning_configs.table_dtype(cfg.quant, cfg.params_dtype)
    shape = (cfg.num_experts, cfg.top_k, cfg.intermediate_size, cfg.hidden_size, dtype)
    if table_path:  # (read afresh: the sweep merges into it)
        if not os.path.exists(table_path):
            return None
        with open(table_path) as f:
            entry = json.load(f).get(tuning_configs.decode_shape(*shape))
    else:  # what the layer runs: this device's table, else its stand-in's
        entry = tuning_configs.decode_table_entry(*shape, torch.cuda.get_device_name())
    return None if entry is None else entry.get("config")


def write(rows: list[dict[str, Any]], args) -> None:
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.table:
        table = {}
        if os.path.exists(args.table):  # (other shapes' entries kept)
            with open(args.table) as f:
                table = json.load(f)
        table.update(decode_table(rows))
        with open(args.table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
            f.write("\n")


def decode_table(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """``tuning_configs.decode_plan``'s table from the rows: per shape, the swept configs of the smallest T, and
    ``max_tokens`` = the largest measured T up to which the decode path's graph and eager times both beat the
    pipeline's at every measured T (0: never)."""
    from moe_plugin_cuda.triton import tuning_configs

    table = {}
    for name in dict.fromkeys(r["preset"] for r in rows):
        for q in dict.fromkeys(r["quant"] for r in rows if r["preset"] == name):
            cells = sorted((r for r in rows if r["preset"] == name and r["quant"] == q and "pipeline" in r
                            and "decode" in r), key=lambda r: r["T"])
            best = next((r["kernels"]["best"] for r in cells if r.get("kernels", {}).get("best")), None)
            if not cells or best is None:
                continue
            max_tokens = 0
            for r in cells:
                if not all(r["decode"][m] < r["pipeline"][m] for m in ("graph_us", "eager_us")):
                    break
                max_tokens = r["T"]
            cfg = preset(name, quant=q)
            dtype = tuning_configs.table_dtype(cfg.quant, cfg.params_dtype)
            key = tuning_configs.decode_shape(cfg.num_experts, cfg.top_k, cfg.intermediate_size, cfg.hidden_size,
                                              dtype)
            table[key] = {"max_tokens": max_tokens, "config": best}
    return table


if __name__ == "__main__":
    sys.exit(main())
