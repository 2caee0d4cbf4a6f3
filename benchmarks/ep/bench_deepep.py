"""Dispatch and combine through moe-core's ``deepep`` against DeepEP's own kernels called directly on the
same buffer with the same tokens, ``torch_a2a``, and a raw ``all_to_all_single`` of the same bytes.

    torchrun --nproc-per-node 2 benchmarks/ep/bench_deepep.py --out deepep-h100x2.json [--cases-passed N --cases-total M]

Cases (issue #30): normal mode, 4096 tokens a rank, hidden 7168, top-8 of 256, BF16 and FP8 wire;
low latency, 128 tokens a rank, same shape, BF16 and FP8. Each stage is timed with CUDA events
around one call from an idle GPU (synchronized after each call): the latency of a call when the GPU waits
for it, where every us of host work before DeepEP's launch counts in full. Host work after the launch
counts only where the host returns after the kernel ended (``*_host_us`` against the column: in the
2026-11-26 runs the low-latency host time, ~20-40 us, ended well inside the ~50-80 us window); an eager
loop bound by the host pays the whole host time instead (the ``*_host_us`` columns). moe-core and the
direct call alternate call by call, in pairs whose order alternates too (A B, B A, ...), ``--pairs``
(normal mode) or ``--ll-pairs`` (low latency) of them after ``--warmup``, with Python's garbage collector
off: drift and the previous call's after-effects hit both columns alike. A call's time is the slower rank's
(the collective's: both ranks make the same calls in step, and a kernel waits for the later rank's launch),
and each column is the median of those; ``pair_ratio`` is the median of the per-pair ratios moe-core /
direct of the same times, ``pair_ratio_blocks`` the least and most of it over 4 consecutive blocks of the
pairs (the spread within the run). The bar reads the columns (issue #30); ``pair_ratio`` shows whether
their ratio holds pair by pair or is drift. Each rank's Python thread runs alone on a core
(``pin_main_thread``): the slower rank's host decides each call. ``torch_a2a`` and the raw all-to-all are
timed on their own, up to 400 calls each. Diagnostics: each column's host time per call and its host time
until DeepEP's C++ runtime is entered (``*_pre_us``, the max over ranks of each rank's median, and by
rank). "direct"
does what a DeepEP user does
for the same result: the FP8 normal wire is quantized with the same function before
``get_dispatch_layout`` + ``dispatch``; low latency calls ``low_latency_dispatch`` / ``_combine``.
Both columns get the same int64 ids (``torch.topk``'s, as a router hands them to ``TopK``). What
moe-core does beyond the direct calls is what the dispatcher contract requires: normal dispatch hands
the experts int32 local ids (one cast kernel) and the per-expert counts on the device (one copy from
pinned memory) in typed results; low latency adds no GPU work, only the host's checks and results.
The combine input (``EPNormalCombine`` / ``EPMaskedCombine``) is what the experts stage returns: it
is made once, outside the timing, as DeepEP's direct combine gets its tensors ready-made.
``benchmarks/ep/deepep_host_time.py`` measures that host path on the CPU.
Raw bytes: the rows each rank sends (token x destination rank for normal mode, token x expert for
low latency), at the wire's row size, split evenly over ranks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import statistics
import sys
import threading
import time
from typing import Callable

import torch
import torch.distributed as dist

from moe_core.config import MoEConfig
from moe_core.contracts import EPMaskedCombine, EPNormalCombine, TopK
from moe_core.planner import plan as make_plan
from moe_core.quant import quantize_fp8_per_token_group

E, K, H = 256, 8, 7168
DEVICE = torch.device("cuda")


class Timer:
    """One call timed from an idle GPU: CUDA events around it, then a sync (wall clock in the CPU smoke
    run). Returns (us, host us): the host part ends when the call returned (the GPU may still run)."""

    def __init__(self) -> None:
        cuda = DEVICE.type == "cuda"
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else None

    def __call__(self, fn: Callable[[], object]) -> tuple[float, float]:
        if self.events is None:
            t0 = time.perf_counter()
            fn()
            us = (time.perf_counter() - t0) * 1e6
            return us, us
        a, b = self.events
        a.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) * 1e3, (t1 - t0) * 1e6


def timed(fn: Callable[[], object], iters: int, warmup: int) -> list[float]:
    """Microseconds per call, ``iters`` calls after ``warmup``."""
    timer = Timer()
    out = [timer(fn)[0] for _ in range(warmup + iters)]
    return out[warmup:]


def timed_pairs(fa: Callable[[], object], fb: Callable[[], object], pairs: int, warmup: int
                ) -> tuple[list[float], list[float], list[float], list[float]]:
    """``fa`` and ``fb`` alternated call by call (A B, then B A, ...): each one's times and host times."""
    timer = Timer()
    ta, tb, ha, hb = [], [], [], []
    for i in range(warmup + pairs):
        if i % 2:
            (b, hb_), (a, ha_) = timer(fb), timer(fa)
        else:
            (a, ha_), (b, hb_) = timer(fa), timer(fb)
        if i >= warmup:
            ta.append(a), tb.append(b), ha.append(ha_), hb.append(hb_)
    return ta, tb, ha, hb


