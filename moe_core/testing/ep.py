"""Dispatcher cases of the conformance kit: round trips in EP worlds of 1, 2 and 4 ranks.

For one (dispatcher, world size) the kit runs every sub-case (format x wire dtype x scenario) in
one world: in-process for world 1, else spawned processes on 127.0.0.1 (gloo on CPU, NCCL on
CUDA) with a hard timeout. Each rank dispatches its own tokens, checks the dispatch output's
structure (counts, masks, local ids), runs the core reference experts and combines; the result
must equal the single-process reference (standard dispatcher, all tokens, one rank) for the
rank's tokens. The world runs once, on the first of its cases; the others read its results.
A fused backend that requires EP runs the same way, whole (``layer(x, topk)``), per declared scheme.
"""

from __future__ import annotations

import dataclasses
import traceback
import zlib
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_core import quant
from moe_core.backends import BackendSpec, EPSupport, Role
from moe_core.config import MoEConfig
from moe_core.contracts import (
    EPMaskedDispatch,
    EPNormalDispatch,
    Format,
    QuantScheme,
    StandardDispatch,
    TopK,
    WireDtype,
)
from moe_core.layer import MoELayer
from moe_core.planner import PlanError
from moe_core.planner import plan as make_plan
from moe_core.testing.cases import Case, KitContext, KitFailure, KitOptions, KitSkip, make_manager
from moe_core.testing.checks import classify
from moe_core.testing.data import Shape, make_float_weights, make_hidden, make_topk, rel_error, tolerance
from moe_core.testing.world import spawn_world

# the weight scheme a dispatcher case pairs with each wire dtype (its natural activation dtype)
SCHEME_FOR_WIRE = {
    WireDtype.BF16: QuantScheme.UNQUANTIZED,
    WireDtype.FP8: QuantScheme.FP8_BLOCK,
    WireDtype.INT8: QuantScheme.INT8_W8A8,
    WireDtype.NVFP4: QuantScheme.NVFP4,
}
SCENARIOS = ("uniform", "skewed", "empty-rank")


@dataclass(frozen=True)
class Sub:
    case_id: str
    fmt: Optional[Format]
    wire: Optional[WireDtype]
    scenario: str
    skip: str = ""  # set: the whole world is skipped for this reason
    scheme: Optional[QuantScheme] = None  # fused cases: the declared scheme (dispatcher cases: from the wire)


def dispatcher_subcases(spec: BackendSpec, world: int, shape: Shape) -> list[Sub]:
    if world == 1 and spec.ep is EPSupport.REQUIRED:
        return [Sub("dispatcher-ep1", None, None, "", f"{spec.qualified_name} declares ep='required'")]
    if world > 1 and spec.ep is EPSupport.NONE:
        return [Sub(f"dispatcher-ep{world}", None, None, "", f"{spec.qualified_name} declares ep='none'")]
    if shape.num_experts % world:
        return [Sub(f"dispatcher-ep{world}", None, None, "", f"num_experts={shape.num_experts} not divisible by {world}")]
    subs = []
    for fmt in spec.formats:
        for wire in spec.wire_dtypes:
            for scenario in SCENARIOS:
                if world == 1 and scenario == "empty-rank":
                    scenario = "empty"
                subs.append(Sub(f"dispatcher-ep{world}-{fmt}-{wire}-{scenario}", fmt, wire, scenario))
    return subs


def fused_subcases(spec: BackendSpec, world: int, shape: Shape) -> list[Sub]:
    """A fused backend that requires EP owns dispatch, experts and combine: each declared scheme and
    scenario runs whole (``layer(x, topk)``) in an EP world and is compared with the reference."""
    if world == 1:
        return [Sub("fused-ep1", None, None, "", f"{spec.qualified_name} declares ep='required'")]
    if shape.num_experts % world:
        return [Sub(f"fused-ep{world}", None, None, "", f"num_experts={shape.num_experts} not divisible by {world}")]
    return [Sub(f"fused-ep{world}-{scheme}-{scenario}", Format.FUSED, None, scenario, scheme=scheme)
            for scheme in sorted(spec.quant_schemes, key=str) for scenario in SCENARIOS]


def ep_subcases(spec: BackendSpec, world: int, shape: Shape) -> list[Sub]:
    return (fused_subcases if spec.role is Role.FUSED else dispatcher_subcases)(spec, world, shape)


def dispatcher_case(ctx: KitContext, case: Case) -> None:
    sub: Sub = case.params["sub"]
    if sub.skip:
        raise KitSkip(sub.skip)
    world = case.params["world"]
    key = ("ep-world", case.backend, world)
    if key not in ctx.cache:
        ctx.cache[key] = run_world(ctx, case.backend, world)
    results = ctx.cache[key]
    status, message = results.get(sub.case_id, ("failed", "no result: the EP world did not reach this case"))
    if status == "skipped":
        raise KitSkip(message)
    if status == "failed":
        raise KitFailure(message)


