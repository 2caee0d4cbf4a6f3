"""Where the host time of ``torch_a2a`` normal dispatch goes, without a profiler (it inflates host time).

    PYTHONPATH=. python benchmarks/ep/host_time.py --world 2 [--tokens 128 4096]

Each rank runs normal dispatch + combine with DeepSeek-V3 sizes; the module's helpers, the
collectives and the host read are wrapped with ``perf_counter`` timers (host time per call, the
host read's time is mostly the wait for the GPU). Then the same with the layout math eager
(``_fused_layout`` off) to see what a compiled call costs on the host (``--variants`` sets the
order; repeat them to see the run-to-run spread). Rank 0 prints the table.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from moe_core import MoEConfig, TopK  # noqa: E402
from moe_core.backends import BackendSpec, Role  # noqa: E402
from moe_core.contracts import EPNormalCombine, Format, WireDtype  # noqa: E402
from moe_core.distributed import TorchA2ADispatcher, torch_a2a  # noqa: E402
from moe_core.runtime import BackendContext  # noqa: E402

TIMES: dict[str, list[float]] = collections.defaultdict(list)


def _timer(name, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            TIMES[name].append((time.perf_counter() - t0) * 1e6)
    return run


def _instrument() -> None:
    for name in ("_normal_layout", "_sources", "_gather_rows", "_a2a"):
        setattr(torch_a2a, name, _timer(name, getattr(torch_a2a, name)))
    fast = torch_a2a._fast
    torch_a2a._fast = lambda fn, *a, **k: _timer(f"_fast({fn.__name__})", fast(fn, *a, **k))
    dist.all_to_all_single = _timer("all_to_all_single", dist.all_to_all_single)
    torch.Tensor.tolist = _timer("tolist (waits for the GPU)", torch.Tensor.tolist)


def _sync(dev: str) -> None:
    if dev == "cuda":
        torch.cuda.synchronize()


def worker(rank: int, world: int, port: int, args) -> None:
    dev = "cpu" if args.cpu else "cuda"
    if args.cpu:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank)
    else:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                                device_id=torch.device("cuda", rank))
    _instrument()
    e, k, h = 256, 8, 7168
    for variant in args.variants:
        fused = variant == "compiled"
        torch_a2a._fused_layout = (lambda d: d.type == "cuda") if fused else (lambda d: False)
        for tokens in args.tokens:
            for wire in ("bf16", "fp8"):
                cfg = MoEConfig(num_experts=e, top_k=k, hidden_size=h, intermediate_size=128, ep_size=world,
                                ep_rank=rank, device=dev, dispatcher="torch_a2a", dispatch_dtype=wire)
                spec = BackendSpec(name="torch_a2a", role=Role.DISPATCHER, impl="moe_core.distributed:TorchA2ADispatcher",
                                   formats=(Format.EP_NORMAL,), devices=frozenset({dev}))
                d = TorchA2ADispatcher(BackendContext(cfg, spec, Format.EP_NORMAL, WireDtype(wire)))
                gen = torch.Generator(device=dev).manual_seed(1234 + rank)
                x = torch.randn(tokens, h, device=dev, generator=gen).bfloat16()
                ids = torch.rand(tokens, e, device=dev, generator=gen).topk(k, dim=1).indices.int()
                topk = TopK(torch.softmax(torch.randn(tokens, k, device=dev, generator=gen), dim=1), ids)
                out = d.dispatch(x, topk)  # and one combine, before the timers are cleared
                y = torch.randn(out.hidden.data.shape[0], h, device=dev, dtype=torch.bfloat16)
                d.combine(EPNormalCombine(y, out.handle))
                walls = []
                for i in range(args.warmup + args.iters):
                    if i == args.warmup:
                        TIMES.clear()
                    dist.barrier()
                    _sync(dev)
                    t0 = time.perf_counter()
                    out = d.dispatch(x, topk)
                    t1 = time.perf_counter()
                    _sync(dev)
                    t2 = time.perf_counter()
                    if i >= args.warmup:
                        walls.append(((t1 - t0) * 1e6, (t2 - t0) * 1e6))
                if rank == 0:
                    print(f"\n### {tokens} tok/rank, {wire} wire, layout math {'compiled' if fused else 'eager'}: "
                          f"dispatch host {statistics.median(w[0] for w in walls):.0f} us, "
                          f"until the GPU is done {statistics.median(w[1] for w in walls):.0f} us (median of {args.iters})")
                    print("| section | calls/dispatch | median us per call | total us per dispatch |\n|---|---|---|---|")
                    for name, ts in sorted(TIMES.items(), key=lambda kv: -sum(kv[1])):
                        per = len(ts) / args.iters
                        print(f"| {name} | {per:g} | {statistics.median(ts):.0f} | {sum(ts) / args.iters:.0f} |")
                TIMES.clear()
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--cpu", action="store_true", help="smoke-test the script on gloo/CPU")
    p.add_argument("--variants", nargs="+", choices=["compiled", "eager"], default=["compiled", "eager"],
                   help="layout math compiled (as on CUDA) or eager, in this order (repeat to see the spread)")
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
