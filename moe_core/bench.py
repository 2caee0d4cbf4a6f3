"""``moe-core bench``: time every usable experts backend through ``MoELayer`` on this machine.

For each preset x quant x T and each experts backend that plans for the config (``auto``
dispatcher, single rank), it builds a layer with random weights, routes random logits with the
preset's router, and times ``layer.forward`` (median of device-event timings, on a GPU after
``WARM_S`` of warm-up calls and over at least ``TIMED_S`` of timed ones; on CUDA also a CUDA-graph
replay when the plan is graph-safe, the best of both is reported, as SGLang's figures are). On a
CPU the presets are scaled down (``scale``, as ``moe-core demo`` does) to run in seconds.

Where the device's peaks are known (``DEVICE_PEAKS``, or given), each result also carries the
fraction of the floor::

    floor = max(bytes / BW, flops / PEAK)
    flops = 6 * T * K * H * I                        (two GEMMs, 2I then I columns, over T*K rows)
    bytes = touched * 3 * H * I * weight_bytes + 2 * T * H * act_bytes   (+ block scales for FP8)

where ``touched`` is the number of distinct experts the routing selects. Elsewhere the floor and
its fraction are left out (null), never computed from another device's figures.
"""

from __future__ import annotations

import csv
import dataclasses
import itertools
import json
import math
import os
import platform
import statistics
import time
from typing import Any, Optional, Sequence

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from moe_core.backends import Role
from moe_core.config import scaled_preset
from moe_core.contracts import QuantScheme, TopK
from moe_core.layer import MoELayer
from moe_core.planner import PlanError, plan
from moe_core.plugins import PluginManager
from moe_core.router import balanced_correction_bias, route

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)
DEFAULT_PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3", "qwen3-235b-a22b")
# on a CPU: the presets at 1/CPU_SCALE of their hidden and intermediate sizes, a few T, bf16 only
CPU_TOKENS = (1, 16, 64, 256)
CPU_SCALE = 16
# one torch thread on a CPU: steady timings on a shared machine (intra-op threads that wait on a busy core
# measured 0.08 s for a DeepSeek-V3 1/16 forward on one thread and 14 s on two, under load)
CPU_THREADS = 1
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

# (name substring, bandwidth B/s, peak bf16 FLOP/s, peak FP8 FLOP/s): the figures of moe-plugin-cuda's
# performance bar for the H100 SXM (issue #5; benchmarks/cuda/vs_bar.py scores against them); the H200 is the same
# chip with faster memory: 4.3 TB/s, 0.9 of its datasheet's 4.8 as 3.0 is of the H100's 3.35 (device-to-device copies
# measured 4.2-4.3 TB/s read + written on the lent H200s: benchmarks/cuda/results/decode-h200-2026-11-29.md)
DEVICE_PEAKS = (("H100", 3.0e12, 732e12, 1288e12), ("H200", 4.3e12, 732e12, 1288e12))


def device_peaks(device_name: str) -> tuple[Optional[float], Optional[float], Optional[float]]:
    """(bandwidth, peak bf16, peak FP8) of a known device; Nones elsewhere (no floor is made up)."""
    for needle, bw, bf16, fp8 in DEVICE_PEAKS:
        if needle in device_name:
            return bw, bf16, fp8
    return None, None, None


def floor_model(cfg, T: int, touched: int, bw: Optional[float], peak: Optional[float]) -> dict[str, Any]:
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
    floor = max(nbytes / bw, flops / peak) if bw and peak else None
    return {"bytes": nbytes, "flops": flops, "floor_s": floor}


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