DEEPEP_METHODS = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine")


class _MarkFirst:
    """``buffer.runtime`` (DeepEP's C++ object) as seen through a proxy that notes when a call first reaches it."""

    def __init__(self, runtime, mark: Callable[[], None]) -> None:
        self._runtime, self._mark = runtime, mark

    def __getattr__(self, name: str):
        real = getattr(self._runtime, name)
        if not callable(real):
            return real

        def marked(*args, **kwargs):
            self._mark()
            return real(*args, **kwargs)
        return marked


def pre_launch_pairs(fa: Callable[[], object], fb: Callable[[], object], buf,
                     pairs: int) -> tuple[list[float], list[float]]:
    """Host us from each call's start to DeepEP's C++ runtime (``Buffer.runtime``, which every ``Buffer`` method
    of the real library calls and moe-core's low-latency dispatch calls itself: docs/decisions.md entry 69), ``fa``
    and ``fb`` alternated as in ``timed_pairs``: how long the GPU idles before DeepEP's C++ host code starts, in a
    call from an idle GPU. DeepEP's Python wrapper counts for the direct column, as a direct call pays it. The
    emulation's methods mostly do not reach a runtime: there each method's entry counts too (the smoke run). The
    proxy and the wrappers are set on the instance for these calls only (the same for both columns)."""
    first: list[float] = []

    def mark() -> None:
        if not first:
            first.append(time.perf_counter())

    def wrap(real: Callable) -> Callable:
        def wrapped(*args, **kwargs):
            mark()
            return real(*args, **kwargs)
        return wrapped

    def one(fn: Callable[[], object]) -> float:
        first.clear()
        t0 = time.perf_counter()
        fn()
        if DEVICE.type == "cuda":
            torch.cuda.synchronize()
        return (first[0] - t0) * 1e6

    runtime = getattr(buf, "runtime", None)
    methods = DEEPEP_METHODS if runtime is None or getattr(sys.modules["deep_ep"], "EMULATED", False) else ()
    if runtime is not None:
        buf.runtime = _MarkFirst(runtime, mark)
    for name in methods:
        setattr(buf, name, wrap(getattr(buf, name)))
    try:
        ta, tb = [], []
        for i in range(pairs):
            if i % 2:
                b, a = one(fb), one(fa)
            else:
                a, b = one(fa), one(fb)
            ta.append(a), tb.append(b)
        return ta, tb
    finally:
        for name in methods:
            delattr(buf, name)
        if runtime is not None:
            buf.runtime = runtime


def host_probe(x: torch.Tensor, topk: TopK) -> dict:
    """ns per call of host operations on moe-core's low-latency hot path, on this machine (timeit, best of 5)."""
    import timeit

    ops = {"ids_int64": lambda: topk.ids_int64(False), "x.shape": lambda: x.shape,
           "x.is_contiguous": x.is_contiguous, "is_dynamo_compiling": torch.compiler.is_dynamo_compiling,
           "empty_lambda": lambda: None}
    if x.is_cuda:
        ops["is_current_stream_capturing"] = torch.cuda.is_current_stream_capturing
        ops["_cuda_isCurrentStreamCapturing"] = torch._C._cuda_isCurrentStreamCapturing
        ops["_cuda_getCurrentRawStream(-1)"] = lambda: torch._C._cuda_getCurrentRawStream(-1)
    return {k: round(min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e9, 1) for k, f in ops.items()}


