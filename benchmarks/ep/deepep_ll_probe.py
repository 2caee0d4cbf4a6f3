"""Where moe-core's low-latency dispatch loses time against DeepEP's direct call (issue #30, decision 69).

    torchrun --nproc-per-node 2 benchmarks/ep/deepep_ll_probe.py [--out DIR] [--rounds 1500] [--smoke]

Same case as ``bench_deepep.py`` (128 tokens a rank, hidden 7168, top-8 of 256, bf16 and FP8 wire). Rank 0
prints lines starting with ``PROBE``. Passes, each with Python's garbage collector off:

A. variants interleaved, each round in a fresh random order (the same on both ranks), one call each, timed as
   ``bench_deepep.py`` times a call (CUDA events around it from an idle GPU, a sync after it):
   ``direct`` (the bench's call), ``direct_pos`` (moe-core's positional arguments), ``moe_core``,
   ``pre+direct`` (moe-core's checks before the launch, then the launch), ``direct+result`` (the launch, then
   moe-core's result), ``spin2+direct`` / ``direct+spin3`` (2 us of host before / 3 us after the call: what
   one us of host work costs there). Per variant: the slower rank's time (median), each rank's time and host
   time, the ranks' start skew (perf_counter is CLOCK_MONOTONIC, one clock for both processes), the median
   ratio to ``direct`` in the same round.
B. ``direct`` and ``moe_core`` with each result held until the next call of the same column (a decode loop
   holds it while the experts run), pairs A B, B A.
C. ``direct`` and ``moe_core`` with DeepEP's C++ ``low_latency_dispatch`` timed from Python: host before it,
   inside it (checks, allocations, the launch, stream waits), after it (results, frees), by rank.
D. torch.profiler (CPU and CUDA activities) over pairs of ``direct`` / ``moe_core``: per call the kernels and
   their GPU durations, the CUDA runtime calls by name, when the launch and the kernel started after the call
   began. Rank 0's FP8 trace goes to ``--out``.
E. ``direct`` and ``moe_core`` (and ``moe_core_rt``) in pairs, every call after a barrier of the ranks.
F. normal mode, bf16, 4096 tokens: host time and the profiler's CPU ops per call, moe-core and direct.
"""

from __future__ import annotations

import argparse
import collections
import gc
import gzip
import json
import os
import pathlib
import random
import statistics
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import bench_deepep as bench  # noqa: E402  (the bench's case, dispatcher and host pinning)
from moe_plugin_cuda.deepep import _LowLatencyHandle  # noqa: E402

from moe_core.contracts import TopK, masked_dispatch_unchecked  # noqa: E402

_new_tuple = tuple.__new__

perf = time.perf_counter
TRIO = ("direct", "moe_core", "moe_core_old")  # the passes beyond A: DeepEP direct, moe-core now and before 68


def spin(us: float) -> None:
    end = perf() + us * 1e-6
    while perf() < end:
        pass


def say(rank: int, tag: str, doc: dict) -> None:
    if rank == 0:
        print(f"PROBE {tag} " + json.dumps(doc), flush=True)


def gather(values: list[float]) -> list[list[float]]:
    """Every rank's list (same length on each), as [rank][i]."""
    t = torch.tensor(values, dtype=torch.float64, device=bench.DEVICE)
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return [o.tolist() for o in out]


def med(v: list[float]) -> float:
    return round(statistics.median(v), 2) if v else float("nan")


class Timer:
    """``bench_deepep.Timer`` plus the call's start on the host (perf_counter)."""

    def __init__(self) -> None:
        cuda = bench.DEVICE.type == "cuda"
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float, float]:
        if self.events is None:
            t0 = perf()
            fn()
            t1 = perf()
            return (t1 - t0) * 1e6, (t1 - t0) * 1e6, t0
        a, b = self.events
        a.record()
        t0 = perf()
        fn()
        t1 = perf()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3, (t1 - t0) * 1e6, t0


