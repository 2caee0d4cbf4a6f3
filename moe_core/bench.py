"""``moe-core bench``: time every usable experts backend through ``MoELayer`` on this machine.

For each preset x quant x T and each experts backend that plans for the config (``auto``
dispatcher, single rank), it builds a layer with random weights, routes random logits with the
preset's router, and times ``layer.forward`` (median of device-event timings, on a GPU after
``WARM_S`` of warm-up calls and over at least ``TIMED_S`` of timed ones; on CUDA also a CUDA-graph
replay when the plan is graph-safe, the best of both is reported, as SGLang's figures are). Each
result carries TFLOP/s and the fraction of the floor::

    floor = max(bytes / BW, flops / PEAK)
    flops = 6 * T * K * H * I                        (two GEMMs, 2I then I columns, over T*K rows)
    bytes = touched * 3 * H * I * weight_bytes + 2 * T * H * act_bytes   (+ block scales for FP8)

where ``touched`` is the number of distinct experts the routing selects, BW = 3.0 TB/s and PEAK
= 732 TFLOP/s (bf16) or 1288 TFLOP/s (FP8): the H100 SXM figures of the moe-plugin-cuda
performance bar (override with ``--bw`` / ``--peak-bf16`` / ``--peak-fp8``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import platform
import statistics
import sys
import time
from typing import Any, Optional

import torch

from moe_core.backends import Role
from moe_core.config import PRESETS, preset
from moe_core.contracts import QuantScheme, TopK
from moe_core.devices import local_device_kind
from moe_core.planner import PlanError, plan
from moe_core.router import balanced_correction_bias, route

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
DEFAULT_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "qwen3-235b-a22b")


def floor_model(cfg, T: int, touched: int, bw: float, peak: float) -> dict[str, float]:
    H, inter, K = cfg.hidden_size, cfg.intermediate_size, cfg.top_k
    fp8 = cfg.quant in (QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN)
    wbytes = 1 if fp8 else cfg.params_dtype.itemsize
    per_expert = 3 * H * inter * wbytes
    if cfg.quant is QuantScheme.FP8_BLOCK:  # 128x128 block scales, fp32
        per_expert += 4 * (math.ceil(2 * inter / 128) * math.ceil(H / 128) + math.ceil(H / 128) * math.ceil(inter / 128))
    elif fp8:  # per-channel scales, fp32
        per_expert += 4 * (2 * inter + H)
    nbytes = touched * per_expert + 2 * T * H * cfg.params_dtype.itemsize
    flops = 6.0 * T * K * H * inter
    return {"bytes": nbytes, "flops": flops, "floor_s": max(nbytes / bw, flops / peak)}


def _fill_weights(layer, cfg, seed: int) -> None:
    """Random weights straight into the layer's parameters, a few experts at a time (the fp32
    staging of a whole DeepSeek-V3 layer would not fit next to it)."""
    from moe_core import quant

    g = torch.Generator(device=layer.device).manual_seed(seed)
    E, H, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    tensors = layer.weight_tensors()
    step = max(1, (1 << 28) // (3 * H * inter))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        w13 = torch.randn((e1 - e0, 2 * inter, H), generator=g, device=layer.device) / math.sqrt(H)
        w2 = torch.randn((e1 - e0, H, inter), generator=g, device=layer.device) / math.sqrt(inter)
        if cfg.quant is QuantScheme.UNQUANTIZED:
            part = {"w13": w13.to(cfg.params_dtype), "w2": w2.to(cfg.params_dtype)}
        else:
            part = quant.quantize_weights(w13, w2, cfg.quant)
        for name, t in part.items():
            tensors[name].data[e0:e1].copy_(t)
    if layer.correction_bias is not None:
        layer.correction_bias.data.copy_(balanced_correction_bias(layer.correction_bias.numel(), g, layer.device))
    layer.load_weights(**{**tensors, **({"correction_bias": layer.correction_bias}
                                        if layer.correction_bias is not None else {})})
    layer.process_weights()


WARM_S = 0.2  # on a GPU each cell runs at least this long before it is timed
# ... and is timed over at least this long: five samples of a heavy cell caught a few clock states of a
# power-capped GPU (H100, qwen3-30b bf16 T=4096: the same kernels read 886-960 us across runs)
TIMED_S = 0.1


def _time(fn, device: torch.device, iters: int, warmup: int) -> list[float]:
    """Per-call times of at least ``iters`` calls (GPU: and of at least ``TIMED_S`` of calls), after
    ``warmup`` calls and (GPU) at least ``WARM_S`` of calls: a light cell timed right after a heavy one
    inherits the GPU's state (H100: qwen3-235b bf16 T=1 read 131 us right after deepseek's T=16384
    cells, 114-115 us when timed first, same kernels)."""
    warm_s = WARM_S if device.type == "cuda" else 0.0
    t0 = time.perf_counter()
    for i in itertools.count():
        if i >= warmup and time.perf_counter() - t0 >= warm_s:
            break
        fn()
        if device.type == "cuda" and i % 8 == 7:
            torch.cuda.synchronize(device)  # (wall time counts work done, not work queued)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        out = []
        while len(out) < iters or sum(out) < TIMED_S:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            out.append(a.elapsed_time(b) * 1e-3)
        return out
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


GRAPH_CALLS = 10


def _graph_time(layer, x, topk, device, iters: int) -> Optional[float]:
    """Per-call time of GRAPH_CALLS forwards captured in one CUDA graph and replayed (the method of
    vLLM's and SGLang's MoE benchmarks): one graph launch per GRAPH_CALLS calls, so the host's
    launch cost is not counted as device time, as in an engine that replays a whole model."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            layer(x, topk)
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            layer(x, topk)
    return statistics.median(_time(graph.replay, device, iters, 3)) / GRAPH_CALLS


