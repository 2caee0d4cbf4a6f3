"""Pure-PyTorch emulation of DeepEP for Ascend (``deep_ep`` of sgl-kernel-npu), TEST SUPPORT ONLY.

Data really moves between processes: every rank runs its own ``Buffer`` on a ``torch.distributed``
group (gloo on CPU) and rows travel with ``all_to_all_single``. Semantics follow ``vendor-apis.md``
sections 1 (the DeepEP V1 API that the Ascend build mirrors), 7 (the Ascend differences) and 8:

- normal ``dispatch``: each token once per destination rank, source-rank blocks in rank order,
  local expert ids (-1 and weight 0 elsewhere), per-local-expert counts as a Python list; INT8
  per-token quantization when ``DEEP_NORMAL_MODE_USE_INT8_QUANT=1`` **at call time** (the Ascend
  build reads ``os.getenv`` inside ``dispatch``), returning ``(int8 [R, H], fp32 [R])``;
- normal ``combine``: unweighted sum of the returned rows per source token;
- ``low_latency_dispatch``: ``use_fp8=True`` means INT8 per-token, returning
  ``(int8 [M, H], fp32 [M])``; rows are a 2-D slab packed by local expert, ``recv_count`` int64
  ``[E_local]`` counts; rows past the counts are garbage (NaN / random here); source-rank blocks
  inside an expert are NOT in rank order (arrival order on the hardware);
- ``low_latency_combine``: ``sum_k w * y`` over the sender's own ``topk_idx`` (-1 skipped);
- ``fused_deep_moe``: the section 8 recipe, with the documented limits enforced.

INFERRED (not in the references): the packed slab capacity ``M = R * num_max * min(K, E_local)``;
the low-latency buffer size hint formula (we only need "a buffer sized for one layer rejects a
larger one").
"""

from __future__ import annotations

import enum
import os
from typing import Any, Optional

import torch
import torch.distributed as dist

from .torch_npu_ops import q_per_row

INT8_ENV = "DEEP_NORMAL_MODE_USE_INT8_QUANT"
LL_MAX_TOKENS = 512


class FuseMode(enum.IntEnum):
    FUSED_DEEP_MOE = 1  # aclnnFusedDeepMoe
    DISPATCH_FFN_COMBINE = 2  # aclnnDispatchFFNCombine


class SoloGroup:
    """A one-rank "group" for single-process op tests (no torch.distributed needed)."""

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


class EventOverlap:
    def __init__(self, event: Any = None, extra_tensors: Any = None) -> None:
        self.event, self.extra_tensors = event, extra_tensors

    def current_stream_wait(self) -> None:
        pass

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


# --------------------------------------------------------------------------- transport