def summarize(names: list[str], times: dict, hosts: dict, starts: dict, base: str = "direct") -> dict:
    """Per variant: slower rank's median, by-rank medians, host medians, start skew, ratio to ``base`` per round."""
    g = {n: (gather(times[n]), gather(hosts[n]), gather(starts[n])) for n in names}
    slow = {n: [max(c) for c in zip(*g[n][0], strict=True)] for n in names}
    out = {}
    for n in names:
        t, h, s = g[n]
        skew = [(c[1] - c[0]) * 1e6 for c in zip(*s, strict=True)] if len(s) > 1 else [0.0]
        out[n] = {"us": med(slow[n]), "by_rank": [med(r) for r in t], "host": [med(r) for r in h],
                  "skew_r1_minus_r0": med(skew), "abs_skew": med([abs(v) for v in skew]),
                  "ratio": round(statistics.median([a / b for a, b in zip(slow[n], slow[base], strict=True)]), 4),
                  "p90": round(sorted(slow[n])[int(0.9 * len(slow[n]))], 2)}
    return out


def setup(wire: str, rank: int, world: int) -> dict:
    tokens = 12 if bench.DEVICE.type != "cuda" else 128
    gen = torch.Generator(device=bench.DEVICE).manual_seed(1000 + rank)
    x = torch.randn(tokens, bench.H, device=bench.DEVICE, generator=gen).to(torch.bfloat16)
    ids64 = torch.rand(tokens, bench.E, device=bench.DEVICE, generator=gen).topk(bench.K, dim=1).indices
    w = torch.rand(tokens, bench.K, device=bench.DEVICE, generator=gen)
    topk = TopK(w / w.sum(1, keepdim=True), ids64)
    d = bench.dispatcher("deepep", "low_latency", wire, tokens, rank, world)
    keep = d.dispatch(x, topk)  # builds the buffer, takes the checked path once (the hot path after it)
    buf = d.buffer
    return dict(x=x, ids64=ids64, topk=topk, d=d, buf=buf, keep=keep, fp8=wire == "fp8")


def variants(c: dict) -> dict[str, Callable[[], Any]]:
    x, ids64, topk, d, buf, fp8 = c["x"], c["ids64"], c["topk"], c["d"], c["buf"], c["fp8"]
    num_max, bf16 = d.num_max, torch.bfloat16
    args = (num_max, bench.E, None, None, fp8, d.ue8m0, d.ue8m0)  # (positionally, as moe-core called it before decision 69)

    def direct():
        return buf.low_latency_dispatch(x, ids64, num_max, bench.E, use_fp8=fp8)

    def direct_pos():
        return buf.low_latency_dispatch(x, ids64, *args)

    def moe_core():
        return d.dispatch(x, topk)

    def pre_direct():  # dispatch's hot path up to the launch (deepep.py), then the launch alone
        idx, b = topk.ids_int64(False), d._entry.low_latency_ready
        if (b is not None and idx is not None and x.__class__ is torch.Tensor and x.dtype is bf16
                and x.shape in d._ll_x_shapes):
            return b.low_latency_dispatch(x, idx, *args)
        raise RuntimeError("hot path not taken")

    def direct_result():  # the launch, then moe-core's result from it
        recv_x, count, handle, _, _ = buf.low_latency_dispatch(x, ids64, *args)
        return d._masked_dispatch(recv_x, count, handle, topk, ids64, bf16)

    def spin_direct():
        spin(2.0)
        return direct()

    def direct_spin():
        r = direct()
        spin(3.0)
        return r

    top_k = d.top_k

    def moe_core_old():  # dispatch's hot path before decision 69: DeepEP's Python wrapper, then _masked_dispatch
        idx, b = topk.ids_int64(False), d._entry.low_latency_ready
        if (b is not None and idx is not None and x.__class__ is torch.Tensor and x.dtype is bf16
                and x.shape in d._ll_x_shapes):
            recv_x, count, handle, _, _ = b.low_latency_dispatch(x, idx, *args)
            if idx.shape[1] != top_k:
                raise RuntimeError("top_k")
            return d._masked_dispatch(recv_x, count, handle, topk, idx, bf16)
        raise RuntimeError("hot path not taken")

    out = {"direct": direct, "direct_pos": direct_pos, "moe_core": moe_core, "moe_core_old": moe_core_old,
           "pre+direct": pre_direct,
           "direct+result": direct_result, "spin2+direct": spin_direct, "direct+spin3": direct_spin}
    # DeepEP's C++ call below Buffer.low_latency_dispatch's Python wrapper, in v1.2.1's order
    if getattr(buf, "runtime", None) is not None:
        ue8m0, hidden, wire = d.ue8m0, x.shape[1], d.wire

        def direct_rt():
            return buf.runtime.low_latency_dispatch(x, ids64, None, None, num_max, bench.E, fp8, ue8m0, ue8m0, False,
                                                    False)

        def moe_core_rt():  # moe-core's hot path with the C++ call and its own handle tuple
            idx, b = topk.ids_int64(False), d._entry.low_latency_ready
            if (b is not None and idx is not None and x.__class__ is torch.Tensor and x.dtype is bf16
                    and x.shape in d._ll_x_shapes):
                rx, rs, count, src, rng, _, _ = b.runtime.low_latency_dispatch(x, idx, None, None, num_max, bench.E,
                                                                               fp8, ue8m0, ue8m0, False, False)
                if idx.shape[1] != top_k:
                    raise RuntimeError("top_k")
                handle = _new_tuple(_LowLatencyHandle, ((src, rng, num_max, hidden, bench.E), idx, bf16))
                return masked_dispatch_unchecked(rx, wire, rs, ue8m0, count, topk, handle)
            raise RuntimeError("hot path not taken")
        out["direct_rt"], out["moe_core_rt"] = direct_rt, moe_core_rt
    return out


