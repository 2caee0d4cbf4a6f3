"""Benchmark ``torch_a2a`` dispatch and combine on NCCL next to raw ``all_to_all_single``.

    PYTHONPATH=. python benchmarks/ep/bench_torch_a2a.py --world 2 --out results/

DeepSeek-V3 sizes by default (H 7168, top-8 of 256 experts), uniform random routing (distinct
experts per token), 128 and 4096 tokens per rank, bf16 and fp8 wire. One GPU per rank. Modes
(``--modes``): ``normal`` (exact buffers, eager: one host read per dispatch), ``normal-graph``
(worst-case buffers, captured in CUDA graphs), ``masked`` (eager) and ``masked-graph`` (captured;
one graph for dispatch, one for combine, each replayed), each with a plugin's fused kernels where one
registered them (the installed plugins load, as under a layer; decision 63); ``normal-torch``,
``normal-graph-torch`` and ``masked-graph-torch`` run the torch functions: the baselines in the same run. A case that fails is recorded with its
error and the run goes on. ``--json PATH`` writes one row per (case, stage) as
``{"tokens_per_rank", "mode", "exec", "wire", "stage", "us", "gbps", "raw_gbps", "ratio", ...}``
with ``"device"`` at the top level, rewritten after every case (a run cut short keeps what it measured).

Bandwidth = bytes this rank actually hands to the collectives of the stage (all destinations,
its own chunk included; the fixed-capacity modes send every slot, padding included) / time of the whole stage (quantization, layout, host sync, slab
expansion or reduction included). The raw figure is ``all_to_all_single`` of byte buffers with
exactly the same split sizes, measured in the same run; ``ratio`` = stage bandwidth / raw
bandwidth = raw time / stage time. Times are medians over iterations of the slowest rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import socket
import statistics
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from moe_core import MoEConfig, TopK  # noqa: E402
from moe_core.backends import BackendSpec, Role  # noqa: E402
from moe_core.contracts import EPMaskedCombine, EPNormalCombine, Format, WireDtype  # noqa: E402
from moe_core.distributed import TorchA2ADispatcher, torch_a2a  # noqa: E402
from moe_core.plugins import get_plugin_manager  # noqa: E402
from moe_core.runtime import BackendContext  # noqa: E402

DEVICE = "cuda"  # "cpu" with --cpu (a gloo smoke test of the script itself)


def _timed(fn, iters: int, warmup: int) -> list[float]:
    """Per-iteration milliseconds of ``fn`` (ranks aligned by a barrier before each), slowest rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end)
        else:  # --cpu smoke test on gloo
            t0 = time.perf_counter()
            fn()
            ms = (time.perf_counter() - t0) * 1e3
        t = torch.tensor([ms], device=DEVICE)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return times


def _raw(send_rows: list[int], recv_rows: list[int], row_bytes: int, iters: int, warmup: int) -> float:
    """Median ms of all_to_all_single moving the same bytes with the same splits."""
    inp = torch.empty(sum(send_rows), row_bytes, dtype=torch.uint8, device=DEVICE)
    out = torch.empty(sum(recv_rows), row_bytes, dtype=torch.uint8, device=DEVICE)
    even = len(set(send_rows)) == 1 and len(set(recv_rows)) == 1
    splits = (None, None) if even else (recv_rows, send_rows)
    return statistics.median(_timed(lambda: dist.all_to_all_single(out, inp, *splits), iters, warmup))


def bench_case(rank: int, world: int, tokens: int, mode: str, wire: str, args) -> dict:
    kernels = torch_a2a._kernels_for(DEVICE)
    if mode not in EXPAND_ALL or kernels is None:
        return _bench_case(rank, world, tokens, mode, wire, args)
    torch_a2a.register_torch_a2a_kernels(DEVICE, dataclasses.replace(kernels, exchange_masked=None))
    try:
        return _bench_case(rank, world, tokens, mode, wire, args)
    finally:
        torch_a2a.register_torch_a2a_kernels(DEVICE, kernels)


