"""Multi-process harness of the ``deepep`` tests (test support only).

``run_world(world, parts, seed)`` spawns ``world`` processes on gloo (127.0.0.1, a free port); each
installs the emulated ``deep_ep``, runs the named parts and sends back its results; a hard timeout
kills the world. Parts:

- ``ops``: the emulated DeepEP ops against straightforward computations from their documentation;
- ``equivalence``: ``plugins/cuda/scripts/deepep_vs_torch_a2a.py``'s cases (deepep vs torch_a2a);
- ``layer``: ``MoELayer`` with dispatcher ``deepep`` and the reference experts against the
  single-process reference layer, plus the buffer registry (sized for the largest layer, normal and
  low-latency layers sharing one buffer).
"""

from __future__ import annotations

import pathlib
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist

from moe_core.testing.world import run_gloo_world

SCRIPTS = pathlib.Path(__file__).resolve().parents[2] / "scripts"
SHAPE = dict(experts=8, topk=3, hidden=2048)


# --------------------------------------------------------------------------- ops


def _all_data(world: int, seed: int, counts: list[int], e: int, k: int, h: int):
    from moe_core.testing.data import make_hidden, make_topk

    gen = torch.Generator().manual_seed(seed)
    xs = [make_hidden(t, h, torch.bfloat16, gen) for t in counts]
    topks = [make_topk(t, k, e, gen, neg_fraction=0.25, empty_token=t >= 3) for t in counts]
    return xs, [t.ids.long() for t in topks], [t.weights for t in topks]