def bench_cell(cfg, backend: str, T: int, settings: "Settings", device: torch.device, layer) -> dict[str, Any]:
    g = torch.Generator(device=device).manual_seed(1000 + T)
    x = torch.randn((T, cfg.hidden_size), generator=g, device=device).to(cfg.params_dtype)
    logits = torch.randn((T, cfg.num_experts), generator=g, device=device)
    topk = route(logits, cfg.top_k, cfg.router, layer.correction_bias)
    topk = TopK(topk.weights.contiguous(), topk.ids.contiguous())
    load = torch.bincount(topk.ids[topk.ids >= 0].flatten(), minlength=cfg.num_experts)
    touched = int((load > 0).sum())
    iters = settings.iters if T < 4096 else max(5, settings.iters // 2)
    eager = statistics.median(_time(lambda: layer(x, topk), device, iters, settings.warmup))
    graph, graph_error = None, None
    if device.type == "cuda" and layer.plan.graph_safe and settings.graph and T <= settings.graph_max_tokens:
        try:
            graph = _graph_time(layer, x, topk, device, iters)
        except Exception as exc:  # report, keep the eager number
            graph_error = f"graph capture failed: {type(exc).__name__}: {exc}"
    best = min(t for t in (eager, graph) if t is not None)
    fp8 = cfg.quant in (QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN)
    model = floor_model(cfg, T, touched, settings.bw, settings.peak_fp8 if fp8 else settings.peak_bf16)
    floor = model["floor_s"]
    return {
        "backend": backend, "T": T, "eager_us": eager * 1e6, "graph_us": None if graph is None else graph * 1e6,
        "best_us": best * 1e6, "tflops": model["flops"] / best / 1e12,
        "floor_us": None if floor is None else floor * 1e6, "frac_floor": None if floor is None else floor / best,
        "experts_touched": touched, "bytes": model["bytes"], "graph_error": graph_error,
        # SGLang's figures assume load spread over the experts; this shows how even ours was
        "max_expert_rows": int(load.max()) if T else 0,
        "flops": model["flops"],
    }




def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def device_name(kind: str) -> str:
    if kind == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    if kind == "cpu":
        threads = torch.get_num_threads()
    return f"{cpu_name()}, {os.cpu_count()} cores, {threads} torch thread{'s' if threads > 1 else ''}"
    return kind


@dataclasses.dataclass
class Settings:
    """What to time and how; ``for_device`` fills the defaults of the device kind."""

    kind: str
    device_name: str
    presets: tuple[str, ...]
    tokens: tuple[int, ...]
    quants: tuple[str, ...]
    backends: tuple[str, ...]  # empty: every usable experts backend
    scale: int
    dtype: str
    iters: int
    warmup: int
    graph: bool
    graph_max_tokens: int
    bw: Optional[float]
    peak_bf16: Optional[float]
    peak_fp8: Optional[float]
    backend_options: dict[str, Any]
    json_path: str
    threads: int
    argv: Sequence[str] = ()

    @classmethod
    def for_device(cls, kind: str, *, presets: Sequence[str] = (), tokens: Sequence[int] = (),
                   quants: Sequence[str] = (), backends: Sequence[str] = (), scale: Optional[int] = None,
                   iters: Optional[int] = None, bw: Optional[float] = None, peak_bf16: Optional[float] = None,
                   peak_fp8: Optional[float] = None, json_path: Optional[str] = None, threads: Optional[int] = None,
                   warmup: Optional[int] = None, **rest: Any) -> "Settings":
        cpu = kind == "cpu"
        threads = threads or (CPU_THREADS if cpu else torch.get_num_threads())
        torch.set_num_threads(threads)
        name = device_name(kind)
        known = device_peaks(name)
        return cls(
            kind=kind, device_name=name, presets=tuple(presets) or DEFAULT_PRESETS,
            tokens=tuple(tokens) or (CPU_TOKENS if cpu else DEFAULT_TOKENS),
            quants=tuple(quants) or (("unquantized",) if cpu else ("unquantized", "fp8_block")),
            backends=tuple(backends), scale=scale or (CPU_SCALE if cpu else 1), iters=iters or (5 if cpu else 20),
            warmup=(2 if cpu else 3) if warmup is None else warmup, threads=threads,
            bw=bw or known[0], peak_bf16=peak_bf16 or known[1], peak_fp8=peak_fp8 or known[2],
            json_path=json_path or f"moe-core-bench-{kind}-{time.strftime('%Y%m%d-%H%M%S')}.json", **rest)


def _backend_names(settings: Settings, manager: PluginManager) -> list[str]:
    if settings.backends:
        return list(settings.backends)
    # the reference is the slow oracle on an accelerator; on a CPU it is what `auto` picks
    return [s.name for s in manager.specs if s.role in (Role.EXPERTS, Role.FUSED) and manager.availability(s).ok
            and settings.kind in s.devices and (settings.kind == "cpu" or s.name != "reference")]


def run(settings: Settings, manager: PluginManager, log: Console, out: Console) -> int:
    """Time every cell; print the table to ``out`` and progress to ``log``; write JSON, CSV and PNG.
    Returns the exit status (1 when no backend is usable here or no cell ran)."""
    names = _backend_names(settings, manager)
    if not names:
        log.print(f"no usable experts backend on device kind {settings.kind!r} (see `moe-core backends`)")
        return 1
    dtype = DTYPES[settings.dtype]
    size = "" if settings.scale == 1 else f", sizes 1/{settings.scale}"
    peaks = (f"floor from BW {settings.bw / 1e12:.2f} TB/s, bf16 {settings.peak_bf16 / 1e12:.0f} / FP8 "
             f"{settings.peak_fp8 / 1e12:.0f} TFLOP/s" if settings.bw and settings.peak_bf16 and settings.peak_fp8
             else "no floor: this device's peaks are unknown (give --bw and --peak-bf16/--peak-fp8)")
    log.print(f"moe-core bench on {settings.kind} ({settings.device_name}); backends: {', '.join(names)}{size}; "
              f"{peaks}")
    device = torch.device("cuda", torch.cuda.current_device()) if settings.kind == "cuda" else None
    results: list[dict[str, Any]] = []
    total = len(settings.presets) * len(settings.quants) * len(names) * len(settings.tokens)
    done = 0
    t_start = time.time()
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
               TextColumn("ETA"), TimeRemainingColumn())
    with Progress(*columns, console=log, transient=True) as progress:
        task = progress.add_task("cells", total=total)
        for name in settings.presets:
            for q in settings.quants:
                for backend in names:
                    cfg = scaled_preset(name, settings.scale, quant=q, params_dtype=dtype, device=settings.kind,
                                        experts=backend, backend_options=settings.backend_options)
                    try:
                        the_plan = plan(cfg, manager=manager)
                    except PlanError as exc:
                        log.print(f"  skip {name} {q} {backend}: {exc.summary}")
                        done += len(settings.tokens)
                        progress.advance(task, len(settings.tokens))
                        continue
                    progress.update(task, description=f"{name} {q} {backend}")
                    layer = MoELayer(cfg, plan=the_plan, check_ids=False, device=device)
                    _fill_weights(layer, cfg, seed=0)
                    for T in settings.tokens:
                        done += 1
                        try:
                            with torch.no_grad():
                                r = bench_cell(cfg, backend, T, settings, layer.device, layer)
                        except Exception as exc:
                            log.print(f"  [{done}/{total}] {name} {q} {backend} T={T}: FAILED "
                                      f"{type(exc).__name__}: {exc}")
                            progress.advance(task)
                            continue
                        r.update(preset=name, quant=q, dtype=settings.dtype, plan_experts=the_plan.experts.name,
                                 dispatch_dtype=str(the_plan.dispatch_dtype), graph_safe=the_plan.graph_safe,
                                 hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size)
                        results.append(r)
                        floor = "" if r["frac_floor"] is None else f"  {r['frac_floor']:.2f} of floor"
                        elapsed = time.time() - t_start
                        eta = elapsed / done * (total - done)
                        log.print(f"  [{done}/{total}] {elapsed:6.0f}s ETA {eta:4.0f}s {name:16s} {q:11s} "
                                  f"{backend:10s} T={T:<6d} {r['best_us']:10.1f} us  {_rate(r['flops'], r['best_us'])}"
                                  f"{floor}" + (f"  ({r['graph_error']})" if r["graph_error"] else ""))
                        progress.advance(task)
                    del layer
                    if settings.kind == "cuda":
                        torch.cuda.empty_cache()
    out.print(results_table(results, settings))
    auto = {}
    for name in settings.presets:  # what the planner picks by default for each preset x quant
        for q in settings.quants:
            try:
                auto[f"{name}/{q}"] = plan(scaled_preset(name, settings.scale, quant=q, params_dtype=dtype,
                                                         device=settings.kind,
                                                         backend_options=settings.backend_options),
                                           manager=manager).experts.name
            except PlanError as exc:
                auto[f"{name}/{q}"] = f"none: {exc.summary}"
    meta = {"device": settings.device_name, "device_kind": settings.kind, "torch": torch.__version__,
            "argv": list(settings.argv), "bw": settings.bw, "peak_bf16": settings.peak_bf16,
            "peak_fp8": settings.peak_fp8, "scale": settings.scale, "auto_plan": auto}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    stem = os.path.splitext(settings.json_path)[0]
    with open(settings.json_path, "w") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    write_csv(results, stem + ".csv")
    written = [settings.json_path, stem + ".csv"]
    try:
        write_plot(results, settings, stem + ".png")
        written.append(stem + ".png")
    except ImportError:
        log.print("no plot: matplotlib is not installed (pip install 'moe-core[plot]')")
    log.print(f"wrote {', '.join(written)}")
    return 0 if results else 1