def exchange(group: Any, per_dest: list[dict[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """Send ``per_dest[r]`` (fields of equal row count) to rank ``r``; return what each rank sent here.

    Every rank must pass the same field names, dtypes and row shapes (zero rows allowed).
    """
    world, me = group.size(), group.rank()
    if len(per_dest) != world:
        raise ValueError(f"need one entry per rank ({world}), got {len(per_dest)}")
    if world == 1:
        return [{k: v.clone() for k, v in per_dest[0].items()}]
    names = sorted(per_dest[0])
    send_n = torch.tensor([next(iter(d.values())).shape[0] for d in per_dest], dtype=torch.int64)
    recv_n = torch.empty(world, dtype=torch.int64)
    dist.all_to_all_single(recv_n, send_n, group=group)
    recv_counts = recv_n.tolist()
    out: list[dict[str, torch.Tensor]] = [{} for _ in range(world)]
    for name in names:
        ref = per_dest[me][name]
        row_shape, dtype = tuple(ref.shape[1:]), ref.dtype
        row_numel = 1
        for s in row_shape:
            row_numel *= s
        row_bytes = max(1, row_numel) * torch.empty((), dtype=dtype).element_size()
        chunks = []
        for d in per_dest:
            t = d[name].contiguous()
            if t.dtype == torch.bool:
                t = t.to(torch.uint8)
            chunks.append(t.reshape(t.shape[0], max(1, row_numel)).view(torch.uint8).reshape(t.shape[0], row_bytes))
        send = torch.cat(chunks)
        recv = torch.empty(sum(recv_counts), row_bytes, dtype=torch.uint8)
        dist.all_to_all_single(recv, send, output_split_sizes=recv_counts, input_split_sizes=send_n.tolist(),
                               group=group)
        view_dtype = torch.uint8 if dtype == torch.bool else dtype
        parts = recv.split(recv_counts)
        for r, p in enumerate(parts):
            v = p.contiguous().view(view_dtype).reshape((p.shape[0],) + row_shape)
            out[r][name] = v.to(torch.bool) if dtype == torch.bool else v
    return out


# --------------------------------------------------------------------------- buffer


class Buffer:
    num_sms: int = 20

    def __init__(self, group: Any, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 12, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, meta_addr: int = 0) -> None:
        self.group = group
        self.rank = group.rank()
        self.group_size = group.size()
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.num_qps_per_rank = num_qps_per_rank
        self.calls: list[str] = []  # test introspection: which entry points ran
        self.env_seen: list[Optional[str]] = []  # value of INT8_ENV seen by each normal dispatch

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        # INFERRED: two (send + receive) BF16 slabs with 32 bytes of metadata per row, like DeepEP V1.
        row = hidden * 2 + 32
        send = num_max_dispatch_tokens_per_rank * row
        recv = num_experts * num_max_dispatch_tokens_per_rank * row
        return 2 * (send + recv)

    # ------------------------------------------------------------ normal mode

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int, previous_event: Any = None,
                            async_finish: bool = False, allocate_on_comm_stream: bool = False):
        self.calls.append("get_dispatch_layout")
        if topk_idx.dtype != torch.int64:
            raise TypeError("topk_idx must be int64")
        e_local = num_experts // self.group_size
        valid = topk_idx >= 0
        rank_of = torch.where(valid, topk_idx // e_local, torch.full_like(topk_idx, -1))
        is_token_in_rank = torch.stack([(rank_of == r).any(dim=1) for r in range(self.group_size)], dim=1) \
            if topk_idx.shape[0] else torch.zeros(0, self.group_size, dtype=torch.bool)
        num_tokens_per_rank = is_token_in_rank.sum(dim=0).to(torch.int32)
        num_tokens_per_expert = torch.bincount(topk_idx[valid], minlength=num_experts).to(torch.int32)
        return num_tokens_per_rank, None, num_tokens_per_expert, is_token_in_rank, EventOverlap()

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None, previous_event=None,
                 async_finish: bool = False, allocate_on_comm_stream: bool = False,
                 dispatch_wait_recv_cost_stats=None):
        self.calls.append("dispatch")
        if isinstance(x, tuple):
            raise NotImplementedError("Not support fp8")
        if handle is not None:
            raise NotImplementedError("Optional communication handle is not supported yet.")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"x must be bf16, got {x.dtype}")
        assert num_tokens_per_rank is not None and is_token_in_rank is not None and num_tokens_per_expert is not None
        env = os.getenv(INT8_ENV)
        self.env_seen.append(env)
        use_quant = env == "1"
        world, me = self.group_size, self.rank
        e_local = num_tokens_per_expert.numel() // world
        per_dest = []
        for r in range(world):
            tok = is_token_in_rank[:, r].nonzero().flatten()
            fields = {"idx": topk_idx[tok], "w": topk_weights[tok].float(), "src": tok.to(torch.int64)}
            if use_quant:
                q, s = q_per_row(x[tok], 127)
                fields.update(x=q, scale=s)
            else:
                fields["x"] = x[tok]
            per_dest.append(fields)
        got = exchange(self.group, per_dest)
        recv_idx = torch.cat([g["idx"] for g in got])
        recv_w = torch.cat([g["w"] for g in got])
        local = recv_idx - me * e_local
        keep = (recv_idx >= 0) & (local >= 0) & (local < e_local)
        recv_topk_idx = torch.where(keep, local, torch.full_like(local, -1))
        recv_topk_weights = torch.where(keep, recv_w, torch.zeros_like(recv_w))
        counts = torch.bincount(recv_topk_idx[keep], minlength=e_local).tolist()
        counts = [-(-c // expert_alignment) * expert_alignment for c in counts]
        recv_x = torch.cat([g["x"] for g in got])
        handle = {"recv_from": [g["src"].shape[0] for g in got], "sent_tokens": [d["src"] for d in per_dest],
                  "num_tokens": x.shape[0], "hidden": x.shape[1]}
        out_x = (recv_x, torch.cat([g["scale"] for g in got])) if use_quant else recv_x
        return out_x, recv_topk_idx, recv_topk_weights, counts, handle, EventOverlap()

    def combine(self, x: torch.Tensor, handle: dict, topk_weights=None, bias=None, config=None,
                previous_event=None, async_finish: bool = False, allocate_on_comm_stream: bool = False,
                combine_send_cost_stats=None):
        self.calls.append("combine")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"combine takes bf16 rows, got {x.dtype}")
        if x.shape[0] != sum(handle["recv_from"]):
            raise ValueError(f"combine got {x.shape[0]} rows, dispatch delivered {sum(handle['recv_from'])}")
        parts = x.split(handle["recv_from"])
        per_dest = [{"y": p} for p in parts]
        if topk_weights is not None:
            for d, w in zip(per_dest, topk_weights.split(handle["recv_from"]), strict=True):
                d["w"] = w.float()
        got = exchange(self.group, per_dest)
        out = torch.zeros(handle["num_tokens"], handle["hidden"], dtype=torch.float32)
        out_w = None if topk_weights is None else torch.zeros(handle["num_tokens"], topk_weights.shape[1])
        for r, g in enumerate(got):
            tok = handle["sent_tokens"][r]
            out.index_add_(0, tok, g["y"].float())
            if out_w is not None:
                out_w.index_add_(0, tok, g["w"])
        if bias is not None:
            for b in (bias if isinstance(bias, tuple) else (bias,)):
                out += b.float()
        return out.to(torch.bfloat16), out_w, EventOverlap()

    # ------------------------------------------------------------ low latency

    def _check_ll(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max: int, num_experts: int) -> None:
        if not self.low_latency_mode:
            raise RuntimeError("low-latency kernels need a Buffer(..., low_latency_mode=True)")
        need = self.get_low_latency_rdma_size_hint(num_max, x.shape[1], self.group_size, num_experts)
        if self.num_rdma_bytes < need:
            raise RuntimeError(f"buffer has {self.num_rdma_bytes} RDMA bytes, this call needs {need}")
        if x.dtype != torch.bfloat16 or x.dim() != 2:
            raise TypeError("x must be bf16 [num_tokens, hidden]")
        if topk_idx.dtype != torch.int64 or topk_idx.shape[0] != x.shape[0]:
            raise TypeError("topk_idx must be int64 [num_tokens, num_topk]")
        if x.shape[0] > num_max or num_max > LL_MAX_TOKENS:
            raise ValueError(f"num_tokens={x.shape[0]} must be <= num_max_dispatch_tokens_per_rank={num_max} "
                             f"<= {LL_MAX_TOKENS}")
        if num_experts % self.group_size:
            raise ValueError("num_experts must be divisible by the number of ranks")

    def _ll_send(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int, quantize: bool):
        """Send one row per (token, expert) to the expert's rank; return the received fields, packed by
        local expert (source blocks rotated per expert: not rank order), plus per-expert counts."""
        world = self.group_size
        e_local = num_experts // world
        t, k = topk_idx.shape
        flat = topk_idx.reshape(-1)
        tok = torch.arange(t).repeat_interleave(k)
        if quantize:
            q, s = q_per_row(x, 127)
        per_dest = []
        for r in range(world):
            sel = ((flat >= r * e_local) & (flat < (r + 1) * e_local)).nonzero().flatten()
            fields = {"e": flat[sel] - r * e_local, "src": tok[sel]}
            if quantize:
                fields.update(x=q[tok[sel]], scale=s[tok[sel]])
            else:
                fields["x"] = x[tok[sel]]
            per_dest.append(fields)
        got = exchange(self.group, per_dest)
        rows = []  # (field dict, src rank) per received entry, grouped by local expert
        for e in range(e_local):
            for j in range(world):
                r = (j + e + 1) % world  # arrival order, deliberately not rank order
                m = got[r]["e"] == e
                rows.append((r, {name: v[m] for name, v in got[r].items()}))
        counts = torch.zeros(e_local, dtype=torch.int64)
        for _, f in rows:
            if f["e"].numel():
                counts[int(f["e"][0])] += f["e"].numel()
        src_rank = torch.cat([torch.full((f["e"].numel(),), r, dtype=torch.int64) for r, f in rows])
        packed = {name: torch.cat([f[name] for _, f in rows]) for name in rows[0][1]}
        packed["src_rank"] = src_rank
        return packed, counts

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats=None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False):
        self.calls.append("low_latency_dispatch")
        if use_ue8m0 or round_scale:
            raise NotImplementedError("MXFP8 (use_ue8m0) is A5 only and not emulated")
        self._check_ll(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts)
        world = self.group_size
        e_local = num_experts // world
        packed, counts = self._ll_send(x, topk_idx, num_experts, quantize=use_fp8)
        cap = world * num_max_dispatch_tokens_per_rank * min(topk_idx.shape[1], e_local)
        n = packed["e"].numel()
        h = x.shape[1]
        if use_fp8:
            data = torch.randint(-127, 128, (cap, h), dtype=torch.int8)
            scale = torch.full((cap,), float("nan"))
            data[:n], scale[:n] = packed["x"], packed["scale"]
            recv_x: Any = (data, scale)
        else:
            recv_x = torch.full((cap, h), float("nan"), dtype=torch.bfloat16)
            recv_x[:n] = packed["x"]
        src_info = torch.full((cap, 3), -1, dtype=torch.int64)
        src_info[:n, 0], src_info[:n, 1], src_info[:n, 2] = packed["src_rank"], packed["src"], packed["e"]
        ep_recv_count = torch.bincount(packed["e"] * world + packed["src_rank"], minlength=e_local * world)
        handle = (src_info, ep_recv_count, num_max_dispatch_tokens_per_rank, h, num_experts, counts)
        return recv_x, counts.clone(), handle, EventOverlap(), None

    def _return_rows(self, y: torch.Tensor, src_info: torch.Tensor, topk_idx: torch.Tensor,
                     topk_weights: torch.Tensor, num_experts: int) -> torch.Tensor:
        """Send each valid packed row back to its source; there ``out[t] += w[t, k] * row``."""
        world, me = self.group_size, self.rank
        e_local = num_experts // world
        valid = src_info[:, 0] >= 0
        per_dest = []
        for r in range(world):
            sel = (valid & (src_info[:, 0] == r)).nonzero().flatten()
            per_dest.append({"y": y[sel].float(), "src": src_info[sel, 1],
                             "e": src_info[sel, 2] + me * e_local})
        got = exchange(self.group, per_dest)
        t = topk_idx.shape[0]
        out = torch.zeros(t, y.shape[1], dtype=torch.float32)
        for g in got:
            if not g["src"].numel():
                continue
            match = topk_idx[g["src"]] == g["e"].unsqueeze(1)  # [n, K]: the slot of that expert
            if not bool(match.any(dim=1).all()):
                raise RuntimeError("a returned row matches no top-k slot of its token")
            w = (topk_weights[g["src"]].float() * match).sum(dim=1)
            out.index_add_(0, g["src"], g["y"] * w.unsqueeze(1))
        return out

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                            handle: tuple, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None):
        self.calls.append("low_latency_combine")
        src_info = handle[0]
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[0] != src_info.shape[0]:
            raise ValueError(f"low_latency_combine takes the packed bf16 slab [{src_info.shape[0]}, H], "
                             f"got {x.dtype} {tuple(x.shape)}")
        if topk_idx.dtype != torch.int64:
            raise TypeError("topk_idx must be int64")
        combined = self._return_rows(x, src_info, topk_idx, topk_weights, handle[4]).to(torch.bfloat16)
        if out is not None:
            out.copy_(combined)
            combined = out
        return combined, EventOverlap(), None

    # ------------------------------------------------------------ fused

    def fused_deep_moe(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor,
                       gmm1_permuted_weight: torch.Tensor, gmm1_permuted_weight_scale: torch.Tensor,
                       gmm2_weight: torch.Tensor, gmm2_weight_scale: torch.Tensor,
                       num_max_dispatch_tokens_per_rank: int, num_experts: int, quant_mode: int = 1,
                       fuse_mode: int = FuseMode.FUSED_DEEP_MOE, profile_enable: bool = False):
        """dispatch (INT8 per token) -> GMM1 (64-tile interleaved w13) -> swiglu -> INT8 -> GMM2 -> bf16 ->
        weighted combine. Returns ``(out [bs, H] bf16, ep_recv_count int32 [E_local])``."""
        self.calls.append("fused_deep_moe")
        if int(fuse_mode) != FuseMode.FUSED_DEEP_MOE:
            raise NotImplementedError("only FuseMode.FUSED_DEEP_MOE is emulated")
        if quant_mode != 1:
            raise ValueError("the registered op is W8A8 INT8 only (quant_mode=1)")
        bs, h = x.shape
        e_local, h1, n1 = gmm1_permuted_weight.shape
        inter = n1 // 2
        k = topk_idx.shape[1]
        if not 1 <= bs <= 256 or not 512 <= h <= 7168 or not 1024 <= inter <= 6144 or k > 12 or num_experts > 512:
            raise ValueError(f"fused_deep_moe limits: bs [1,256], H [512,7168], I [1024,6144], topk <= 12, "
                             f"experts <= 512; got bs={bs} H={h} I={inter} topk={k} E={num_experts}")
        if gmm1_permuted_weight.dtype != torch.int8 or gmm2_weight.dtype != torch.int8:
            raise TypeError("weights must be int8 (FRACTAL_NZ)")
        if h1 != h or gmm2_weight.shape != (e_local, h, inter) or e_local * self.group_size != num_experts:
            raise ValueError(f"expected w13 [E_l, {h}, 2I] and w2 [E_l, {h}, I] (not transposed), got "
                             f"{tuple(gmm1_permuted_weight.shape)} and {tuple(gmm2_weight.shape)}")
        s13, s2 = gmm1_permuted_weight_scale.float(), gmm2_weight_scale.float()  # as the real wrapper does
        if s13.shape != (e_local, n1) or s2.shape != (e_local, h):
            raise ValueError("scales must be fp32 [E_l, 2I] and [E_l, H]")
        self._check_ll(x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts)
        # undo the 64-column gate/up interleave
        w13 = gmm1_permuted_weight.view(e_local, h, inter // 64, 2, 64).transpose(2, 3).reshape(e_local, h, n1)
        s13 = s13.view(e_local, inter // 64, 2, 64).transpose(1, 2).reshape(e_local, n1)
        packed, counts = self._ll_send(x, topk_idx, num_experts, quantize=True)
        y = torch.empty(packed["e"].numel(), h, dtype=torch.bfloat16)
        for e in range(e_local):
            m = packed["e"] == e
            if not bool(m.any()):
                continue
            a = packed["x"][m].float() @ w13[e].float() * s13[e] * packed["scale"][m, None]
            gate, up = a.chunk(2, dim=-1)
            hq, hs = q_per_row(torch.nn.functional.silu(gate) * up, 127)
            y[m] = (hq.float() @ gmm2_weight[e].float().t() * s2[e] * hs[:, None]).to(torch.bfloat16)
        src_info = torch.stack([packed["src_rank"], packed["src"], packed["e"]], dim=1)
        out = self._return_rows(y, src_info, topk_idx, topk_weights, num_experts).to(torch.bfloat16)
        return out, counts.to(torch.int32)