# --------------------------------------------------------------------------- one world


def run_world(ctx: KitContext, backend: str, world: int) -> dict[str, tuple[str, str]]:
    spec = ctx.spec(backend)
    kind, device = ctx.placement(spec)
    subs = [s for s in ep_subcases(spec, world, ctx.shape) if not s.skip]
    if ctx.options.select:
        subs = [s for s in subs if any(x in s.case_id for x in ctx.options.select)]
    payload = dict(backend=backend, world=world, kind=kind, device=str(device), subs=subs,
                   options=dataclasses.replace(ctx.options, manager_factory=_picklable(ctx.options.manager_factory)))
    if world == 1:
        return _merge([_worker_body(0, payload, ctx.manager)], subs)
    if device.type == "cuda" and torch.cuda.device_count() < world:
        return {s.case_id: ("skipped", f"EP world of {world} needs {world} GPUs, {torch.cuda.device_count()} present")
                for s in subs}
    if ctx.options.manager_factory is not None and payload["options"].manager_factory is None:
        return {s.case_id: ("skipped", "EP worlds need manager_factory as a 'module:function' string "
                            "(spawned workers build their own plugin manager)") for s in subs}
    return _merge(_spawn(payload, world, ctx.options.ep_timeout_s), subs)


def _picklable(factory: Any) -> Any:
    if factory is None or isinstance(factory, str):
        return factory
    mod, qual = getattr(factory, "__module__", None), getattr(factory, "__qualname__", "")
    if mod and qual and "<" not in qual:
        return f"{mod}:{qual}"
    return None


def _merge(per_rank: list[Optional[dict[str, tuple[str, str]]]], subs: list[Sub]) -> dict[str, tuple[str, str]]:
    out: dict[str, tuple[str, str]] = {}
    first_error = next((r["__error__"][1] for r in per_rank if r and "__error__" in r), "")
    for s in subs:
        entries = [(rank, r.get(s.case_id) if r else None) for rank, r in enumerate(per_rank)]
        failed = [f"rank {rank}: {e[1]}" for rank, e in entries if e and e[0] == "failed"]
        missing = [rank for rank, e in entries if e is None]
        if failed:
            out[s.case_id] = ("failed", "\n".join(failed))
        elif missing:
            out[s.case_id] = ("failed", f"rank(s) {missing} did not finish this case"
                              + (f"; first error in the world: {first_error}" if first_error else ""))
        elif all(e[0] == "skipped" for _, e in entries):
            out[s.case_id] = ("skipped", entries[0][1][1])
        else:
            out[s.case_id] = ("passed", "")
    return out


def _spawn(payload: dict[str, Any], world: int, timeout_s: float) -> list[Optional[dict[str, tuple[str, str]]]]:
    options: KitOptions = payload["options"]
    backend = "nccl" if torch.device(payload["device"]).type == "cuda" else "gloo"
    outcomes = spawn_world(_rank_body, world, payload, setup=options.setup, timeout=timeout_s, backend=backend)
    return [o.value if o.ok else {"__error__": ("failed", f"rank {o.rank}: {o.error}")} for o in outcomes]


def _rank_body(rank: int, world: int, payload: dict[str, Any]) -> dict[str, tuple[str, str]]:
    if torch.device(payload["device"]).type == "cuda":  # one GPU per rank
        payload = dict(payload, device=str(torch.device("cuda", rank)))
    return _worker_body(rank, payload, make_manager(payload["options"].manager_factory), group=dist.group.WORLD)


def _worker_body(rank: int, payload: dict[str, Any], manager: Any, group: Any = None) -> dict[str, tuple[str, str]]:
    """Run every sub-case on this rank; returns case id -> (status, message)."""
    out: dict[str, tuple[str, str]] = {}
    cache: dict[Any, Any] = {}
    for sub in payload["subs"]:
        try:
            _round_trip(rank, payload, manager, group, sub, cache)
            out[sub.case_id] = ("passed", "")
        except KitSkip as exc:
            out[sub.case_id] = ("skipped", str(exc))
        except KitFailure as exc:
            out[sub.case_id] = ("failed", str(exc))
        except Exception as exc:
            out[sub.case_id] = ("failed", f"raised {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-4)}")
            if payload["world"] > 1:  # the other ranks may be stuck in a collective: stop this world
                out["__error__"] = ("failed", f"rank {rank} in {sub.case_id}: {type(exc).__name__}: {exc}")
                break
    return out


