"""``deepep`` on real GPUs beyond the dispatcher equivalence (``torchrun --nproc-per-node 2``):

- ``layer``: ``MoELayer`` with dispatcher ``deepep`` and each CUDA experts backend (triton, grouped_mm,
  cutlass) x EP_NORMAL / EP_MASKED x (bf16, unquantized) / (fp8, fp8_block), against the
  single-GPU reference layer (standard dispatcher, reference experts) on the same tokens; a
  combination the planner refuses is reported with its reason, not counted as run;
- ``graph``: a low-latency (EP_MASKED, triton experts) layer captured in a CUDA graph and replayed on
  fresh tokens, against eager and the reference;
- ``overlap``: low-latency ``dispatch_async`` / ``combine_async`` (DeepEP's receive hook) with a matmul
  between issue and ``wait()``, against the same steps in sequence, with a late peer: its wait is what the
  hook can hide on one node (``check_overlap`` says why).

Prints one ``RESULT {json}`` line per check on rank 0 and exits non-zero if any ran and failed.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moe_core import quant
from moe_core.config import MoEConfig
from moe_core.contracts import EPMaskedCombine, TopK
from moe_core.layer import MoELayer
from moe_core.planner import PlanError
from moe_core.testing.data import make_float_weights, make_hidden, make_topk, rel_error, tolerance

E, K, H, INTER = 16, 4, 2048, 512


def _ckpt(scheme: str) -> dict:
    w13, w2 = make_float_weights(E, H, INTER, torch.Generator().manual_seed(77))
    if scheme == "unquantized":
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    return quant.quantize_weights(w13, w2, scheme)


def _layer(cfg: MoEConfig, ckpt: dict) -> MoELayer:
    layer = MoELayer(cfg, device=f"cuda:{torch.cuda.current_device()}")
    layer.load_weights(**{k: v.cuda() for k, v in ckpt.items()})
    layer.process_weights()
    return layer


def _config(experts: str, fmt: str, scheme: str, wire: str, rank: int, world: int, **kw) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, quant=scheme, ep_size=world,
                     ep_rank=rank, ep_group=dist.group.WORLD, max_tokens_per_rank=64, device="cuda",
                     dispatcher="deepep", experts=experts, dispatch_dtype=wire, dispatch_format=fmt, **kw)


def _reference(scheme: str, wire: str, ckpt: dict) -> MoELayer:
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=INTER, quant=scheme, device="cuda",
                    dispatcher="standard", experts="reference", dispatch_dtype=wire)
    return _layer(cfg, ckpt)


def _tokens(rank: int, seed: int, t: int):
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    x = make_hidden(t, H, torch.bfloat16, gen).cuda()
    tk = make_topk(t, K, E, gen, neg_fraction=0.2, empty_token=t >= 3)
    return x, TopK(tk.weights.cuda(), tk.ids.cuda())


def layer_cases() -> list[tuple[str, str, str, str]]:
    """(experts, format, quant scheme, wire): cutlass last (its library may compile at first use)."""
    return [(experts, fmt, scheme, wire) for experts in ("triton", "grouped_mm", "cutlass")
            for scheme, wire in (("unquantized", "bf16"), ("fp8_block", "fp8")) for fmt in ("ep_normal", "ep_masked")]


def check_layer(rank: int, world: int, experts: str, fmt: str, scheme: str, wire: str) -> dict:
    row = dict(check="layer", experts=experts, format=fmt, wire=wire, quant=scheme)
    ckpt = _ckpt(scheme)
    try:
        layer = _layer(_config(experts, fmt, scheme, wire, rank, world), ckpt)
    except PlanError as exc:  # the same on every rank: no collective was started
        return dict(row, status="refused", reason=" ".join(str(exc).split())[:300])
    ref = _reference(scheme, wire, ckpt)
    errs = []
    for i, t in enumerate((64, 37 - 30 * rank, 1)):  # a full batch, odd sizes, T=1
        x, topk = _tokens(rank, 100 + i, t)
        y = layer(x, topk)
        errs.append(rel_error(y, ref(x, topk)))
    tol = tolerance(scheme, wire)
    return dict(row, status="passed" if all(e <= tol for e in errs) else "failed",
                errs=[float(f"{e:.3g}") for e in errs], tol=tol,
                plan=f"{layer.plan.dispatcher_name} x {layer.plan.experts.name} {layer.plan.format} "
                     f"{layer.plan.dispatch_dtype}")


def check_graph(rank: int, world: int) -> dict:
    ckpt = _ckpt("unquantized")
    cfg = _config("triton", "ep_masked", "unquantized", "bf16", rank, world, cuda_graph=True)
    layer = _layer(cfg, ckpt)
    ref = _reference("unquantized", "bf16", ckpt)
    x, topk = _tokens(rank, 5, 48)
    sx, sw, si = x.clone(), topk.weights.clone(), topk.ids.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            layer(sx, TopK(sw, si))
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = layer(sx, TopK(sw, si))
    errs = []
    for i in range(3):
        x, topk = _tokens(rank, 50 + i, 48)
        sx.copy_(x), sw.copy_(topk.weights), si.copy_(topk.ids)
        graph.replay()
        torch.cuda.synchronize()
        eager = layer(x, topk)
        errs.append((rel_error(sy, ref(x, topk)), rel_error(sy, eager)))
    tol = tolerance("unquantized", "bf16")
    ok = layer.plan.graph_safe and all(a <= tol and b <= tol for a, b in errs)
    return dict(check="cuda_graph", status="passed" if ok else "failed", graph_safe=layer.plan.graph_safe,
                errs=[[float(f"{a:.3g}"), float(f"{b:.3g}")] for a, b in errs], replays=3)


def _step_us(fns: list, steps: int = 15, warmup: int = 3) -> list[float]:
    """This rank's us per step of each fn, every step started together on all ranks (synchronize, barrier) and
    ended by a synchronize: the median of ``steps``, the fns taking turns (drift hits them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + steps):
        for fn, out in zip(fns, times, strict=True):
            torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e6)
    return [statistics.median(t) for t in times]


