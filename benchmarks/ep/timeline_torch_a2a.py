"""When, within one eager ``torch_a2a`` dispatch, the host reaches each piece and when the GPU does (issue #32):
the profiler's Python tracer costs more than the pieces it times, so here each piece is wrapped in a
``perf_counter`` pair and a CUDA event pair, nothing else.

    python benchmarks/ep/timeline_torch_a2a.py --out DIR [--tokens 4096] [--wires bf16 fp8] [--modes normal]

World 2 on NCCL (one GPU per rank, 127.0.0.1). Per case and rank, medians over ``--iters`` calls (each from an
idle GPU after a barrier, as ``bench_torch_a2a.py`` times them) of, per piece: host enter / exit and GPU enter /
exit in us from the call's start (the GPU columns: events recorded on the stream as the host passed those
points, so "GPU enter" is when the device got there). Rank 0 writes ``DIR/timeline.md``.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from profile_torch_a2a import make, run_world  # noqa: E402

from moe_core.distributed import torch_a2a  # noqa: E402
from moe_core.plugins import get_plugin_manager  # noqa: E402

# the module-level pieces timed (called by the plugin's own functions); the registered kernels' functions are
# timed through the registry (``torch_a2a._KERNELS``), where the core finds them
PIECES = (("moe_plugin_cuda.triton.a2a", "_symmetric_rows"), ("moe_plugin_cuda.triton.a2a", "pack_into"),
          ("moe_plugin_cuda.triton.a2a", "_put_counts"), ("moe_plugin_cuda.triton.a2a", "pack_fixed_into"),
          ("moe_core.distributed.torch_a2a", "_masked_received"))


class Recorder:
    def __init__(self) -> None:
        self.marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(self, name: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        self.marks.append((name, time.perf_counter(), ev))


def timed(rec: Recorder, fn, label: str):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        rec.mark(f"{label} >")
        try:
            return fn(*args, **kwargs)
        finally:
            rec.mark(f"{label} <")

    return call


def wrap(rec: Recorder, owner, attr: str, label: str):
    fn = getattr(owner, attr)
    setattr(owner, attr, timed(rec, fn, label))
    return fn


def instrument(rec: Recorder) -> list[tuple[object, str, object]]:
    import dataclasses
    import importlib

    undo = []
    for mod_name, attr in PIECES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        if hasattr(mod, attr):
            undo.append((mod, attr, wrap(rec, mod, attr, attr)))
    for attr in ("_read_counts", "_dispatch_normal_fused", "_exchange_fixed"):
        undo.append((torch_a2a.TorchA2ADispatcher, attr, wrap(rec, torch_a2a.TorchA2ADispatcher, attr, attr)))
    for attr in ("start", "wait"):
        undo.append((torch_a2a._HostCopy, attr, wrap(rec, torch_a2a._HostCopy, attr, f"host copy {attr}")))
    kernels = torch_a2a._kernels_for("cuda")
    if kernels is not None:
        fns = {f.name: getattr(kernels, f.name) for f in dataclasses.fields(kernels) if f.name != "direct_ok"}
        torch_a2a._KERNELS["cuda"] = dataclasses.replace(
            kernels, **{name: timed(rec, fn, name) for name, fn in fns.items() if callable(fn)})
        undo.append((torch_a2a._KERNELS, None, kernels))
    return undo


def restore(undo) -> None:
    for owner, attr, fn in undo:
        if attr is None:
            owner["cuda"] = fn
        else:
            setattr(owner, attr, fn)


def host_us(fn, n: int) -> float:
    """Mean host time of ``fn()`` over ``n`` calls in a row (launches are asynchronous: what issuing costs)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def pieces(rank: int, tokens: int, wire: str) -> list[str]:
    """Host cost of each piece of an exact normal dispatch called on its own (both ranks call the collective
    ones in the same order)."""
    import triton
    from moe_plugin_cuda.triton import a2a
    from moe_plugin_cuda.triton.launch import pow2

    d, x, topk = make(rank, 2, tokens, "normal", wire)
    for _ in range(3):
        d.dispatch(x, topk)
    kern = torch_a2a._kernels_for("cuda")
    ids, w = topk.ids, topk.weights
    row, msg = kern.layout(ids, d.world, d.num_local)
    wire_dt = d.wire
    group = d.group
    out = {}
    out["triton.next_power_of_2"] = host_us(lambda: triton.next_power_of_2(40), 2000)
    out["launch.pow2 (pure Python)"] = host_us(lambda: pow2(40), 2000)
    out["torch.empty [2, 4096] int64"] = host_us(lambda: torch.empty(2, 4096, dtype=torch.int64, device="cuda"), 500)
    out["layout"] = host_us(lambda: kern.layout(ids, d.world, d.num_local), 200)
    out["direct_ok"] = host_us(lambda: d._direct_exchange(kern, x.device), 500)
    out["_symmetric_rows (lookup)"] = host_us(
        lambda: a2a._symmetric_rows(group, d.world, msg.shape[2] * 8, x.device, use="counts"), 500)
    _, handle, _ = a2a._symmetric_rows(group, d.world, msg.shape[2] * 8, x.device, use="counts")
    dist.barrier()
    out["handle.barrier"] = host_us(lambda: handle.barrier(channel=0), 200)
    dist.barrier()
    out["exchange_normal"] = host_us(
        lambda: kern.exchange_normal(x, ids, w, row, msg, wire_dt, group, d.capacity), 50)
    recv = kern.exchange_normal(x, ids, w, row, msg, wire_dt, group, d.capacity)
    copy = torch_a2a._HostCopy()
    out["host copy start + wait"] = host_us(lambda: copy.start(msg)(), 200)
    out["unpack (chunks)"] = host_us(lambda: kern.unpack(recv, msg[1], wire_dt, x.dtype, d.hidden, d.top_k, d.rank,
                                                          d.num_local, rows=d.world * d.capacity,
                                                          chunk=d.capacity), 100)
    msg_host = msg.cpu()
    out["_read_counts"] = host_us(lambda: d._read_counts(msg_host), 500)
    dist.barrier()
    out["dispatch (whole, back to back)"] = host_us(lambda: d.dispatch(x, topk), 30)
    lines = [f"## host cost of the pieces, normal {wire} {tokens} tokens, rank {rank}", "", "| piece | host us a call |",
             "|---|---|"]
    return lines + [f"| {k} | {v:.1f} |" for k, v in out.items()] + [""]