def _tokens_per_rank(sub: Sub, world: int, shape: Shape) -> list[int]:
    if sub.fmt is Format.STANDARD:  # every rank holds the same (global) tokens
        t = 0 if sub.scenario in ("empty", "empty-rank") and world == 1 else shape.tokens_odd
        return [t] * world
    counts = [shape.tokens_odd + 2 * r for r in range(world)]
    if sub.scenario == "empty-rank":
        counts[1] = 0
    if sub.scenario == "empty":
        counts = [0] * world
    return counts


def _checkpoint(options: KitOptions, backend: str, scheme: QuantScheme, cache: dict) -> dict[str, torch.Tensor]:
    """Full-checkpoint weights of ``scheme``, shared by a world's sub-cases (identical on every rank)."""
    if scheme not in cache:
        shape = options.shape
        gen = torch.Generator()
        gen.manual_seed(options.seed ^ hash_id(f"{backend}/{scheme}/weights"))
        w13, w2 = make_float_weights(shape.num_experts, shape.hidden_size, shape.intermediate_size, gen)
        ckpt = quant.quantize_weights(w13, w2, scheme)
        if scheme is QuantScheme.UNQUANTIZED:
            ckpt = {k: v.to(torch.bfloat16) for k, v in ckpt.items()}
        cache[scheme] = ckpt
    return cache[scheme]


def _round_trip(rank: int, payload: dict[str, Any], manager: Any, group: Any, sub: Sub, cache: dict) -> None:
    options: KitOptions = payload["options"]
    shape, world, device = options.shape, payload["world"], torch.device(payload["device"])
    backend = payload["backend"]
    fmt, wire = sub.fmt, sub.wire
    fused = fmt is Format.FUSED  # the backend under test does all three stages; its plan picks the wire
    scheme = sub.scheme if fused else SCHEME_FOR_WIRE[wire]
    e_local = shape.num_experts // world
    top_k = min(shape.top_k, e_local) if sub.scenario == "skewed" else shape.top_k
    counts = _tokens_per_rank(sub, world, shape)

    # the same global data on every rank (seeded by the run seed and the case id)
    ckpt = _checkpoint(options, backend, scheme, cache)
    gen = torch.Generator()
    gen.manual_seed(options.seed ^ hash_id(f"{backend}/{sub.case_id}"))
    subset = range(0, e_local) if sub.scenario == "skewed" else None  # skewed: every token to rank 0's experts
    xs, topks = [], []
    for t in counts if fmt is not Format.STANDARD else counts[:1]:
        xs.append(make_hidden(t, shape.hidden_size, torch.bfloat16, gen))
        topks.append(make_topk(t, top_k, shape.num_experts, gen, neg_fraction=0.2 if top_k > 1 else 0.0,
                               empty_token=t >= 3, experts_subset=subset))
    mine = 0 if fmt is Format.STANDARD else rank
    x, topk = xs[mine], topks[mine]

    cfg = MoEConfig(num_experts=shape.num_experts, top_k=top_k, hidden_size=shape.hidden_size,
                    intermediate_size=shape.intermediate_size, quant=scheme, params_dtype=torch.bfloat16,
                    ep_size=world, ep_rank=rank, ep_group=group, device=payload["kind"], dispatcher=backend,
                    experts=backend if fused else "reference.reference", dispatch_dtype="auto" if fused else str(wire),
                    # the world's largest per-rank batch: fixed-buffer dispatchers (masked, MoRI) size from it
                    max_tokens_per_rank=max(max(counts), 1) if fmt is not Format.STANDARD else None)
    what = f"{backend} with format {fmt}, wire {wire}, ep_size {world}"
    try:
        p = make_plan(cfg, manager=manager)
    except PlanError as exc:
        classify([r for rej in exc.rejected for r in rej.reasons], what)
        raise
    if p.format is not fmt:  # the planner picks the dispatcher's first shared format; the kit forces each one
        p = dataclasses.replace(p, format=fmt)
    layer = MoELayer(cfg, plan=p, manager=manager, device=device)
    layer.load_weights(**{k: v.to(device) for k, v in ckpt.items()})
    layer.process_weights()
    x_d, topk_d = x.to(device), TopK(topk.weights.to(device), topk.ids.to(device))
    with torch.no_grad():
        if fused:
            out = layer(x_d, topk_d)
        else:
            dispatched = layer.dispatcher.dispatch(x_d, topk_d)
            _check_dispatch(dispatched, fmt, cfg, topks, rank, world)
            combined_in = layer.experts.apply(layer, dispatched)
            out = layer.dispatcher.combine(combined_in)
    wire = p.dispatch_dtype

    # single-process reference on all tokens
    ref_cfg = cfg.replace(ep_size=1, ep_rank=0, ep_group=None, dispatcher="reference.standard", device="cpu",
                          max_tokens_per_rank=None, experts="reference.reference", dispatch_dtype=str(wire))
    ref_layer = MoELayer(ref_cfg, manager=manager, device=torch.device("cpu"))
    ref_layer.load_weights(**ckpt)
    ref_layer.process_weights()
    with torch.no_grad():
        ref_all = ref_layer.forward(torch.cat(xs), TopK(torch.cat([t.weights for t in topks]),
                                                        torch.cat([t.ids for t in topks])))
    start = sum(counts[:mine])
    ref = ref_all[start:start + counts[mine]]
    if tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        raise KitFailure(f"combine returned {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {ref.dtype} "
                         f"(this rank's T={counts[mine]} tokens)")
    err = rel_error(out, ref)
    tol = tolerance(scheme, wire)
    if err > tol:
        o, r = out.detach().cpu().double(), ref.double()
        row = (o - r).norm(dim=-1) / r.norm(dim=-1).clamp(min=1e-12)
        bad = (row > 3 * tol).nonzero().flatten().tolist()
        stages = "the fused backend's output" if fused else "round trip dispatch -> reference experts -> combine"
        raise KitFailure(f"{stages} differs from the single-process "
                         f"reference: relative error {err:.4g} > {tol:g} (scenario {sub.scenario}, tokens per rank "
                         f"{counts}); {len(bad)} of {len(row)} tokens off, first {bad[:6]}")


