"""Gloo EP world for the ``cutedsl`` experts behind ``torch_a2a`` masked dispatch (test support only).

``run_world(world, case, seed)`` spawns ``world`` processes (gloo on 127.0.0.1); each installs the
emulated flashinfer (SM100), plans ``torch_a2a`` x ``cutedsl`` through the planner, and compares every
pass with the core reference computed locally on one rank (all experts, same checkpoint, same BF16
wire) and with the exact float64 computation (dequantized weights, no activation rounding). Returns
per-rank dicts with the plan and, per pass, the relative errors [vs reference, backend vs exact,
reference vs exact]; a hard timeout kills the group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from moe_core.testing.world import run_gloo_world


def run_rank(case: dict, world: int, rank: int, seed: int) -> dict:
    from moe_core import quant
    from moe_core.config import MoEConfig
    from moe_core.layer import MoELayer
    from moe_core.plugins import PluginManager
    from moe_core.reference.oracle import moe_float64
    from moe_core.testing.data import make_float_weights, make_hidden, make_topk, rel_error

    manager = PluginManager()
    E, K, H, I = case["E"], case["K"], case["H"], case["I"]
    w13, w2 = make_float_weights(E, H, I, torch.Generator().manual_seed(seed))  # one checkpoint on every rank
    ckpt = quant.quantize_weights(w13, w2, "nvfp4", a13_amax=4.0, a2_amax=4.0)
    dw13, dw2 = quant.dequantize_weights(ckpt, "nvfp4")
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
        exact = moe_float64(x.float(), topk.weights, topk.ids, dw13, dw2, routed_scaling_factor=case["rsf"])
        result["errors"].append([rel_error(out, expected), rel_error(out, exact), rel_error(expected, exact)])
        result["tokens"].append(t)
    result["calls"] = sorted(set(__import__("flashinfer").emulator.calls))
    return result


def _rank(rank: int, world: int, case: dict, seed: int) -> dict:
    return run_rank(case, world, rank, seed)


def run_world(world: int, case: dict, seed: int, timeout: float = 120.0) -> list[dict]:
    """Run ``case`` on ``world`` ranks; return the result of each rank. Raises on error or timeout."""
    return run_gloo_world(_rank, world, case, seed, setup="flashinfer_emulation:install_into_process",
                          timeout=timeout)