def _bench_case(rank: int, world: int, tokens: int, mode: str, wire: str, args) -> dict:
    fmt, buffers, graph, extra = MODES[mode]
    e, k, h = args.experts, args.top_k, args.hidden
    el = e // world
    cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=128, ep_size=world, ep_rank=rank,
                    max_tokens_per_rank=tokens, device=DEVICE, dispatcher="torch_a2a", dispatch_dtype=wire,
                    backend_options=torch_a2a_options(buffers, extra))
    spec = BackendSpec(name="torch_a2a", role=Role.DISPATCHER, impl="moe_core.distributed:TorchA2ADispatcher",
                       formats=(Format.EP_NORMAL, Format.EP_MASKED), devices=frozenset({"cuda"}))
    d = TorchA2ADispatcher(BackendContext(cfg, spec, fmt, WireDtype(wire)))
    gen = torch.Generator(device=DEVICE).manual_seed(1234 + rank)
    x = torch.randn(tokens, h, device=DEVICE, generator=gen).bfloat16()
    ids = torch.rand(tokens, e, device=DEVICE, generator=gen).topk(k, dim=1).indices.int()
    weights = torch.softmax(torch.randn(tokens, k, device=DEVICE, generator=gen), dim=1)
    topk = TopK(weights, ids)
    # wire row: data + int32 side block [scales | K ids | K weights | bad-id count | token count]
    # (exact normal mode: without the two counts)
    in_band = 0 if fmt is Format.EP_NORMAL and buffers != "worst_case" else 2
    row_bytes = h * (2 if wire == "bf16" else 1) + 4 * (_scale_words(wire, h) + 2 * k + in_band)
    hb = h * 2  # combine moves bf16

    if buffers == "worst_case":
        y = torch.empty(tokens * world, h, device=DEVICE, dtype=torch.bfloat16).normal_()
        if graph:
            dispatch_fn, combine_fn, out = _graphs(d, x, topk, lambda o: EPNormalCombine(y, o.handle))
        else:
            out = d.dispatch(x, topk)
            ci = EPNormalCombine(y, out.handle)
            dispatch_fn = lambda: d.dispatch(x, topk)  # noqa: E731
            combine_fn = lambda: d.combine(ci)  # noqa: E731
        _sync()
        d_send_rows = d_recv_rows = c_send_rows = c_recv_rows = [tokens] * world
        valid_rows = int((out.handle.slot > 0).sum())
    elif fmt is Format.EP_NORMAL:
        out = d.dispatch(x, topk)
        _sync()
        dispatch_fn = lambda: d.dispatch(x, topk)  # noqa: E731
        hd = out.handle
        ci = EPNormalCombine(torch.randn(sum(hd.recv_counts), h, device=DEVICE, dtype=torch.bfloat16), hd)
        combine_fn = lambda: d.combine(ci)  # noqa: E731
        d_send_rows, d_recv_rows = hd.send_counts, hd.recv_counts
        c_send_rows, c_recv_rows = hd.recv_counts, hd.send_counts
        valid_rows = sum(hd.send_counts)
    else:
        y = torch.empty(el, tokens * world, h, device=DEVICE, dtype=torch.bfloat16).normal_()
        if graph:
            dispatch_fn, combine_fn, out = _graphs(d, x, topk, lambda o: EPMaskedCombine(y, o.topk, o.handle))
        else:
            out = d.dispatch(x, topk)
            ci = EPMaskedCombine(y, out.topk, out.handle)
            dispatch_fn = lambda: d.dispatch(x, topk)  # noqa: E731
            combine_fn = lambda: d.combine(ci)  # noqa: E731
        _sync()
        d_send_rows = d_recv_rows = c_send_rows = c_recv_rows = [tokens] * world
        valid_rows = int((out.handle.slot > 0).sum())
    ms_dispatch = statistics.median(_timed(dispatch_fn, args.iters, args.warmup))
    ms_combine = statistics.median(_timed(combine_fn, args.iters, args.warmup))
    raw_dispatch = _raw(d_send_rows, d_recv_rows, row_bytes, args.iters, args.warmup)
    raw_combine = _raw(c_send_rows, c_recv_rows, hb, args.iters, args.warmup)
    if args.profile:  # after the timed runs (compiled kernels built); every rank runs the calls
        from contextlib import nullcontext

        from torch.profiler import ProfilerActivity, profile

        with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if rank == 0 else nullcontext()) as prof:
            for _ in range(args.profile_iters):
                dispatch_fn()
                combine_fn()
            _sync()
        if rank == 0:
            print(f"--- profile {tokens} tok/rank {mode} {wire} ({args.profile_iters} dispatch+combine)",
                  flush=True)
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=25), flush=True)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15), flush=True)
    d_bytes = sum(d_send_rows) * row_bytes
    c_bytes = sum(c_send_rows) * hb

    def gbps(nbytes: int, ms: float) -> float:
        return nbytes / (ms * 1e-3) / 1e9

    return {
        "tokens_per_rank": tokens, "mode": mode, "exec": "graph" if graph else "eager", "wire": wire,
        "world": world, "rows_sent_valid": valid_rows, "rows_sent_total": sum(d_send_rows),
        "dispatch_bytes": d_bytes, "dispatch_ms": ms_dispatch, "dispatch_GBps": gbps(d_bytes, ms_dispatch),
        "raw_dispatch_ms": raw_dispatch, "raw_dispatch_GBps": gbps(d_bytes, raw_dispatch),
        "dispatch_ratio": raw_dispatch / ms_dispatch,
        "combine_bytes": c_bytes, "combine_ms": ms_combine, "combine_GBps": gbps(c_bytes, ms_combine),
        "raw_combine_ms": raw_combine, "raw_combine_GBps": gbps(c_bytes, raw_combine),
        "combine_ratio": raw_combine / ms_combine,
    }