def worker(rank: int, world: int, port: int, args) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                            device_id=torch.device("cuda", rank))
    get_plugin_manager()
    lines = [f"# torch_a2a eager dispatch timeline, {world}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}",
             "", "Per piece: medians (us from the call's start) of host enter/exit (`>`, `<`) and GPU enter/exit; `call` the whole dispatch.",
             ""]
    rec = Recorder()
    for tokens in args.tokens:
        for mode in args.modes:
            for wire in args.wires:
                d, x, topk = make(rank, world, tokens, mode, wire)
                for _ in range(5):
                    d.dispatch(x, topk)
                torch.cuda.synchronize()
                undo = instrument(rec)
                per: dict[str, list[tuple[float, float]]] = {}
                starts: list[float] = []  # perf_counter is the host's monotonic clock, the same in both processes
                try:
                    for i in range(args.warmup + args.iters):
                        dist.barrier()
                        torch.cuda.synchronize()
                        rec.marks.clear()
                        rec.mark("call >")
                        d.dispatch(x, topk)
                        rec.mark("call <")
                        torch.cuda.synchronize()
                        if i < args.warmup:
                            continue
                        _, h0, e0 = rec.marks[0]
                        starts.append(h0)
                        seen: dict[str, int] = {}
                        for name, h, ev in rec.marks:
                            n = seen.get(name, 0)
                            seen[name] = n + 1
                            key = name if not n else f"{name} #{n + 1}"
                            per.setdefault(key, []).append(((h - h0) * 1e6, e0.elapsed_time(ev) * 1e3))
                finally:
                    restore(undo)
                rows = sorted(per.items(), key=lambda kv: statistics.median(v[0] for v in kv[1]))
                table = [f"## {mode} {wire} {tokens} tokens, rank {rank} ({args.iters} calls)", "",
                         "| point | host us | GPU us |", "|---|---|---|"]
                table += [f"| {k} | {statistics.median(v[0] for v in vs):.1f} | {statistics.median(v[1] for v in vs):.1f} |"
                          for k, vs in rows]
                gathered: list = [None] * world
                dist.all_gather_object(gathered, table)
                all_starts: list = [None] * world
                dist.all_gather_object(all_starts, starts)
                if rank == 0:
                    skew = statistics.median((b - a) * 1e6 for a, b in zip(all_starts[0], all_starts[1], strict=True))
                    lines += [f"rank 1 started its calls {skew:.1f} us after rank 0 (median)", ""]
                    print(lines[-2], flush=True)
                    for t in gathered:
                        lines += t + [""]
                        print("\n".join(t), flush=True)
                del d, x, topk
                torch.cuda.empty_cache()
    if args.pieces:
        for tokens in args.tokens:
            for wire in args.wires:
                table = pieces(rank, tokens, wire)
                gathered = [None] * world
                dist.all_gather_object(gathered, table)
                if rank == 0:
                    for t in gathered:
                        lines += t
                        print("\n".join(t), flush=True)
    if rank == 0:
        with open(os.path.join(args.out, "timeline.md"), "w") as f:
            f.write("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
    ap.add_argument("--wires", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--modes", nargs="+", default=["normal"])
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--pieces", action="store_true", help="also each piece's host cost, called on its own")
    run_world(worker, ap.parse_args())


if __name__ == "__main__":
    main()
