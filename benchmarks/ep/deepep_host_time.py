"""Host time and extra torch ops of moe-core's ``deepep`` dispatch / combine against DeepEP's ``Buffer``
called directly (what ``bench_deepep.py`` compares), with DeepEP's own calls taken out.

    python benchmarks/ep/deepep_host_time.py [--iters 2000] [--profile]

CPU only, two processes (gloo on 127.0.0.1; rank 0 prints), the emulated ``deep_ep`` (plugins/cuda/tests/emulation). Each
``Buffer`` method is replaced by a replay of its first result, so what is timed is only the Python
and torch work around DeepEP: moe-core's path against the direct calls of ``bench_deepep.py``, same
shape as there (hidden 7168, top-8 of 256; 128 tokens in low latency, normal mode's 4096 cut to
``--normal-tokens`` 256 by default, as a CPU's own op time would hide the host path). Besides the host time
(us: the least of 5 medians of ``--iters`` / 5 calls each), it lists the torch ops that run outside DeepEP's calls (under
``TorchDispatchMode``; views and metadata excluded): on a GPU each is a kernel launch (~5 us of host
time, a few us of GPU time), which a sync-per-call timing counts in full, and the Python bytecodes each call
runs (in all and before its first DeepEP call; a count, so unlike the times it does not move with the
machine's load). ``--profile`` prints
cProfile's top functions of the moe-core calls. Numbers are this CPU's, not a GPU host's: compare
the two columns and the op lists, not the absolute values.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import pathlib
import pstats
import socket
import statistics
import sys
import time
import types
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "plugins/cuda/tests/emulation"))

import deep_ep_emulation  # noqa: E402
from bench_deepep import E, H, K, direct_normal_dispatch, dispatcher  # noqa: E402  (the same case as the GPU bench)
from moe_plugin_cuda.deepep import wraps_runtime_dispatch  # noqa: E402

from moe_core.contracts import EPMaskedCombine, EPNormalCombine, TopK  # noqa: E402

# ops that launch no kernel on a GPU (views, metadata, no-op casts are not even dispatched)
NO_KERNEL = {"aten.view.default", "aten._unsafe_view.default", "aten.slice.Tensor", "aten.select.int",
             "aten.unsqueeze.default", "aten.reshape.default", "aten.alias.default", "aten.detach.default",
             "aten.t.default", "aten.transpose.int", "aten.expand.default", "aten.permute.default",
             "aten.empty.memory_format", "aten.empty_strided.default", "aten.split.Tensor", "aten.unbind.int",
             "aten.view_as.default", "aten.lift_fresh.default", "aten.as_strided.default"}


FIRST_CALL: list[Optional[float]] = [None]  # when the timed call first reached DeepEP (perf_counter)


class Replay:
    """A ``deep_ep.Buffer`` whose methods return their first (real, emulated) result again."""

    def __init__(self, buffer: Any) -> None:
        self._buffer, self._cache = buffer, {}
        self._wrapper = wraps_runtime_dispatch(type(buffer))  # (so its wrapper runs, around the replayed runtime)

    def __getattr__(self, name: str) -> Any:
        real = getattr(self._buffer, name)
        if name == "runtime":  # DeepEP's C++ object, which moe-core's low-latency hot path calls (entry 69)
            if name not in self._cache:
                self._cache[name] = Replay(real)
            return self._cache[name]
        if name == "low_latency_dispatch" and self._wrapper:
            # DeepEP's Python wrapper runs (a direct call pays it) around its replayed C++ call
            return types.MethodType(type(self._buffer).low_latency_dispatch, self)
        if not callable(real):
            return real

        def replay(*args: Any, **kwargs: Any) -> Any:
            if FIRST_CALL[0] is None:
                FIRST_CALL[0] = time.perf_counter()
            if name not in self._cache:
                self._cache[name] = real(*args, **kwargs)
            return self._cache[name]
        return replay


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in NO_KERNEL:
            self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def host_us(fn: Callable[[], Any], iters: int) -> tuple[float, float]:
    """(whole call, until its first DeepEP call) in us: the least of 5 block medians (other load on
    the machine only adds). Before its first launch the GPU idles in a sync-per-call timing."""
    for _ in range(5):
        fn()
    blocks = []
    for _ in range(5):
        whole, before = [], []
        for _ in range(max(iters // 5, 1)):
            FIRST_CALL[0] = None
            t0 = time.perf_counter()
            fn()
            t1 = time.perf_counter()
            whole.append((t1 - t0) * 1e6)
            before.append(((FIRST_CALL[0] or t1) - t0) * 1e6)
        blocks.append((statistics.median(whole), statistics.median(before)))
    return min(b[0] for b in blocks), min(b[1] for b in blocks)


def bytecodes(fn: Callable[[], Any]) -> tuple[int, int]:
    """(Python bytecodes the call ran, of which before its first DeepEP call), DeepEP's stand-in
    (``Replay``) not counted: the host path's work counted exactly, unlike times on a loaded CPU (a C
    call such as ``x.shape`` counts as one, so it is a proxy, not a time)."""
    skip = {Replay.__getattr__.__code__, Replay.__init__.__code__}
    counts = [0, 0]

    def trace(frame: Any, event: str, arg: Any) -> Any:
        if event == "call":
            if frame.f_code in skip or frame.f_code.co_name == "replay":
                return None
            frame.f_trace_opcodes = True
        elif event == "opcode":
            counts[0] += 1
            if FIRST_CALL[0] is None:
                counts[1] += 1
        return trace

    FIRST_CALL[0] = None
    sys.settrace(trace)
    try:
        fn()
    finally:
        sys.settrace(None)
    return counts[0], counts[1]


def ops_of(fn: Callable[[], Any]) -> dict[str, int]:
    with CountOps() as mode:
        fn()
    return dict(mode.ops)


def case(mode: str, wire: str, tokens: int, args: argparse.Namespace) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
    d = dispatcher("deepep", mode, wire, tokens, dist.get_rank(), dist.get_world_size())
    gen = torch.Generator().manual_seed(1000)
    x = torch.randn(tokens, H, generator=gen).to(torch.bfloat16)
    ids64 = torch.rand(tokens, E, generator=gen).topk(K, dim=1).indices
    w = torch.rand(tokens, K, generator=gen)
    w = w / w.sum(1, keepdim=True)
    topk = TopK(w, ids64) if args.int64_ids else TopK(w, ids64.int())
    real = d.buffer
    buf = Replay(real._buffer if isinstance(real, Replay) else real)  # the group's buffer, last case's replay off
    d._entry.buffer = buf  # moe-core's calls go to the same replaying buffer
    d._entry.low_latency_ready = None  # (the low-latency hot path's buffer: set again at the next call)
    fp8 = wire == "fp8"
    if mode == "normal":
        out = d.dispatch(x, topk)
        y = out.hidden.dequantize(torch.bfloat16).contiguous()

        def direct_dispatch():
            return direct_normal_dispatch(buf, x, ids64, w, fp8)

        handle = direct_dispatch()[4]
        return {"dispatch": (lambda: d.dispatch(x, topk), direct_dispatch),  # the experts' output, made once:
                "combine": (lambda ci=EPNormalCombine(y, out.handle): d.combine(ci), lambda: buf.combine(y, handle))}
    out = d.dispatch(x, topk)
    y = out.hidden.dequantize(torch.bfloat16).contiguous()
    handle = buf.low_latency_dispatch(x, ids64, d.num_max, E, use_fp8=fp8)[2]
    return {"dispatch": (lambda: d.dispatch(x, topk),
                         lambda: buf.low_latency_dispatch(x, ids64, d.num_max, E, use_fp8=fp8)),
            "combine": (lambda ci=EPMaskedCombine(y, topk, out.handle): d.combine(ci),
                        lambda: buf.low_latency_combine(y, ids64, w, handle))}


def worker(rank: int, port: int, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    deep_ep_emulation.install_into_process(stream_order=False)  # its torch function mode would slow every op
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"normal mode {args.normal_tokens} tokens, low latency 128; least of 5 medians of {args.iters // 5} calls; "
        f"TopK from {'int64' if args.int64_ids else 'int32'} ids", flush=True)
    say("| mode | wire | stage | host us: moe-core / direct | of which before DeepEP's first call | "
        "Python bytecodes: moe-core / direct (before DeepEP's first call) | "
        "torch ops outside DeepEP: moe-core / direct |\n|---|---|---|---|---|---|---|")
    for mode, tokens in (("normal", args.normal_tokens), ("low_latency", 128)):
        if mode not in args.modes:
            continue
        for wire in ("bf16", "fp8"):
            for stage, (mc, direct) in case(mode, wire, tokens, args).items():
                (m_us, m_pre), (d_us, d_pre) = host_us(mc, args.iters), host_us(direct, args.iters)
                (m_bc, m_bc_pre), (d_bc, d_bc_pre) = bytecodes(mc), bytecodes(direct)
                m_ops, d_ops = ops_of(mc), ops_of(direct)
                extra = collections.Counter(m_ops) - collections.Counter(d_ops)
                fmt = ", ".join(f"{k.removeprefix('aten.')} x{v}" for k, v in sorted(extra.items())) or "none"
                say(f"| {mode} | {wire} | {stage} | {m_us:.1f} / {d_us:.1f} | {m_pre:.1f} / {d_pre:.1f} | "
                    f"{m_bc} / {d_bc} ({m_bc_pre} / {d_bc_pre}) | "
                      f"{sum(m_ops.values())} / {sum(d_ops.values())} (extra: {fmt}) |", flush=True)
                if args.profile and rank == 0:
                    prof = cProfile.Profile()
                    prof.runcall(lambda mc=mc: [mc() for _ in range(200)])
                    pstats.Stats(prof).sort_stats("tottime").print_stats(12)
        dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--normal-tokens", type=int, default=256,
                    help="normal mode's tokens a rank (the bench's 4096 makes the CPU's own op time dominate)")
    ap.add_argument("--int32-ids", dest="int64_ids", action="store_false",
                    help="moe-core's TopK made from int32 ids (default: int64, as a router hands them over)")
    ap.add_argument("--modes", nargs="+", choices=("normal", "low_latency"), default=("normal", "low_latency"))
    ap.add_argument("--profile", action="store_true", help="cProfile's top functions of each moe-core call")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, args), nprocs=2, join=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
