"""Where the host time of one MoE forward goes at decode sizes, per CUDA experts backend (issue 31, item 1).

    python benchmarks/cuda/host_time.py [--presets ...] [--quant unquantized fp8_block] [--tokens 1 16 64]
        [--backends triton cutlass grouped_mm] [--iters 50] [--sections] [--json out.json]

Each cell (preset x quant x backend x T) is a ``MoELayer`` planned with that experts backend, random
weights and routing as ``moe-core bench`` makes them, ``check_ids`` off (as engines run it; ``--check-ids``
turns it on). Columns, per forward:

  host_us      median CPU time of ``layer(x, topk)`` with the GPU idle (synchronized before the call, not
               inside it: launches are asynchronous, so this is what the host spends issuing the work)
  prof_cpu_us  torch.profiler's CPU time of the same call (a ``record_function`` around it; the profiler
               adds its own cost)
  launches     device kernels the call ran (the profiler's device events; memsets and copies included)
  gpu_us       the sum of those kernels' device times (calls back to back, so the GPU keeps its clocks)
  syncs        host-device synchronizations (``torch.cuda.set_sync_debug_mode``'s warnings)
  direct       of the Triton launches per forward (host_us's calls), those replayed (``moe_plugin_cuda.triton.replay``:
               the forward's launches recorded once per shape, issued again with new pointers) or made by
               ``moe_plugin_cuda.triton.launch`` straight through the compiled kernel's launcher (the rest went through
               ``kernel[grid]``)

``--device cpu-emulated``: the same cells on the CPU, the layer planned for the H100 (its tuned tables, so the
same path as there), weights allocated but never read, every Triton launch going through an emulated compiled
launcher that logs and returns (``plugins/cuda/tests/emulation/triton_launch_emulation.py``, ``execute=False``): the
host's Python of a forward, before/after comparable off the device (the launches' own cost in Triton's launcher
and the driver, and the CUDA caching allocator, are not in it). Only host_us (median and, on a shared CPU, the
10th percentile ``host_us_p10``; ``host_best_us``: the least mean of ``iters / 10`` batches of 10 calls, as
timeit's best of repeats, the steadiest on a shared CPU) and the sections are measured there.

``--sections``: the calls again with ``perf_counter`` timers around the pipeline's pieces (the layer's
stages, the backends' launchers, each Triton kernel's launch by kernel name (``launch NAME``: through
``moe_plugin_cuda.triton.launch``, direct or not; ``triton launch NAME``: through ``JITFunction.run``), TMA
descriptors, ``torch.empty``): inclusive host time per forward, nested pieces counted in their callers too. Timers
add about a microsecond each, so read the pieces against each other, not against ``host_us``.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import time
import warnings
from typing import Any, Callable, Optional

import torch

from moe_core import MoELayer
from moe_core.bench import _fill_weights  # noqa: PLC2701 (the bench's own weight filling, not a copy)
from moe_core.config import MoEConfig, preset
from moe_core.contracts import TopK
from moe_core.planner import PlanError, plan
from moe_core.router import route

PRESETS = ("mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3")
BACKENDS = ("triton", "cutlass", "grouped_mm")


# ------------------------------------------------------------------ cells (decode.py builds them the same way)


def build_layer(cfg: MoEConfig, device: torch.device, check_ids: bool = False) -> MoELayer:
    """A layer planned for ``cfg`` (``PlanError`` if its experts backend cannot run it), weights filled."""
    layer = MoELayer(cfg, plan=plan(cfg), check_ids=check_ids, device=device)
    _fill_weights(layer, cfg, seed=0)
    return layer


def make_inputs(cfg: MoEConfig, layer: MoELayer, T: int) -> tuple[torch.Tensor, TopK, int]:
    """(hidden states, routing, experts touched) for T tokens: random, routed by the preset's router."""
    g = torch.Generator(device=layer.device).manual_seed(1000 + T)
    x = torch.randn((T, cfg.hidden_size), generator=g, device=layer.device).to(cfg.params_dtype)
    logits = torch.randn((T, cfg.num_experts), generator=g, device=layer.device)
    topk = route(logits, cfg.top_k, cfg.router, layer.correction_bias)
    topk = TopK(topk.weights.contiguous(), topk.ids.contiguous())
    touched = int(torch.unique(topk.ids[topk.ids >= 0]).numel())
    return x, topk, touched


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


