"""Gloo EP world for the ``cutedsl`` experts behind ``torch_a2a`` masked dispatch (test support only).

``run_world(world, case, seed)`` spawns ``world`` processes (gloo on 127.0.0.1); each installs the
emulated flashinfer (SM100), plans ``torch_a2a`` x ``cutedsl`` through the planner, and compares every
pass with the core reference computed locally on one rank (all experts, same checkpoint, same BF16
wire). Returns per-rank dicts with the plan and the relative errors; a hard timeout kills the group.
"""

from __future__ import annotations

import socket
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_rank(case: dict, world: int, rank: int, seed: int) -> dict:
    from moe_core import quant
    from moe_core.config import MoEConfig
    from moe_core.layer import MoELayer
    from moe_core.plugins import PluginManager
    from moe_core.testing.data import make_float_weights, make_hidden, make_topk, rel_error

    manager = PluginManager()
    E, K, H, I = case["E"], case["K"], case["H"], case["I"]
    w13, w2 = make_float_weights(E, H, I, torch.Generator().manual_seed(seed))  # one checkpoint on every rank
    ckpt = quant.quantize_weights(w13, w2, "nvfp4", a13_amax=4.0, a2_amax=4.0)
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant="nvfp4", ep_size=world,
                    ep_rank=rank, ep_group=dist.group.WORLD, max_tokens_per_rank=case["max_tokens"], device="cuda",
                    cuda_graph=True, routed_scaling_factor=case["rsf"])
    layer = MoELayer(cfg, manager=manager, device="cpu")
    ref_cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant="nvfp4", device="cpu",
                        dispatcher="standard", experts="reference", dispatch_dtype=str(layer.plan.dispatch_dtype),
                        routed_scaling_factor=case["rsf"])
    ref = MoELayer(ref_cfg, manager=manager, device="cpu")
    for lay in (layer, ref):
        lay.load_weights(**ckpt)
        lay.process_weights()
    plan = layer.plan
    result: dict[str, Any] = {"dispatcher": plan.dispatcher_name, "experts": plan.experts.name,
                              "format": str(plan.format), "dtype": str(plan.dispatch_dtype),
                              "graph_safe": plan.graph_safe, "errors": [], "tokens": [], "empty_rows_zero": True}
    gen = torch.Generator().manual_seed(seed * 7919 + rank + 1)  # different tokens on each rank
    for p, per_rank in enumerate(case["tokens"]):
        t = per_rank[rank % len(per_rank)]
        x = make_hidden(t, H, torch.bfloat16, gen)
        topk = make_topk(t, K, E, gen, neg_fraction=0.25, empty_token=(p == 0))
        out = layer(x, topk)
        expected = ref(x, topk)
        if out.shape != expected.shape or out.dtype != expected.dtype:
            raise AssertionError(f"output {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)}")
        if t and bool(topk.ids[0].eq(-1).all()):
            result["empty_rows_zero"] &= bool(out[0].eq(0).all())
        result["errors"].append(rel_error(out, expected))
        result["tokens"].append(t)
    result["calls"] = sorted(set(__import__("flashinfer").emulator.calls))
    return result


def _worker(rank: int, world: int, port: int, seed: int, case: dict, queue: Any) -> None:
    try:
        torch.set_num_threads(1)
        import flashinfer_emulation

        flashinfer_emulation.install_into_process()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = run_rank(case, world, rank, seed)
        dist.barrier()
        queue.put((rank, result, None))
    except BaseException:
        queue.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_world(world: int, case: dict, seed: int, timeout: float = 120.0) -> list[dict]:
    """Run ``case`` on ``world`` ranks; return the result of each rank. Raises on error or timeout."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, seed, case, queue), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, dict] = {}
    errors = []
    try:
        for _ in range(world):
            rank, res, err = queue.get(timeout=timeout)
            if err:
                errors.append(f"rank {rank}:\n{err}")
                break
            results[rank] = res
    except Exception as exc:  # queue.Empty: a rank hung or died
        errors.append(f"no result within {timeout}s ({type(exc).__name__})")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.1)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world)]
