"""The collectives ``MoELayer`` itself runs over its EP group (not a dispatcher's).

- the EP input rule (decision 43): every rank passes its own tokens; for a dispatcher that
  expects the same tokens on every rank (``standard``), the layer gathers them and keeps its rows;
- checks every rank takes part in, so that one rank's error reaches all. A rank that raises on its own while the others enter a collective leaves them waiting until
the process group's timeout (30 minutes by default): any check that can fail on one rank only
must be exchanged, and every rank raises with what each rank saw.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from moe_core.contracts import TopK

__all__ = ["agree_on_layer", "check_ids_on_every_rank", "gather_tokens", "group_active"]


def group_active() -> bool:
    """Whether ``torch.distributed`` is initialized (the EP group can be used)."""
    return dist.is_available() and dist.is_initialized()


def agree_on_layer(fingerprint: dict[str, Any], error: Optional[BaseException], group: Any) -> None:
    """Exchange this rank's layer fingerprint (or its build error) once; raise on every rank if a
    rank failed to build its layer or the ranks' layers differ, naming the field and each rank's value."""
    mine = {"fingerprint": fingerprint, "error": None if error is None else f"{type(error).__name__}: {error}"}
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    failed = {r: m["error"] for r, m in enumerate(everyone) if m["error"] is not None}
    if failed:
        if error is not None:
            raise error
        raise RuntimeError("MoELayer: the layer could not be built on EP rank(s) " + ", ".join(
            f"{r} ({msg.splitlines()[0]})" for r, msg in failed.items()))
    fields = sorted({k for m in everyone for k in m["fingerprint"]})
    differ = [f"{k}: " + ", ".join(f"rank {r} {m['fingerprint'].get(k)!s}" for r, m in enumerate(everyone))
              for k in fields if len({repr(m["fingerprint"].get(k)) for m in everyone}) > 1]
    if differ:
        raise ValueError("MoELayer: the ranks of the EP group built different layers (every rank must use "
                         "the same config and plan):\n  " + "\n  ".join(differ))


def check_ids_on_every_rank(ids: torch.Tensor, num_experts: int, group: Any) -> None:
    """The expert-id range check of ``MoELayer`` under EP, with a dispatcher that does not check
    in-band: each rank's id range is exchanged (one small all-gather) and every rank raises if
    any rank's ids leave ``[-1, num_experts)``."""
    if ids.numel():
        lo, hi = torch.aminmax(ids)
        mine = torch.stack([lo, hi]).to(torch.int64)
    else:
        mine = torch.tensor([-1, -1], dtype=torch.int64, device=ids.device)
    ranges = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(ranges, mine, group=group)
    bad = {r: tuple(x.tolist()) for r, x in enumerate(ranges) if x[0] < -1 or x[1] >= num_experts}
    if bad:
        raise ValueError(f"topk.ids must be in [-1, {num_experts}) (-1 = no expert), got values in "
                         + ", ".join(f"[{lo}, {hi}] on EP rank {r}" for r, (lo, hi) in bad.items()))


def assert_ids_on_every_rank_async(ids: torch.Tensor, num_experts: int, group: Any) -> None:
    """The same check without a host sync (accelerators): a device flag, max-reduced over the
    group, then a device-side assertion on every rank, so every rank fails at its next
    synchronization rather than one rank failing and the others waiting in the dispatch."""
    bad = ((ids < -1) | (ids >= num_experts)).any().to(torch.int32).reshape(1)
    if not torch.compiler.is_compiling():  # a traced c10d call is not worth the risk: compiled, the rank alone asserts
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
    torch._assert_async(bad[0] == 0, f"moe_core.MoELayer: topk.ids must be in [-1, {num_experts}) "
                        "(-1 = no expert) on every EP rank; some rank's ids are not")


def gather_tokens(x: torch.Tensor, topk: TopK, group: Any) -> tuple[torch.Tensor, TopK, slice]:
    """Every rank's tokens, in rank order, on every rank; and the rows of this rank's tokens.

    One small all-gather of the token counts (read on the host), then one all-gather of the rows
    (activations, ids, weights as bytes, padded to the largest count: gloo has no bfloat16)."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
    counts = [torch.empty_like(count) for _ in range(world)]
    dist.all_gather(counts, count, group=group)
    sizes = [int(c) for c in counts]
    most = max(sizes)
    k = topk.ids.shape[1]
    row = torch.cat([x.contiguous().view(torch.uint8).reshape(x.shape[0], x.shape[1] * x.element_size()), topk.ids.contiguous().view(torch.uint8),
                     topk.weights.contiguous().view(torch.uint8)], dim=1)
    padded = row.new_zeros(most, row.shape[1])
    padded[:x.shape[0]] = row
    rows = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(rows, padded, group=group)
    every = torch.cat([r[:n] for r, n in zip(rows, sizes, strict=True)])
    nx = row.shape[1] - 8 * k
    hidden = every[:, :nx].contiguous().view(x.dtype).reshape(-1, x.shape[1])
    ids = every[:, nx:nx + 4 * k].contiguous().view(torch.int32)
    weights = every[:, nx + 4 * k:].contiguous().view(torch.float32)
    start = sum(sizes[:rank])
    return hidden, TopK(weights, ids), slice(start, start + x.shape[0])
