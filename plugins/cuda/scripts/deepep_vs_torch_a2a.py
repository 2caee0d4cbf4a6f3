"""``deepep`` vs ``torch_a2a``: the same tokens through both dispatchers, compared.

On GPUs (NCCL), where ``deep_ep`` (DeepEP V1 ``Buffer``, v1.2.1) is importable::

    torchrun --nproc-per-node 8 plugins/cuda/scripts/deepep_vs_torch_a2a.py [--hidden 7168 --experts 256 --topk 8 --tokens 128]

Without ``deep_ep`` it exits with status 2 and says so. The CPU tests
(``plugins/cuda/tests/test_deepep_ep.py``) run the same ``run_cases`` on gloo against the emulated
``deep_ep``.

Per case (normal / low-latency mode x BF16 / FP8 wire x routing scenario), on every rank:

- dispatch: normal mode must deliver exactly what ``torch_a2a`` delivers (both keep source-rank then
  token order): rows, FP8 scales, local ids, weights, per-expert counts. Low-latency mode's row order
  is not deterministic, so per local expert the *multiset* of valid rows is compared (sorted by a
  random projection), and ``masked_m`` against the pairs routed here, counted from every rank's
  routing;
- combine: a synthetic expert ``g_e(x) = x * (1 + e / E)`` is applied to each dispatcher's own output
  (weighted for EP_NORMAL, unweighted for EP_MASKED, rows past ``masked_m`` left as the garbage they
  are), combined, and compared with each other and with the float64 value
  ``sum_k w_k (1 + e_k / E) x_t`` (``x`` as the wire carries it).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_core import quant
from moe_core.config import MoEConfig
from moe_core.contracts import EPMaskedCombine, EPMaskedDispatch, EPNormalCombine, EPNormalDispatch, TopK
from moe_core.planner import plan as make_plan
from moe_core.testing.data import make_hidden, make_topk, rel_error

SCHEME = {"bf16": "unquantized", "fp8": "fp8_block"}
TOLERANCE = {"bf16": 1e-2, "fp8": 3e-2}


def make_cases(world: int, tokens: int, modes=("normal", "low_latency"), wires=("bf16", "fp8"),
               scenarios=("uniform", "skewed", "empty-rank")) -> list[dict]:
    cases = []
    for mode in modes:
        for wire in wires:
            for scenario in scenarios:
                counts = [max(1, tokens - 3 * r) for r in range(world)]  # odd and uneven sizes
                if scenario == "empty-rank":
                    counts[1] = 0
                cases.append(dict(mode=mode, wire=wire, scenario=scenario, counts=counts))
    return cases


def _data(case: dict, shape: dict, seed: int, index: int) -> tuple[list[torch.Tensor], list[TopK]]:
    """Every rank's tokens and routing (the same on every rank: each rank can count what it should get)."""
    gen = torch.Generator().manual_seed(seed * 1009 + index)
    e, k, h = shape["experts"], shape["topk"], shape["hidden"]
    subset = range(0, e // len(case["counts"])) if case["scenario"] == "skewed" else None  # all to rank 0
    k = min(k, len(subset)) if subset is not None else k
    xs, topks = [], []
    for t in case["counts"]:
        xs.append(make_hidden(t, h, torch.bfloat16, gen))
        topks.append(make_topk(t, k, e, gen, neg_fraction=0.2, empty_token=t >= 3, experts_subset=subset))
    return xs, topks


def _dispatcher(name: str, case: dict, shape: dict, top_k: int, rank: int, world: int, manager: Any) -> Any:
    cfg = MoEConfig(num_experts=shape["experts"], top_k=top_k, hidden_size=shape["hidden"], intermediate_size=128,
                    quant=SCHEME[case["wire"]], ep_size=world, ep_rank=rank, ep_group=dist.group.WORLD,
                    max_tokens_per_rank=max(max(case["counts"]), 1), device="cuda", dispatcher=name,
                    experts="reference", dispatch_dtype=case["wire"],
                    dispatch_format="ep_masked" if case["mode"] == "low_latency" else "ep_normal",
                    backend_options={"deepep": {"ue8m0": case.get("ue8m0", False)}})
    p = make_plan(cfg, manager=manager)
    return p.build()[0]


def _synthetic_experts(d: Any, rank: int, num_experts: int) -> Any:
    """``g_e(x) = x * (1 + e / E)`` on a dispatch output, as the experts stage would return it."""
    x = d.hidden.dequantize(torch.float32)
    if isinstance(d, EPNormalDispatch):
        e_local = d.expert_counts.numel()
        ids, w = d.topk.ids.long(), d.topk.weights.float()
        factor = torch.where(ids >= 0, w * (1 + (ids + rank * e_local) / num_experts), 0.0).sum(dim=1)
        return EPNormalCombine((x * factor.unsqueeze(1)).to(torch.bfloat16), d.handle)
    e_local = x.shape[0]
    factor = 1 + (torch.arange(e_local, device=x.device) + rank * e_local) / num_experts
    return EPMaskedCombine((x * factor.view(-1, 1, 1)).to(torch.bfloat16), d.topk, d.handle)


def _oracle(x: torch.Tensor, topk: TopK, wire: str, ue8m0: bool, num_experts: int) -> torch.Tensor:
    xw = quant.quantize_activations(x, wire, ue8m0=ue8m0).dequantize(torch.float64) if wire == "fp8" else x.double()
    ids, w = topk.ids.long(), topk.weights.double()
    factor = torch.where(ids >= 0, w * (1 + ids.double() / num_experts), 0.0).sum(dim=1)
    return xw * factor.unsqueeze(1)


def _rows_key(d: EPMaskedDispatch, proj: torch.Tensor) -> list[torch.Tensor]:
    """Per local expert, the sorted random projections of its valid rows (order-free fingerprint)."""
    x = d.hidden.dequantize(torch.float64)
    m = d.masked_m.tolist()
    return [torch.sort(x[e, :m[e]] @ proj).values for e in range(x.shape[0])]


def _expected_counts(topks: list[TopK], rank: int, e_local: int) -> torch.Tensor:
    ids = torch.cat([t.ids for t in topks]).long()
    mine = ids[(ids >= rank * e_local) & (ids < (rank + 1) * e_local)] - rank * e_local
    return torch.bincount(mine, minlength=e_local)


def run_case(case: dict, shape: dict, seed: int, index: int, rank: int, world: int, device: torch.device,
             manager: Any = None, exact: bool = True) -> dict:
    """One case on this rank. Every collective runs before a mismatch is reported (an early raise would
    leave the other ranks waiting), then ``AssertionError`` lists every mismatch.

    :param exact: the emulation quantizes FP8 with the same recipe as moe-core, so rows match
        bit for bit; on real DeepEP allow last-bit differences of its FP8 kernel.
    """
    xs, topks = _data(case, shape, seed, index)
    x, topk = xs[rank].to(device), TopK(topks[rank].weights.to(device), topks[rank].ids.to(device))
    top_k = topks[0].ids.shape[1]
    e_local = shape["experts"] // world
    problems: list[str] = []

    def check(ok: bool, what: str) -> None:
        if not ok:
            problems.append(what)

    deepep = _dispatcher("deepep", case, shape, top_k, rank, world, manager)
    a2a = _dispatcher("torch_a2a", case, shape, top_k, rank, world, manager)
    is_async = case.get("async", False)
    with_a2a = not case.get("ue8m0", False)  # torch_a2a has no power-of-two scales: compare with fp64 only
    dd = deepep.dispatch_async(x, topk).wait() if is_async else deepep.dispatch(x, topk)
    da = a2a.dispatch(x, topk)
    expected = _expected_counts(topks, rank, e_local)
    if case["mode"] == "normal":
        check(isinstance(dd, EPNormalDispatch), f"dispatch returned {type(dd).__name__}")
        check(torch.equal(dd.expert_counts.cpu().long(), expected),
              f"expert_counts {dd.expert_counts.tolist()} != pairs routed here {expected.tolist()}")
        check(dd.expert_counts_host == tuple(expected.tolist()), f"expert_counts_host {dd.expert_counts_host}")
        if with_a2a:
            check(dd.hidden.data.dtype == da.hidden.data.dtype and dd.hidden.data.shape == da.hidden.data.shape,
                  f"received {dd.hidden.data.dtype} {tuple(dd.hidden.data.shape)}, torch_a2a "
                  f"{da.hidden.data.dtype} {tuple(da.hidden.data.shape)}")
            if dd.hidden.data.shape == da.hidden.data.shape:
                same = torch.equal(dd.hidden.data.view(torch.uint8), da.hidden.data.view(torch.uint8))
                if not exact:
                    same = same or rel_error(dd.hidden.dequantize(), da.hidden.dequantize()) < 1e-2
                check(same, "received rows differ from torch_a2a's")
                if exact and dd.hidden.scale is not None:
                    check(torch.equal(dd.hidden.scale, da.hidden.scale), "received FP8 scales differ")
                check(torch.equal(dd.topk.ids, da.topk.ids) and torch.equal(dd.topk.weights, da.topk.weights),
                      "received local ids / weights differ from torch_a2a's")
    else:
        check(isinstance(dd, EPMaskedDispatch), f"dispatch returned {type(dd).__name__}")
        check(dd.masked_m.dtype == torch.int32 and torch.equal(dd.masked_m.cpu().long(), expected),
              f"masked_m {dd.masked_m.tolist()} != pairs routed here {expected.tolist()}")
        if with_a2a:
            gen = torch.Generator().manual_seed(seed)
            proj = torch.randn(shape["hidden"], dtype=torch.float64, generator=gen).to(device)
            for e, (kd, ka) in enumerate(zip(_rows_key(dd, proj), _rows_key(da, proj), strict=True)):
                tol = 0.0 if exact else 1e-2 * (float(ka.abs().max()) if ka.numel() else 0.0)
                diff = float((kd - ka).abs().max()) if kd.shape == ka.shape and kd.numel() else 0.0
                check(kd.shape == ka.shape and diff <= tol,
                      f"rows received for local expert {e} differ from torch_a2a's ({kd.numel()} vs {ka.numel()} "
                      f"rows, max projection difference {diff:.3g} > {tol:.3g})")
    ci = _synthetic_experts(dd, rank, shape["experts"])
    out_d = deepep.combine_async(ci).wait() if is_async else deepep.combine(ci)
    out_a = a2a.combine(_synthetic_experts(da, rank, shape["experts"]))
    ref = _oracle(x.cpu(), topks[rank], case["wire"], case.get("ue8m0", False), shape["experts"])
    check(tuple(out_d.shape) == (x.shape[0], shape["hidden"]) and out_d.dtype == x.dtype,
          f"combine returned {out_d.dtype} {tuple(out_d.shape)}")
    err_ref = rel_error(out_d, ref)
    err_a2a = rel_error(out_d, out_a) if with_a2a else float("nan")
    tol = TOLERANCE[case["wire"]]
    check(err_ref <= tol, f"combined output vs float64: relative error {err_ref:.3g} > {tol}")
    check(not with_a2a or err_a2a <= tol, f"combined output vs torch_a2a: relative error {err_a2a:.3g} > {tol}")
    if x.shape[0] and bool((topk.ids[0] < 0).all()):
        check(bool((out_d[0] == 0).all()), "a token routed to no expert got a non-zero output")
    if problems:
        raise AssertionError(f"case {case} rank {rank}/{world} seed {seed}: " + "; ".join(problems))
    return dict(case, rank=rank, err_ref=err_ref, err_a2a=err_a2a, tokens=x.shape[0])


def run_cases(cases: list[dict], shape: dict, seed: int, rank: int, world: int, device: torch.device,
              manager: Any = None, exact: bool = True) -> list[dict]:
    return [run_case(c, shape, seed, i, rank, world, device, manager, exact) for i, c in enumerate(cases)]


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=7168)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--topk", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128, help="tokens on rank 0 (fewer on the others)")
    ap.add_argument("--seed", type=int, default=None, help="the data's seed (default: drawn on rank 0, sent to all)")
    args = ap.parse_args(argv)
    try:
        import deep_ep  # noqa: F401
    except ImportError as exc:
        print(f"deep_ep is not importable ({exc}): build DeepEP (V1 Buffer API, v1.2.1) first; nothing to compare",
              file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("no CUDA device: this script compares the real DeepEP on GPUs", file=sys.stderr)
        return 2
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    if args.seed is None:  # every rank must draw the same tokens (issue #28 item 15)
        seed = torch.tensor([int.from_bytes(os.urandom(3), "little")], device=device)
        dist.broadcast(seed, 0)
        args.seed = int(seed)
    shape = dict(hidden=args.hidden, experts=args.experts, topk=args.topk)
    cases = make_cases(world, args.tokens)
    cases += [dict(c, ue8m0=True) for c in cases if c["wire"] == "fp8" and c["scenario"] == "uniform"]
    cases += [dict(c, **{"async": True}) for c in cases if c["scenario"] == "uniform" and not c.get("ue8m0")]
    failures = 0
    for i, case in enumerate(cases):
        try:
            r = run_case(case, shape, args.seed, i, rank, world, device, exact=False)
            if rank == 0:
                print(f"ok   {case['mode']:<11} {case['wire']:<4} {case['scenario']:<10} ue8m0={case.get('ue8m0', False)!s:<5} "
                      f"async={case.get('async', False)!s:<5} err vs fp64 {r['err_ref']:.2e}  vs torch_a2a {r['err_a2a']:.2e}")
        except AssertionError as exc:
            failures += 1
            print(f"FAIL rank {rank}: {exc}", file=sys.stderr)
        torch.cuda.synchronize()
        dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print(f"{len(cases) - failures}/{len(cases)} cases passed on rank 0 (seed {args.seed})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