WARM_S = 0.3  # seconds of calls before timing: host caches and clocks (one run read 1.5-3x colder without it)


def warm_up(fn: Callable[[], Any], device: torch.device) -> None:
    """At least 3 calls and WARM_S seconds of them (compiles, caches, CPU and GPU clocks)."""
    t0, i = time.perf_counter(), 0
    while i < 3 or time.perf_counter() - t0 < WARM_S:
        fn()
        i += 1
        if i % 8 == 0:
            sync(device)
    sync(device)


def host_times(fn: Callable[[], Any], device: torch.device, iters: int) -> list[float]:
    """Seconds the host spends in ``fn()`` with the device idle at the start of each call."""
    out = []
    for _ in range(iters):
        sync(device)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    sync(device)
    return out


# ------------------------------------------------------------------ profiler


def profile(fn: Callable[[], Any], device: torch.device, iters: int) -> dict[str, float]:
    """Per call of ``fn``: the profiler's CPU time, device kernels and their summed device time. The calls
    run back to back: with a sync before each, the H100 idled long enough between them to drop its clocks
    (kernel times 3x their graph-replay times on 2026-11-25)."""
    from torch.profiler import ProfilerActivity, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(iters):
            with record_function("moe_forward"):
                fn()
        sync(device)
    cpu, kernels, gpu = 0.0, 0, 0.0
    for evt in prof.events():
        if evt.device_type == torch.autograd.DeviceType.CPU and evt.name == "moe_forward":
            cpu += evt.time_range.elapsed_us()
        elif evt.device_type != torch.autograd.DeviceType.CPU:
            kernels += 1
            gpu += evt.time_range.elapsed_us()
    return {"prof_cpu_us": cpu / iters, "launches": kernels / iters, "gpu_us": gpu / iters}


def count_syncs(fn: Callable[[], Any], device: torch.device) -> int:
    """Synchronizing calls in one ``fn()`` (those torch's sync debug mode reports)."""
    if device.type != "cuda":
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# ------------------------------------------------------------------ sections


