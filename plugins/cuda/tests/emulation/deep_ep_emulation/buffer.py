"""Pure-PyTorch emulation of DeepEP's V1 ``deep_ep.Buffer`` (v1.2.1 API), TEST SUPPORT ONLY.

Every rank runs its own ``Buffer`` on a ``torch.distributed`` group (gloo on CPU) and rows really
travel between processes with ``all_to_all_single``. Semantics follow ``vendor-apis.md`` sections 1
and 8; the constraints DeepEP asserts are asserted here too, so a plugin bug fails loudly:

- ``get_dispatch_layout``: per-rank counts deduplicated per token, per-expert counts, ``is_token_in_rank``.
- ``dispatch``: each token once per destination rank; rows grouped by source rank (ascending), source
  token order inside a block; local ids (-1 and weight 0 elsewhere); per-local-expert counts as a
  Python list rounded up to ``expert_alignment``; FP8 ``(e4m3, scales [T, H/128])`` passes through.
- ``combine``: unweighted fp32 sum of the returned rows per source token (+ bias), as bf16.
- ``low_latency_dispatch``: one row per (token, expert) in a ``[E_l, R*num_max, H]`` slab; source-rank
  blocks per expert in a **random order, and rows inside a block shuffled too** (on the hardware the
  order comes from atomics), so tests cannot depend on it; rows past ``recv_count`` are garbage
  (NaN / random bytes); FP8 quantization by DeepEP's own in-kernel recipe, bit for bit
  (``quantize_fp8_ll``); scales as column-major views (fp32 ``[.., H/128]``, or UE8M0 int32
  ``[.., H/512]``, 4 exponent bytes per int, low byte first); result tensors are fresh allocations
  each call, as in v1.2.1's ``deep_ep.cpp``; with ``return_recv_hook`` the slab and counts hold
  garbage until the hook is called.
- ``Buffer.runtime`` (DeepEP's C++ ``deep_ep_cpp.Buffer``) has the low-latency dispatch with v1.2.1's C++
  arguments and 7 results, and ``Buffer.low_latency_dispatch`` is v1.2.1's Python wrapper of it, statement for
  statement (the plugin's hot path calls the runtime where the wrapper is that one).
- ``low_latency_combine``: ``sum_k [id != -1] w * y`` with the sender's own ids and weights, as bf16.
- Low-latency kernels after normal kernels without ``clean_low_latency_buffer`` raise (on the
  hardware they would read a dirty buffer).
- Buffer sizes are checked against the size hints of the call (a buffer sized for a smaller layer
  raises), and creation is collective: every rank must create it with the same sizes.

Not emulated (the plugin does not use them; calling them raises): cached dispatch (``handle=``),
``num_worst_tokens``, internode (more than 8 ranks), ``zero_copy``, LogFMT. NVSHMEM environment
variables are recorded in ``Buffer.nvshmem_env`` instead of being written to ``os.environ``.

INFERRED (not in the references): the byte formulas of the size hints (their structure follows
DeepEP's ``config.hpp``; only their monotonicity matters here).
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

NUM_MAX_NVL_PEERS = 8
ALIGNMENT = 128  # NUM_BUFFER_ALIGNMENT_BYTES
LL_HIDDEN = (2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192)
QP_DEPTH = 1024
FP8_MAX = 448.0
FP8_MARGIN = 1e-4  # kFP8Margin: the floor of each group's amax
topk_idx_t = torch.int64


def _align(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


class Config:
    def __init__(self, num_sms: int = 20, num_max_nvl_chunked_send_tokens: int = 6,
                 num_max_nvl_chunked_recv_tokens: int = 256, num_max_rdma_chunked_send_tokens: int = 6,
                 num_max_rdma_chunked_recv_tokens: int = 256) -> None:
        assert num_max_nvl_chunked_send_tokens < num_max_nvl_chunked_recv_tokens
        assert num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens // 2
        self.num_sms = num_sms
        self.num_max_nvl_chunked_send_tokens = num_max_nvl_chunked_send_tokens
        self.num_max_nvl_chunked_recv_tokens = num_max_nvl_chunked_recv_tokens
        self.num_max_rdma_chunked_send_tokens = num_max_rdma_chunked_send_tokens
        self.num_max_rdma_chunked_recv_tokens = num_max_rdma_chunked_recv_tokens

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        assert num_ranks < NUM_MAX_NVL_PEERS or num_ranks % NUM_MAX_NVL_PEERS == 0
        rdma_ranks, nvl_ranks = max(num_ranks // NUM_MAX_NVL_PEERS, 1), min(num_ranks, NUM_MAX_NVL_PEERS)
        slots = (self.num_sms // 2) * nvl_ranks
        per_token = hidden_bytes + 128 * (8 + 4) + 128 * 4  # data, top-k ids and weights, scales
        return _align(slots * (2 * rdma_ranks + 3) * 4 + slots * self.num_max_nvl_chunked_recv_tokens * per_token)

    def get_rdma_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        if num_ranks <= NUM_MAX_NVL_PEERS:  # intranode: no RDMA buffer
            return 0
        rdma_ranks = num_ranks // NUM_MAX_NVL_PEERS
        per_token = hidden_bytes + 128 * (8 + 4) + 128 * 4
        return _align((self.num_sms // 2) * rdma_ranks * self.num_max_rdma_chunked_recv_tokens * per_token * 2)


# --------------------------------------------------------------------------- stream order
# DeepEP runs its normal kernels on its own comm stream, which waits for ``previous_event`` when one
# is given *instead of* the compute stream: an input written after that event may be read before it
# exists (on 2x H100 the async FP8 dispatch read rows the cast had not written yet). On the CPU all
# happens in host order, so tensors are stamped with it (``StreamOrder``, on in spawned workers) and
# events too, and the ops refuse an input newer than their ``previous_event``.
_CLOCK = itertools.count(1)


class StreamOrder(TorchFunctionMode):
    """Stamps each tensor a torch op creates with the host's order (a returned existing tensor keeps
    its stamp: ``x.contiguous()`` of a contiguous ``x`` writes nothing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and getattr(t, "_emulated_written_at", None) is None:
                t._emulated_written_at = next(_CLOCK)
        return out