def hash_id(text: str) -> int:
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _check_dispatch(d: Any, fmt: Format, cfg: MoEConfig, topks: list[TopK], rank: int, world: int) -> None:
    """The dispatch output must be of the declared format and internally consistent."""
    want = {Format.STANDARD: StandardDispatch, Format.EP_NORMAL: EPNormalDispatch,
            Format.EP_MASKED: EPMaskedDispatch}[fmt]
    if not isinstance(d, want):
        raise KitFailure(f"dispatch returned {type(d).__name__}, the plan's format {fmt} needs {want.__name__}")
    e_local = cfg.num_local_experts
    first = cfg.local_expert_range.start
    # (token, expert) pairs routed to this rank's experts, over every rank's tokens
    all_ids = torch.cat([t.ids for t in topks]) if fmt is not Format.STANDARD else topks[0].ids
    mine = all_ids[(all_ids >= first) & (all_ids < first + e_local)].long() - first
    expected = torch.bincount(mine, minlength=e_local)
    if fmt is Format.EP_MASKED:
        m = d.masked_m
        if m.dtype != torch.int32 or tuple(m.shape) != (e_local,):
            raise KitFailure(f"masked_m must be int32 [{e_local}], got {m.dtype} {tuple(m.shape)}")
        if not torch.equal(m.cpu().long(), expected):
            raise KitFailure(f"masked_m {m.cpu().tolist()} != (token, local expert) pairs routed here "
                             f"{expected.tolist()} (rank {rank} of {world})")
        if d.hidden.shape[0] != e_local or d.hidden.shape[1] < int(expected.max()):
            raise KitFailure(f"masked slab shape {tuple(d.hidden.shape)} cannot hold counts {expected.tolist()}")
        return
    ids = d.topk.ids.cpu()
    if ids.numel() and (int(ids.min()) < -1 or int(ids.max()) >= e_local):
        raise KitFailure(f"dispatched ids must be local ([-1, {e_local})), got range [{int(ids.min())}, {int(ids.max())}]")
    got = torch.bincount(ids[ids >= 0].long(), minlength=e_local)
    if not torch.equal(got, expected):
        raise KitFailure(f"dispatched (token, local expert) pairs per expert {got.tolist()} != routed here "
                         f"{expected.tolist()} (rank {rank} of {world})")
    if fmt is Format.EP_NORMAL:
        w = d.topk.weights.cpu()
        if ids.numel() and torch.any(w[ids < 0] != 0):
            raise KitFailure("EP_NORMAL dispatched weights must be 0 where the local id is -1")
        c = d.expert_counts
        if c.dtype != torch.int32 or tuple(c.shape) != (e_local,):
            raise KitFailure(f"expert_counts must be int32 [{e_local}], got {c.dtype} {tuple(c.shape)}")
        if not torch.equal(c.cpu().long(), expected):
            raise KitFailure(f"expert_counts {c.cpu().tolist()} != (token, local expert) pairs received "
                             f"{expected.tolist()} (rank {rank} of {world})")
        if d.expert_counts_host is not None and list(d.expert_counts_host) != expected.tolist():
            raise KitFailure(f"expert_counts_host {list(d.expert_counts_host)} != {expected.tolist()}")