def pass_a(c: dict, wire: str, rank: int, rounds: int, warmup: int) -> None:
    fns = variants(c)
    names = list(fns)
    timer = Timer()
    times, hosts, starts = ({n: [] for n in names} for _ in range(3))
    for i in range(warmup + rounds):
        order = names[:]
        random.Random(i).shuffle(order)  # the same order on every rank
        for n in order:
            t, h, s = timer(fns[n])
            if i >= warmup:
                times[n].append(t), hosts[n].append(h), starts[n].append(s)
    out = summarize(names, times, hosts, starts)
    say(rank, f"A {wire}", out)
    if rank == 0:  # one line per variant: us (slower rank), ratio to direct in the same round, host by rank, skew
        for n, v in out.items():
            print(f"A-short {wire} {n:14s} {v['us']:8.2f} x{v['ratio']:.4f} host {v['host']} skew {v['skew_r1_minus_r0']}"
                  f" by_rank {v['by_rank']}", flush=True)


def pass_b(c: dict, wire: str, rank: int, pairs: int, warmup: int) -> None:
    fns = variants(c)
    held: dict[str, Any] = {n: None for n in TRIO}

    def holding(name: str) -> Callable[[], None]:
        fn = fns[name]

        def call() -> None:
            held[name] = None  # the previous result freed before the call, the new one kept
            held[name] = fn()
        return call

    calls = {n: holding(n) for n in held}
    timer = Timer()
    times, hosts, starts = ({n: [] for n in held} for _ in range(3))
    for i in range(warmup + pairs):
        for n in (TRIO if i % 2 == 0 else TRIO[::-1]):
            t, h, s = timer(calls[n])
            if i >= warmup:
                times[n].append(t), hosts[n].append(h), starts[n].append(s)
    held.clear()
    say(rank, f"B {wire} held", summarize(list(calls), times, hosts, starts))


def pass_e(c: dict, wire: str, rank: int, pairs: int, warmup: int) -> None:
    """Pairs as in ``bench_deepep.py``, but every call starts after a barrier of the ranks (outside the timing):
    no call inherits the ranks' skew from the one before it."""
    fns = variants(c)
    names = [n for n in (*TRIO, "moe_core_rt") if n in fns]
    timer = Timer()
    times, hosts, starts = ({n: [] for n in names} for _ in range(3))
    for i in range(warmup + pairs):
        order = names if i % 2 == 0 else names[::-1]
        for n in order:
            dist.barrier()
            t, h, s = timer(fns[n])
            if i >= warmup:
                times[n].append(t), hosts[n].append(h), starts[n].append(s)
    say(rank, f"E {wire} aligned starts", summarize(names, times, hosts, starts))