def part_ops(rank: int, world: int, seed: int) -> dict:
    """Each emulated op against a direct computation of what vendor-apis.md section 1 says it returns."""
    import deep_ep
    from moe_plugin_cuda.deepep import unpack_ue8m0

    from moe_core.quant import quantize_fp8_per_token_group

    g = dist.group.WORLD
    e, k, h = 8, 3, 2048
    el = e // world
    counts = [5 + 2 * r for r in range(world)]
    counts[-1] = 0  # a rank with no tokens
    xs, ids, ws = _all_data(world, seed, counts, e, k, h)
    x, idx, w = xs[rank], ids[rank], ws[rank]
    checked = []

    # normal kernels
    buf = deep_ep.Buffer(g, 1 << 26, 0)
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, e)
    want_in = torch.tensor([[bool(((row >= r * el) & (row < (r + 1) * el)).any()) for r in range(world)]
                            for row in idx], dtype=torch.bool).view(-1, world)
    assert per_rdma is None and torch.equal(in_rank, want_in)
    assert per_rank.tolist() == want_in.sum(0).tolist()
    assert per_expert.tolist() == [int((idx == j).sum()) for j in range(e)]
    checked.append("get_dispatch_layout")

    for fp8 in (False, True):
        payload = quantize_fp8_per_token_group(x) if fp8 else x
        recv, r_idx, r_w, r_counts, handle, _ = buf.dispatch(
            payload, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=None, is_token_in_rank=in_rank,
            num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=4)
        rows, want_idx, want_w = [], [], []
        for src in range(world):  # source blocks in rank order, tokens in order
            for t in range(counts[src]):
                if bool(((ids[src][t] >= rank * el) & (ids[src][t] < (rank + 1) * el)).any()):
                    rows.append((src, t))
                    loc = ids[src][t] - rank * el
                    ok = (ids[src][t] >= 0) & (loc >= 0) & (loc < el)
                    want_idx.append(torch.where(ok, loc, -1))
                    want_w.append(torch.where(ok, ws[src][t], 0.0))
        if fp8:
            q, s = recv
            for i, (src, t) in enumerate(rows):
                wq, wsc = quantize_fp8_per_token_group(xs[src][t:t + 1])
                assert torch.equal(q[i].view(torch.uint8), wq[0].view(torch.uint8)) and torch.equal(s[i], wsc[0])
        else:
            assert torch.equal(recv, torch.stack([xs[s_][t] for s_, t in rows]) if rows else recv[:0])
        assert len(rows) == r_idx.shape[0]
        if rows:
            assert torch.equal(r_idx, torch.stack(want_idx)) and torch.equal(r_w, torch.stack(want_w))
        pairs = [int((r_idx == j).sum()) for j in range(el)]
        assert r_counts == [-(-c // 4) * 4 for c in pairs]  # aligned to expert_alignment
        assert handle[0][:, rank].tolist() == list(torch.tensor(
            [sum(1 for s_, _ in rows if s_ == src) for src in range(world)]).cumsum(0).tolist())
        checked.append(f"dispatch-{'fp8' if fp8 else 'bf16'}")

    # combine: return the received rows unchanged (+ a bias): each token gets x * (ranks it went to) + bias
    recv, *_, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=None,
                                       is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                                       topk_weights=w)
    bias = torch.randn(x.shape[0], h).to(torch.bfloat16)
    out, out_w, _ = buf.combine(recv, handle, topk_weights=torch.ones(recv.shape[0], k), bias=bias)
    n_ranks = in_rank.sum(1, keepdim=True).float()
    assert torch.equal(out, (x.float() * n_ranks + bias.float()).to(torch.bfloat16))
    assert torch.equal(out_w, n_ranks.expand(-1, k))
    checked.append("combine")

    # low-latency kernels
    num_max = 12
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max, h, world, e)
    try:  # a buffer smaller than the call's size hint is refused
        buf_small = deep_ep.Buffer(g, 0, hint - 128 * 8, low_latency_mode=True, num_qps_per_rank=el)
        buf_small.low_latency_dispatch(x, idx, num_max, e, use_fp8=False)
        raise AssertionError("a buffer smaller than the size hint was accepted")
    except RuntimeError as exc:
        assert "RDMA buffer" in str(exc)
    ll = deep_ep.Buffer(g, 1 << 26, hint, low_latency_mode=True, num_qps_per_rank=el)
    recv, *_ = ll.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=None, is_token_in_rank=in_rank,
                           num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    try:
        ll.low_latency_dispatch(x, idx, num_max, e, use_fp8=False)
        raise AssertionError("low-latency dispatch on a dirty buffer was accepted")
    except RuntimeError as exc:
        assert "clean_low_latency_buffer" in str(exc)
    ll.clean_low_latency_buffer(num_max, h, e)
    checked.append("clean_low_latency_buffer")

    for use_fp8, ue8m0, hook in ((False, False, False), (True, False, True), (True, True, False)):
        recv_x, recv_count, handle, _, recv_hook = ll.low_latency_dispatch(
            x, idx, num_max, e, use_fp8=use_fp8, round_scale=ue8m0, use_ue8m0=ue8m0, return_recv_hook=hook)
        if hook:
            assert recv_count.tolist() == [-7] * el, "counts must be garbage before the receive hook"
            recv_hook()
        data = recv_x[0] if use_fp8 else recv_x
        src_info, layout_range = handle[0], handle[1]
        assert data.shape == (el, world * num_max, h) and recv_count.dtype == torch.int32
        for j in range(el):
            ge = rank * el + j
            want = sorted((src, t) for src in range(world) for t in range(counts[src]) if bool((ids[src][t] == ge).any()))
            got = []
            assert int(recv_count[j]) == len(want)
            for src in range(world):
                begin, n = int(layout_range[j, src]) >> 32, int(layout_range[j, src]) & 0xFFFFFFFF
                for row in range(begin, begin + n):
                    t = int(src_info[j, row])
                    got.append((src, t))
                    ref = xs[src][t]
                    if not use_fp8:
                        assert torch.equal(data[j, row], ref)
                        continue
                    # DeepEP's in-kernel recipe (calculate_fp8_scales), element by element
                    groups = ref.float().view(-1, 128)
                    amax = groups.abs().amax(1).clamp(min=1e-4)
                    sinv = amax * torch.tensor(1 / 448, dtype=torch.float32)
                    mult = torch.full_like(amax, 448.0).div(amax)
                    if ue8m0:
                        sinv = 2.0 ** torch.ceil(torch.log2(sinv))
                        mult = 1 / sinv
                        packed = recv_x[1][j, row]  # int32 [H/512]
                        exps = packed.contiguous().view(torch.uint8)
                        assert torch.equal(exps.long(), torch.log2(sinv).long() + 127)
                    else:
                        assert torch.equal(recv_x[1][j, row], sinv)
                    q = (groups * mult[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(-1)
                    assert torch.equal(data[j, row].view(torch.uint8), q.view(torch.uint8))
            assert sorted(got) == want and sum(int(layout_range[j, s_]) & 0xFFFFFFFF for s_ in range(world)) == len(want)
            if not use_fp8 and len(want) < world * num_max:
                assert bool(data[j, len(want):].isnan().all()), "rows past recv_count must be garbage (NaN)"
        if use_fp8:
            sc = recv_x[1]
            assert sc.stride(1) == 1 and sc.stride(2) == world * num_max, "scales must be a column-major view"
        # low_latency_combine: experts scale their rows by (1 + e/E); out = sum_k w * (1 + e_k/E) * x (as sent).
        # Rows past recv_count stay garbage (NaN): combine must not read them.
        deq = data.float()
        if use_fp8:
            scales = unpack_ue8m0(recv_x[1], h // 128) if ue8m0 else recv_x[1]
            deq = (deq.view(el, -1, h // 128, 128) * scales.unsqueeze(-1)).view(el, -1, h)
        factor = 1 + (torch.arange(el) + rank * el).float() / e
        out, _, comb_hook = ll.low_latency_combine((deq * factor.view(-1, 1, 1)).to(torch.bfloat16), idx, w, handle,
                                                   return_recv_hook=hook)
        if hook:
            assert bool(out.isnan().all()), "combine output must be garbage before the receive hook"
            comb_hook()
        sent = quantize_fp8_per_token_group(x, ue8m0=ue8m0) if use_fp8 else None
        xq = x.double() if not use_fp8 else (sent[0].double().view(-1, h // 128, 128)
                                             * sent[1].double().unsqueeze(-1)).view(-1, h)
        want_out = xq * torch.where(idx >= 0, w.double() * (1 + idx.double() / e), 0.0).sum(1, keepdim=True)
        assert out.shape == x.shape and out.dtype == torch.bfloat16
        if x.shape[0]:
            err = float((out.double() - want_out).norm() / want_out.norm())
            assert err < 1e-2, f"low_latency_combine relative error {err}"
        checked.append(f"low_latency-{'fp8' if use_fp8 else 'bf16'}{'-ue8m0' if ue8m0 else ''}{'-hook' if hook else ''}")
    # result tensors are fresh allocations (v1.2.1 deep_ep.cpp): earlier results stay valid
    again = [ll.low_latency_dispatch(x, idx, num_max, e, use_fp8=False)[0] for _ in range(3)]
    assert len({a.data_ptr() for a in again}) == 3
    checked.append("fresh-result-tensors")
    return {"checked": checked}


# --------------------------------------------------------------------------- equivalence


def part_equivalence(rank: int, world: int, seed: int) -> dict:
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import deepep_vs_torch_a2a as eq

    from moe_core.plugins import PluginManager

    manager = PluginManager()
    cases = eq.make_cases(world, 9)
    cases += [dict(mode=m, wire="fp8", scenario="uniform", counts=[7 + r for r in range(world)], ue8m0=True)
              for m in ("normal", "low_latency")]
    cases += [dict(mode=m, wire=w, scenario="uniform", counts=[6 + r for r in range(world)], **{"async": True})
              for m in ("normal", "low_latency") for w in ("bf16", "fp8")]
    results = eq.run_cases(cases, SHAPE, seed, rank, world, torch.device("cpu"), manager)
    import moe_plugin_cuda.deepep as deepep

    calls: Counter = Counter()
    for entry in deepep.BUFFERS._groups.values():
        calls.update(entry.buffer.calls)
    return {"results": results, "calls": dict(calls)}


# --------------------------------------------------------------------------- layer end to end


def _layer_pair(case: dict, world: int, rank: int, ckpt: dict, manager: Any):
    from moe_core.config import MoEConfig
    from moe_core.layer import MoELayer

    cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=2048, intermediate_size=128, quant=case["quant"],
                    ep_size=world, ep_rank=rank, ep_group=dist.group.WORLD, max_tokens_per_rank=case["max_tokens"],
                    device="cuda", dispatcher="deepep", experts="reference", dispatch_dtype=case["wire"],
                    dispatch_format=case["format"])
    layer = MoELayer(cfg, manager=manager, device="cpu")
    layer.load_weights(**ckpt)
    layer.process_weights()
    ref_cfg = MoEConfig(num_experts=8, top_k=3, hidden_size=2048, intermediate_size=128, quant=case["quant"],
                        device="cpu", dispatcher="standard", experts="reference", dispatch_dtype=case["wire"])
    ref = MoELayer(ref_cfg, manager=manager, device="cpu")
    ref.load_weights(**ckpt)
    ref.process_weights()
    return layer, ref


def part_layer(rank: int, world: int, seed: int) -> dict:
    import deep_ep
    import moe_plugin_cuda.deepep as deepep

    from moe_core import quant
    from moe_core.plugins import PluginManager
    from moe_core.testing.data import make_float_weights, make_hidden, make_topk, rel_error, tolerance

    manager = PluginManager()
    ckpts = {}
    for scheme in ("unquantized", "fp8_block"):
        w13, w2 = make_float_weights(8, 2048, 128, torch.Generator().manual_seed(seed))
        if scheme == "unquantized":
            w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
        ckpts[scheme] = quant.quantize_weights(w13, w2, scheme)
    cases = [dict(quant=q, wire=wire, format=f, max_tokens=mt)
             for f, mt in (("ep_normal", None), ("ep_masked", 20))
             for q, wire in (("unquantized", "bf16"), ("fp8_block", "fp8"))]
    cases.append(dict(quant="fp8_block", wire="fp8", format="ep_masked", max_tokens=6))
    # every layer is built before the first call: the buffer must fit the largest (max_tokens 20, not 6)
    layers = [(c, *_layer_pair(c, world, rank, ckpts[c["quant"]], manager)) for c in cases]
    entry = deepep.BUFFERS._groups[dist.group.WORLD]
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    out: dict[str, Any] = {"cases": []}
    buffers = set()
    for rep in range(2):
        for case, layer, ref in reversed(layers):  # the small graph layer calls first
            t = 0 if (rank == world - 1 and rep == 0) else min(case["max_tokens"] or 17, 5 + 3 * rank + rep)
            x = make_hidden(t, 2048, torch.bfloat16, gen)
            topk = make_topk(t, 3, 8, gen, neg_fraction=0.2, empty_token=t >= 3)
            y = layer(x, topk)
            err = rel_error(y, ref(x, topk))
            tol = tolerance(case["quant"], case["wire"])
            assert y.shape == x.shape and y.dtype == x.dtype
            assert err <= tol, f"{case}: relative error {err:.3g} > {tol} (T={t}, rank {rank})"
            if t and bool((topk.ids[0] < 0).all()):
                assert bool((y[0] == 0).all()), "a token routed to no expert got a non-zero output"
            out["cases"].append(dict(case, tokens=t, err=err, format_planned=str(layer.plan.format),
                                     graph_safe=layer.plan.graph_safe))
            buffers.add(id(entry.buffer))
    ll_need = deep_ep.Buffer.get_low_latency_rdma_size_hint(deepep.deepep_num_max(layers[2][1].config), 2048,
                                                            world, 8)
    out.update(buffers=len(buffers), rdma_bytes=entry.buffer.num_rdma_bytes, ll_need=ll_need,
               nvl_bytes=entry.buffer.num_nvl_bytes, low_latency_mode=entry.buffer.low_latency_mode,
               qps=entry.buffer.num_qps_per_rank, calls=dict(entry.buffer.calls))
    return out


def part_in_flight(rank: int, world: int, seed: int) -> dict:
    """Async low-latency calls: a third one in flight is refused before it is issued (every rank
    raises at the same point, no collective left waiting); once one is received the next goes through."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import deepep_vs_torch_a2a as eq

    from moe_core.plugins import PluginManager
    from moe_core.testing.data import make_hidden, make_topk

    case = dict(mode="low_latency", wire="bf16", scenario="uniform", counts=[5] * world)
    d = eq._dispatcher("deepep", case, SHAPE, SHAPE["topk"], rank, world, PluginManager())
    gen = torch.Generator().manual_seed(seed + rank)
    x, topk = make_hidden(5, SHAPE["hidden"], torch.bfloat16, gen), make_topk(5, SHAPE["topk"], SHAPE["experts"], gen)
    first, second = d.dispatch_async(x, topk), d.dispatch_async(x, topk)
    try:
        d.dispatch_async(x, topk)
        third = None
    except RuntimeError as exc:
        third = str(exc)
    try:
        d.dispatch(x, topk)  # a synchronous call would be a third one in flight too
        third_sync = None
    except RuntimeError as exc:
        third_sync = str(exc)
    m1 = first.wait().masked_m.clone()
    again = d.dispatch_async(x, topk)  # allowed again
    m2, out = second.wait().masked_m.clone(), again.wait()
    comb = d.combine_async(eq._synthetic_experts(out, rank, SHAPE["experts"]))
    y = comb.wait()
    return {"third": third, "third_sync": third_sync, "same_counts": bool(torch.equal(m1, m2) and torch.equal(m1, out.masked_m)),
            "combined_rows": int(y.shape[0])}


def part_hot_path(rank: int, world: int, seed: int) -> dict:
    """Synchronous low-latency calls, on the hot path (a TopK from int64 ids, contiguous bf16 input) and
    off it (int32 ids: a cast; fp32 or strided input, a strided slab: a copy; a bad shape: the contract's refusal), give the
    same results; a combine whose weights DeepEP refuses raises the contract's error, not the library's."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import deepep_vs_torch_a2a as eq

    from moe_core.contracts import TopK
    from moe_core.plugins import PluginManager
    from moe_core.testing.data import make_hidden, make_topk

    t = 7
    case = dict(mode="low_latency", wire="bf16", scenario="uniform", counts=[t] * world)
    d = eq._dispatcher("deepep", case, SHAPE, SHAPE["topk"], rank, world, PluginManager())
    gen = torch.Generator().manual_seed(seed + rank)
    x, routed = make_hidden(t, SHAPE["hidden"], torch.float32, gen), make_topk(t, SHAPE["topk"], SHAPE["experts"], gen)
    ids64 = routed.ids.long()

    def run(x_in: torch.Tensor, topk: TopK) -> tuple[torch.Tensor, torch.Tensor]:
        out = d.dispatch(x_in, topk)
        return out.masked_m.clone(), d.combine(eq._synthetic_experts(out, rank, SHAPE["experts"])).float()

    hot = TopK(routed.weights, ids64)
    ref_m, ref_y = run(x.to(torch.bfloat16), hot)
    variants = {"int32_ids": (x.to(torch.bfloat16), TopK(routed.weights, ids64.int())),
                "fp32_input": (x, hot), "strided_input": (x.to(torch.bfloat16).t().contiguous().t(), hot)}
    same = {}
    for name, (x_in, topk) in variants.items():
        m, y = run(x_in, topk)
        same[name] = bool(torch.equal(m, ref_m) and torch.allclose(y, ref_y, rtol=1e-2, atol=1e-2))
    errors = {}
    refused = {"hidden": (torch.zeros(t, SHAPE["hidden"] // 2, dtype=torch.bfloat16), hot),  # before the launch
               "rows": (x.to(torch.bfloat16), TopK(hot.weights[:-1], ids64[:-1])),  # DeepEP's own check first
               "top_k": (x.to(torch.bfloat16), TopK(hot.weights[:, :-1], ids64[:, :-1].contiguous()))}  # after it
    for name, (x_in, topk) in refused.items():
        try:
            d.dispatch(x_in, topk)
        except ValueError as exc:
            errors[name] = str(exc)
    out = d.dispatch(x.to(torch.bfloat16), hot)
    ci = eq._synthetic_experts(out, rank, SHAPE["experts"])
    bad = type(ci)(ci.hidden, TopK(hot.weights[:-1], ids64[:-1]), ci.handle)  # the weights of t - 1 tokens
    try:
        d.combine(bad)
    except ValueError as exc:
        errors["weights"] = str(exc)
    y_after = d.combine(ci).float()  # the buffer still serves the hot path after a refusal
    # a strided slab: DeepEP refuses it before launching anything, the checked path copies it
    strided = type(ci)(ci.hidden.transpose(0, 1).contiguous().transpose(0, 1), ci.topk, ci.handle)
    same["strided_slab"] = bool(torch.allclose(d.combine(strided).float(), y_after, rtol=0, atol=0))
    # a DeepEP whose wrapper is not v1.2.1's (docs/decisions.md, entry 69): the hot path calls that wrapper by its
    # keywords (the checked path is made unusable here to show it), with the same results
    buf, launch = d.buffer, d._launch_low_latency_dispatch
    d._entry.wraps_runtime, d._launch_low_latency_dispatch, wrapped = False, None, buf.calls["low_latency_dispatch"]
    m, y = run(x.to(torch.bfloat16), hot)
    same["other_wrapper"] = bool(torch.equal(m, ref_m) and torch.allclose(y, ref_y, rtol=1e-2, atol=1e-2)
                                 and buf.calls["low_latency_dispatch"] == wrapped + 1)
    d._entry.wraps_runtime, d._launch_low_latency_dispatch = True, launch
    return {"same": same, "errors": errors, "after_refusal": bool(torch.allclose(y_after, ref_y, rtol=1e-2, atol=1e-2)),
            "hot_path_ready": d._entry.low_latency_ready is not None}


def part_async_events(rank: int, world: int, seed: int) -> dict:
    """Normal mode's async API with a caller's ``previous_event``: an FP8 dispatch (the cast follows the
    event) and a combine of fp32 rows (the bf16 cast follows it too) go through the emulation's
    stream-order checks and match the synchronous results."""
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    import deep_ep
    import deepep_vs_torch_a2a as eq

    from moe_core.contracts import EPNormalCombine
    from moe_core.plugins import PluginManager
    from moe_core.testing.data import make_hidden, make_topk

    case = dict(mode="normal", wire="fp8", scenario="uniform", counts=[7] * world)
    d = eq._dispatcher("deepep", case, SHAPE, SHAPE["topk"], rank, world, PluginManager())
    gen = torch.Generator().manual_seed(seed + rank)
    x, topk = make_hidden(7, SHAPE["hidden"], torch.bfloat16, gen), make_topk(7, SHAPE["topk"], SHAPE["experts"], gen)
    sync = d.dispatch(x, topk)
    out = d.dispatch_async(x, topk, previous_event=deep_ep.Buffer.capture()).wait()
    same_dispatch = torch.equal(out.hidden.data.view(torch.uint8), sync.hidden.data.view(torch.uint8))
    y = out.hidden.dequantize(torch.float32)  # fp32: the combine casts to bf16 after the caller's event
    combined = d.combine_async(EPNormalCombine(y, out.handle), previous_event=deep_ep.Buffer.capture()).wait()
    want = d.combine(EPNormalCombine(y.to(torch.bfloat16), sync.handle))
    return {"same_dispatch": same_dispatch, "same_combine": bool(torch.equal(combined, want.to(combined.dtype)))}


PARTS = {"hot_path": part_hot_path, "async_events": part_async_events, "ops": part_ops, "equivalence": part_equivalence,
         "layer": part_layer, "in_flight": part_in_flight}


def _parts(rank: int, world: int, seed: int, parts: list) -> dict:
    results = {}
    for name in parts:
        results[name] = PARTS[name](rank, world, seed)
        dist.barrier()
    return results


def run_world(world: int, parts: list[str], seed: int, timeout: float = 200.0) -> list[dict]:
    """Run ``parts`` on ``world`` ranks; returns ``results[rank][part]``. Raises on error or timeout."""
    return run_gloo_world(_parts, world, seed, parts, setup="deep_ep_emulation:install_into_process",
                          timeout=timeout)