def median_over_ranks(samples: list[float]) -> float:
    """The max over ranks of each rank's median."""
    t = torch.tensor([statistics.median(samples)], dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def slowest_rank(samples: list[float]) -> list[float]:
    """Each call's time on the slower rank: the collective's time (every rank made the same calls in step)."""
    t = torch.tensor(samples, dtype=torch.float64, device=DEVICE)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def per_rank(value: float) -> list[float]:
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64, device=DEVICE)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return [round(v, 2) for v in t.tolist()]


def smt_siblings(cpu: int) -> set[int]:
    """The logical CPUs sharing ``cpu``'s physical core (Linux sysfs; just ``cpu`` where it cannot tell)."""
    try:
        text = pathlib.Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list").read_text().strip()
    except OSError:
        return {cpu}
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out | {cpu}


def pin_main_thread(local_rank: int) -> dict:
    """This rank's Python thread alone on one physical core, the process's other threads (NCCL's, NVSHMEM's
    proxies, torch's) off the ranks' cores and off their SMT siblings: a quiet host for both columns alike.
    moe-core's extra cost is host time before DeepEP's launch and the later rank's launch decides a collective's
    time (docs/decisions.md entry 69), so a rank whose thread shared a core ran the same calls up to 2x slower (run
    2's repeat, 2026-11-26: pre-launch 5.2 vs 2.6 us by rank). With only the core itself reserved, rank 0 still ran
    the same direct calls 1.55x slower than rank 1 (13:24 probe on 2x H100; the cause is not known, an SMT sibling
    shared with another thread would be one): the siblings are now kept free too, and the JSON names them. The run
    script keeps the CUTLASS build off the first 4 CPUs and lets it finish before the bench. Returns what it did
    (for the JSON)."""
    if not hasattr(os, "sched_setaffinity"):
        return {"pinned": False}
    allowed = sorted(os.sched_getaffinity(0))
    world_local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    taken = smt_siblings(allowed[0]) | smt_siblings(allowed[1])  # (CPUs 0-1: interrupts, the run script's work)
    picked: list[set[int]] = []
    for cpu in allowed[2:]:  # one logical CPU per rank, on physical cores nothing else is pinned to
        if len(picked) == world_local:
            break
        group = smt_siblings(cpu) & set(allowed)
        if not group & taken:
            picked.append(group)
            taken |= group
    rest = [c for c in allowed if not any(c in g for g in picked)]
    if len(picked) < world_local or len(rest) < 2:
        return {"pinned": False, "cores": len(allowed)}
    core = min(picked[local_rank])
    main = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        try:
            os.sched_setaffinity(tid, {core} if tid == main else rest)
        except OSError:  # a thread that ended meanwhile
            pass
    return {"pinned": True, "core": core, "kept_free": sorted(picked[local_rank] - {core}),
            "other_threads_on": f"{len(rest)} CPUs, none on the ranks' physical cores"}


def dispatcher(name: str, mode: str, wire: str, tokens: int, rank: int, world: int):
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=256,
                    quant="fp8_block" if wire == "fp8" else "unquantized", ep_size=world, ep_rank=rank,
                    ep_group=dist.group.WORLD, max_tokens_per_rank=tokens, device="cuda", dispatcher=name,
                    experts="reference", dispatch_dtype=wire,
                    dispatch_format="ep_masked" if mode == "low_latency" else "ep_normal")
    return make_plan(cfg).build()[0]


def direct_normal_dispatch(buf, x: torch.Tensor, ids64: torch.Tensor, w: torch.Tensor, fp8: bool):
    """DeepEP's normal dispatch called by hand, as its README does: the layout, then the dispatch."""
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(ids64, E)
    payload = quantize_fp8_per_token_group(x) if fp8 else x
    return buf.dispatch(payload, topk_idx=ids64, topk_weights=w, num_tokens_per_rank=per_rank,
                        num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert)


