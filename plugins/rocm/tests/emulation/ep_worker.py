"""Multi-process tests of MoRI on gloo (TEST SUPPORT ONLY): ``run_world(case, arch, world)`` runs
one case on ``world`` spawned ranks (``moe_core.testing.run_gloo_world``: 127.0.0.1, bounded by a
timeout, any rank's error raised with its traceback) and returns each rank's findings (errors,
counts); ``test_mori_ep.py`` asserts on them. Each rank installs the emulated vendor ops first.

Cases:
- ``op``: the emulated MoRI op alone (dispatch once per unique destination PE, global ids,
  valid-row count, unweighted combine = value x number of PEs, fp8 combine cast).
- ``layer``: ``MoELayer`` planned with ``mori`` x ``aiter`` (and ``mori`` x ``reference``) on
  "rocm" (tensors on CPU), every scheme and wire dtype, against a single-rank reference layer
  holding the full checkpoint; uneven token counts (one rank has none), -1 ids, a token with no
  expert, two forward passes (so MoRI's stale buffer rows are there to be misread).
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch.distributed as dist

from moe_core.testing.world import run_gloo_world

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rocm_kit_setup import install_for_process as install  # noqa: E402


def case_op(arch: str, rank: int, world: int) -> dict:
    import mori.shmem
    from moe_plugin_rocm.mori_dispatcher import init_mori_shmem
    from mori.ops import EpDispatchCombineConfig, EpDispatchCombineOp

    init_mori_shmem()
    E_l, K, H, P = 3, 2, 64, 8
    E = E_l * world
    g = torch.Generator().manual_seed(100 + rank)
    T = [5, 0, 8, 3][rank % 4]
    x = torch.randn(T, H, generator=g).bfloat16()
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)]).int() if T else \
        torch.zeros(0, K, dtype=torch.int32)
    w = torch.rand(T, K, generator=g)
    results = {"T": T}
    for quant in ("none", "fp8_direct_cast"):
        cfg = EpDispatchCombineConfig(data_type=torch.bfloat16, rank=rank, world_size=world, hidden_dim=H,
                                      scale_dim=0, scale_type_size=4, max_token_type_size=2,
                                      max_num_inp_token_per_rank=P, num_experts_per_rank=E_l,
                                      num_experts_per_token=K, quant_type=quant)
        op = EpDispatchCombineOp(cfg)
        out, out_w, out_s, out_i, total = op.dispatch(x, w, None, ids)
        n = int(total[0])
        # what each rank should receive: every token with >= 1 expert here, once, with global ids
        all_ids = [torch.zeros(P, K, dtype=torch.int32) for _ in range(world)]
        padded = torch.zeros(P, K, dtype=torch.int32)
        padded[:T] = ids
        padded[T:] = -1
        dist.all_gather(all_ids, padded)
        lo, hi = rank * E_l, (rank + 1) * E_l
        expect = sorted(tuple(r.tolist()) for a in all_ids for r in a if ((r >= lo) & (r < hi)).any())
        got = sorted(tuple(r.tolist()) for r in out_i[:n])
        results[f"{quant}_recv_ok"] = expect == got and n == len(expect)
        results[f"{quant}_shapes"] = [list(out.shape), list(out_w.shape), out_s is None, list(total.shape),
                                      str(total.dtype)]
        # combine the received rows unchanged: each token comes back times its number of PEs
        y, y_w = op.combine(out.float().bfloat16(), out_w, ids, call_reset=True)
        n_pe = torch.tensor([len({int(e) // E_l for e in r}) for r in ids.tolist()]).float()
        exp_x = x.float() * n_pe[:, None]
        exp_w = w * n_pe[:, None]
        results[f"{quant}_combine_err"] = float((y[:T].float() - exp_x).norm() / exp_x.norm()) if T else 0.0
        results[f"{quant}_combine_w_err"] = float((y_w[:T] - exp_w).abs().max()) if T else 0.0
        try:  # a second dispatch without reset must fail (we passed call_reset=True: it must work)
            op.dispatch(x, w, None, ids)
            op.combine(out, None, ids)
            op.dispatch(x, w, None, ids)
            results[f"{quant}_reset_enforced"] = False
        except RuntimeError:
            results[f"{quant}_reset_enforced"] = True
        dist.barrier()
    mori.shmem.shmem_finalize()
    return results


def case_layer(arch: str, rank: int, world: int) -> dict:
    from moe_plugin_rocm.mori_dispatcher import init_mori_shmem
    from rocm_emulation.arch_oracle import aiter_float64

    from moe_core import MoEConfig, MoELayer, PluginManager, QuantScheme, WireDtype, quant
    from moe_core.reference.oracle import moe_float64
    from moe_core.testing.data import make_float_weights, make_hidden, make_topk, rel_error

    init_mori_shmem()
    pm = PluginManager()
    E, K, H, inter, P = 4 * world, 3, 256, 128, 24
    results = {}
    for scheme in (QuantScheme.UNQUANTIZED, QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN):
        for wire in ("auto", "fp8" if scheme is QuantScheme.FP8_PER_TOKEN else "bf16"):
            for experts in ("aiter", "reference"):
                if experts == "reference" and wire == "bf16":
                    continue
                key = f"{scheme}/{wire}/{experts}"
                g = torch.Generator().manual_seed(7)  # same checkpoint on every rank
                w13, w2 = make_float_weights(E, H, inter, g)
                if scheme is QuantScheme.UNQUANTIZED:
                    w13, w2 = w13.bfloat16(), w2.bfloat16()
                ckpt = quant.quantize_weights(w13, w2, scheme)
                cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=inter, quant=scheme,
                                device="rocm", ep_size=world, ep_rank=rank, max_tokens_per_rank=P,
                                routed_scaling_factor=1.5, dispatcher="mori", experts=experts,
                                dispatch_dtype=wire)
                layer = MoELayer(cfg, manager=pm, device="cpu")
                layer.load_weights(**ckpt)
                layer.process_weights()
                ref_cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=inter, quant=scheme,
                                    device="cpu", routed_scaling_factor=1.5, experts="reference",
                                    dispatch_dtype=str(layer.plan.dispatch_dtype))
                ref = MoELayer(ref_cfg, manager=pm, device="cpu")
                ref.load_weights(**ckpt)
                ref.process_weights()
                errs, oracle_errs, ref_oracle_errs, exact_errs = [], [], [], []
                for step in range(2):
                    gl = torch.Generator().manual_seed(1000 * step + rank)
                    T = [[19, 0, 1, 24], [7, 13, 24, 5]][step][rank % 4]
                    x = make_hidden(T, H, torch.bfloat16, gl)
                    topk = make_topk(T, K, E, gl, neg_fraction=0.3, empty_token=True)
                    out = layer(x, topk)
                    expect = ref(x, topk)
                    assert out.shape == (T, H) and out.dtype == torch.bfloat16
                    errs.append(rel_error(out, expect))
                    if T:
                        d13, d2 = quant.dequantize_weights(ckpt, scheme)
                        o = moe_float64(x, topk.weights, topk.ids, d13, d2, routed_scaling_factor=1.5)
                        oracle_errs.append(rel_error(out, o))
                        ref_oracle_errs.append(rel_error(expect, o))
                        # the float64 definition of what this experts backend computes on this arch
                        x_in = quant.quantize_activations(x, layer.plan.dispatch_dtype).dequantize() \
                            if layer.plan.dispatch_dtype is WireDtype.FP8 else x
                        exact = aiter_float64(scheme, arch if experts == "aiter" else "gfx950", x_in, topk.weights,
                                              topk.ids, ckpt, routed_scaling_factor=1.5)
                        exact_errs.append(rel_error(out, exact))
                    if T and topk.ids[0].eq(-1).all():
                        errs.append(float(out[0].float().abs().max()))  # token with no expert: zero
                results[key] = {"dtype": str(layer.plan.dispatch_dtype), "err": max(errs),
                                "exact": max(exact_errs, default=0.0),
                                "oracle": max(oracle_errs, default=0.0), "ref_oracle": max(ref_oracle_errs, default=0.0),
                                "shuffled": bool(getattr(layer.w13, "is_shuffled", False))}
    # T above the layer's capacity is an error, never a silent truncation
    try:
        layer(make_hidden(P + 1, H, torch.bfloat16, g), make_topk(P + 1, K, E, g))
        results["overflow_rejected"] = False
    except ValueError:
        results["overflow_rejected"] = True
    return results


def _rank(rank: int, world: int, case: str, arch: str) -> dict:
    install(arch)
    return {"op": case_op, "layer": case_layer}[case](arch, rank, world)


def run_world(case: str, arch: str, world: int, timeout: float = 150.0) -> list[dict]:
    """``case`` on ``world`` ranks: each rank's findings, in rank order."""
    return run_gloo_world(_rank, world, case, arch, timeout=timeout)