def _rate(flops: float, us: float) -> str:
    rate = flops / us * 1e6
    return f"{rate / 1e12:7.1f} TFLOP/s" if rate >= 1e12 else f"{rate / 1e9:7.2f} GFLOP/s"


def _preset_order(name: str) -> tuple[int, str]:
    return (DEFAULT_PRESETS.index(name) if name in DEFAULT_PRESETS else len(DEFAULT_PRESETS), name)


def results_table(results: list[dict[str, Any]], settings: Settings) -> Table:
    """Median microseconds per preset x quant x backend and T (with the fraction of the floor where known)."""
    floor = any(r["frac_floor"] is not None for r in results)
    title = "median us" + (" (fraction of the floor)" if floor else "") + f" on {settings.device_name}"
    table = Table(title=title, title_justify="left", box=None, header_style="bold")
    for column in ("preset", "quant", "backend"):
        table.add_column(column, no_wrap=True)
    tokens = sorted({r["T"] for r in results})
    for t in tokens:
        table.add_column(f"T={t}", justify="right", no_wrap=True)
    keys = sorted({(r["preset"], r["quant"], r["backend"]) for r in results},
                  key=lambda k: (_preset_order(k[0]), k[1], k[2]))
    by_key = {(r["preset"], r["quant"], r["backend"], r["T"]): r for r in results}
    for k in keys:
        cells = []
        for t in tokens:
            r = by_key.get((*k, t))
            if r is None:
                cells.append("-")
            else:
                cells.append(f"{r['best_us']:.0f}" + ("" if r["frac_floor"] is None else f" ({r['frac_floor']:.2f})"))
        table.add_row(*k, *cells)
    if not results:
        table.add_row("no results", "", "")
    return table