def bench_cell(cfg, backend: str, T: int, args, device: torch.device, layer=None) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(1000 + T)
    x = torch.randn((T, cfg.hidden_size), generator=g, device=device).to(cfg.params_dtype)
    logits = torch.randn((T, cfg.num_experts), generator=g, device=device)

    topk = route(logits, cfg.top_k, cfg.router, layer.correction_bias)
    topk = TopK(topk.weights.contiguous(), topk.ids.contiguous())
    load = torch.bincount(topk.ids[topk.ids >= 0].flatten(), minlength=cfg.num_experts)
    touched = int((load > 0).sum())
    iters = args.iters if T < 4096 else max(5, args.iters // 2)
    eager = statistics.median(_time(lambda: layer(x, topk), device, iters, args.warmup))
    graph = None
    if device.type == "cuda" and layer.plan.graph_safe and not args.no_graph and T <= args.graph_max_tokens:
        try:
            graph = _graph_time(layer, x, topk, device, iters)
        except Exception as exc:  # report, keep the eager number
            print(f"    graph capture failed: {type(exc).__name__}: {exc}", file=sys.stderr)
    best = min(t for t in (eager, graph) if t is not None)
    fp8 = cfg.quant in (QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN)
    model = floor_model(cfg, T, touched, args.bw, args.peak_fp8 if fp8 else args.peak_bf16)
    return {
        "backend": backend, "T": T, "eager_us": eager * 1e6, "graph_us": None if graph is None else graph * 1e6,
        "best_us": best * 1e6, "tflops": model["flops"] / best / 1e12, "floor_us": model["floor_s"] * 1e6,
        "frac_floor": model["floor_s"] / best, "experts_touched": touched, "bytes": model["bytes"],
        # SGLang's figures assume load spread over the experts; this shows how even ours was
        "max_expert_rows": int(load.max()) if T else 0,
        "flops": model["flops"],
    }


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="moe-core bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(DEFAULT_PRESETS), choices=sorted(PRESETS))
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    p.add_argument("--quant", nargs="+", default=["unquantized", "fp8_block"],
                   choices=[q.value for q in QuantScheme])
    p.add_argument("--backends", nargs="+", default=None, help="experts backends (default: every usable one "
                   "except the reference, which is the slow oracle)")
    p.add_argument("--device", default=None, help="device kind: cuda, cpu, ... (default: this machine's)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-graph", action="store_true", help="eager timing only")
    p.add_argument("--graph-max-tokens", type=int, default=4096, help="graph-time only up to this T")
    p.add_argument("--bw", type=float, default=3.0e12)
    p.add_argument("--peak-bf16", type=float, default=732e12)
    p.add_argument("--peak-fp8", type=float, default=1288e12)
    p.add_argument("--json", default=None, help="write every result to this file")
    p.add_argument("--backend-options", default=None, help="JSON of backend_options for every layer")
    args = p.parse_args(argv)

    from moe_core.layer import MoELayer
    from moe_core.plugins import get_plugin_manager

    kind = args.device or local_device_kind()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    manager = get_plugin_manager()
    opts = json.loads(args.backend_options) if args.backend_options else {}
    names = args.backends or [s.name for s in manager.specs if s.role is Role.EXPERTS and s.name != "reference"
                              and manager.availability(s).ok and kind in s.devices]
    if not names:
        print(f"no usable experts backend on device kind {kind!r}", file=sys.stderr)
        return 1
    dev_name = torch.cuda.get_device_name() if kind == "cuda" and torch.cuda.is_available() else platform.processor()
    print(f"moe-core bench on {kind} ({dev_name}); backends: {', '.join(names)}", file=sys.stderr)
    results: list[dict[str, Any]] = []
    total = len(args.presets) * len(args.quant) * len(names) * len(args.tokens)
    done = 0
    t_start = time.time()
    for name in args.presets:
        for q in args.quant:
            for backend in names:
                cfg = preset(name, quant=q, params_dtype=dtype, device=kind, experts=backend, backend_options=opts)
                try:
                    the_plan = plan(cfg, manager=manager)
                except PlanError as exc:
                    print(f"  skip {name} {q} {backend}: {exc.summary}", file=sys.stderr)
                    done += len(args.tokens)
                    continue
                device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else None
                layer = MoELayer(cfg, plan=the_plan, check_ids=False, device=device)
                _fill_weights(layer, cfg, seed=0)
                for T in args.tokens:
                    done += 1
                    try:
                        with torch.no_grad():
                            r = bench_cell(cfg, backend, T, args, layer.device, layer)
                    except Exception as exc:
                        print(f"  [{done}/{total}] {name} {q} {backend} T={T}: FAILED {type(exc).__name__}: {exc}",
                              file=sys.stderr)
                        continue
                    r.update(preset=name, quant=q, dtype=args.dtype, plan_experts=the_plan.experts.name,
                             dispatch_dtype=str(the_plan.dispatch_dtype), graph_safe=the_plan.graph_safe)
                    results.append(r)
                    print(f"  [{done}/{total}] {time.time() - t_start:6.0f}s {name:16s} {q:11s} {backend:10s} "
                          f"T={T:<6d} {r['best_us']:10.1f} us  {r['tflops']:7.1f} TFLOP/s  "
                          f"{r['frac_floor']:.2f} of floor", file=sys.stderr, flush=True)
                del layer
                if kind == "cuda":
                    torch.cuda.empty_cache()
    print_table(results)
    auto = {}
    for name in args.presets:  # what the planner picks by default for each preset x quant
        for q in args.quant:
            try:
                auto[f"{name}/{q}"] = plan(preset(name, quant=q, params_dtype=dtype, device=kind,
                                                  backend_options=opts), manager=manager).experts.name
            except PlanError as exc:
                auto[f"{name}/{q}"] = f"none: {exc.summary}"
    if args.json:
        meta = {"device": dev_name, "device_kind": kind, "torch": torch.__version__, "argv": argv or sys.argv[1:],
                "bw": args.bw, "peak_bf16": args.peak_bf16, "peak_fp8": args.peak_fp8, "auto_plan": auto}
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def print_table(results: list[dict[str, Any]]) -> None:
    if not results:
        print("no results")
        return
    tokens = sorted({r["T"] for r in results})
    print(f"{'preset':16s} {'quant':11s} {'backend':10s} " + " ".join(f"{'T=' + str(t):>17s}" for t in tokens))
    keys = sorted({(r["preset"], r["quant"], r["backend"]) for r in results},
                  key=lambda k: (DEFAULT_PRESETS.index(k[0]) if k[0] in DEFAULT_PRESETS else 99, k[1], k[2]))
    for k in keys:
        cells = []
        for t in tokens:
            r = next((r for r in results if (r["preset"], r["quant"], r["backend"]) == k and r["T"] == t), None)
            cells.append(f"{r['best_us']:>10.0f} ({r['frac_floor']:.2f})" if r else f"{'-':>17s}")
        print(f"{k[0]:16s} {k[1]:11s} {k[2]:10s} " + " ".join(cells))
    print("cells: median microseconds (fraction of the floor)")


if __name__ == "__main__":
    sys.exit(main())