class Sections:
    """``perf_counter`` timers patched around named callables; inclusive microseconds per name."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = collections.defaultdict(list)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, name: str, fn: Callable) -> Callable:
        times = self.times[name]

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append((time.perf_counter() - t0) * 1e6)
        return timed

    def patch(self, owner: Any, attr: str, name: Optional[str] = None) -> None:
        if not hasattr(owner, attr):
            return
        old = getattr(owner, attr)
        setattr(owner, attr, self.wrap(name or attr, old))
        self._undo.append(lambda: setattr(owner, attr, old))

    def patch_launcher(self, owner: Any) -> None:
        """``owner.launch`` (``moe_plugin_cuda.triton.launch.launch``, as a module imported it), timed by kernel name:
        the direct launches and the ``kernel[grid]`` ones alike."""
        if not hasattr(owner, "launch"):
            return
        old = owner.launch
        sections = self

        def launch(kernel, grid, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return old(kernel, grid, *args, **kwargs)
            finally:
                sections.times[f"launch {kernel.fn.__name__}"].append((time.perf_counter() - t0) * 1e6)
        owner.launch = launch
        self._undo.append(lambda: setattr(owner, "launch", old))

    def patch_triton_launches(self) -> None:
        """Every Triton kernel launch through ``JITFunction.run`` (``kernel[grid]``), timed by kernel name."""
        from triton.runtime.jit import JITFunction

        old = JITFunction.run
        sections = self

        def run(self, *args, **kwargs):
            t0 = time.perf_counter()
            try:
                return old(self, *args, **kwargs)
            finally:
                sections.times[f"triton launch {self.fn.__name__}"].append((time.perf_counter() - t0) * 1e6)
        JITFunction.run = run
        self._undo.append(lambda: setattr(JITFunction, "run", old))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()

    def table(self, calls: int) -> list[dict[str, Any]]:
        rows = [{"section": k, "per_forward": len(v) / calls, "us_per_forward": sum(v) / calls}
                for k, v in self.times.items() if v]
        return sorted(rows, key=lambda r: -r["us_per_forward"])


def instrument(layer: MoELayer, sections: Sections) -> None:
    """Timers around the layer's stages and the CUDA plugin's pipeline pieces."""
    for stage in ("_dispatch", "_apply_experts", "_combine", "_fused_forward", "_apply_tokens"):
        if getattr(layer, stage, None) is not None:
            setattr(layer, stage, sections.wrap(f"layer.{stage[1:]}", getattr(layer, stage)))
    try:
        from moe_plugin_cuda.triton import ops as triton_ops
    except ImportError:  # no triton: the other pieces still are timed
        triton_ops = None
    if triton_ops is not None:
        for fn in ("fused_experts", "align_block_size", "expert_rows", "quantize_fp8_groups", "gemm1", "gemm2",
                   "_a_descriptor", "_b_descriptor"):
            sections.patch(triton_ops, fn, f"triton_ops.{fn}")
        sections.patch_launcher(triton_ops)
        sections.patch_triton_launches()
        for program in getattr(layer.experts, "_programs", {}).values():  # (the recorded calls' launches)
            if program is not None:
                sections.patch(program, "run", "replay.Program.run")
    try:
        from moe_plugin_cuda.cutlass import experts as cutlass_experts
        from moe_plugin_cuda.cutlass import ops as cutlass_ops
    except ImportError:
        cutlass_experts = cutlass_ops = None
    if cutlass_experts is not None:
        for fn in ("run_fused", "choose_path"):
            sections.patch(cutlass_experts, fn, f"cutlass_experts.{fn}")
        for fn in ("fused_experts", "quantize_into_rows", "_experts"):
            sections.patch(cutlass_ops, fn, f"cutlass_ops.{fn}")
        sections.patch_launcher(cutlass_ops)
    from moe_plugin_cuda import grouped_mm

    sections.patch(grouped_mm, "grouped_mm_experts", "grouped_mm.grouped_mm_experts")
    sections.patch(torch, "empty", "torch.empty")


# ------------------------------------------------------------------ main


def trace(fn: Callable[[], Any], device: torch.device, path: str, calls: int = 5) -> None:
    """A chrome trace (``path``, gzipped) of ``calls`` calls, each from an idle device, with Python frames
    (``with_stack``): where the host time of one call goes, function by function, next to its kernels."""
    import gzip
    import shutil

    from torch.profiler import ProfilerActivity

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with torch.profiler.profile(activities=activities, with_stack=True) as prof:
        for _ in range(calls):
            sync(device)
            fn()
        sync(device)
    prof.export_chrome_trace(path)
    with open(path, "rb") as f, gzip.open(path + ".gz", "wb") as g:
        shutil.copyfileobj(f, g)
    os.remove(path)


class _Patches:
    """``setattr`` with undo (what the launch emulation's ``install`` takes as its monkeypatch)."""

    def __init__(self) -> None:
        self._undo: list[Callable[[], None]] = []

    def setattr(self, owner: Any, name: str, value: Any) -> None:
        old = getattr(owner, name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old))

    def undo(self) -> None:
        while self._undo:
            self._undo.pop()()


H100 = "NVIDIA H100 80GB HBM3"