CSV_COLUMNS = ("preset", "quant", "backend", "T", "best_us", "eager_us", "graph_us", "tflops", "floor_us",
               "frac_floor", "experts_touched", "max_expert_rows", "bytes", "flops", "dtype", "plan_experts",
               "dispatch_dtype", "graph_safe", "hidden_size", "intermediate_size")


def write_csv(results: list[dict[str, Any]], path: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(results)


def write_plot(results: list[dict[str, Any]], settings: Settings, path: str) -> None:
    """Time against T per preset x quant, one line per backend (log-log). Raises ImportError without
    matplotlib (the optional extra ``moe-core[plot]``)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    panels = sorted({(r["preset"], r["quant"]) for r in results}, key=lambda k: (_preset_order(k[0]), k[1]))
    cols = min(len(panels), 4) or 1
    rows = max(1, math.ceil(len(panels) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3.2 * rows), squeeze=False)
    for ax, (name, q) in zip(axes.flat, panels, strict=False):
        for backend in sorted({r["backend"] for r in results if (r["preset"], r["quant"]) == (name, q)}):
            cells = sorted((r["T"], r["best_us"]) for r in results if (r["preset"], r["quant"], r["backend"]) ==
                           (name, q, backend))
            ax.plot([c[0] for c in cells], [c[1] for c in cells], marker="o", label=backend)
        ax.set(xscale="log", yscale="log", title=f"{name} {q}", xlabel="tokens", ylabel="median us")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    scale = "" if settings.scale == 1 else f", sizes 1/{settings.scale}"
    fig.suptitle(f"moe-core bench on {settings.kind} ({settings.device_name}{scale})", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