def check_overlap(rank: int, world: int) -> dict:
    """DeepEP's receive hook (low latency) overlapping compute, where there is something to overlap.

    Intranode, the low-latency send kernel writes every byte into the peer's buffer with NVLink stores and
    sets the peer's flag before it ends (``internode_ll.cu``: ``nvshmemi_get_p2p_ptr`` != 0 takes
    ``UNROLLED_WARP_COPY``, not an IBGDA put), so no transfer is left in flight for the hook to hide, unlike
    over RDMA; what it can hide is the wait for a late peer. So the last rank is made late by one matmul
    before each dispatch (a straggler), and each step (dispatch, matmul, combine, matmul) is timed with
    synchronous calls and with the hook deferred past the matmul, with and without the straggler. On the
    other ranks the straggler's cost is what it adds to a step: the synchronous step must pay at least 20 us
    for it (else nothing was there to hide), and the overlapped step must hide at least half of that, i.e.
    pay at most half as much, with the same result. (The straggler's matmul also fills its own rank's
    host-launch gaps, so the early ranks wait less than a matmul: 54 us of a 235 us matmul on 2x H100.)"""
    ckpt = _ckpt("unquantized")
    layer = _layer(_config("triton", "ep_masked", "unquantized", "bf16", rank, world), ckpt)
    d = layer.dispatcher
    x, topk = _tokens(rank, 9, 64)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    late = rank == world - 1

    def mm():
        return a @ a

    def seq(skew: bool):
        if skew and late:
            mm()  # the straggler
        out = d.dispatch(x, topk)
        mm()
        y = d.combine(EPMaskedCombine(out.hidden.data, out.topk, out.handle))
        mm()
        return y

    def overlapped(skew: bool):
        if skew and late:
            mm()
        p = d.dispatch_async(x, topk)
        mm()  # runs while this rank waits for the late peer's tokens (the hook receives after it)
        out = p.wait()
        c = d.combine_async(EPMaskedCombine(out.hidden.data, out.topk, out.handle))
        mm()
        return c.wait()

    # the four steps take turns (drift hits them alike)
    t_seq, t_ovl, t_seq0, t_ovl0, t_mm = _step_us([lambda: seq(True), lambda: overlapped(True), lambda: seq(False),
                                                   lambda: overlapped(False), mm])
    same = rel_error(overlapped(True), seq(True)) <= 1e-3
    wait_seq, wait_ovl = t_seq - t_seq0, t_ovl - t_ovl0  # what the late peer cost each step
    hidden = 1 - wait_ovl / wait_seq if wait_seq > 0 else 0.0
    early = not late
    ok = same and (wait_seq >= 20 and hidden >= 0.5 if early else True)
    return dict(check="async_overlap", status="passed" if ok else "failed", role="early" if early else "late",
                skewed_sequential_us=round(t_seq, 1), skewed_overlapped_us=round(t_ovl, 1),
                unskewed_sequential_us=round(t_seq0, 1), unskewed_overlapped_us=round(t_ovl0, 1),
                late_peer_cost_us=[round(wait_seq, 1), round(wait_ovl, 1)], late_peer_wait_hidden=round(hidden, 3),
                matmul_us=round(t_mm, 1), same_result=same)


def _gather_json(obj: object, world: int) -> list:
    """Every rank's ``obj`` (JSON-able), through a byte tensor (no pickle, no numpy)."""
    data = torch.tensor(list(json.dumps(obj).encode()), dtype=torch.uint8, device="cuda")
    sizes = [torch.zeros(1, dtype=torch.int64, device="cuda") for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([data.numel()], device="cuda"))
    n = max(int(s) for s in sizes)
    bufs = [torch.zeros(n, dtype=torch.uint8, device="cuda") for _ in range(world)]
    dist.all_gather(bufs, torch.cat([data, torch.zeros(n - data.numel(), dtype=torch.uint8, device="cuda")]))
    return [json.loads(bytes(b[:int(s)].tolist()).decode()) for b, s in zip(bufs, sizes, strict=True)]


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", rank))
    cases = [("layer", check_layer, case) for case in layer_cases()]
    checks = cases[:4] + [("cuda_graph", check_graph, ()), ("async_overlap", check_overlap, ())] + cases[4:]
    results = []
    for name, fn, args in checks:  # results printed as they come (a step killed at its limit keeps them)
        try:
            r = fn(rank, world, *args)
        except Exception as exc:  # one broken check must not hide the others
            r = dict(check=name, case=list(args), status="error", error=f"{type(exc).__name__}: {exc}"[:400])
        torch.cuda.synchronize()
        results.append(r)
        per_rank = _gather_json(r, world)
        if rank == 0:
            merged = dict(per_rank[0])
            states = {x["status"] for x in per_rank}
            merged["status"] = states.pop() if len(states) == 1 else "failed"
            if (merged["status"] != per_rank[0]["status"] or merged["status"] in ("failed", "error")
                    or name == "async_overlap"):  # (the late rank's numbers too)
                merged["per_rank"] = per_rank
            print("RESULT " + json.dumps(merged), flush=True)
    failed = any(r["status"] in ("failed", "error") for r in results)
    dist.barrier()
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