def emulate_h100(patches: _Patches) -> None:
    """The CPU made to plan and launch as the H100 does (``--device cpu-emulated``): the CUDA backends available,
    the H100's tuned tables, Triton's compiled launchers emulated without running the kernels."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(here, "..", "..", "plugins", "cuda", "tests", "emulation"))
    os.environ["TRITON_INTERPRET"] = "1"  # (the emulation runs the interpreter's kernels; none runs here)
    import triton_launch_emulation
    from moe_plugin_cuda import probes
    from moe_plugin_cuda.cutlass import experts as cutlass_experts
    from moe_plugin_cuda.cutlass import lib as cutlass_lib

    from moe_core.backends import available

    triton_launch_emulation.install(patches, execute=False)
    patches.setattr(probes, "probe_cutlass", lambda: available("emulated"))
    patches.setattr(probes, "probe_triton", lambda: available("emulated"))
    patches.setattr(cutlass_lib, "library", lambda *a, **k: None)
    patches.setattr(cutlass_experts, "_device_name", lambda index: H100)


def build_emulated_layer(cfg: MoEConfig) -> MoELayer:
    """``cfg`` (a CUDA config) planned as on the H100 and built on the CPU, its weights allocated (untouched pages:
    never read) and marked processed as ``process_weights`` leaves them."""
    import dataclasses

    layer = MoELayer(cfg, plan=dataclasses.replace(plan(cfg, dry_run=True), dry_run=False), check_ids=False,
                     device=torch.device("cpu"))
    if hasattr(layer.experts, "_device_name"):  # (the triton experts read it from the device)
        layer.experts._device_name = H100
    layer._loaded = True
    layout = getattr(layer.experts, "w13_layout", None)
    if layout is not None and cfg.quant.value == "unquantized":
        layout.mark(layer.w13)  # (as if interleaved: the values are never read)
    layer.process_weights()
    return layer


def graph_eager_cell(layer: MoELayer, x: torch.Tensor, topk: TopK, iters: int) -> dict[str, Any]:
    """The design question of an eager forward replaying a CUDA graph of the whole layer (``--graph-eager``): the
    inputs copied into the graph's static buffers, the graph replayed, the output cloned (the caller keeps it).
    Host time per such call (as host_us) and its device time (back to back, the profiler's kernels and copies)."""
    xs, ws, ids = x.clone(), topk.weights.clone(), topk.ids.clone()
    static = TopK(ws, ids)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            layer(xs, static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = layer(xs, static)

    def call():
        xs.copy_(x)
        ws.copy_(topk.weights)
        ids.copy_(topk.ids)
        graph.replay()
        return ys.clone()

    warm_up(call, x.device)
    host = host_times(call, x.device, iters)
    want = layer(x, topk)
    got = call()
    sync(x.device)
    prof = profile(call, x.device, max(5, iters // 5))
    return {"graph_eager_host_us": statistics.median(host) * 1e6, "graph_eager_gpu_us": prof["gpu_us"],
            "graph_eager_launches": prof["launches"], "graph_eager_equal": bool(torch.equal(got, want))}


def measure_cell(layer: MoELayer, x: torch.Tensor, topk: TopK, iters: int, with_sections: bool,
                 trace_path: Optional[str] = None, host_only: bool = False, graph_eager: bool = False
                 ) -> dict[str, Any]:
    dev = layer.device

    def call():
        return layer(x, topk)

    try:
        from moe_plugin_cuda.triton.launch import stats as launch_stats
    except ImportError:
        launch_stats = {"direct": 0, "triton": 0, "replayed": 0}
    with torch.no_grad():
        warm_up(call, dev)
        before = dict(launch_stats)
        host = host_times(call, dev, iters)
        row: dict[str, Any] = {"host_us": statistics.median(host) * 1e6, "host_us_min": min(host) * 1e6,
                               "host_us_p10": sorted(host)[len(host) // 10] * 1e6,
                               **{f"{k}_launches": (launch_stats[k] - before[k]) / iters for k in before}}
        if host_only:  # (a shared CPU: the least mean of many short batches, as timeit's best of repeats)
            batches = []
            for _ in range(max(20, iters // 10)):
                t0 = time.perf_counter()
                for _ in range(10):
                    call()
                batches.append((time.perf_counter() - t0) / 10 * 1e6)
            row["host_best_us"] = min(batches)
            row.update(prof_cpu_us=float("nan"), launches=row["replayed_launches"] + row["direct_launches"]
                       + row["triton_launches"], gpu_us=float("nan"), syncs=0)
        else:
            row.update(profile(call, dev, max(5, iters // 5)))
            row["syncs"] = count_syncs(call, dev)
        if graph_eager and dev.type == "cuda":
            try:
                row.update(graph_eager_cell(layer, x, topk, iters))
            except Exception as exc:  # (the cell's own numbers stand)
                print(f"<!--   graph eager FAILED: {type(exc).__name__}: {exc} -->", flush=True)
        if trace_path:
            trace(call, dev, trace_path)
        if with_sections:
            sections = Sections()
            saved = {k: getattr(layer, k) for k in ("_dispatch", "_apply_experts", "_combine", "_fused_forward",
                                                    "_apply_tokens") if hasattr(layer, k)}
            instrument(layer, sections)
            try:
                call()
                sync(dev)
                for times in sections.times.values():  # (the timers hold these lists)
                    times.clear()
                for _ in range(iters):
                    sync(dev)
                    call()
                sync(dev)
            finally:
                sections.undo()
                for k, v in saved.items():
                    setattr(layer, k, v)
            row["sections"] = sections.table(iters)
    return row


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--quant", nargs="+", default=["unquantized", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--backends", nargs="+", default=list(BACKENDS))
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--sections", nargs="*", type=int, default=None, metavar="T",
                   help="also time the pipeline's pieces (at these T; none given: at every T)")
    p.add_argument("--check-ids", action="store_true", help="the layer's expert-id check on (its default in eager)")
    p.add_argument("--triton-launch", action="store_true",
                   help="every Triton launch through kernel[grid], none direct (the launcher's baseline)")
    p.add_argument("--no-replay", action="store_true",
                   help="no forward's launches recorded and replayed (each one through the direct launcher: the "
                        "replay's baseline)")
    p.add_argument("--json", default=None)
    p.add_argument("--graph-eager", action="store_true",
                   help="also the host and device time of an eager call replaying a CUDA graph of the layer (inputs "
                        "copied in, output cloned): graph_eager_* (a design measurement)")
    p.add_argument("--traces", default=None, metavar="DIR",
                   help="also a chrome trace with Python frames per cell (DIR/host-<preset>-<quant>-<backend>-<T>.json.gz)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu", "cpu-emulated"),
                   help="cpu: the machinery on the reference backend (a check); cpu-emulated: the H100's plan on the "
                        "CPU, Triton launches emulated and not run (the host's Python, see above)")
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("host_time.py needs a CUDA device (or --device cpu)", file=sys.stderr)
        return 1
    emulated = args.device == "cpu-emulated"
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    patches = _Patches()
    if emulated:
        emulate_h100(patches)
    if args.triton_launch:
        from moe_plugin_cuda.triton import launch

        launch.enabled = False
    if args.no_replay:
        from moe_plugin_cuda.triton import replay

        replay.enabled = False
    if args.traces:
        os.makedirs(args.traces, exist_ok=True)
    rows = []
    print("| preset | quant | backend | T | host_us | prof_cpu_us | launches | gpu_us | syncs | direct |\n"
          "|---|---|---|---|---|---|---|---|---|---|", flush=True)
    for name in args.presets:
        for q in args.quant:
            for backend in args.backends:
                cfg = preset(name, quant=q, device="cuda" if emulated else args.device, experts=backend)
                try:
                    layer = build_emulated_layer(cfg) if emulated else build_layer(cfg, device, args.check_ids)
                except PlanError as exc:
                    print(f"<!-- skip {name} {q} {backend}: {exc.summary} -->", flush=True)
                    continue
                except RuntimeError as exc:  # (emulated: the CPU could not allocate the weights)
                    print(f"<!-- skip {name} {q} {backend}: {type(exc).__name__}: {exc} -->", flush=True)
                    continue
                for T in args.tokens:
                    x, topk, _ = make_inputs(cfg, layer, T)
                    sections = args.sections is not None and (not args.sections or T in args.sections)
                    trace_path = (os.path.join(args.traces, f"host-{name}-{q}-{backend}-{T}.json")
                                  if args.traces else None)
                    try:
                        r = {"preset": name, "quant": q, "backend": backend, "T": T,
                             **measure_cell(layer, x, topk, args.iters, sections, trace_path, host_only=emulated,
                                          graph_eager=args.graph_eager)}
                    except Exception as exc:  # report the cell, keep the others
                        print(f"<!-- {name} {q} {backend} T={T} FAILED: {type(exc).__name__}: {exc} -->", flush=True)
                        continue
                    rows.append(r)
                    print(f"| {name} | {q} | {backend} | {T} | {r['host_us']:.1f} | {r['prof_cpu_us']:.1f} | "
                          f"{r['launches']:g} | {r['gpu_us']:.1f} | {r['syncs']} | "
                          f"{r.get('replayed_launches', 0) + r['direct_launches']:g}/"  # (BASE: no replays)
                          f"{r.get('replayed_launches', 0) + r['direct_launches'] + r['triton_launches']:g} |",
                          flush=True)
                    if "graph_eager_host_us" in r:
                        print(f"<!--   graph eager: host {r['graph_eager_host_us']:.1f} us, gpu {r['graph_eager_gpu_us']:.1f} "
                              f"us, {r['graph_eager_launches']:g} device ops, equal {r['graph_eager_equal']} -->", flush=True)
                    if emulated:
                        print(f"<!--   host_us p10 {r['host_us_p10']:.1f} min {r['host_us_min']:.1f} best batch "
                              f"{r['host_best_us']:.1f} -->", flush=True)
                    for s in r.get("sections", []):
                        print(f"<!--   {s['section']:40s} x{s['per_forward']:<4g} {s['us_per_forward']:8.1f} us -->",
                              flush=True)
                del layer
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    if args.json:
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else args.device, "torch": torch.__version__, "argv": sys.argv[1:],
                "check_ids": args.check_ids, "direct_launch": not args.triton_launch, "replay": not args.no_replay}
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