def pass_c(c: dict, wire: str, rank: int, rounds: int) -> None:
    """Host split around DeepEP's C++ call (``runtime.low_latency_dispatch``) for every variant, in a fresh random
    order each round, by rank: before it, inside it (checks, allocations, the launch, stream waits), after it until
    the call returned, and the result's release (its tensors back to the caching allocator)."""
    buf = c["buf"]
    marks: list[float] = []
    runtime = getattr(buf, "runtime", None)

    class Proxy:
        def __getattr__(self, name: str) -> Any:
            return getattr(runtime, name)

        def low_latency_dispatch(self, *a: Any) -> Any:
            marks.append(perf())
            r = runtime.low_latency_dispatch(*a)
            marks.append(perf())
            return r

    if runtime is None:  # the emulation has no C++ runtime: time its Buffer method instead
        real = buf.low_latency_dispatch

        def timed_method(*a: Any, **k: Any) -> Any:
            marks.append(perf())
            r = real(*a, **k)
            marks.append(perf())
            return r
        buf.low_latency_dispatch = timed_method
    else:
        buf.runtime = Proxy()
    fns = variants(c)  # (the runtime variants read buf.runtime per call: the proxy)
    names = [n for n in fns if not n.startswith("spin") and not n.endswith("spin3")]
    split = {n: {k: [] for k in ("pre", "cpp", "post", "free", "exit")} for n in names}
    try:
        for i in range(rounds + 20):
            order = names[:]
            random.Random(10_000 + i).shuffle(order)
            for n in order:
                marks.clear()
                t0 = perf()
                r = fns[n]()
                t1 = perf()
                del r
                t2 = perf()
                if bench.DEVICE.type == "cuda":
                    torch.cuda.synchronize()
                if i >= 20:
                    s = split[n]
                    s["pre"].append((marks[0] - t0) * 1e6), s["cpp"].append((marks[1] - marks[0]) * 1e6)
                    s["post"].append((t1 - marks[1]) * 1e6), s["free"].append((t2 - t1) * 1e6)
                    s["exit"].append(marks[1])
    finally:
        if runtime is None:
            del buf.low_latency_dispatch
        else:
            buf.runtime = runtime
    out = {}
    for n, s in split.items():
        out[n] = {k: [med(r) for r in gather(s[k])] for k in ("pre", "cpp", "post", "free")}
        exit_ = gather(s["exit"])
        if len(exit_) > 1:
            out[n]["cpp_exit_skew_r1_minus_r0"] = med([(b - a) * 1e6 for a, b in zip(exit_[0], exit_[1], strict=True)])
    say(rank, f"C {wire} host split by rank [pre, cpp, post, free]", out)


