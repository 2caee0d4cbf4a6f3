"""``torch_a2a``: expert-parallel dispatch and combine over ``torch.distributed.all_to_all_single``.

Experts are split evenly over the EP group: global expert ``e`` lives on rank ``e // E_local``
as local expert ``e % E_local``. Two modes, chosen by the plan's format:

**EP_NORMAL** (DeepEP normal-mode semantics). Each token is sent once to every rank that holds at
least one of its experts (not once per expert), with its top-k ids made local (-1 and weight 0
for experts elsewhere). Received rows are grouped by source rank (ascending) and keep the
source's token order. Variable sizes: the per-rank counts are exchanged with a small all-to-all
and read on the host (one host sync per dispatch, so this mode is not graph-safe). The same sync
brings the per-local-expert counts (``expert_counts_host``) and a collective check of the ids.
Combine sends the weighted rows back and sums them per token.

**EP_MASKED** (DeepEP low-latency semantics). Fixed capacity ``C = max_tokens_per_rank``: every
rank sends exactly ``C`` row slots to every rank (a token once per destination rank, unused
slots padding) in one equal-split all-to-all, then expands the received rows into the
``[E_local, C * world, H]`` slab with ``masked_m`` valid rows per local expert (valid rows
first, in (source rank, token, k) order). All shapes are fixed and nothing is read on the
host, so this mode is graph-safe. Combine weights each expert output with the sender's top-k
weights (the weights travel with the token at dispatch; if ``EPMaskedCombine.topk`` is a
different TopK, its weights are exchanged again), reduces per token on the expert's rank,
sends one row per (token, rank) back and sums. ``T > max_tokens_per_rank`` raises.

Wire dtypes: BF16 (the activations' own dtype), FP8 (e4m3, per-token 128-channel group scales)
and INT8 (per-token scale), quantized once before sending; the scales, local ids and weights
travel with the rows as a small int32 side block. Every collective moves bytes (``uint8``
views), so any dtype works on any backend (gloo has no float8). Combine moves the experts'
output dtype.

Top-k ids of one token must be distinct (every router guarantees it): the masked slab holds
at most one row per (token, expert).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

from moe_core.backends import Code, Reason, available, unavailable
from moe_core.contracts import (
    FP8_GROUP,
    CombineInput,
    DispatchOutput,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Format,
    QuantizedActivations,
    TopK,
    WireDtype,
)
from moe_core.runtime import BackendContext, Dispatcher

if TYPE_CHECKING:
    from moe_core.backends import BackendSpec
    from moe_core.config import MoEConfig

__all__ = ["TorchA2ADispatcher", "probe", "check"]

WIRE_DTYPES = (WireDtype.BF16, WireDtype.FP8, WireDtype.INT8)


# --------------------------------------------------------------------------- spec helpers


def probe() -> Reason:
    """``torch_a2a`` needs only ``torch.distributed``."""
    try:
        if not dist.is_available():
            return unavailable(Code.NOT_INSTALLED, "this torch build has no torch.distributed",
                               "install a torch build with distributed support")
        return available("torch.distributed is available")
    except Exception as exc:  # probes never raise
        return unavailable(Code.LOAD_ERROR, f"torch.distributed check failed: {exc!r}")


def check(config: "MoEConfig", spec: "BackendSpec") -> list[Reason]:
    """Plan-time check: when torch.distributed is initialized, the EP group must match the config.

    Planning without an initialized group (the CLI planning for a target) is allowed; building
    the dispatcher then requires it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        world = dist.get_world_size(config.ep_group)
        rank = dist.get_rank(config.ep_group)
    except Exception as exc:
        return [unavailable(Code.UNSUPPORTED_PARALLEL, f"cannot query the EP group: {exc!r}",
                            "pass a torch.distributed ProcessGroup this rank belongs to as ep_group")]
    if (world, rank) != (config.ep_size, config.ep_rank):
        return [unavailable(Code.UNSUPPORTED_PARALLEL,
                            f"EP group has size {world} and this rank is {rank}, config says ep_size="
                            f"{config.ep_size} ep_rank={config.ep_rank}",
                            "set ep_size/ep_rank from the group (or pass the right ep_group)")]
    return []


