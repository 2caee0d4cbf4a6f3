"""Multi-process EP harness for moe-plugin-npu's tests (test support only).

``run_world(world, cases, seed)`` spawns ``world`` processes on gloo (127.0.0.1, a free port), each
installs the emulated Ascend stack, runs every case and returns per-rank results; a hard timeout
kills the group. A case builds the layer on the planned npu backends (weights on CPU) and compares
each pass against the core reference backend run locally (ep_size 1, same weights, same wire dtype);
quantized npu_gmm cases are also compared with ``gmm_oracle`` (the documented 16-bit intermediate).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

from moe_core.testing.world import run_gloo_world

INT8_ENV = "DEEP_NORMAL_MODE_USE_INT8_QUANT"


def _weights(case: dict, seed: int) -> dict[str, torch.Tensor]:
    from moe_core import quant
    from moe_core.testing.data import make_float_weights

    gen = torch.Generator().manual_seed(seed)  # same on every rank: one checkpoint
    w13, w2 = make_float_weights(case["E"], case["H"], case["I"], gen)
    if case["quant"] == "unquantized":
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
    return quant.quantize_weights(w13, w2, case["quant"])


def _layers(case: dict, world: int, rank: int, tensors: dict, manager: Any):
    from moe_core.config import MoEConfig
    from moe_core.layer import MoELayer

    cfg = MoEConfig(num_experts=case["E"], top_k=case["K"], hidden_size=case["H"], intermediate_size=case["I"],
                    quant=case["quant"], ep_size=world, ep_rank=rank, ep_group=dist.group.WORLD,
                    max_tokens_per_rank=case["max_tokens"], device="npu", cuda_graph=case.get("masked", False),
                    dispatcher=case.get("dispatcher", "auto"), experts=case.get("experts", "auto"),
                    dispatch_dtype=case.get("dispatch_dtype", "auto"),
                    routed_scaling_factor=case.get("rsf", 1.0))
    layer = MoELayer(cfg, manager=manager, device="cpu")
    layer.load_weights(**tensors)
    layer.process_weights()
    ref_cfg = MoEConfig(num_experts=case["E"], top_k=case["K"], hidden_size=case["H"],
                        intermediate_size=case["I"], quant=case["quant"], device="cpu", dispatcher="standard",
                        experts="reference", dispatch_dtype=str(layer.plan.dispatch_dtype),
                        routed_scaling_factor=case.get("rsf", 1.0))
    ref = MoELayer(ref_cfg, manager=manager, device="cpu")
    ref.load_weights(**tensors)
    ref.process_weights()
    return layer, ref


def run_case(case: dict, world: int, rank: int, seed: int) -> dict:
    import gmm_oracle

    from moe_core import quant
    from moe_core.plugins import PluginManager
    from moe_core.testing.data import make_hidden, make_topk, rel_error

    manager = PluginManager()
    tensors = _weights(case, seed)
    layer, ref = _layers(case, world, rank, tensors, manager)
    plan = layer.plan
    result: dict[str, Any] = {"dispatcher": plan.dispatcher_name, "experts": plan.experts.name,
                              "format": str(plan.format), "dtype": str(plan.dispatch_dtype),
                              "trail": [str(s) for s in plan.dtype_trail], "errors": [], "tokens": []}
    gen = torch.Generator().manual_seed(seed * 7919 + rank + 1)  # different tokens per rank
    for p, tokens in enumerate(case["tokens"]):
        t = tokens[rank % len(tokens)]
        x = make_hidden(t, case["H"], torch.bfloat16, gen)
        topk = make_topk(t, case["K"], case["E"], gen, neg_fraction=0.2, empty_token=(p == 0))
        out = layer(x, topk)
        expected = ref(x, topk)
        if out.shape != expected.shape or out.dtype != torch.bfloat16:
            raise AssertionError(f"output {tuple(out.shape)} {out.dtype}, expected {tuple(expected.shape)} bf16")
        if t > 0 and bool(topk.ids[0].eq(-1).all()) and bool(out[0].ne(0).any()):
            raise AssertionError("a token routed to no expert got a non-zero output")
        result["errors"].append(rel_error(out, expected))
        result["tokens"].append(t)
        if plan.experts.name == "npu_gmm" and case["quant"] != "unquantized":
            # also vs the oracle with GMM1's documented 16-bit output, and the exact math (gmm_oracle)
            x_in = quant.quantize_activations(x, plan.dispatch_dtype).dequantize(torch.float32)
            args = (x_in, topk.weights, topk.ids, tensors, case["quant"])
            rsf = case.get("rsf", 1.0)
            result.setdefault("checks", []).append(gmm_oracle.errors(
                out, expected, gmm_oracle.npu_gmm_oracle(*args, torch.float16, rsf),
                gmm_oracle.exact_float64(*args, rsf)))
    buffer = getattr(layer.experts if plan.fused else layer.dispatcher, "buffer", None)
    if buffer is not None:
        result["calls"] = sorted(set(buffer.calls))
        result["env_seen"] = sorted({str(v) for v in buffer.env_seen})
        result["rdma_bytes"] = buffer.num_rdma_bytes
    result["env_after"] = os.environ.get(INT8_ENV)
    return result


def run_two_layers(case: dict, world: int, rank: int, seed: int) -> dict:
    """Two layers in one process (a model and its draft) with different wire dtypes on deepep_npu
    normal mode, called interleaved: each dispatch must see its own INT8 setting."""
    from moe_core.plugins import PluginManager
    from moe_core.testing.data import make_hidden, make_topk, rel_error

    manager = PluginManager()
    out: dict[str, Any] = {}
    layers = {}
    for quant in ("int8_w8a8", "unquantized"):
        c = dict(case, quant=quant, dispatcher="deepep_npu", experts="npu_gmm")
        layers[quant] = _layers(c, world, rank, _weights(c, seed), manager)
    gen = torch.Generator().manual_seed(seed + rank)
    for _ in range(2):
        for quant, (layer, ref) in layers.items():
            x = make_hidden(5 + rank, case["H"], torch.bfloat16, gen)
            topk = make_topk(5 + rank, case["K"], case["E"], gen)
            out.setdefault(quant, {"errors": []})["errors"].append(rel_error(layer(x, topk), ref(x, topk)))
    for quant, (layer, _) in layers.items():
        out[quant]["dtype"] = str(layer.plan.dispatch_dtype)
        out[quant]["env_seen"] = sorted({str(v) for v in layer.dispatcher.buffer.env_seen})
    out["env_after"] = os.environ.get(INT8_ENV, "<unset>")
    return out


def _cases(rank: int, world: int, cases: list, seed: int) -> list:
    return [(run_two_layers if case.get("kind") == "two_layers" else run_case)(case, world, rank, seed)
            for case in cases]


def run_world(world: int, cases: list, seed: int, timeout: float = 150.0) -> list[list[dict]]:
    """Run ``cases`` on ``world`` ranks; return ``results[rank][case]``. Raises on error or timeout."""
    return run_gloo_world(_cases, world, cases, seed, setup="npu_emulation:install_into_process", timeout=timeout)