def pass_d(c: dict, wire: str, rank: int, pairs: int, out_dir: pathlib.Path | None) -> None:
    """torch.profiler over pairs: kernels, runtime calls, launch and kernel offsets per call."""
    from torch.profiler import ProfilerActivity, profile, record_function

    fns = variants(c)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.DEVICE.type == "cuda" else [])
    for _ in range(10):
        for n in TRIO:
            fns[n]()
    if bench.DEVICE.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=acts) as prof:
        for i in range(pairs):
            for n in (TRIO if i % 2 == 0 else TRIO[::-1]):
                with record_function(f"{n}#{i}"):
                    fns[n]()
                if bench.DEVICE.type == "cuda":
                    torch.cuda.synchronize()
    path = pathlib.Path(f"/tmp/deepep_ll_probe_{wire}_{rank}.json")
    prof.export_chrome_trace(str(path))
    doc = json.loads(path.read_text())
    if out_dir is not None and rank == 0 and wire == "fp8":
        with gzip.open(out_dir / f"trace_{wire}_rank0.json.gz", "wt") as f:
            json.dump(doc, f)
    ev = doc["traceEvents"]
    ann = [e for e in ev if e.get("cat") == "user_annotation" and "#" in e.get("name", "")]
    runtime = [e for e in ev if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_corr = collections.defaultdict(list)
    for e in gpu:
        by_corr[e.get("args", {}).get("correlation")].append(e)
    cpu_ops = [e for e in ev if e.get("cat") == "cpu_op"]
    stats = {n: collections.defaultdict(list) for n in TRIO}
    calls = {n: collections.Counter() for n in stats}
    durs = {n: collections.defaultdict(list) for n in stats}  # host us of each runtime call / aten op by name
    kernels = {n: collections.Counter() for n in stats}
    for a in ann:
        n = a["name"].split("#")[0]
        t0, t1 = a["ts"], a["ts"] + a["dur"]
        inside = [r for r in runtime if t0 <= r["ts"] <= t1]
        calls[n].update(r["name"] for r in inside)
        for r in inside + [o for o in cpu_ops if t0 <= o["ts"] <= t1]:
            durs[n][r["name"]].append(r["dur"])
        ks = [k for r in inside for k in by_corr.get(r.get("args", {}).get("correlation"), [])]
        kernels[n].update(k["name"][:60] for k in ks)
        s = stats[n]
        s["host"].append(a["dur"])
        launches = [r for r in inside if "Launch" in r["name"]]
        if launches:
            s["launch_at"].append(launches[0]["ts"] - t0)
        if ks:
            k = max(ks, key=lambda k: k["dur"])
            s["kernel_at"].append(k["ts"] - t0), s["kernel_dur"].append(k["dur"])
            s["kernel_end_at"].append(k["ts"] + k["dur"] - t0), s["n_gpu_ops"].append(len(ks))
    calls_per = {n: {k: round(v / max(len(stats[n]["host"]), 1), 2) for k, v in sorted(calls[n].items())} for n in calls}
    summary = {n: {k: med(v) for k, v in s.items()} for n, s in stats.items()}
    say(rank, f"D {wire} profile rank0", {"medians_us": summary, "runtime_calls_per_call": calls_per,
                                          "gpu_ops": {n: dict(k) for n, k in kernels.items()}})
    say(rank, f"D {wire} host us per runtime call / aten op (median, rank0)",
        {n: {k: med(v) for k, v in sorted(dd.items())} for n, dd in durs.items()})
    # rank 1's medians too (its kernels wait for rank 0's send)
    vals = torch.tensor([summary[n].get(k, float("nan")) for n in stats
                         for k in ("host", "launch_at", "kernel_at", "kernel_dur", "kernel_end_at")],
                        dtype=torch.float64, device=bench.DEVICE)
    allv = [torch.empty_like(vals) for _ in range(dist.get_world_size())]
    dist.all_gather(allv, vals)
    say(rank, f"D {wire} profile by rank [host, launch_at, kernel_at, kernel_dur, kernel_end_at]",
        {n: [[round(v, 2) for v in r.tolist()[j * 5:(j + 1) * 5]] for r in allv] for j, n in enumerate(stats)})


def setup_normal(rank: int, world: int) -> dict:
    """Normal mode's case, its dispatcher declared before the low-latency ones: the group's one buffer is built
    for both needs at the first call (a later, larger need would rebuild it, NVSHMEM included)."""
    tokens = 4096 if bench.DEVICE.type == "cuda" else 37
    gen = torch.Generator(device=bench.DEVICE).manual_seed(2000 + rank)
    x = torch.randn(tokens, bench.H, device=bench.DEVICE, generator=gen).to(torch.bfloat16)
    ids64 = torch.rand(tokens, bench.E, device=bench.DEVICE, generator=gen).topk(bench.K, dim=1).indices
    w = torch.rand(tokens, bench.K, device=bench.DEVICE, generator=gen)
    w = w / w.sum(1, keepdim=True)
    return dict(x=x, ids64=ids64, w=w, topk=TopK(w, ids64),
                d=bench.dispatcher("deepep", "normal", "bf16", tokens, rank, world))


def pass_f(c: dict, rank: int, pairs: int) -> None:
    """Normal mode, bf16, 4096 tokens (the bench's case): host time per call and where it goes (profiler's CPU
    ops by self time, CUDA runtime calls per call) for moe-core and the direct calls."""
    from torch.profiler import ProfilerActivity, profile, record_function

    x, ids64, w, topk, d = c["x"], c["ids64"], c["w"], c["topk"], c["d"]
    d.dispatch(x, topk)
    buf = d.buffer
    fns = {"direct": lambda: bench.direct_normal_dispatch(buf, x, ids64, w, False), "moe_core": lambda: d.dispatch(x, topk)}
    timer = Timer()
    times, hosts, starts = ({n: [] for n in fns} for _ in range(3))
    for i in range(10 + pairs):
        for n in (("direct", "moe_core") if i % 2 == 0 else ("moe_core", "direct")):
            t, h, s = timer(fns[n])
            if i >= 10:
                times[n].append(t), hosts[n].append(h), starts[n].append(s)
    say(rank, "F normal bf16 dispatch", summarize(list(fns), times, hosts, starts))
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if bench.DEVICE.type == "cuda" else [])
    for n, fn in fns.items():
        with profile(activities=acts) as prof:
            for _ in range(20):
                with record_function(n):
                    fn()
                if bench.DEVICE.type == "cuda":
                    torch.cuda.synchronize()
        ka = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)
        top = [(e.key[:48], e.count // 20 if e.count >= 20 else round(e.count / 20, 2), round(e.self_cpu_time_total / 20, 1))
               for e in ka[:16]]
        say(rank, f"F {n} ops [name, per call, self cpu us per call]", {"top": top})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=1500)
    ap.add_argument("--pairs", type=int, default=1000)
    ap.add_argument("--profile-pairs", type=int, default=100)
    ap.add_argument("--no-normal", action="store_true", help="skip pass F (normal mode)")
    ap.add_argument("--smoke", action="store_true", help="CPU, gloo, the emulated deep_ep (tests the script)")
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.smoke:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "plugins/cuda/tests/emulation"))
        import deep_ep_emulation

        deep_ep_emulation.install_into_process()
        bench.DEVICE, bench.E, bench.H = torch.device("cpu"), 32, 2048
        dist.init_process_group("gloo")
    else:
        bench.DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(bench.DEVICE)
        dist.init_process_group("nccl", device_id=bench.DEVICE)
    out_dir = pathlib.Path(args.out) if args.out else None
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
    normal = None if args.no_normal else setup_normal(rank, world)
    cases = {wire: setup(wire, rank, world) for wire in ("fp8", "bf16")}
    dist.barrier()
    say(rank, "pinning", bench.pin_main_thread(int(os.environ.get("LOCAL_RANK", rank))))
    time.sleep(0 if args.smoke else 2)
    name = torch.cuda.get_device_name(bench.DEVICE) if bench.DEVICE.type == "cuda" else "CPU (emulated)"
    entry = cases["fp8"]["d"]._entry
    say(rank, "device", {"device": f"{world}x {name}", "torch": torch.__version__,
                         "wraps_runtime": getattr(entry, "wraps_runtime", None),
                         "hot_path_ready": entry.low_latency_ready is not None})
    gc.collect()
    gc.disable()
    try:
        for wire in ("fp8", "bf16"):
            pass_a(cases[wire], wire, rank, args.rounds, 20)
        for wire in ("fp8", "bf16"):
            pass_b(cases[wire], wire, rank, args.pairs, 20)
            pass_c(cases[wire], wire, rank, args.pairs // 2)
            pass_e(cases[wire], wire, rank, args.pairs // 2, 20)
        for wire in ("fp8", "bf16"):
            pass_d(cases[wire], wire, rank, args.profile_pairs, out_dir)
        if not args.no_normal:
            pass_f(normal, rank, 100)
    finally:
        gc.enable()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