# --------------------------------------------------------------------------- wire helpers


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` -> contiguous ``uint8 [N, row_bytes]`` view (collectives move bytes)."""
    t = t.contiguous()
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[list[int]], in_splits: Optional[list[int]],
         group) -> None:
    """``all_to_all_single`` on byte views of ``out`` and ``inp`` (same row size, dim 0 split)."""
    dist.all_to_all_single(_bytes_out(out), _bytes(inp), out_splits, in_splits, group=group)


def _bytes_out(t: torch.Tensor) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError("internal: all-to-all output must be contiguous")
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _words(rows: torch.Tensor) -> torch.Tensor:
    """Byte rows as the element type index copies use. Wide words (8 bytes per element) were
    tried, but source and destination views could pick different word sizes (the INT8 masked wire
    at H=256 broke; found by the conformance kit), so rows are copied as bytes until both sides
    choose their word size together."""
    return rows


def _gather_rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``t.index_select(0, index)`` for a 2-D tensor, copying whole rows as wide words."""
    return _words(_bytes(t)).index_select(0, index).view(torch.uint8).view(t.dtype).view(-1, t.shape[1])


def _scale_words(dtype: WireDtype, hidden: int) -> int:
    """fp32 scale words per row on the wire."""
    if dtype is WireDtype.FP8:
        return -(-hidden // FP8_GROUP)
    if dtype is WireDtype.INT8:
        return 1
    return 0


@dataclass(frozen=True)
class _NormalHandle:
    src_token: torch.Tensor  # int64 [S]: source token of each sent row
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _MaskedHandle:
    gather_index: torch.Tensor  # int64 [W*C, K]: slab row read for each received (row, k) pair
    pair_weight: torch.Tensor  # fp32 [W*C, K]: sender's weights (0 for pairs not here)
    hit: torch.Tensor  # bool [T, W]: token t was sent to rank r
    pos: torch.Tensor  # int64 [T, W]: its slot in the block for rank r
    src: torch.Tensor  # int64 [W*C]: source token of each sent slot (sender side)
    send_valid: torch.Tensor  # bool [W*C, K]: (slot, k) pair is a local expert of the slot's rank
    topk_weights: torch.Tensor  # the dispatch TopK's weights (identity check in combine)
    num_tokens: int
    dtype: torch.dtype


# --------------------------------------------------------------------------- dispatcher


class TorchA2ADispatcher(Dispatcher):
    """EP dispatcher over ``torch.distributed`` all-to-all; format EP_NORMAL or EP_MASKED."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        if ctx.format not in (Format.EP_NORMAL, Format.EP_MASKED):
            raise ValueError(f"torch_a2a produces ep_normal or ep_masked, not {ctx.format}")
        if ctx.dispatch_dtype not in WIRE_DTYPES:
            raise ValueError(f"torch_a2a carries {'/'.join(map(str, WIRE_DTYPES))}, not {ctx.dispatch_dtype}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch_a2a needs an initialized torch.distributed process group "
                               "(torch.distributed.init_process_group) before the layer is built")
        self.group = cfg.ep_group  # None: the default group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if (self.world, self.rank) != (cfg.ep_size, cfg.ep_rank):
            raise ValueError(f"torch_a2a: EP group has size {self.world}, rank {self.rank}; config says "
                             f"ep_size={cfg.ep_size}, ep_rank={cfg.ep_rank}")
        if cfg.num_experts % self.world:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the EP group size {self.world}")
        self.num_experts = cfg.num_experts
        self.num_local = cfg.num_experts // self.world
        self.top_k = cfg.top_k
        self.hidden = cfg.hidden_size
        self.wire = ctx.dispatch_dtype
        self.masked = ctx.format is Format.EP_MASKED
        self.capacity = cfg.max_tokens_per_rank
        if self.masked and self.capacity is None:
            raise ValueError("torch_a2a masked mode needs config.max_tokens_per_rank (the fixed capacity)")

    # ----------------------------------------------------------------- common

    def _validate(self, x: torch.Tensor, topk: TopK) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"hidden_states must be [T, {self.hidden}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"hidden_states must be bf16, fp16 or fp32, got {x.dtype}")
        if topk.ids.shape != (x.shape[0], self.top_k):
            raise ValueError(f"topk.ids must be [T={x.shape[0]}, top_k={self.top_k}], got {tuple(topk.ids.shape)}")
        if topk.ids.device != x.device:
            raise ValueError(f"topk on {topk.ids.device} but hidden_states on {x.device}")

    def _quantize(self, x: torch.Tensor) -> QuantizedActivations:
        from moe_core.quant import quantize_activations

        return quantize_activations(x, self.wire)

    def _row_meta(self, qa: QuantizedActivations, rows: Optional[torch.Tensor], lids: torch.Tensor,
                  weights: torch.Tensor) -> torch.Tensor:
        """int32 side block ``[N, scale words | K local ids | K weights (fp32 bits)]``."""
        parts = []
        if qa.scale is not None:
            scale = qa.scale.float().reshape(qa.scale.shape[0], _scale_words(self.wire, self.hidden))
            if rows is not None:
                scale = scale.index_select(0, rows)
            parts.append(scale.contiguous().view(torch.int32))
        parts += [lids.to(torch.int32), weights.float().contiguous().view(torch.int32)]
        return torch.cat(parts, dim=1)

    def _split_meta(self, meta: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
        ns, k = _scale_words(self.wire, self.hidden), self.top_k
        scale = meta[:, :ns].contiguous().view(torch.float32) if ns else None
        lids = meta[:, ns:ns + k].contiguous()
        weights = meta[:, ns + k:].contiguous().view(torch.float32)
        return scale, lids, weights

    def _wire_row_bytes(self, x: torch.Tensor) -> int:
        if self.wire is WireDtype.BF16:
            return self.hidden * x.element_size()
        return self.hidden  # fp8 / int8: one byte per element

    def _wire_torch_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.wire is WireDtype.BF16:
            return x.dtype
        return torch.float8_e4m3fn if self.wire is WireDtype.FP8 else torch.int8

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> DispatchOutput:
        self._validate(hidden_states, topk)
        if self.masked:
            return self._dispatch_masked(hidden_states, topk)
        return self._dispatch_normal(hidden_states, topk)

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        if self.masked:
            if not isinstance(combine_input, EPMaskedCombine):
                raise TypeError(f"torch_a2a (ep_masked) combines EPMaskedCombine, got {type(combine_input).__name__}")
            return self._combine_masked(combine_input)
        if not isinstance(combine_input, EPNormalCombine):
            raise TypeError(f"torch_a2a (ep_normal) combines EPNormalCombine, got {type(combine_input).__name__}")
        return self._combine_normal(combine_input)

    # ----------------------------------------------------------------- normal mode

    def _dispatch_normal(self, x: torch.Tensor, topk: TopK) -> EPNormalDispatch:
        dev, (t, k), w, el, e = x.device, topk.ids.shape, self.world, self.num_local, self.num_experts
        ids = topk.ids.long()
        in_range = (ids >= 0) & (ids < e)
        bad = ((ids < -1) | (ids >= e)).sum()
        dest = torch.where(in_range, ids // el, w)
        hit = torch.zeros(t, w + 1, dtype=torch.int64, device=dev).scatter_(1, dest, 1)[:, :w]  # [T, W]
        pairs = torch.zeros(e + 1, dtype=torch.int64, device=dev)
        pairs.scatter_add_(0, torch.where(in_range, ids, e).flatten(), torch.ones_like(ids).flatten())
        # row r goes to rank r: [bad ids here, rows for r, (token, expert) pairs per expert of r]
        msg = torch.cat([bad.view(1, 1).expand(w, 1), hit.sum(0).view(w, 1), pairs[:e].view(w, el)], dim=1)
        recv_msg = torch.empty_like(msg)
        dist.all_to_all_single(recv_msg, msg, group=self.group)
        # the one host sync of normal mode
        host = torch.cat([msg[:, 1], recv_msg[:, 0], recv_msg[:, 1], recv_msg[:, 2:].sum(0)]).tolist()
        send_counts, bad_by_rank, recv_counts = host[:w], host[w:2 * w], host[2 * w:3 * w]
        counts_host = tuple(host[3 * w:])
        if any(bad_by_rank):  # every rank learns it from the same message, so all raise together
            ranks = [r for r, b in enumerate(bad_by_rank) if b]
            raise ValueError(f"topk.ids out of range [-1, {e}) on EP rank(s) {ranks} "
                             f"({bad_by_rank[self.rank]} on this rank {self.rank})")

        # rows sent: for each destination rank in order, its tokens in token order
        n_send = sum(send_counts)
        order = torch.argsort((hit.t().reshape(-1) == 0).to(torch.int8), stable=True)[:n_send]
        src_token = order % t if t else order
        dst = order // t if t else order
        qa = self._quantize(x)
        row_ids = ids.index_select(0, src_token)
        local = (row_ids >= 0) & (row_ids // el == dst.unsqueeze(1))
        lids = torch.where(local, row_ids - dst.unsqueeze(1) * el, -1)
        weights = torch.where(local, topk.weights.index_select(0, src_token), 0.0)
        send_data = _gather_rows(qa.data, src_token)
        send_meta = self._row_meta(qa, src_token, lids, weights)

        n_recv = sum(recv_counts)
        recv_data = torch.empty(n_recv, self.hidden, dtype=send_data.dtype, device=dev)
        recv_meta = torch.empty(n_recv, send_meta.shape[1], dtype=torch.int32, device=dev)
        _a2a(recv_data, send_data, recv_counts, send_counts, self.group)
        _a2a(recv_meta, send_meta, recv_counts, send_counts, self.group)

        scale, rlids, rweights = self._split_meta(recv_meta)
        hidden = QuantizedActivations(recv_data, self.wire, scale, ue8m0=qa.ue8m0)
        counts = recv_msg[:, 2:].sum(0).to(torch.int32)
        handle = _NormalHandle(src_token, send_counts, recv_counts, t, x.dtype)
        return EPNormalDispatch(hidden, TopK(rweights, rlids), counts, counts_host, handle)

    def _combine_normal(self, ci: EPNormalCombine) -> torch.Tensor:
        h: _NormalHandle = ci.handle
        if not isinstance(h, _NormalHandle):
            raise ValueError("EPNormalCombine.handle must be the handle of this dispatcher's dispatch")
        y = ci.hidden
        if y.dim() != 2 or y.shape != (sum(h.recv_counts), self.hidden):
            raise ValueError(f"EPNormalCombine.hidden must be [{sum(h.recv_counts)}, {self.hidden}], "
                             f"got {tuple(y.shape)}")
        back = torch.empty(len(h.src_token), self.hidden, dtype=y.dtype, device=y.device)
        _a2a(back, y, h.send_counts, h.recv_counts, self.group)
        out = torch.zeros(h.num_tokens, self.hidden, dtype=torch.float32, device=y.device)
        out.index_add_(0, h.src_token, back.float())
        return out.to(h.dtype)

    # ----------------------------------------------------------------- masked mode

    def _dispatch_masked(self, x: torch.Tensor, topk: TopK) -> EPMaskedDispatch:
        dev, (t, k), w, el, e, c = x.device, topk.ids.shape, self.world, self.num_local, self.num_experts, self.capacity
        if t > c:
            raise ValueError(f"masked dispatch: {t} tokens on EP rank {self.rank} exceed "
                             f"max_tokens_per_rank={c} (the fixed capacity of the masked slab); "
                             "raise max_tokens_per_rank or split the batch")
        cw = c * w
        ids = topk.ids.long()
        in_range = (ids >= 0) & (ids < e)  # ids outside [-1, E) cannot be checked without a sync: no expert
        dest = torch.where(in_range, ids // el, w)
        hit = torch.zeros(t, w + 1, dtype=torch.int64, device=dev).scatter_(1, dest, 1)[:, :w]  # [T, W]
        pos = hit.cumsum(0) - 1
        ranks = torch.arange(w, device=dev)
        slot = torch.where(hit.bool(), ranks * c + pos, cw).flatten()  # [T*W]; cw = discard
        tokens = torch.arange(t, device=dev).unsqueeze(1).expand(t, w).reshape(-1)
        src = torch.zeros(cw + 1, dtype=torch.int64, device=dev).scatter_(0, slot, tokens)[:cw]
        row_used = torch.zeros(cw + 1, dtype=torch.bool, device=dev).scatter_(0, slot, hit.bool().flatten())[:cw]

        # per slot: local ids on the slot's destination rank (-1 elsewhere and in unused slots)
        if t:
            slot_ids = ids.index_select(0, src)
            slot_w = topk.weights.index_select(0, src)
        else:
            slot_ids = torch.full((cw, k), -1, dtype=torch.int64, device=dev)
            slot_w = torch.zeros(cw, k, dtype=torch.float32, device=dev)
        slot_rank = (torch.arange(cw, device=dev) // c).unsqueeze(1)
        send_valid = row_used.unsqueeze(1) & (slot_ids >= 0) & (slot_ids < e) & (slot_ids // el == slot_rank)
        lids = torch.where(send_valid, slot_ids - slot_rank * el, -1)
        weights = torch.where(send_valid, slot_w, 0.0)

        qa = self._quantize(x)
        db = self._wire_row_bytes(x)
        meta = self._row_meta(qa, src, lids, weights) if t else self._empty_meta(cw, lids, weights)
        mb = meta.shape[1] * 4
        # per destination chunk: [C data rows | C meta rows], so data blocks stay contiguous
        send = torch.empty(w, c * (db + mb), dtype=torch.uint8, device=dev)
        if t:
            xb = _bytes(qa.data)
            for r in range(w):
                # the word size follows the destination's alignment; the source (offset 0) takes any
                dst = _words(send[r, :c * db].view(c, db))
                torch.index_select(xb.view(dst.dtype), 0, src[r * c:(r + 1) * c], out=dst)
        send[:, c * db:].copy_(meta.view(torch.uint8).view(w, c * mb))
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.group)

        # expand received rows into the [E_local, C*W, H] slab, valid rows first per expert
        rdata = recv[:, :c * db].view(w, c, db)
        scale, rlids, rweights = self._split_meta(recv[:, c * db:].contiguous().view(torch.int32).view(cw, -1))
        pair_valid = rlids >= 0
        key = torch.where(pair_valid, rlids.long(), el).flatten()  # [P], el = not here
        p = key.numel()
        counts = torch.zeros(el + 1, dtype=torch.int64, device=dev).scatter_add_(0, key, torch.ones_like(key))
        order = torch.argsort(key, stable=True)
        starts = counts.cumsum(0) - counts
        arange_p = torch.arange(p, device=dev)
        rank_in = torch.empty_like(key).scatter_(0, order, arange_p - starts.index_select(0, key.index_select(0, order)))
        # discarded pairs land in a scratch expert (index el), spread over its rows
        slab_index = torch.where(key < el, key * cw + rank_in.clamp(max=cw - 1), el * cw + arange_p % cw)
        slab_index = slab_index.view(w, c, k)
        slab = torch.empty((el + 1) * cw, db, dtype=torch.uint8, device=dev)
        _words(slab).index_put_((slab_index,), _words(rdata).unsqueeze(2))
        slab_scale = None
        if scale is not None:
            ns = scale.shape[1]
            slab_scale = torch.empty((el + 1) * cw, ns, dtype=torch.float32, device=dev)
            slab_scale.index_put_((slab_index,), scale.view(w, c, 1, ns))
            slab_scale = slab_scale[:el * cw].view(el, cw, ns)
        data = slab[:el * cw].view(el, cw, db).view(self._wire_torch_dtype(x))
        hidden = QuantizedActivations(data, self.wire, slab_scale, ue8m0=qa.ue8m0)
        masked_m = counts[:el].clamp(max=cw).to(torch.int32)
        # combine reads every (row, k) pair: pairs not here read the row's first valid pair (finite,
        # weight 0), never a row past masked_m (garbage, maybe NaN); rows with no pair read row 0
        slab_index = slab_index.view(cw, k)
        first = slab_index.gather(1, pair_valid.to(torch.int8).argmax(dim=1, keepdim=True))
        gather_index = torch.where(pair_valid, slab_index, torch.where(pair_valid.any(1, keepdim=True), first, 0))
        handle = _MaskedHandle(gather_index, rweights, hit.bool(), pos, src, send_valid,
                               topk.weights, t, x.dtype)
        return EPMaskedDispatch(hidden, masked_m, topk, handle)

    def _empty_meta(self, rows: int, lids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        ns = _scale_words(self.wire, self.hidden)
        zeros = torch.zeros(rows, ns, dtype=torch.int32, device=lids.device)
        return torch.cat([zeros, lids.to(torch.int32), weights.float().view(torch.int32)], dim=1)

    def _combine_masked(self, ci: EPMaskedCombine) -> torch.Tensor:
        h: _MaskedHandle = ci.handle
        if not isinstance(h, _MaskedHandle):
            raise ValueError("EPMaskedCombine.handle must be the handle of this dispatcher's dispatch")
        w, el, c, k = self.world, self.num_local, self.capacity, self.top_k
        cw = c * w
        y = ci.hidden
        if y.shape != (el, cw, self.hidden):
            raise ValueError(f"EPMaskedCombine.hidden must be [{el}, {cw}, {self.hidden}], got {tuple(y.shape)}")
        if ci.topk.weights.shape != (h.num_tokens, k):
            raise ValueError(f"EPMaskedCombine.topk must be [T={h.num_tokens}, {k}], got {tuple(ci.topk.weights.shape)}")
        pair_weight = h.pair_weight
        if ci.topk.weights is not h.topk_weights:  # other weights than dispatched: send them again
            if h.num_tokens:
                slot_w = torch.where(h.send_valid, ci.topk.weights.index_select(0, h.src), 0.0)
            else:
                slot_w = torch.zeros(cw, k, dtype=torch.float32, device=y.device)
            pair_weight = torch.empty_like(slot_w)
            _a2a(pair_weight, slot_w, None, None, self.group)

        # weighted sum over this rank's experts, one row per received (source rank, token) slot:
        # gather the K rows of each slot, then one batched [1, K] x [K, H] product (fp32 accumulation)
        g = _gather_rows(y.reshape(el * cw, self.hidden), h.gather_index.flatten()).view(cw, k, self.hidden)
        # (rows with no expert here read garbage, possibly NaN: the sender masks them out)
        send = torch.bmm(pair_weight.to(y.dtype).unsqueeze(1), g).squeeze(1)
        back = torch.empty_like(send)
        _a2a(back, send, None, None, self.group)

        out = torch.zeros(h.num_tokens, self.hidden, dtype=torch.float32, device=y.device)
        if h.num_tokens:
            back = back.view(w, c, self.hidden)
            for r in range(w):
                rows = back[r].index_select(0, h.pos[:, r].clamp(min=0)).float()
                out.add_(rows.masked_fill_(~h.hit[:, r:r + 1], 0.0))
        return out.to(h.dtype)
