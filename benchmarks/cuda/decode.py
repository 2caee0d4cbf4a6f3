"""Decode-size MoE benchmark (issue 31, item 3): graph, eager, host time and the memory floor per cell.

    python benchmarks/cuda/decode.py [--presets ...] [--quant unquantized fp8_block] [--tokens 1 16 64]
        [--backends auto triton cutlass] [--out-dir benchmarks/cuda/results] [--date YYYY-MM-DD]
    python benchmarks/cuda/decode.py --cpu-smoke --out-dir DIR      (tiny sizes, reference backend, CPU: CI)

Each cell (preset x quant x T x backend; ``auto`` = the planner's pick, reported under its name) is a
``MoELayer`` with random weights and routing as ``moe-core bench`` makes them, ``check_ids`` off:

  graph_us  GRAPH_CALLS forwards captured in one CUDA graph, replayed; device time per forward (median)
  eager_us  one forward from an idle GPU with L2 flushed before it (a 256 MB write, then a sync): device
            events around the call, so a forward whose host issues its launches slower than the GPU
            runs them is timed at the host's pace, as an engine without graphs sees it (median)
  host_us   CPU time of the forward with the GPU idle (launches are asynchronous; median)
  floor_us  the memory floor: bytes of the touched experts' weights (+ FP8 block scales) and of the
            activations in and out at the device's bandwidth in ``moe_core.bench.DEVICE_PEAKS`` (H100 3.0 TB/s,
            H200 4.3; ``--bw`` overrides), or the FLOP floor if that is higher (``moe_core.bench.floor_model``)

``--own-tables-only`` ignores the tables of a stand-in device (``tuning_configs.TABLE_STAND_INS``: an H200 reads
the H100's): what the device runs on the untuned heuristics. The report also gives a device-to-device copy's
bandwidth measured at the start (bytes read and written), next to the floor's figure.

Writes ``decode-<gpu>-<date>.json`` (a list of rows {"preset", "quant", "T", "backend", "graph_us",
"eager_us", "host_us", "floor_us"}; ``graph_us`` null where there is no graph) and the same as a
markdown table (``.md``, with the device, versions and command) under ``--out-dir``. ``--warm-only``
runs every cell once without timing (fills Triton's kernel cache, e.g. in parallel processes).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from host_time import PRESETS, build_layer, host_times, make_inputs, sync, warm_up  # noqa: E402

from moe_core.bench import DEVICE_PEAKS, device_peaks, floor_model  # noqa: E402
from moe_core.config import MoEConfig, RouterConfig, preset  # noqa: E402
from moe_core.contracts import QuantScheme  # noqa: E402
from moe_core.planner import PlanError, plan  # noqa: E402

GRAPH_CALLS = 20  # forwards per captured graph
FLUSH_BYTES = 256 << 20  # > 4x the H200's 60 MB L2
# --cpu-smoke: a layer small enough for the reference backend on a CI machine
SMOKE = dict(num_experts=8, top_k=2, hidden_size=256, intermediate_size=128,
             router=RouterConfig(scoring="softmax", renormalize=True))


def graph_time(call: Callable[[], Any], device: torch.device, reps: int) -> float:
    """Device seconds per forward: GRAPH_CALLS forwards in one graph, replayed (median of ``reps``)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            call()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(GRAPH_CALLS):
            call()
    for _ in range(3):
        graph.replay()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3 / GRAPH_CALLS)
    del graph
    return statistics.median(out)


