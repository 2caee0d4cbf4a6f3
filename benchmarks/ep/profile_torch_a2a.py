"""Where an eager ``torch_a2a`` dispatch spends its time on GPUs (issue #32): per case, the stage's
device time (CUDA events from an idle GPU, as ``bench_torch_a2a.py`` times it), its host time (until
the call returned), and ``torch.profiler``'s top CPU ops and CUDA kernels over a few calls.

    python benchmarks/ep/profile_torch_a2a.py --out DIR [--tokens 128 4096] [--wires bf16 fp8]
        [--modes normal normal-worst-case masked]

World 2 on NCCL (one GPU per rank, 127.0.0.1); rank 0 writes ``DIR/profile.md`` (tables) and one
chrome trace per case and rank (``DIR/trace-<mode>-<wire>-<tokens>-rank<r>.json.gz``, ``--traces``; ``--stack``: with
Python frames).
"""

from __future__ import annotations

import argparse
import gzip
import os
import shutil
import socket
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_deepep import Timer  # noqa: E402
from bench_torch_a2a import MODES, torch_a2a_options  # noqa: E402

from moe_core import MoEConfig, TopK  # noqa: E402
from moe_core.backends import BackendSpec, Role  # noqa: E402
from moe_core.contracts import Format, WireDtype  # noqa: E402
from moe_core.distributed import TorchA2ADispatcher  # noqa: E402
from moe_core.plugins import get_plugin_manager  # noqa: E402
from moe_core.runtime import BackendContext  # noqa: E402

E, K, H = 256, 8, 7168


def make(rank: int, world: int, tokens: int, mode: str, wire: str):
    fmt, buffers, _, extra = MODES[mode]
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=128, ep_size=world, ep_rank=rank,
                    max_tokens_per_rank=tokens, device="cuda", dispatcher="torch_a2a", dispatch_dtype=wire,
                    backend_options=torch_a2a_options(buffers, extra))
    spec = BackendSpec(name="torch_a2a", role=Role.DISPATCHER, impl="moe_core.distributed:TorchA2ADispatcher",
                       formats=(Format.EP_NORMAL, Format.EP_MASKED), devices=frozenset({"cuda"}))
    d = TorchA2ADispatcher(BackendContext(cfg, spec, fmt, WireDtype(wire)))
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)
    x = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    ids = torch.rand(tokens, E, device="cuda", generator=gen).topk(K, dim=1).indices.int()
    w = torch.softmax(torch.randn(tokens, K, device="cuda", generator=gen), dim=1)
    return d, x, TopK(w, ids)


def times(fn, iters: int) -> tuple[float, float]:
    """(device us, host us) medians, each call from an idle GPU after a barrier (``bench_deepep.Timer``)."""
    timer, dev, host = Timer(), [], []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        us, host_us = timer(fn)
        dev.append(us)
        host.append(host_us)
    return statistics.median(dev), statistics.median(host)


def worker(rank: int, world: int, port: int, args) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                            device_id=torch.device("cuda", rank))
    from torch.profiler import ProfilerActivity, profile

    get_plugin_manager()  # the installed plugins load, as under a layer (the cuda plugin's kernels: decision 63)

    lines = [f"# torch_a2a eager profile, {world}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}", ""]
    for tokens in args.tokens:
        for mode in args.modes:
            for wire in args.wires:
                name = f"{mode}-{wire}-{tokens}"
                d, x, topk = make(rank, world, tokens, mode, wire)
                fn = lambda d=d, x=x, topk=topk: d.dispatch(x, topk)  # noqa: E731 (binds this case's inputs)
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                dev_us, host_us = times(fn, args.iters)
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=args.stack) as prof:
                    for _ in range(3):
                        dist.barrier()
                        torch.cuda.synchronize()
                        fn()
                        torch.cuda.synchronize()
                if rank == 0:
                    lines += [f"## {name}: device {dev_us:.1f} us, host {host_us:.1f} us (median of {args.iters})", "",
                              "```", prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=22),
                              prof.key_averages().table(sort_by="self_device_time_total", row_limit=14), "```", ""]
                    print(f"{name}: device {dev_us:.1f} us host {host_us:.1f} us", flush=True)
                if args.traces:  # both ranks': a call waits for the later rank
                    raw = os.path.join(args.out, f"trace-{name}-rank{rank}.json")
                    prof.export_chrome_trace(raw)
                    with open(raw, "rb") as f, gzip.open(raw + ".gz", "wb") as g:
                        shutil.copyfileobj(f, g)
                    os.remove(raw)
                del d, x, topk, fn
                torch.cuda.empty_cache()
    if rank == 0:
        with open(os.path.join(args.out, "profile.md"), "w") as f:
            f.write("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, nargs="+", default=[128, 4096])
    ap.add_argument("--wires", nargs="+", default=["bf16", "fp8"])
    ap.add_argument("--modes", nargs="+", default=["normal", "normal-worst-case", "masked"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--traces", action="store_true")
    ap.add_argument("--stack", action="store_true", help="the traces with Python frames (where the host time goes)")
    run_world(worker, ap.parse_args())


def run_world(worker, args, world: int = 2) -> None:
    """``worker(rank, world, port, args)`` on ``world`` spawned ranks (127.0.0.1, a free port), ``args.out`` made."""
    os.makedirs(args.out, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, port, args), nprocs=world)


if __name__ == "__main__":
    main()