def _graphs(d, x, topk, combine_input):
    """Capture a graph-safe mode's dispatch and combine in two CUDA graphs (static inputs: x,
    topk and the experts' output inside ``combine_input(dispatched)``; the combine graph reads the
    dispatch graph's outputs); return their replays and that output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up outside capture (allocator, NCCL, compiled kernels)
        for _ in range(2):
            w = d.dispatch(x, topk)
            d.combine(combine_input(w))
        del w
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g_dispatch, g_combine = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(g_dispatch):
        out = d.dispatch(x, topk)
    ci = combine_input(out)
    with torch.cuda.graph(g_combine):
        d.combine(ci)
    torch.cuda.synchronize()
    return g_dispatch.replay, g_combine.replay, out


def _sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _empty_cache() -> None:
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def _scale_words(wire: str, h: int) -> int:
    return {"bf16": 0, "fp8": -(-h // 128), "int8": 1}[wire]


def worker(rank: int, world: int, port: int, args, queue) -> None:
    global DEVICE
    if args.cpu:
        DEVICE = "cpu"
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                                device_id=torch.device("cuda", rank))
    get_plugin_manager()  # the installed plugins load, as under a layer (the cuda plugin's kernels: decision 63)
    # one process measures many shapes, where a layer has one: dynamo's limit of 8 graphs per function would turn
    # the torch path's compiled helpers eager after a few sizes
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    rows = []
    modes = [m for m in args.modes if not (args.cpu and MODES[m][2])]
    device = f"{world}x {torch.cuda.get_device_name(0)}" if DEVICE == "cuda" else f"{world}x cpu (gloo)"
    for tokens in args.tokens:
        for mode in modes:
            for wire in args.wires:
                case = {"tokens_per_rank": tokens, "mode": mode, "exec": "graph" if MODES[mode][2] else "eager",
                        "wire": wire, "world": world}
                try:
                    r = bench_case(rank, world, tokens, mode, wire, args)
                    failed = 0
                except Exception:  # record it and go on (every rank runs the same cases)
                    r = dict(case, error=traceback.format_exc()[-2000:])
                    failed = 1
                    # now, on every rank: a CUDA error is sticky, and the next call below may end the process
                    print(f"rank {rank} {mode} {wire}: {r['error']}", file=sys.stderr, flush=True)
                _empty_cache()
                # ranks agree on the outcome, so one rank's failure does not desynchronize the rest
                flag = torch.tensor([failed], device=DEVICE)
                dist.all_reduce(flag)
                if int(flag) and "error" not in r:
                    r = dict(case, error="failed on another rank")
                rows.append(r)
                if rank == 0:
                    print(json.dumps(r), flush=True)
                    if args.json:
                        write_stage_rows(args.json, device, rows, args)
    if rank == 0:
        queue.put(rows)
    dist.barrier()
    dist.destroy_process_group()


MODES = {  # name -> (format, normal-mode buffers, captured in CUDA graphs, other torch_a2a options)
    "normal": (Format.EP_NORMAL, "exact", False, {}), "normal-graph": (Format.EP_NORMAL, "worst_case", True, {}),
    "normal-worst-case": (Format.EP_NORMAL, "worst_case", False, {}),
    "masked": (Format.EP_MASKED, None, False, {}), "masked-graph": (Format.EP_MASKED, None, True, {}),
    # the torch functions where a plugin registered fused kernels (decision 63): the baselines in the same run
    "normal-torch": (Format.EP_NORMAL, "exact", False, {"kernels": "torch"}),
    "normal-graph-torch": (Format.EP_NORMAL, "worst_case", True, {"kernels": "torch"}),
    "masked-graph-torch": (Format.EP_MASKED, None, True, {"kernels": "torch"}),
    # the fixed-capacity exchange forced either way (decision 66; the plain modes take the "auto" choice)
    "normal-direct": (Format.EP_NORMAL, "exact", False, {"exchange": "direct"}),
    "normal-collective": (Format.EP_NORMAL, "exact", False, {"exchange": "collective"}),
    "normal-graph-direct": (Format.EP_NORMAL, "worst_case", True, {"exchange": "direct"}),
    "normal-graph-collective": (Format.EP_NORMAL, "worst_case", True, {"exchange": "collective"}),
    "masked-graph-direct": (Format.EP_MASKED, None, True, {"exchange": "direct"}),
    "masked-graph-collective": (Format.EP_MASKED, None, True, {"exchange": "collective"}),
    # the direct exchange with every received slot expanded after it (the plugin's exchange_masked left out): the
    # path before decision 71, to measure its own-slots-into-the-slab against in the same run
    "masked-graph-direct-expand": (Format.EP_MASKED, None, True, {"exchange": "direct"})}
EXPAND_ALL = {"masked-graph-direct-expand"}


def torch_a2a_options(buffers, extra: dict) -> dict:
    """``backend_options`` of a mode: its normal-mode buffers and its other options."""
    options = {"normal_buffers": buffers, **extra} if buffers else dict(extra)
    return {"torch_a2a": options} if options else {}


def stage_rows(rows: list[dict]) -> list[dict]:
    """One row per (case, stage): times in us, bandwidths in GB/s, ratio = stage / raw bandwidth."""
    out = []
    for r in rows:
        head = {key: r[key] for key in ("tokens_per_rank", "mode", "exec", "wire")}
        if "error" in r:
            out.append(dict(head, stage="both", error=r["error"].strip().splitlines()[-1][:300]))
            continue
        for stage in ("dispatch", "combine"):
            out.append(dict(head, stage=stage, us=round(r[f"{stage}_ms"] * 1e3, 1),
                            gbps=round(r[f"{stage}_GBps"], 2), raw_gbps=round(r[f"raw_{stage}_GBps"], 2),
                            ratio=round(r[f"{stage}_ratio"], 4), raw_us=round(r[f"raw_{stage}_ms"] * 1e3, 1),
                            bytes=r[f"{stage}_bytes"], world=r["world"]))
    return out


def write_stage_rows(path: str, device: str, rows: list[dict], args) -> None:
    meta = {"device": device, "torch": torch.__version__, "command": " ".join(sys.argv), "hidden": args.hidden,
            "top_k": args.top_k, "experts": args.experts, "iters": args.iters, "note": "us: median of the slowest rank; raw: all_to_all_single of the same bytes "
                                    "with the same splits, eager, same run"}
    if DEVICE == "cuda":
        meta["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(dict(meta, rows=stage_rows(rows)), f, indent=1)


def table(rows: list[dict]) -> str:
    lines = ["| tokens/rank | mode | exec | wire | dispatch ms | dispatch GB/s | raw a2a GB/s | ratio | "
             "combine ms | combine GB/s | raw a2a GB/s | ratio |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        head = f"| {r['tokens_per_rank']} | {r['mode']} | {r['exec']} | {r['wire']} |"
        if "error" in r:
            lines.append(f"{head} failed: {r['error'].strip().splitlines()[-1][:120]} |||||||")
            continue
        lines.append(f"{head} {r['dispatch_ms']:.3f} | "
                     f"{r['dispatch_GBps']:.1f} | {r['raw_dispatch_GBps']:.1f} | {r['dispatch_ratio']:.0%} | "
                     f"{r['combine_ms']:.3f} | {r['combine_GBps']:.1f} | {r['raw_combine_GBps']:.1f} | "
                     f"{r['combine_ratio']:.0%} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--wires", nargs="+", default=["bf16", "fp8"])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--cpu", action="store_true", help="smoke-test the script on gloo/CPU (numbers meaningless)")
    p.add_argument("--out", default=None, help="directory for results.json and results.md")
    p.add_argument("--profile", action="store_true",
                   help="after timing, profile --profile-iters calls and print rank 0's kernel and host tables")
    p.add_argument("--profile-iters", type=int, default=5)
    p.add_argument("--modes", nargs="+", default=["normal", "normal-graph", "masked-graph"], choices=list(MODES),
                   help="normal (exact buffers, eager), normal-graph (worst-case buffers, CUDA graphs), "
                        "normal-worst-case (eager), masked (eager), masked-graph; -torch: the torch functions; "
                        "-direct / -collective: the fixed-capacity exchange forced (decision 66)")
    p.add_argument("--json", default=None, help="write the per-stage rows here (e.g. results/torch_a2a-h100x2.json)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(worker, args=(args.world, port, args, queue), nprocs=args.world, start_method="spawn")
    rows = queue.get()
    md = table(rows)
    print(md)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        meta = {"command": " ".join(sys.argv), "world": args.world, "torch": torch.__version__}
        if not args.cpu:
            meta.update(device=torch.cuda.get_device_name(0), nccl=".".join(map(str, torch.cuda.nccl.version())))
        with open(os.path.join(args.out, "results.json"), "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "results.md"), "w") as f:
            f.write(json.dumps(meta) + "\n\n" + md + "\n")


if __name__ == "__main__":
    main()