def eager_times(call: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    """Seconds per forward from an idle GPU and a cold L2 (CUDA), or wall time (CPU)."""
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            call()
            out.append(time.perf_counter() - t0)
        return out
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    out = []
    for _ in range(reps):
        flush.zero_()
        torch.cuda.synchronize(device)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        call()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return out


def floor_us(cfg: MoEConfig, T: int, touched: int, peaks: tuple[float, float, float]) -> Optional[float]:
    """The cell's floor at ``peaks`` (bandwidth, peak bf16, peak FP8), or None where they are unknown."""
    bw, bf16, fp8 = peaks
    if bw is None:
        return None
    scaled = cfg.quant in (QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN)
    return floor_model(cfg, T, touched, bw, fp8 if scaled else bf16)["floor_s"] * 1e6


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes read and written per second by a device-to-device copy of ``nbytes`` (median of 10)."""
    a = torch.empty(nbytes, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    b.copy_(a)
    out = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        out.append(2 * nbytes / (start.elapsed_time(end) * 1e-3))
    return statistics.median(out)


def run_cells(configs: list[tuple[str, str, Callable[[str], MoEConfig]]], backends: list[str], tokens: list[int],
              device: torch.device, reps: int, warm_only: bool = False,
              peaks: tuple[float, float, float] = (None, None, None)) -> list[dict[str, Any]]:
    """Rows for each (preset name, quant, config for an experts backend) x backend x T."""
    rows = []
    for name, q, make_cfg in configs:
        picked = None
        try:
            picked = plan(make_cfg("auto")).experts.name
        except PlanError as exc:
            print(f"  skip {name} {q}: {exc.summary}", file=sys.stderr)
        names = list(dict.fromkeys(picked if b == "auto" else b for b in backends if b != "auto" or picked))
        for backend in names:
            cfg = make_cfg(backend)
            try:
                layer = build_layer(cfg, device)
            except PlanError as exc:
                print(f"  skip {name} {q} {backend}: {exc.summary}", file=sys.stderr)
                continue
            for T in tokens:
                x, topk, touched = make_inputs(cfg, layer, T)

                def call(layer=layer, x=x, topk=topk):
                    return layer(x, topk)

                try:
                    with torch.no_grad():
                        if warm_only:
                            for _ in range(3):
                                call()
                            sync(device)
                            continue
                        warm_up(call, device)
                        graph = (graph_time(call, device, reps) if device.type == "cuda" and layer.plan.graph_safe
                                 else None)
                        eager = statistics.median(eager_times(call, device, reps))
                        host = statistics.median(host_times(call, device, reps))
                except Exception as exc:  # report the cell, keep the others
                    print(f"  {name} {q} T={T} {backend}: FAILED {type(exc).__name__}: {exc}", file=sys.stderr)
                    continue
                row = {"preset": name, "quant": q, "T": T, "backend": backend,
                       "graph_us": None if graph is None else round(graph * 1e6, 2),
                       "eager_us": round(eager * 1e6, 2), "host_us": round(host * 1e6, 2),
                       "floor_us": None if (f := floor_us(cfg, T, touched, peaks)) is None else round(f, 2)}
                rows.append(row)
                pick = " (pick)" if backend == picked else ""
                print(f"  {name:16s} {q:11s} T={T:<3d} {backend + pick:16s} graph {row['graph_us']} eager "
                      f"{row['eager_us']} host {row['host_us']} floor {row['floor_us']} us", file=sys.stderr,
                      flush=True)
            layer = call = None  # (the closure holds the layer too) before the allocator's cache is emptied
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    head = [f"# Decode benchmark, {meta['device']}, {meta['date']}", "",
            f"`{meta['command']}` (torch {meta['torch']}, triton {meta.get('triton', '-')}); microseconds per "
            "forward, median; graph = many forwards replayed in one CUDA graph, eager = from an idle GPU with "
            "L2 flushed, host = CPU time of the call with the GPU idle, floor = touched experts' weights + "
            f"activations at {meta['bw_tbs']} TB/s (a device-to-device copy measured {meta.get('copy_tbs', '-')} "
            "TB/s read + written); frac = floor / graph. Planner's pick: "
            + ", ".join(f"{k}: {v}" for k, v in meta["auto_plan"].items()), "",
            "| preset | quant | T | backend | graph_us | eager_us | host_us | floor_us | frac |",
            "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        g = r["graph_us"]
        floor = r["floor_us"]
        frac = f"{floor / g:.2f}" if g and floor else "-"
        pick = " (pick)" if meta["auto_plan"].get(f"{r['preset']}/{r['quant']}") == r["backend"] else ""
        head.append(f"| {r['preset']} | {r['quant']} | {r['T']} | {r['backend']}{pick} | "
                    f"{'-' if g is None else f'{g:.1f}'} | {r['eager_us']:.1f} | {r['host_us']:.1f} | "
                    f"{'-' if floor is None else f'{floor:.1f}'} | {frac} |")
    return "\n".join(head) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--quant", nargs="+", default=["unquantized", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 16, 64])
    p.add_argument("--backends", nargs="+", default=["auto", "triton", "cutlass"])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    p.add_argument("--date", default=datetime.date.today().isoformat())
    p.add_argument("--gpu", help="the file name's device tag (default: h100 or h200 from the device's name)")
    p.add_argument("--bw", type=float, help="the floor's bandwidth, B/s (default: moe_core.bench.DEVICE_PEAKS)")
    p.add_argument("--own-tables-only", action="store_true",
                   help="ignore a stand-in device's tables (tuning_configs.TABLE_STAND_INS): the untuned heuristics")
    p.add_argument("--warm-only", action="store_true", help="run each cell once, time nothing, write nothing")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny sizes on the CPU reference backend (CI)")
    args = p.parse_args(argv)

    peaks: tuple = (None, None, None)
    if args.cpu_smoke:
        torch.set_num_threads(1)  # a shared CI machine: threads only contend
        device, kind, tag = torch.device("cpu"), "cpu", "cpu-smoke"
        peaks = device_peaks("H100")  # (a floor to check the arithmetic against: the H100's figures)
        configs = [("smoke", q, lambda b, q=q: MoEConfig(**SMOKE, quant=q, device="cpu",
                                                          experts="reference" if b == "auto" else b))
                   for q in args.quant]
        backends = ["auto"]
    else:
        if not torch.cuda.is_available():
            print("decode.py needs a CUDA device (or --cpu-smoke)", file=sys.stderr)
            return 1
        device, kind = torch.device("cuda", torch.cuda.current_device()), "cuda"
        device_name = torch.cuda.get_device_name(device)
        tag = args.gpu or next((needle.lower() for needle, *_ in DEVICE_PEAKS if needle in device_name), "gpu")
        peaks = device_peaks(device_name)
        if args.own_tables_only:
            from moe_plugin_cuda.triton import tuning_configs

            tuning_configs.TABLE_STAND_INS = {}
        configs = [(name, q, lambda b, name=name, q=q: preset(name, quant=q, device="cuda", experts=b))
                   for name in args.presets for q in args.quant]
        backends = args.backends
    if args.bw:
        peaks = (args.bw, *peaks[1:])
    t0, threads = time.time(), torch.get_num_threads()
    try:
        copy = None if kind != "cuda" or args.warm_only else copy_bandwidth(device)
        rows = run_cells(configs, backends, args.tokens, device, args.reps, args.warm_only, peaks)
    finally:
        torch.set_num_threads(threads)
    print(f"{len(rows)} cells in {time.time() - t0:.0f} s", file=sys.stderr)
    if args.warm_only:
        return 0
    auto = {}
    for name, q, make_cfg in configs:
        try:
            auto[f"{name}/{q}"] = plan(make_cfg("auto")).experts.name
        except PlanError as exc:
            auto[f"{name}/{q}"] = f"none ({exc.summary})"
    meta = {"device": torch.cuda.get_device_name(device) if kind == "cuda" else platform.processor() or "cpu",
            "date": args.date, "torch": torch.__version__, "auto_plan": auto,
            "bw_tbs": "-" if peaks[0] is None else f"{peaks[0] / 1e12:g}",
            "copy_tbs": "-" if copy is None else f"{copy / 1e12:.2f}",
            "command": "python benchmarks/cuda/decode.py " + " ".join(sys.argv[1:] if argv is None else argv)}
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"decode-{tag}-{args.date}"
    stem.with_suffix(".json").write_text(json.dumps(rows, indent=1) + "\n")
    stem.with_suffix(".md").write_text(markdown(rows, meta))
    print(f"wrote {stem}.json and .md", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