def run_case(mode: str, wire: str, tokens: int, rank: int, world: int, pairs: int, warmup: int) -> list[dict]:
    gen = torch.Generator(device=DEVICE).manual_seed(1000 + rank)
    x = torch.randn(tokens, H, device=DEVICE, generator=gen).to(torch.bfloat16)
    scores = torch.rand(tokens, E, device=DEVICE, generator=gen)
    ids64 = scores.topk(K, dim=1).indices
    w = torch.rand(tokens, K, device=DEVICE, generator=gen)
    w = w / w.sum(1, keepdim=True)
    topk = TopK(w, ids64)  # as a router hands it over: int64 ids, TopK keeps them for DeepEP (ids_int64)
    d = dispatcher("deepep", mode, wire, tokens, rank, world)
    a2a = dispatcher("torch_a2a", mode, wire, tokens, rank, world)
    buf = d.buffer
    fp8 = wire == "fp8"
    rows = {}

    if mode == "normal":
        out = d.dispatch(x, topk)
        y = out.hidden.dequantize(torch.bfloat16).contiguous()
        handle = out.handle

        def direct_dispatch():
            return direct_normal_dispatch(buf, x, ids64, w, fp8)

        recv = direct_dispatch()
        direct_y, direct_handle = (recv[0][0] if fp8 else recv[0]).to(torch.bfloat16), recv[4]
        stages = {
            "dispatch": (lambda: d.dispatch(x, topk), direct_dispatch, lambda: a2a.dispatch(x, topk)),
            "combine": (lambda ci=EPNormalCombine(y, handle): d.combine(ci),
                        lambda: buf.combine(direct_y, direct_handle),
                        None),
        }
        a_out = a2a.dispatch(x, topk)
        a_y = a_out.hidden.dequantize(torch.bfloat16)
        stages["combine"] = stages["combine"][:2] + (lambda ci=EPNormalCombine(a_y, a_out.handle): a2a.combine(ci),)
        local = E // world
        dests = torch.stack([((ids64 >= r * local) & (ids64 < (r + 1) * local)).any(1) for r in range(world)], 1)
        rows["dispatch"] = int(dests.sum())
        rows["combine"] = int(dests.sum())
    else:
        num_max = d.num_max
        out = d.dispatch(x, topk)
        y = out.hidden.dequantize(torch.bfloat16).contiguous()
        handle = out.handle

        def direct_dispatch():
            return buf.low_latency_dispatch(x, ids64, num_max, E, use_fp8=fp8)

        recv = direct_dispatch()
        direct_handle = recv[2]
        stages = {
            "dispatch": (lambda: d.dispatch(x, topk), direct_dispatch, lambda: a2a.dispatch(x, topk)),
            "combine": (lambda ci=EPMaskedCombine(y, topk, handle): d.combine(ci),
                        lambda: buf.low_latency_combine(y, ids64, w, direct_handle), None),
        }
        a_out = a2a.dispatch(x, topk)
        a_y = a_out.hidden.dequantize(torch.bfloat16)
        stages["combine"] = stages["combine"][:2] + (lambda ci=EPMaskedCombine(a_y, topk, a_out.handle): a2a.combine(ci),)
        rows["dispatch"] = rows["combine"] = int((ids64 >= 0).sum())

    results = []
    for stage, (mc, direct, ta) in stages.items():
        row_bytes = (H + H // 128 * 4) if (fp8 and stage == "dispatch") else H * 2
        nbytes = rows[stage] * row_bytes
        chunk = -(-nbytes // world)
        send = torch.empty(chunk * world, dtype=torch.uint8, device=DEVICE)
        recv_raw = torch.empty_like(send)
        gc.collect()
        gc.disable()  # (as timeit does: a collection inside one column's call would be noise)
        try:
            mc_t, dir_t, mc_host, dir_host = timed_pairs(mc, direct, pairs, warmup)
            mc_pre, dir_pre = pre_launch_pairs(mc, direct, buf, max(pairs // 2, 1))
            ta_t = timed(ta, min(pairs, 400), warmup)
            raw_t = timed(lambda r=recv_raw, s=send: dist.all_to_all_single(r, s), min(pairs, 400), warmup)
        finally:
            gc.enable()
        mc_t, dir_t, ta_t, raw_t = map(slowest_rank, (mc_t, dir_t, ta_t, raw_t))
        ratios = [m / d for m, d in zip(mc_t, dir_t, strict=True)]
        n = len(ratios) // 4
        blocks = [statistics.median(ratios[i * n:(i + 1) * n]) for i in range(4)] if n else [statistics.median(ratios)]
        results.append({"mode": mode, "wire": wire, "tokens_per_rank": tokens, "stage": stage,
                        "moe_core_us": round(statistics.median(mc_t), 2),
                        "deepep_direct_us": round(statistics.median(dir_t), 2),
                        "torch_a2a_us": round(statistics.median(ta_t), 2),
                        "raw_a2a_us": round(statistics.median(raw_t), 2),
                        # diagnostics: the median of the per-pair ratios (robust to drift), the pairs
                        # timed, how long each call kept the host (a moe-core - direct gap as large here
                        # as in the *_us columns is host time, not GPU work)
                        "pair_ratio": round(statistics.median(ratios), 4),
                        # the pairs' ratio in 4 consecutive blocks (least, most): drift within the run
                        "pair_ratio_blocks": [round(min(blocks), 4), round(max(blocks), 4)],
                        "pairs": pairs,
                        "moe_core_host_us": round(median_over_ranks(mc_host), 2),
                        "deepep_direct_host_us": round(median_over_ranks(dir_host), 2),
                        # until DeepEP's C++ runtime: the host work before the launch (the direct call's Python wrapper included)
                        "moe_core_pre_us": round(median_over_ranks(mc_pre), 2),
                        "deepep_direct_pre_us": round(median_over_ranks(dir_pre), 2),
                        "pre_us_by_rank": {"moe_core": per_rank(statistics.median(mc_pre)),
                                           "direct": per_rank(statistics.median(dir_pre))}})
        if rank == 0:
            print(json.dumps(results[-1]), flush=True)
    if mode == "low_latency" and wire == "bf16" and rank == 0:
        print("HOST_PROBE_NS " + json.dumps(host_probe(x, topk)), flush=True)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--pairs", type=int, default=400,
                    help="(moe-core, direct) pairs timed per stage, alternated call by call; also the calls "
                         "timed for torch_a2a and the raw all-to-all")
    ap.add_argument("--ll-pairs", type=int, default=2000,
                    help="pairs timed per low-latency stage (a call is ~60 us: more pairs for the same seconds)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--cases-passed", type=int, default=None)
    ap.add_argument("--cases-total", type=int, default=None)
    ap.add_argument("--smoke", action="store_true",
                    help="CPU, gloo, the emulated deep_ep, hidden 2048, 32 experts, few tokens (tests the script)")
    args = ap.parse_args()
    global DEVICE, E, H
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    sizes = (("normal", 4096), ("low_latency", 128))
    if args.smoke:
        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "plugins/cuda/tests/emulation"))
        import deep_ep_emulation

        deep_ep_emulation.install_into_process()
        DEVICE, E, H, sizes = torch.device("cpu"), 32, 2048, (("normal", 37), ("low_latency", 12))
        dist.init_process_group("gloo")
    else:
        DEVICE = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(DEVICE)
        dist.init_process_group("nccl", device_id=DEVICE)
    import deep_ep

    # the group's buffer, built once for every case's need before any timing (the low-latency need makes DeepEP
    # start NVSHMEM), then a pause: the first low-latency case of run 1 found the host slower, direct calls too
    prelude = [dispatcher("deepep", mode, "bf16", tokens, rank, world) for mode, tokens in sizes]
    built = prelude[0].buffer
    dist.barrier()
    pinning = pin_main_thread(int(os.environ.get("LOCAL_RANK", rank)))
    time.sleep(0 if args.smoke else 2)
    del prelude, built
    rows = []
    for mode, tokens in sizes:
        for wire in ("bf16", "fp8"):
            pairs = args.pairs if mode == "normal" else args.ll_pairs
            rows += run_case(mode, wire, tokens, rank, world, pairs, args.warmup)
    if rank == 0:
        version = getattr(deep_ep, "__version__", None) or "1.2.1 (built from source, tag commit 9af0e0d)"
        name = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU (emulated deep_ep, smoke)"
        doc = {"device": f"{world}x {name}, torch {torch.__version__}",
               "deep_ep_version": version, "cases_passed": args.cases_passed, "cases_total": args.cases_total,
               "host_pinning_rank0": pinning,
               "rows": rows}
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {args.out}")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