def _check_written_before(previous_event: Any, op: str, **inputs: Any) -> None:
    if previous_event is None:
        return
    for name, t in inputs.items():
        if isinstance(t, torch.Tensor) and getattr(t, "_emulated_written_at", 0) > previous_event.at:
            raise RuntimeError(f"{op}: {name} was written after previous_event; DeepEP's comm stream waits for "
                               "previous_event instead of the compute stream, so it could read it unwritten")


class EventOverlap:
    def __init__(self, event: Any = None, extra_tensors: Any = None) -> None:
        self.event, self.extra_tensors = event, extra_tensors
        self.at = next(_CLOCK)  # host order stands in for the stream position

    def current_stream_wait(self) -> None:  # CPU: everything already happened in program order
        pass

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.current_stream_wait()


# --------------------------------------------------------------------------- transport


def exchange(group: Any, world: int, per_dest: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Send ``per_dest[r]`` (fields with equal row counts) to rank ``r``; return what each rank sent here.
    Every rank passes the same field names, dtypes and row shapes (zero rows allowed). Bytes move."""
    if world == 1:
        return [{k: v.clone() for k, v in per_dest[0].items()}]
    send_n = torch.tensor([next(iter(d.values())).shape[0] for d in per_dest], dtype=torch.int64)
    recv_n = torch.empty_like(send_n)
    dist.all_to_all_single(recv_n, send_n, group=group)
    splits_in, splits_out = send_n.tolist(), recv_n.tolist()
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name in sorted(per_dest[0]):
        ref = per_dest[0][name]
        row_shape, dtype = tuple(ref.shape[1:]), ref.dtype
        rows = [d[name].to(torch.uint8) if dtype == torch.bool else d[name] for d in per_dest]
        row_numel = max(1, math.prod(row_shape))
        send = torch.cat([r.contiguous().reshape(r.shape[0], row_numel).view(torch.uint8) for r in rows])
        recv = torch.empty(sum(splits_out), send.shape[1], dtype=torch.uint8)
        dist.all_to_all_single(recv, send, splits_out, splits_in, group=group)
        for r, part in enumerate(recv.split(splits_out)):
            v = part.contiguous().view(torch.uint8 if dtype == torch.bool else dtype).reshape((-1,) + row_shape)
            out[r][name] = v.bool() if dtype == torch.bool else v
    return out


def quantize_fp8_ll(x: torch.Tensor, round_scale: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepEP v1.2.1's in-kernel cast (``internode_ll.cu`` dispatch + ``calculate_fp8_scales`` in
    ``utils.cuh``), bit for bit, per 128 channels of the bf16 row in fp32:
    ``amax = max(1e-4, max |x|)``; without ``round_scale``: ``scale_inv = amax * fl(1/448)`` and
    ``scale = 448 / amax`` (two roundings, not ``amax / 448``: about 3 e4m3 bytes in 10^4 and most
    scales differ in the last bit from ``moe_core.quant``, docs/decisions.md); with ``round_scale``:
    ``e = ceil(log2(amax * fl(1/448)))`` from the float's bits, ``scale_inv = 2^e``, ``scale = 2^-e``;
    ``q = satfinite_e4m3_rn(x * scale)``. Returns (e4m3 ``[T, H]``, fp32 ``scale_inv [T, H/128]``)."""
    t, h = x.shape
    xg = x.float().view(t, h // 128, 128)
    amax = xg.abs().amax(dim=-1).clamp(min=FP8_MARGIN) if t else torch.zeros(0, h // 128)
    scaled = amax * torch.tensor(1 / FP8_MAX, dtype=torch.float32)  # kFinfoAmaxInvE4M3 is a float
    if round_scale:
        bits = scaled.view(torch.int32)
        exp = ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)  # fast_log2_ceil
        scale_inv = ((exp + 127) << 23).view(torch.float32)  # fast_pow2
        scale = ((127 - exp) << 23).view(torch.float32)
    else:
        # a true division (``448.0 / tensor`` would be ``reciprocal(tensor) * 448``: two roundings)
        scale_inv, scale = scaled, torch.full_like(amax, FP8_MAX).div(amax)
    q = (xg * scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(t, h), scale_inv


def pack_ue8m0(scale_inv: torch.Tensor) -> torch.Tensor:
    """fp32 power-of-two scales ``[..., G]`` -> int32 ``[..., G/4]``: the exponent byte of each, 4 per int,
    low byte first."""
    exp = ((scale_inv.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return exp.view(torch.int32)


# --------------------------------------------------------------------------- buffer


class Runtime:
    """``Buffer.runtime``: DeepEP's C++ ``deep_ep_cpp.Buffer`` as far as the plugin calls it (the low-latency
    dispatch, with v1.2.1's C++ signature and results); ``Buffer``'s wrapper calls it as DeepEP's does."""

    def __init__(self, buffer: "Buffer") -> None:
        self.low_latency_dispatch = buffer._low_latency_dispatch


class Buffer:
    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, explicitly_destroy: bool = False, enable_shrink: bool = False,
                 comm: Any = None) -> None:
        self.group = group
        self.rank, self.group_size = group.rank(), group.size()
        self.num_nvl_bytes, self.num_rdma_bytes = num_nvl_bytes, num_rdma_bytes
        self.low_latency_mode, self.num_qps_per_rank = low_latency_mode, num_qps_per_rank
        assert num_nvl_bytes % ALIGNMENT == 0 and num_rdma_bytes % ALIGNMENT == 0, "buffer sizes must be 128-aligned"
        if self.group_size > NUM_MAX_NVL_PEERS:
            raise NotImplementedError("internode (more than 8 ranks) is not emulated")
        if num_rdma_bytes > 0:
            assert low_latency_mode, "an RDMA buffer intranode needs low_latency_mode"
        self.nvshmem_env: dict[str, str] = {}
        if low_latency_mode:
            assert num_qps_per_rank > 0
            self.nvshmem_env = {"NVSHMEM_IB_ENABLE_IBGDA": "1", "NVSHMEM_QP_DEPTH": str(QP_DEPTH),
                                "NVSHMEM_IBGDA_NUM_RC_PER_PE": str(num_qps_per_rank),
                                "NVSHMEM_DISABLE_P2P": "0" if allow_nvlink_for_low_latency_mode else "1"}
        if self.group_size > 1:  # creation is collective (DeepEP all-gathers IPC handles / NVSHMEM ids)
            # a tensor all-gather, not all_gather_object (which needs numpy, absent from CI)
            mine = torch.tensor([num_nvl_bytes, num_rdma_bytes, int(low_latency_mode), num_qps_per_rank],
                                dtype=torch.int64)
            gathered = [torch.empty_like(mine) for _ in range(self.group_size)]
            dist.all_gather(gathered, mine, group=group)
            every = [tuple(g.tolist()) for g in gathered]
            if any(e != tuple(mine.tolist()) for e in every):
                raise RuntimeError(f"ranks created DeepEP buffers with different settings: {every}")
        self.runtime = Runtime(self)  # (DeepEP's deep_ep_cpp.Buffer)
        self.calls: Counter = Counter()  # test introspection
        self._dirty = False  # normal kernels ran since the last clean_low_latency_buffer
        self._rng = torch.Generator().manual_seed(7919 * (self.rank + 1))  # arrival order, per rank

    # ------------------------------------------------------------ static API

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        assert new_num_sms % 2 == 0, "The SM count must be even"
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        return EventOverlap()

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> Config:
        # DeepEP's table for the intranode sizes (the only ones emulated)
        table = {2: (24, 256, 6, 128), 4: (6, 256, 6, 128), 8: (6, 256, 6, 128)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks} (emulation: intranode only)"
        return Config(Buffer.num_sms, *table[num_ranks])

    @staticmethod
    def get_combine_config(num_ranks: int) -> Config:
        table = {2: (10, 256, 6, 128), 4: (9, 256, 6, 128), 8: (4, 256, 6, 128)}
        assert num_ranks in table, f"Unsupported number of EP ranks: {num_ranks} (emulation: intranode only)"
        return Config(Buffer.num_sms, *table[num_ranks])

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        # two (send + receive + signal) buffers, BF16 rows plus a 16-byte header and FP8 scales
        msg = 16 + hidden * 2 + (hidden // 128) * 4
        send = num_max_dispatch_tokens_per_rank * msg
        recv = num_experts * num_max_dispatch_tokens_per_rank * msg
        signal = num_experts * 4
        return _align(2 * (send + recv + signal))

    # ------------------------------------------------------------ normal kernels

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self.calls["get_dispatch_layout"] += 1
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        _check_written_before(previous_event, "get_dispatch_layout", topk_idx=topk_idx)
        if topk_idx.dtype != topk_idx_t or topk_idx.dim() != 2:
            raise TypeError(f"topk_idx must be int64 [T, K], got {topk_idx.dtype} {tuple(topk_idx.shape)}")
        R = self.group_size
        assert num_experts % R == 0
        if topk_idx.numel() and (int(topk_idx.min()) < -1 or int(topk_idx.max()) >= num_experts):
            raise ValueError(f"topk_idx outside [-1, {num_experts})")
        e_local = num_experts // R
        t = topk_idx.shape[0]
        rank_of = torch.where(topk_idx >= 0, topk_idx // e_local, -1)
        in_rank = (rank_of.unsqueeze(2) == torch.arange(R)).any(dim=1) if t else torch.zeros(0, R, dtype=torch.bool)
        per_rank = in_rank.sum(dim=0).to(torch.int32)
        per_expert = torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts).to(torch.int32)
        return per_rank, None, per_expert, in_rank, EventOverlap()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self.calls["dispatch"] += 1
        if handle is not None:
            raise NotImplementedError("cached dispatch (handle=) is not emulated")
        if num_worst_tokens:
            raise NotImplementedError("num_worst_tokens is not emulated")
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        x, scales = x if isinstance(x, tuple) else (x, None)
        _check_written_before(previous_event, "dispatch", x=x, x_scales=scales, topk_idx=topk_idx,
                              topk_weights=topk_weights)
        t, h = x.shape
        if scales is None:
            if x.dtype != torch.bfloat16 or not x.is_contiguous() or (h * 2) % 16:
                raise TypeError(f"x must be contiguous bf16 [T, H] with 16-byte rows, got {x.dtype} {tuple(x.shape)}")
        else:
            if x.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32 or h % 128 \
                    or tuple(scales.shape) != (t, h // 128):
                raise TypeError(f"FP8 x must be (e4m3fn [T, H], fp32 [T, H/128]) with H % 128 == 0, got "
                                f"{x.dtype} {tuple(x.shape)} / {scales.dtype} {tuple(scales.shape)}")
        assert None not in (num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights)
        if topk_idx.dtype != topk_idx_t or topk_weights.dtype != torch.float32 or topk_idx.shape != topk_weights.shape:
            raise TypeError("topk_idx int64 and topk_weights fp32, both [T, K]")
        R, me = self.group_size, self.rank
        config = config or self.get_dispatch_config(R)
        self._check_nvl(config, h)
        if not torch.equal(num_tokens_per_rank, is_token_in_rank.sum(dim=0).to(torch.int32)):
            raise ValueError("num_tokens_per_rank does not match is_token_in_rank")
        self._dirty = True
        e_local = num_tokens_per_expert.numel() // R

        per_dest = []
        for r in range(R):
            tok = is_token_in_rank[:, r].nonzero().flatten()
            fields = {"x": x[tok], "idx": topk_idx[tok], "w": topk_weights[tok], "tok": tok}
            if scales is not None:
                fields["s"] = scales[tok]
            per_dest.append(fields)
        got = exchange(self.group, R, per_dest)
        recv_x = torch.cat([g["x"] for g in got])
        idx = torch.cat([g["idx"] for g in got])
        w = torch.cat([g["w"] for g in got])
        local = idx - me * e_local
        mine = (idx >= 0) & (local >= 0) & (local < e_local)
        recv_idx = torch.where(mine, local, -1)
        recv_w = torch.where(mine, w, 0.0)
        counts = torch.bincount(recv_idx[mine], minlength=e_local).tolist()
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]

        # handle: (rank_prefix_matrix, channel_prefix_matrix, recv_channel_prefix_matrix, recv_src_idx,
        # is_token_in_rank, send_head); the channel matrices are not modelled (zeros)
        every = [torch.zeros(R, dtype=torch.int32) for _ in range(R)]
        dist.all_gather(every, num_tokens_per_rank.to(torch.int32), group=self.group)
        rank_prefix_matrix = torch.stack(every).cumsum(dim=0).to(torch.int32)  # [i][j]: end of i's block at j
        channels = torch.zeros(R, config.num_sms // 2, dtype=torch.int32)
        recv_src_idx = torch.cat([g["tok"] for g in got]).to(torch.int32)
        send_head = torch.where(is_token_in_rank, is_token_in_rank.to(torch.int64).cumsum(dim=0) - 1, -1).to(torch.int32)
        new_handle = (rank_prefix_matrix, channels, channels.clone(), recv_src_idx, is_token_in_rank, send_head)
        out_x = recv_x if scales is None else (recv_x, torch.cat([g["s"] for g in got]))
        return out_x, recv_idx, recv_w, counts, new_handle, EventOverlap()

    def combine(self, x: torch.Tensor, handle: tuple, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self.calls["combine"] += 1
        if allocate_on_comm_stream:
            assert previous_event is not None and async_finish
        _check_written_before(previous_event, "combine", x=x, topk_weights=topk_weights)
        rank_prefix_matrix, _, _, recv_src_idx, is_token_in_rank, send_head = handle
        R, me = self.group_size, self.rank
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] != recv_src_idx.numel():
            raise TypeError(f"combine takes bf16 [{recv_src_idx.numel()}, H] (the received rows), got "
                            f"{x.dtype} {tuple(x.shape)}")
        self._check_nvl(config or self.get_combine_config(R), x.shape[1])
        self._dirty = True
        ends = rank_prefix_matrix[:, me].tolist()
        sizes = [e - b for b, e in zip([0] + ends[:-1], ends, strict=True)]
        per_dest = [{"y": p} for p in x.split(sizes)]
        if topk_weights is not None:
            for d, p in zip(per_dest, topk_weights.split(sizes), strict=True):
                d["w"] = p
        got = exchange(self.group, R, per_dest)
        t = is_token_in_rank.shape[0]
        out = torch.zeros(t, x.shape[1], dtype=torch.float32)
        out_w = None if topk_weights is None else torch.zeros(t, topk_weights.shape[1], dtype=torch.float32)
        for r, g in enumerate(got):
            tok = is_token_in_rank[:, r].nonzero().flatten()
            assert torch.equal(send_head[tok, r].long(), torch.arange(tok.numel())), "corrupt handle"
            out.index_add_(0, tok, g["y"].float())
            if out_w is not None:
                out_w.index_add_(0, tok, g["w"].float())
        for b in (() if bias is None else bias if isinstance(bias, tuple) else (bias,)):
            out += b.float()
        return out.to(torch.bfloat16), out_w, EventOverlap()

    def _check_nvl(self, config: Config, hidden: int) -> None:
        need = config.get_nvl_buffer_size_hint(hidden * 2, self.group_size)
        if self.num_nvl_bytes < need:
            raise RuntimeError(f"NVL buffer of {self.num_nvl_bytes} bytes, this call needs {need} (H={hidden})")

    # ------------------------------------------------------------ low-latency kernels

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        self.calls["clean_low_latency_buffer"] += 1
        self._dirty = False

    def _check_ll(self, x: torch.Tensor, num_max: int, num_experts: int) -> None:
        R = self.group_size
        if not self.low_latency_mode:
            raise RuntimeError("low-latency kernels need Buffer(..., low_latency_mode=True)")
        if self._dirty:
            raise RuntimeError("normal kernels used this buffer: call clean_low_latency_buffer first")
        if self.num_qps_per_rank != num_experts // R:
            raise RuntimeError(f"num_qps_per_rank={self.num_qps_per_rank} must equal the local experts "
                               f"{num_experts // R} in low-latency mode")
        need = self.get_low_latency_rdma_size_hint(num_max, x.shape[-1], R, num_experts)
        if self.num_rdma_bytes < need:
            raise RuntimeError(f"RDMA buffer of {self.num_rdma_bytes} bytes, this call needs {need}")
        if x.shape[-1] not in LL_HIDDEN:
            raise ValueError(f"hidden {x.shape[-1]} has no low-latency kernel ({LL_HIDDEN})")
        if (R * num_max) % 4 or QP_DEPTH < 2 * (num_max + 1):
            raise ValueError(f"num_max_dispatch_tokens_per_rank={num_max}: need R*num_max % 4 == 0 and "
                             f"QP depth {QP_DEPTH} >= 2*(num_max+1)")

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats=None,
                             dispatch_wait_recv_cost_stats=None, use_fp8: bool = True, round_scale: bool = False,
                             use_ue8m0: bool = False, async_finish: bool = False, return_recv_hook: bool = False):
        """DeepEP v1.2.1's Python wrapper (``deep_ep/buffer.py``), statement for statement: the C++ call, its
        results regrouped (the plugin compares this body with v1.2.1's before it calls ``runtime`` itself)."""
        packed_recv_x, packed_recv_x_scales, packed_recv_count, packed_recv_src_info, packed_recv_layout_range, event, hook = \
            self.runtime.low_latency_dispatch(x, topk_idx,
                                              cumulative_local_expert_recv_stats,
                                              dispatch_wait_recv_cost_stats,
                                              num_max_dispatch_tokens_per_rank, num_experts,
                                              use_fp8, round_scale, use_ue8m0,
                                              async_finish, return_recv_hook)
        handle = (packed_recv_src_info, packed_recv_layout_range, num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
        tensors_to_record = (x, topk_idx,
                             packed_recv_x, packed_recv_x_scales, packed_recv_count,
                             packed_recv_src_info, packed_recv_layout_range,
                             cumulative_local_expert_recv_stats)
        return (packed_recv_x, packed_recv_x_scales) if use_fp8 else packed_recv_x, packed_recv_count, handle, \
            EventOverlap(event, tensors_to_record if async_finish else None), hook

    def _low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, cumulative_local_expert_recv_stats: Any,
                              dispatch_wait_recv_cost_stats: Any, num_max_dispatch_tokens_per_rank: int,
                              num_experts: int, use_fp8: bool, round_scale: bool, use_ue8m0: bool, async_finish: bool,
                              return_recv_hook: bool):
        """``deep_ep_cpp.Buffer.low_latency_dispatch`` (``Runtime``): v1.2.1's C++ arguments and 7 results."""
        self.calls["low_latency_dispatch"] += 1
        num_max, R = num_max_dispatch_tokens_per_rank, self.group_size
        self._check_ll(x, num_max, num_experts)
        if x.dtype != torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
            raise TypeError(f"x must be contiguous bf16 [T, H], got {x.dtype} {tuple(x.shape)}")
        if topk_idx.dtype != topk_idx_t or topk_idx.shape[0] != x.shape[0]:
            raise TypeError("topk_idx must be int64 [T, K]")
        t, h = x.shape
        assert t <= num_max, f"{t} tokens > num_max_dispatch_tokens_per_rank={num_max}"
        assert not (use_fp8 and h % 512), "FP8 low-latency dispatch needs hidden % 512 == 0"
        assert not use_ue8m0 or round_scale, "use_ue8m0 requires round_scale"
        assert not (async_finish and return_recv_hook)
        e_local, cap = num_experts // R, R * num_max

        # one message per (token, expert)
        flat = topk_idx.reshape(-1)
        tok = torch.arange(t).repeat_interleave(topk_idx.shape[1])
        if use_fp8:
            q, s = quantize_fp8_ll(x, round_scale)
        per_dest = []
        for r in range(R):
            sel = ((flat >= r * e_local) & (flat < (r + 1) * e_local)).nonzero().flatten()
            fields = {"e": flat[sel] - r * e_local, "tok": tok[sel]}
            fields.update({"x": q[tok[sel]], "s": s[tok[sel]]} if use_fp8 else {"x": x[tok[sel]]})
            per_dest.append(fields)
        got = exchange(self.group, R, per_dest)

        # result tensors: fresh allocations each call (deep_ep.cpp's torch::empty), garbage until received
        g = h // 128
        data = torch.empty(e_local, cap, h, dtype=torch.float8_e4m3fn if use_fp8 else torch.bfloat16)
        scales_cm = torch.empty(e_local, g // 4 if use_ue8m0 else g, cap,
                                dtype=torch.int32 if use_ue8m0 else torch.float32) if use_fp8 else None
        recv_count = torch.full((e_local,), -7, dtype=torch.int32)
        src_info = torch.full((e_local, cap), -1, dtype=torch.int32)
        layout_range = torch.zeros(e_local, R, dtype=torch.int64)
        self._fill_garbage(data, scales_cm)

        writes = []  # (expert, rows, source fields, picks) applied by the receive
        for e in range(e_local):
            pos = 0
            for r in torch.randperm(R, generator=self._rng).tolist():  # arrival order
                hit = (got[r]["e"] == e).nonzero().flatten()
                hit = hit[torch.randperm(hit.numel(), generator=self._rng)]
                layout_range[e, r] = (pos << 32) | hit.numel()
                writes.append((e, pos, r, hit))
                pos += hit.numel()
            assert pos <= cap

        def receive() -> None:
            counts = torch.zeros(e_local, dtype=torch.int32)
            for e, pos, r, hit in writes:
                n = hit.numel()
                data[e, pos:pos + n] = got[r]["x"][hit]
                src_info[e, pos:pos + n] = got[r]["tok"][hit].to(torch.int32)
                if use_fp8:
                    sc = got[r]["s"][hit]
                    scales_cm[e, :, pos:pos + n] = (pack_ue8m0(sc) if use_ue8m0 else sc).t()
                counts[e] += n
            recv_count.copy_(counts)

        if not return_recv_hook:
            receive()
        scales = scales_cm.transpose(1, 2) if use_fp8 else None  # column-major views
        return data, scales, recv_count, src_info, layout_range, None, receive if return_recv_hook else None

    def _fill_garbage(self, data: torch.Tensor, scales: Optional[torch.Tensor]) -> None:
        if data.dtype == torch.bfloat16:
            data.fill_(float("nan"))
        else:
            data.view(torch.uint8).copy_(torch.randint(0, 256, data.shape, dtype=torch.uint8, generator=self._rng))
        if scales is not None:
            scales.view(torch.float32).fill_(float("nan"))

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle: tuple,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats=None):
        self.calls["low_latency_combine"] += 1
        if use_logfmt or zero_copy:
            raise NotImplementedError("LogFMT and zero-copy combine are not emulated")
        src_info, layout_range, num_max, h, num_experts = handle
        R, me = self.group_size, self.rank
        e_local = num_experts // R
        self._check_ll(x, num_max, num_experts)
        if x.dtype != torch.bfloat16 or tuple(x.shape) != (e_local, R * num_max, h):
            raise TypeError(f"x must be bf16 [{e_local}, {R * num_max}, {h}], got {x.dtype} {tuple(x.shape)}")
        if topk_idx.dtype != topk_idx_t or topk_weights.dtype != torch.float32 or topk_idx.shape != topk_weights.shape:
            raise TypeError("topk_idx int64 and topk_weights fp32, both the sender's [T, K]")
        assert not (async_finish and return_recv_hook)
        per_dest = []
        for r in range(R):
            rows, toks, experts = [], [], []
            for e in range(e_local):
                begin, n = int(layout_range[e, r]) >> 32, int(layout_range[e, r]) & 0xFFFFFFFF
                rows.append(x[e, begin:begin + n])
                toks.append(src_info[e, begin:begin + n].long())
                experts.append(torch.full((n,), me * e_local + e, dtype=torch.int64))
            per_dest.append({"y": torch.cat(rows), "tok": torch.cat(toks), "e": torch.cat(experts)})
        got = exchange(self.group, R, per_dest)
        t = topk_idx.shape[0]
        result = out if out is not None else torch.empty(t, h, dtype=torch.bfloat16)

        def receive() -> None:
            acc = torch.zeros(t, h, dtype=torch.float32)
            for g in got:
                if not g["tok"].numel():
                    continue
                match = topk_idx[g["tok"]] == g["e"].unsqueeze(1)  # [n, K]: the slot this row answers
                if not bool((match.sum(dim=1) == 1).all()):
                    raise RuntimeError("a combined row matches no (or several) top-k slots of its token")
                w = (topk_weights[g["tok"]] * match).sum(dim=1)
                acc.index_add_(0, g["tok"], g["y"].float() * w.unsqueeze(1))
            result.copy_(acc.to(torch.bfloat16))

        if return_recv_hook:
            result.fill_(float("nan"))
        else:
            receive()
        return result, EventOverlap(), receive if return_recv_hook else None
