"""One rank of an EP test run: ``run_rank(rank, world, scenario, seed, backend)``.

Started by ``tests/ep/harness.py`` (one spawned process per rank, 127.0.0.1). Runs every case of
the scenario and returns ``{"cases": {name: result}}`` or ``{"error": traceback}``. The parent
test asserts on the results, so a failing check names the case, the rank and the numbers.

Scenarios:
- ``layer``: ``MoELayer`` with ``torch_a2a`` (normal and masked, every wire dtype, several
  routings) against the single-process reference layer on this rank's tokens.
- ``comm``: the dispatcher alone, checking the layouts (each token once per destination rank,
  counts, order, masked_m, garbage rows ignored) with a float64 stand-in for the experts.
- ``errors``: masked capacity overflow, ids out of range (both modes), bad shapes.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import traceback

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from moe_core import MoEConfig, MoELayer, TopK, plan  # noqa: E402
from moe_core.backends import BackendSpec, Role  # noqa: E402
from moe_core.contracts import (  # noqa: E402
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Format,
    WireDtype,
)
from moe_core.distributed import TorchA2ADispatcher, torch_a2a  # noqa: E402
from moe_core.plugin_api import register_torch_a2a_kernels  # noqa: E402
from moe_core.plugins import get_plugin_manager  # noqa: E402
from moe_core.runtime import BackendContext  # noqa: E402
from moe_core.testing.data import make_float_weights, make_hidden, make_topk, rel_error  # noqa: E402

E, K, H, I = 16, 4, 256, 128  # noqa: E741 (I: the intermediate size, as in the papers)
CAPACITY = 40
WIRES = ("bf16", "fp8", "int8")
MODES = (Format.EP_NORMAL, Format.EP_MASKED)
# name -> (format, normal-mode buffers): exact counts (host read) or worst-case (graph-safe, decision 56)
VARIANTS = {"ep_normal": (Format.EP_NORMAL, "exact"), "ep_normal_worst_case": (Format.EP_NORMAL, "worst_case"),
            "ep_masked": (Format.EP_MASKED, None)}
# max_tokens_per_rank of the fused kernels' runs in Triton's interpreter (CPU), which costs per token: odd, and
# world 2's 34 received slots still span two of expand_masked's blocks (a2a.MASKED_BLOCK = 32), the last partial
INTERPRETER_CAPACITY = 17


def routing_cases(world: int, rank: int, seed: int, capacity: int = CAPACITY) -> dict[str, tuple[torch.Tensor, TopK]]:
    """name -> (hidden [T, H] bf16, topk) of this rank's tokens. Different seeds per rank."""
    el = E // world
    gen = torch.Generator().manual_seed(seed * 1000 + rank)

    def make(t: int, **kw):
        return make_hidden(t, H, torch.bfloat16, gen), make_topk(t, K, E, gen, **kw)

    return {
        # -1 ids sprinkled, one token with no expert at all, odd size differing per rank (23 + 4 * rank at 40)
        "uniform": make(capacity // 2 + 3 + capacity // 10 * rank, neg_fraction=0.25, empty_token=True),
        # every token of every rank goes to rank 0's experts
        "skewed": make(capacity - rank, experts_subset=range(0, el)),
        # rank 1 has no tokens, rank 0 has one
        "zero_ranks": make({0: 1, 1: 0}.get(rank, capacity // 2 - 3)),
        # nobody has tokens
        "idle": make(0),
        # exactly at the masked capacity
        "full": make(capacity),
    }


def ep_config(world: int, rank: int, wire: str, backend_dtype=torch.bfloat16, buffers=None, kernels=None,
              exchange=None, capacity: int = CAPACITY) -> MoEConfig:
    options = {k: v for k, v in (("normal_buffers", buffers), ("kernels", kernels), ("exchange", exchange)) if v}
    return MoEConfig(backend_options={"torch_a2a": options} if options else {},
                     num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, params_dtype=backend_dtype,
                     ep_size=world, ep_rank=rank, max_tokens_per_rank=capacity, dispatcher="torch_a2a",
                     experts="reference", dispatch_dtype=wire, device="cuda" if torch.cuda.is_available() else "cpu")


def checkpoint(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = make_float_weights(E, H, I, gen)
    return {"w13": w13.bfloat16(), "w2": w2.bfloat16()}


def build_layer(cfg: MoEConfig, fmt: Format, weights: dict, device: torch.device) -> MoELayer:
    p = plan(cfg)
    if p.format is not fmt:  # masked is chosen by the planner only for CUDA graphs: ask for it here
        p = dataclasses.replace(p, format=fmt)
    layer = MoELayer(cfg, plan=p, device=device)
    layer.load_weights(**{k: v.to(device) for k, v in weights.items()})
    layer.process_weights()
    return layer


# --------------------------------------------------------------------------- scenarios


def scenario_layer(world: int, rank: int, device: torch.device, seed: int) -> dict:
    weights = checkpoint(seed)
    cases = routing_cases(world, rank, seed)
    results = {}
    for wire in WIRES:
        ref_layers = {}
        for w in {wire, "bf16"}:
            cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dispatcher="standard",
                            experts="reference", dispatch_dtype=w, device="cpu")
            ref_layers[w] = build_layer(cfg, Format.STANDARD, weights, torch.device("cpu"))
        for mode, (fmt, buffers) in VARIANTS.items():
            if buffers == "worst_case" and wire == "int8":
                continue
            layer = build_layer(ep_config(world, rank, wire, buffers=buffers), fmt, weights, device)
            assert layer.plan.dispatcher.name == "torch_a2a" and layer.plan.dispatch_dtype is WireDtype(wire)
            for name, (x, topk) in cases.items():
                out = layer(x.to(device), TopK(topk.weights.to(device), topk.ids.to(device))).cpu()
                ref = ref_layers[wire](x, topk)
                ref16 = ref_layers["bf16"](x, topk)
                results[f"{mode}/{wire}/{name}"] = {
                    "tokens": x.shape[0], "shape_ok": list(out.shape) == list(x.shape) and out.dtype == x.dtype,
                    "err": rel_error(out, ref), "err_vs_bf16": rel_error(out, ref16),
                    "finite": bool(torch.isfinite(out.float()).all()),
                }
    return results


def _make_dispatcher(world: int, rank: int, fmt: Format, wire: str, buffers=None, kernels=None,
                     exchange=None, capacity: int = CAPACITY) -> TorchA2ADispatcher:
    cfg = ep_config(world, rank, wire, buffers=buffers, kernels=kernels, exchange=exchange, capacity=capacity)
    spec = BackendSpec(name="torch_a2a", role=Role.DISPATCHER, impl="moe_core.distributed:TorchA2ADispatcher",
                       formats=MODES, devices=frozenset({"cpu", "cuda"}))
    return TorchA2ADispatcher(BackendContext(cfg, spec, fmt, WireDtype(wire)))


def _expert_fn(x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Stand-in expert ``e``: a distinct float64 map per global expert id."""
    return torch.tanh(x.double()) * (1.0 + e.double().unsqueeze(-1)) + e.double().unsqueeze(-1) / 10


def scenario_comm(world: int, rank: int, device: torch.device, seed: int) -> dict:
    el = E // world
    first = rank * el
    # every rank knows every rank's tokens (same generators), to check what it should receive
    all_cases = [routing_cases(world, r, seed) for r in range(world)]
    results = {}
    for mode, (fmt, buffers) in VARIANTS.items():
        for wire in WIRES:
            d = _make_dispatcher(world, rank, fmt, wire, buffers)
            for name, (x, topk) in all_cases[rank].items():
                key = f"{mode}/{wire}/{name}"
                dev_topk = TopK(topk.weights.to(device), topk.ids.to(device))
                out_d = d.dispatch(x.to(device), dev_topk)
                checks = {}
                deq = out_d.hidden.dequantize(torch.float32).cpu()
                if fmt is Format.EP_NORMAL:
                    assert isinstance(out_d, EPNormalDispatch)
                    # expected rows: for each source rank in order, its tokens that use an expert here
                    # (worst-case buffers: in that source's CAPACITY rows, then padding rows)
                    exp_rows, exp_ids, exp_w, sent = [], [], [], []
                    for src in range(world):
                        xs, ts = all_cases[src][name]
                        ids = ts.ids.long()
                        mine = (ids >= first) & (ids < first + el)
                        sel = mine.any(1)
                        exp_rows.append(_wire_roundtrip(xs, wire, device)[sel].float())
                        exp_ids.append(torch.where(mine, ids - first, -1)[sel])
                        exp_w.append(torch.where(mine, ts.weights, 0.0)[sel])
                        sent.append(int(sel.sum()))
                    exp_rows, exp_ids, exp_w = torch.cat(exp_rows), torch.cat(exp_ids), torch.cat(exp_w)
                    counts = torch.bincount(exp_ids[exp_ids >= 0], minlength=el)
                    got_ids, got_w = out_d.topk.ids.cpu().long(), out_d.topk.weights.cpu()
                    valid = torch.ones(deq.shape[0], dtype=torch.bool)
                    if buffers == "worst_case":
                        checks["rows"] = deq.shape[0] == world * CAPACITY
                        valid = (torch.arange(CAPACITY).unsqueeze(0) < torch.tensor(sent).unsqueeze(1)).reshape(-1)
                        valid = valid if checks["rows"] else torch.zeros(deq.shape[0], dtype=torch.bool)
                        checks["padding"] = bool((got_ids[~valid] == -1).all() and (got_w[~valid] == 0).all())
                        checks["padding_finite"] = bool(torch.isfinite(deq[~valid]).all())
                        checks["counts_host"] = out_d.expert_counts_host is None  # nothing read on the host
                    else:
                        checks["rows"] = deq.shape[0] == exp_rows.shape[0]
                        checks["counts_host"] = list(out_d.expert_counts_host) == counts.tolist()
                    checks["ids"] = torch.equal(got_ids[valid], exp_ids)
                    checks["weights"] = torch.equal(got_w[valid], exp_w)
                    checks["counts"] = torch.equal(out_d.expert_counts.cpu().long(), counts)
                    data_err = rel_error(deq[valid], exp_rows) if checks["ids"] else float("inf")
                    # stand-in experts: weighted sum over local experts, float64
                    lid = out_d.topk.ids.cpu().long()
                    y = torch.zeros(deq.shape[0], H, dtype=torch.float64)
                    for j in range(K):
                        ok = lid[:, j] >= 0
                        y += torch.where(ok.unsqueeze(1), _expert_fn(deq, lid[:, j] + first)
                                         * out_d.topk.weights.cpu()[:, j:j + 1].double(), 0.0)
                    y[~valid] = float("nan")  # padding rows' outputs must never be read back
                    out = d.combine(EPNormalCombine(y.to(torch.bfloat16).to(device), out_d.handle)).cpu()
                else:
                    assert isinstance(out_d, EPMaskedDispatch)
                    cw = CAPACITY * world
                    m = out_d.masked_m.cpu().long()
                    exp_counts = torch.zeros(el, dtype=torch.long)
                    exp_rows = [[] for _ in range(el)]
                    for src in range(world):
                        xs, ts = all_cases[src][name]
                        xs = _wire_roundtrip(xs, wire, device).float()
                        for t, row in enumerate(ts.ids.long().tolist()):
                            for e in row:
                                if first <= e < first + el:
                                    exp_counts[e - first] += 1
                                    exp_rows[e - first].append(xs[t])
                    checks["shape"] = list(deq.shape) == [el, cw, H]
                    checks["masked_m"] = torch.equal(m, exp_counts)
                    # valid rows are the expected rows, in (source, token) order
                    errs = []
                    for e in range(el):
                        if exp_rows[e] and int(m[e]) == len(exp_rows[e]):
                            errs.append(rel_error(deq[e, :len(exp_rows[e])], torch.stack(exp_rows[e])))
                    data_err = max(errs, default=0.0)
                    # stand-in experts, unweighted; rows past masked_m are NaN and must be ignored
                    y = torch.full((el, cw, H), float("nan"), dtype=torch.float64)
                    for e in range(el):
                        n = int(m[e])
                        y[e, :n] = _expert_fn(deq[e, :n], torch.full((n,), first + e))
                    ci = EPMaskedCombine(y.to(torch.bfloat16).to(device), out_d.topk, out_d.handle)
                    out = d.combine(ci).cpu()
                    # combine with other weights (the same values, a new tensor): exchanged again
                    ci2 = EPMaskedCombine(ci.hidden, TopK(out_d.topk.weights.clone(), out_d.topk.ids), out_d.handle)
                    checks["reweighted_same"] = rel_error(d.combine(ci2).cpu(), out) < 1e-6
                # expected output from this rank's own tokens, float64 on the wire-dequantized input
                ids = topk.ids.long()
                ref = torch.zeros(x.shape[0], H, dtype=torch.float64)
                xq = _wire_roundtrip(x, wire, device)
                for j in range(K):
                    ok = ids[:, j] >= 0
                    ref += torch.where(ok.unsqueeze(1), _expert_fn(xq, ids[:, j].clamp(min=0))
                                       * topk.weights[:, j:j + 1].double(), 0.0)
                results[key] = {"checks": checks, "data_err": data_err, "err": rel_error(out, ref),
                                "shape_ok": list(out.shape) == list(x.shape) and out.dtype == x.dtype,
                                "tokens": x.shape[0]}
    return results


_REUSED: dict = {}


def _emulated_exchange_fixed(x, ids, weights, src, num_tokens, bad_ids, wire, group):
    """The cuda plugin's ``exchange_fixed`` on gloo (no symmetric memory there): its rows, moved by
    ``all_to_all_single`` into ONE receive buffer per shape that every call reuses, as the direct write's are."""
    from moe_plugin_cuda.triton import a2a

    send = a2a.pack_fixed(x, ids, weights, src, num_tokens, bad_ids, wire)
    recv = _REUSED.setdefault(tuple(send.shape), torch.empty_like(send))
    torch.distributed.all_to_all_single(recv, send, group=group)
    return recv


def _emulated_exchange_normal(x, ids, weights, row, msg, wire, group, capacity):
    """The cuda plugin's ``exchange_normal`` on gloo: its rows in chunks of ``capacity`` per source (the overflow flag
    set as its kernel sets it), moved by ``all_to_all_single`` into one reused receive buffer per shape, and the
    counts messages."""
    from moe_plugin_cuda.triton import a2a

    send = a2a.pack(x, ids, weights, row, wire)
    per_rank = msg[0, :, 2].tolist()
    chunks = send.new_zeros(len(per_rank) * capacity, send.shape[1])
    for r, n in enumerate(per_rank):
        first = sum(per_rank[:r])
        chunks[r * capacity:r * capacity + min(n, capacity)] = send[first:first + min(n, capacity)]
    msg[0, :, -1] = int(max(per_rank) > capacity)
    recv = _REUSED.setdefault(("normal",) + tuple(chunks.shape), torch.empty_like(chunks))
    torch.distributed.all_to_all_single(recv, chunks, group=group)
    torch.distributed.all_to_all_single(msg[1], msg[0], group=group)  # (it moves the counts messages too)
    return recv


def _emulated_exchange_masked_back(y, slab_index, valid, weights, group):
    """The cuda plugin's ``exchange_masked_back`` on gloo: ``reduce_masked``'s rows by ``all_to_all_single`` into one
    reused buffer per shape."""
    from moe_plugin_cuda.triton import a2a

    send = a2a.reduce_masked(y, slab_index, valid, weights)
    recv = _REUSED.setdefault(("back",) + tuple(send.shape), torch.empty_like(send))
    torch.distributed.all_to_all_single(recv, send, group=group)
    return recv


def _emulated_exchange_masked(x, ids, weights, src, num_tokens, bad_ids, wire, group, num_local, data_dtype):
    """The cuda plugin's ``exchange_masked`` on gloo: the counts rows by ``all_to_all_single``; the real pack kernel
    (own slots straight into the slab) through a table of addresses whose other ranks' entries point into a local
    staging buffer, moved by ``all_to_all_single`` into one reused receive buffer per shape (this rank's own chunk
    there: the pack's side blocks); then the expansion of the other ranks' slots only."""
    from moe_plugin_cuda.triton import a2a

    world, rank = torch.distributed.get_world_size(group), torch.distributed.get_rank(group)
    cw, (h, k) = src.shape[0], (x.shape[1], ids.shape[1])
    c = cw // world
    data_bytes, _, b = a2a._row_layout(wire, h, x.element_size(), k, in_band=True)
    ns = a2a._scale_words(wire, h)
    index, msg = a2a.self_layout(ids, x.shape[0], world, num_local, c, rank)
    counts = torch.empty_like(msg)
    torch.distributed.all_to_all_single(counts, msg, group=group)
    recv = _REUSED.setdefault(("masked", cw, b), torch.empty(cw, b, dtype=torch.uint8))
    staging = torch.empty(cw, b, dtype=torch.uint8)  # row r * C + j: this rank's slot j for rank r
    peers = torch.tensor([recv.data_ptr() if r == rank else staging.data_ptr() + (r - rank) * c * b
                          for r in range(world)], dtype=torch.int64)
    slab = torch.empty(num_local * cw, data_bytes, dtype=torch.uint8)
    slab_scale = torch.empty(num_local * cw, ns, dtype=torch.float32) if ns else None
    a2a.pack_masked_into(x, ids, weights, src, num_tokens, bad_ids, wire, peers, rank, index, counts, slab, slab_scale)
    moved = torch.empty_like(staging)
    torch.distributed.all_to_all_single(moved, staging, group=group)
    own = slice(rank * c, (rank + 1) * c)
    moved[own] = recv[own]
    recv.copy_(moved)
    recv_data, recv_meta = a2a.split_fixed(recv, wire, x.dtype, h, k)
    return (recv_meta,) + a2a.expand_masked(recv_data, recv_meta, ns, k, rank, num_local, data_dtype, slab,
                                            slab_scale, done=(rank * c, c))


def scenario_comm_fused(world: int, rank: int, device: torch.device, seed: int, modes=tuple(VARIANTS),
                        exchange=None, wires=WIRES) -> dict:
    """``modes`` (default: every mode) with the cuda plugin's fused kernels (decision 63; on the CPU in Triton's interpreter) against
    the torch path: the same received bytes, ids, weights and counts (masked: the slab's valid rows), the same
    combined rows. ``exchange="direct"``: the fixed-capacity modes move their rows by the plugin's
    ``exchange_fixed`` (decision 66; on gloo an emulation that reuses its receive rows as the real one does), and
    every dispatch is followed by another one before its outputs are checked and combined (nothing it returned
    may live in the reused rows)."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels' module is imported
    register_torch_a2a_kernels(device.type, "moe_plugin_cuda.triton.a2a:KERNELS")
    if exchange == "direct" and device.type == "cpu":
        from moe_plugin_cuda.triton import a2a

        register_torch_a2a_kernels("cpu", dataclasses.replace(
            a2a.KERNELS, exchange_fixed=_emulated_exchange_fixed, exchange_normal=_emulated_exchange_normal,
            exchange_masked_back=_emulated_exchange_masked_back, exchange_masked=_emulated_exchange_masked,
            direct_ok=None,
            exchange_counts=lambda msg, group: torch.distributed.all_to_all_single(msg[1], msg[0], group=group)))
    gen = torch.Generator().manual_seed(seed + rank)
    capacity = CAPACITY if device.type == "cuda" else INTERPRETER_CAPACITY
    results = {}

    def same(a, b) -> bool:
        return (a is None and b is None) or (a is not None and b is not None and a.dtype == b.dtype
                                             and a.shape == b.shape
                                             and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8)))

    for mode in modes:
        fmt, buffers = VARIANTS[mode]
        for wire in wires:
            fused = _make_dispatcher(world, rank, fmt, wire, buffers, exchange=exchange, capacity=capacity)
            plain = _make_dispatcher(world, rank, fmt, wire, buffers, kernels="torch", capacity=capacity)
            for name, (x, topk) in routing_cases(world, rank, seed, capacity).items():
                x, topk = x.to(device), TopK(topk.weights.to(device), topk.ids.to(device))
                a, b = fused.dispatch(x, topk), plain.dispatch(x, topk)
                if exchange == "direct":  # other rows through the same receive rows before `a` is read
                    fused.dispatch(-x, TopK(topk.weights, topk.ids.flip(0)))
                checks = {"fused": torch_a2a._kernels_for(device.type) is not None}  # the kernels loaded: the fused path ran
                if fmt is Format.EP_NORMAL:
                    checks.update({
                        "data": a.hidden.data.is_contiguous() and same(a.hidden.data, b.hidden.data),
                        "scale": same(a.hidden.scale, b.hidden.scale),
                        "ids": same(a.topk.ids, b.topk.ids),
                        "weights": same(a.topk.weights, b.topk.weights),
                        "counts": same(a.expert_counts, b.expert_counts),
                        "counts_host": a.expert_counts_host == b.expert_counts_host,
                    })
                    y = make_hidden(a.hidden.data.shape[0], H, torch.bfloat16, gen).to(device)
                    ca, cb = EPNormalCombine(y, a.handle), EPNormalCombine(y, b.handle)
                else:
                    m = a.masked_m
                    checks["masked_m"] = same(m, b.masked_m)
                    valid = (torch.arange(a.hidden.data.shape[1], device=device) < m.unsqueeze(1))
                    checks["slab"] = checks["masked_m"] and same(a.hidden.data[valid], b.hidden.data[valid])
                    checks["slab_scale"] = (a.hidden.scale is None and b.hidden.scale is None) or (
                        checks["masked_m"] and same(a.hidden.scale[valid], b.hidden.scale[valid]))
                    el, cw = a.hidden.data.shape[:2]
                    y = make_hidden(el * cw, H, torch.bfloat16, gen).view(el, cw, H)
                    # valid rows: the stand-in experts of the received tokens, so that the combine has a float64
                    # oracle from this rank's own tokens (rows past masked_m stay random: never read)
                    deq = a.hidden.dequantize(torch.float32).cpu()
                    for e, n in enumerate(m.tolist()):
                        y[e, :n] = _expert_fn(deq[e, :n], torch.full((n,), rank * el + e)).to(torch.bfloat16)
                    y = y.to(device)
                    ca, cb = EPMaskedCombine(y, a.topk, a.handle), EPMaskedCombine(y, b.topk, b.handle)
                out_a, out_b = fused.combine(ca), plain.combine(cb)
                # masked combine: weighted fp32 sums, which the torch path's compiled code may contract into FMAs
                # where the kernel rounds each product (decision 70): a tolerance, and the float64 oracle below
                exact = fmt is not Format.EP_MASKED
                result = {"checks": checks, "combine_err": rel_error(out_a.float(), out_b.float()),
                          "combine_same": torch.equal(out_a, out_b) if exact else None, "tokens": x.shape[0]}
                if fmt is Format.EP_MASKED:
                    ids = topk.ids.long().cpu()
                    ref = torch.zeros(x.shape[0], H, dtype=torch.float64)
                    xq = _wire_roundtrip(x, wire, device)
                    for j in range(K):
                        ref += torch.where(ids[:, j:j + 1] >= 0, _expert_fn(xq, ids[:, j].clamp(min=0))
                                           * topk.weights.cpu()[:, j:j + 1].double(), 0.0)
                    result["ref_err"] = rel_error(out_a.cpu(), ref)
                results[f"{mode}/{wire}/{name}"] = result
    return results


def scenario_direct_overflow(world: int, rank: int, device: torch.device, seed: int) -> dict:
    """Exact normal mode with the direct exchange (decision 66) and rank 0 over ``max_tokens_per_rank`` (its rows
    overflow their chunks): every rank moves the rows again by ``all_to_all_single``, and the dispatch is the torch
    path's, byte for byte."""
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        from moe_plugin_cuda.triton import a2a

        register_torch_a2a_kernels("cpu", dataclasses.replace(a2a.KERNELS, exchange_normal=_emulated_exchange_normal,
                                                              direct_ok=None))
    else:
        register_torch_a2a_kernels(device.type, "moe_plugin_cuda.triton.a2a:KERNELS")
    gen = torch.Generator().manual_seed(seed + rank)
    spec = BackendSpec(name="torch_a2a", role=Role.DISPATCHER, impl="moe_core.distributed:TorchA2ADispatcher",
                       formats=MODES, devices=frozenset({"cpu", "cuda"}))
    out = {}
    for kernels in ("auto", "torch"):
        cfg = dataclasses.replace(ep_config(world, rank, "bf16", kernels=kernels, exchange="direct"),
                                  max_tokens_per_rank=4)
        d = TorchA2ADispatcher(BackendContext(cfg, spec, Format.EP_NORMAL, WireDtype("bf16")))
        gen.manual_seed(seed + rank)
        t = 9 if rank == 0 else 3
        x, tk = make_hidden(t, H, torch.bfloat16, gen).to(device), make_topk(t, K, E, gen)
        out[kernels] = d.dispatch(x, TopK(tk.weights.to(device), tk.ids.to(device)))
    a, b = out["auto"], out["torch"]
    rows = [int(n) for n in ((tk.ids.unsqueeze(0) // (E // world)) == torch.arange(world).view(world, 1, 1)).any(2).sum(1)]
    same = lambda u, v: u.shape == v.shape and torch.equal(u.contiguous().view(torch.uint8), v.contiguous().view(torch.uint8))  # noqa: E731
    return {"overflow": {"checks": {"fused": torch_a2a._kernels_for(device.type) is not None,
                                    "data": same(a.hidden.data, b.hidden.data), "ids": same(a.topk.ids, b.topk.ids),
                                    "weights": same(a.topk.weights, b.topk.weights),
                                    "counts_host": a.expert_counts_host == b.expert_counts_host,
                                    # the premise: rank 0's rows overflow a chunk of 4 (every rank falls back)
                                    "premise": rank != 0 or max(rows) > 4}}}


def _wire_roundtrip(x: torch.Tensor, wire: str, device: torch.device) -> torch.Tensor:
    """What the wire carries, quantized on the same device as the dispatcher does (CPU and CUDA
    may round an FP8 tie differently), dequantized in float64 on the CPU."""
    from moe_core import quant

    return quant.quantize_activations(x.to(device), WireDtype(wire)).dequantize(torch.float32).cpu().double()


def scenario_errors(world: int, rank: int, device: torch.device, seed: int) -> dict:
    results = {}
    gen = torch.Generator().manual_seed(seed + rank)
    # masked capacity overflow: every rank overflows (it raises before any collective)
    d = _make_dispatcher(world, rank, Format.EP_MASKED, "bf16")
    x, topk = make_hidden(CAPACITY + 1, H, torch.bfloat16, gen), make_topk(CAPACITY + 1, K, E, gen)
    try:
        d.dispatch(x.to(device), TopK(topk.weights.to(device), topk.ids.to(device)))
        results["overflow"] = {"raised": False}
    except ValueError as exc:
        results["overflow"] = {"raised": True, "message": str(exc)}
    # the same with worst-case normal buffers (the same fixed-capacity exchange)
    dw = _make_dispatcher(world, rank, Format.EP_NORMAL, "fp8", "worst_case")
    try:
        dw.dispatch(x.to(device), TopK(topk.weights.to(device), topk.ids.to(device)))
        results["overflow_worst_case"] = {"raised": False}
    except ValueError as exc:
        results["overflow_worst_case"] = {"raised": True, "message": str(exc)}
    # ids out of range in normal mode, on rank 0 only: every rank raises, nobody hangs
    d = _make_dispatcher(world, rank, Format.EP_NORMAL, "bf16")
    x, topk = make_hidden(5, H, torch.bfloat16, gen), make_topk(5, K, E, gen)
    ids = topk.ids.clone()
    if rank == 0:
        ids[2, 1] = E + 3
    try:
        d.dispatch(x.to(device), TopK(topk.weights.to(device), ids.to(device)))
        results["bad_ids"] = {"raised": False}
    except ValueError as exc:
        results["bad_ids"] = {"raised": True, "message": str(exc)}
    # the same in masked mode (no host read: the count travels in-band), on rank 0 only. CPU only: on
    # CUDA it is a device-side assert, which leaves the context unusable (the overflow scenario
    # covers that path, alone in its processes)
    if device.type == "cpu":
        dm = _make_dispatcher(world, rank, Format.EP_MASKED, "bf16")
        try:
            dm.dispatch(x.to(device), TopK(topk.weights.to(device), ids.to(device)))
            results["bad_ids_masked"] = {"raised": False}
        except ValueError as exc:
            results["bad_ids_masked"] = {"raised": True, "message": str(exc)}
        try:  # worst-case normal buffers check in-band too
            dw.dispatch(x.to(device), TopK(topk.weights.to(device), ids.to(device)))
            results["bad_ids_worst_case"] = {"raised": False}
        except ValueError as exc:
            results["bad_ids_worst_case"] = {"raised": True, "message": str(exc)}
    # the group is still usable afterwards
    out_d = d.dispatch(x.to(device), TopK(topk.weights.to(device), topk.ids.to(device)))
    results["after_error"] = {"rows": int(out_d.hidden.shape[0])}
    # wrong hidden size
    try:
        d.dispatch(torch.zeros(3, H + 1, dtype=torch.bfloat16, device=device),
                   TopK(topk.weights[:3].to(device), topk.ids[:3].to(device)))
        results["bad_shape"] = {"raised": False}
    except ValueError as exc:
        results["bad_shape"] = {"raised": True, "message": str(exc)}
    return results


def scenario_graph(world: int, rank: int, device: torch.device, seed: int, exchange=None) -> dict:
    """CUDA only: masked mode and worst-case normal mode never sync with the host, and are
    captured and replayed in a CUDA graph (``exchange``: the backend option, decision 66)."""
    results = {}
    gen = torch.Generator().manual_seed(seed + rank)
    for (mode, (fmt, buffers)), wire in [(v, w) for v in VARIANTS.items() if v[0] != "ep_normal" for w in WIRES]:
        d = _make_dispatcher(world, rank, fmt, wire, buffers, exchange=exchange)
        x = make_hidden(CAPACITY - 3 - rank, H, torch.bfloat16, gen).to(device)
        tk = make_topk(CAPACITY - 3 - rank, K, E, gen, neg_fraction=0.2)
        topk = TopK(tk.weights.to(device), tk.ids.to(device))

        def step(d=d, x=x, topk=topk, fmt=fmt):  # bound now: called within this iteration only
            out_d = d.dispatch(x, topk)
            if fmt is Format.EP_NORMAL:  # graph-safe stand-in experts: the weighted sum of 2x the row
                y = out_d.hidden.dequantize(torch.float32) * (2 * out_d.topk.weights.sum(1, keepdim=True))
                return d.combine(EPNormalCombine(y.to(torch.bfloat16), out_d.handle))
            y = (out_d.hidden.dequantize(torch.float32) * 2).to(torch.bfloat16)
            return d.combine(EPMaskedCombine(y, out_d.topk, out_d.handle))

        eager = step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # any host sync in dispatch/combine raises
        try:
            no_sync = step()
            synced = None
        except RuntimeError as exc:
            no_sync, synced = None, str(exc)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm up on a side stream before capture
            step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = step()
        x.copy_(x * -1)  # new inputs in place, then replay
        graph.replay()
        torch.cuda.synchronize()
        ref = step()
        results[f"{mode}/{wire}/graph"] = {
            "host_sync": synced, "no_sync_err": rel_error(no_sync.cpu(), eager.cpu()) if no_sync is not None else None,
            "replay_err": rel_error(captured.cpu(), ref.cpu()), "expected_norm": float(ref.float().norm()),
        }
    return results


def scenario_overflow(world: int, rank: int, device: torch.device, seed: int) -> dict:
    """Masked capacity overflow on rank 0 only: every rank must raise promptly (not wait in a
    collective for the process-group timeout). On CUDA the other ranks see a device-side assert,
    which surfaces at their next synchronizing call."""
    import time

    gen = torch.Generator().manual_seed(seed + rank)
    d = _make_dispatcher(world, rank, Format.EP_MASKED, "fp8")
    t = CAPACITY + 3 if rank == 0 else CAPACITY - rank
    x, topk = make_hidden(t, H, torch.bfloat16, gen), make_topk(t, K, E, gen)
    start = time.monotonic()
    try:
        d.dispatch(x.to(device), TopK(topk.weights.to(device), topk.ids.to(device)))
        if device.type == "cuda":
            torch.cuda.synchronize()
        res = {"raised": False}
    except (ValueError, RuntimeError) as exc:
        res = {"raised": True, "type": type(exc).__name__, "message": str(exc)}
    res["seconds"] = time.monotonic() - start
    if device.type == "cuda" and rank == 0:
        torch.cuda.synchronize()  # let this rank's side of the exchange finish before the process exits
    return {"overflow_rank0": res}


def scenario_ops(world: int, rank: int, device: torch.device, seed: int) -> dict:
    """Kernels, collectives and host syncs of one dispatch and one combine (``opcount.OpCounter``)."""
    from opcount import OpCounter

    results = {}
    x, topk = routing_cases(world, rank, seed)["uniform"]
    x, topk = x.to(device), TopK(topk.weights.to(device), topk.ids.to(device))
    for mode, (fmt, buffers) in VARIANTS.items():
        for wire in WIRES:
            d = _make_dispatcher(world, rank, fmt, wire, buffers)
            for _ in range(2):  # the second round is counted (lazy initialisation out of the way)
                with OpCounter() as cd:
                    out = d.dispatch(x, topk)
                if fmt is Format.EP_NORMAL:
                    ci = EPNormalCombine(out.hidden.dequantize(torch.bfloat16), out.handle)
                else:
                    ci = EPMaskedCombine(out.hidden.dequantize(torch.bfloat16), out.topk, out.handle)
                with OpCounter() as cc:
                    d.combine(ci)
            results[f"{mode}/{wire}"] = {"dispatch": cd.summary(), "combine": cc.summary()}
    return results


def _outcome(fn, *args) -> dict:
    """Run ``fn(*args)``; report whether it raised, what, and how long it took (a hang shows as the harness timeout)."""
    import time

    start = time.monotonic()
    try:
        fn(*args)
        res = {"raised": False}
    except Exception as exc:
        res = {"raised": True, "type": type(exc).__name__, "message": str(exc)}
    res["seconds"] = time.monotonic() - start
    return res


def scenario_layer_bad_ids(world: int, rank: int, device: torch.device, seed: int) -> dict:
    """``MoELayer`` with the default ``check_ids``: a bad id on rank 0 only makes every rank raise,
    for every dispatcher and mode (issue 28 item 10: rank 0 used to raise alone, the others waited)."""
    gen = torch.Generator().manual_seed(seed + rank)
    weights = checkpoint(seed)
    results = {}
    for dispatcher, fmt in (("torch_a2a", Format.EP_NORMAL), ("torch_a2a", Format.EP_MASKED),
                            ("standard", Format.STANDARD)):
        cfg = dataclasses.replace(ep_config(world, rank, "bf16"), dispatcher=dispatcher)
        layer = build_layer(cfg, fmt, weights, device)
        t = 0 if rank == world - 1 else 6  # the last rank has no tokens at all
        x, topk = make_hidden(t, H, torch.bfloat16, gen), make_topk(t, K, E, gen)
        ids = topk.ids.clone()
        if rank == 0:
            ids[3, 1] = E + 2
        results[f"{dispatcher}/{fmt}"] = _outcome(layer, x.to(device), TopK(topk.weights.to(device), ids.to(device)))
        # the group is still usable afterwards
        x, topk = make_hidden(3, H, torch.bfloat16, gen), make_topk(3, K, E, gen)
        results[f"{dispatcher}/{fmt}/after"] = _outcome(layer, x.to(device), topk)
    # the accelerator form of the check (no host sync: a max-reduced device flag, then a device-side
    # assert on every rank), forced here on CPU where torch._assert_async raises at once
    layer._ids_exchanged, layer._ids_flag_reduced = False, True
    results["standard/async"] = _outcome(layer, x.to(device), TopK(topk.weights, topk.ids.clone().fill_(
        E + 1) if rank == 0 else topk.ids))
    return results


def scenario_layer_bad_ids_device(world: int, rank: int, device: torch.device, seed: int) -> dict:
    """On GPUs, with a dispatcher that does not check ids in-band (``standard``) and the default
    check: rank 0's bad id makes every rank's next synchronize fail (the device flag reduced over the
    group, then a device-side assert), instead of rank 0 failing alone (decision 43)."""
    gen = torch.Generator().manual_seed(seed + rank)
    cfg = dataclasses.replace(ep_config(world, rank, "bf16"), dispatcher="standard")
    layer = build_layer(cfg, Format.STANDARD, checkpoint(seed), device)
    x, topk = make_hidden(5, H, torch.bfloat16, gen), make_topk(5, K, E, gen)
    ids = topk.ids.clone()
    if rank == 0:
        ids[2, 0] = E + 3

    def forward_and_sync():
        layer(x.to(device), TopK(topk.weights.to(device), ids.to(device)))
        torch.cuda.synchronize()
    return {"bad_id_rank0": _outcome(forward_and_sync)}


def scenario_mismatch(world: int, rank: int, device: torch.device, seed: int) -> dict:
    """Ranks built with different configs: every rank raises at build time naming the field and each
    rank's value (issue 28 item 8), and a layer that fails to plan on one rank fails on all."""
    base = ep_config(world, rank, "fp8")
    variants = {
        "wire": dict(dispatch_dtype="fp8" if rank == 0 else "int8"),
        "quant": dict(quant="fp8_block" if rank == 0 else "unquantized", dispatch_dtype="auto"),
        "capacity": dict(max_tokens_per_rank=CAPACITY + rank),
        "top_k": dict(top_k=K if rank == 0 else K - 1),
        "hidden": dict(hidden_size=H if rank == 0 else H + 128),
        "plan_fails_on_one_rank": dict(experts="reference" if rank == 0 else "no_such_backend"),
        "same": {},
    }
    results = {}
    for name, change in variants.items():
        cfg = dataclasses.replace(base, **change)
        results[name] = _outcome(lambda c: MoELayer(c, device=device), cfg)
    return results


def scenario_input_rule(world: int, rank: int, device: torch.device, seed: int) -> dict:
    """Every rank passes its own tokens, whichever dispatcher the plan uses (decision 43): the output
    is the single-process reference layer's on this rank's tokens (issue 28 item 3)."""
    weights = checkpoint(seed)
    ref_cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, dispatcher="standard",
                        experts="reference", device="cpu")
    ref = build_layer(ref_cfg, Format.STANDARD, weights, torch.device("cpu"))
    results = {}
    for dispatcher, fmt in (("standard", Format.STANDARD), ("torch_a2a", Format.EP_NORMAL)):
        cfg = dataclasses.replace(ep_config(world, rank, "bf16"), dispatcher=dispatcher)
        layer = build_layer(cfg, fmt, weights, device)
        for name, (x, topk) in routing_cases(world, rank, seed).items():
            out = layer(x.to(device), TopK(topk.weights.to(device), topk.ids.to(device))).cpu()
            results[f"{dispatcher}/{name}"] = {"shape_ok": list(out.shape) == list(x.shape),
                                               "err": rel_error(out, ref(x, topk))}
    return results


SCENARIOS = {"input_rule": scenario_input_rule, "layer_bad_ids": scenario_layer_bad_ids,
             "layer_bad_ids_device": scenario_layer_bad_ids_device, "mismatch": scenario_mismatch, "layer": scenario_layer, "comm": scenario_comm,
             # (the fused kernels with the collective exchange; comm_fused_direct: with the direct one)
             "comm_fused": lambda *a: scenario_comm_fused(*a, exchange="collective"),
             "comm_fused_exact": lambda *a: scenario_comm_fused(*a, modes=("ep_normal",), exchange="collective"),
             # (bf16 and fp8: the transport is the same code for every wire, and the interpreter is slow)
             "comm_fused_direct": lambda *a: scenario_comm_fused(*a, exchange="direct", wires=("bf16", "fp8")),
             "direct_overflow": scenario_direct_overflow, "errors": scenario_errors, "graph": scenario_graph,
             "graph_direct": lambda *a: scenario_graph(*a, exchange="direct"),
             "ops": scenario_ops, "overflow": scenario_overflow}


def run_rank(rank: int, world: int, scenario: str, seed: int, backend: str) -> dict:
    """This rank's part of ``scenario`` (the process group exists): ``{"seed", "cases"}``, or
    ``{"seed", "error"}`` with the traceback."""
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":  # the installed plugins load, as under a layer (the cuda plugin's kernels: decision 63)
        get_plugin_manager()
    result: dict = {"seed": seed}
    try:
        result["cases"] = SCENARIOS[scenario](world, rank, device, seed)
    except Exception:
        result["error"] = traceback.format_exc()
    return result


def run_rank_scenarios(rank: int, world: int, scenarios: tuple[str, ...], seed: int, backend: str) -> dict:
    """``run_rank`` of each of ``scenarios`` in turn, in this one process group: ``{scenario: its result}``."""
    return {scenario: run_rank(rank, world, scenario, seed, backend) for scenario in scenarios}
