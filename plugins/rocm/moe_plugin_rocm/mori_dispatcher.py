"""Dispatcher ``mori``: MoRI's ``EpDispatchCombineOp`` (format ``EP_NORMAL``).

MoRI sends each token once per unique destination rank, with its **global** int32 ids and
weights, into a persistent buffer of ``ep_size * max_tokens_per_rank`` rows of which only the
first ``total_recv`` (an int32 ``[1]`` device tensor) are valid. Its combine returns, per own
token, the **unweighted** sum of the rows sent back by each unique destination rank, so the
experts must weight (the ``EP_NORMAL`` contract: experts weight and sum over their local experts).

The dispatch output is the core's ``EPNormalDispatch`` over the whole buffer, with no host sync:

- ``topk``: ids localized to this rank (``-1`` for other ranks' experts **and for every row at or
  past total_recv**), weights zeroed there, so any ``EP_NORMAL`` experts backend is correct on it;
- ``expert_counts``: per-local-expert pair counts of the valid rows, on the device;
- ``handle`` (``MoriHandle``): the raw global ids/weights and ``total_recv``, which the ``aiter``
  experts use directly (``expert_mask`` + ``num_local_tokens``), and this rank's own routing
  for combine.

-1 ids (no expert): MoRI derives destinations from ids, so a -1 slot is replaced by another id of
the same token (no extra traffic), or, for a token with no expert at all, by this rank's first
expert (a local copy). Such a filled slot travels with weight **-0.0**, a marker that contributes
nothing and that the receiver turns back into -1 (local ids) or the fake expert id ``E``
(``MoriHandle.recv_ids``), so filled slots are neither counted nor computed.

Before building layers, each process initializes MoRI's symmetric memory once with
``init_mori_shmem(group)`` (MoRI's documented setup; not hidden in a layer, since it is
process-wide).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moe_core.plugin_api import (
    BackendContext,
    Dispatcher,
    EPNormalCombine,
    EPNormalDispatch,
    QuantizedActivations,
    TopK,
    WireDtype,
    quant,
)
from moe_plugin_rocm.platform import current_arch

__all__ = ["MoriDispatcher", "MoriHandle", "init_mori_shmem"]

DEFAULT_GROUP_NAME = "moe_core_ep"


def init_mori_shmem(group=None, name: str = DEFAULT_GROUP_NAME) -> str:
    """Register ``group`` (default: WORLD) with c10d under ``name`` and initialize MoRI's shmem on
    it (``mori.shmem.shmem_torch_process_group_init``). Call once per process, after
    ``torch.distributed.init_process_group``; call ``mori.shmem.shmem_finalize()`` at teardown."""
    import mori.shmem
    import torch.distributed as dist

    torch._C._distributed_c10d._register_process_group(name, group if group is not None else dist.group.WORLD)
    mori.shmem.shmem_torch_process_group_init(name)
    return name


@dataclass(frozen=True)
class MoriHandle:
    """State of one MoRI dispatch, for the experts and for combine."""

    src_ids: torch.Tensor  # int32 [T, K]: this rank's routing as dispatched (-1 replaced)
    num_tokens: int  # T
    recv_ids: torch.Tensor = field(repr=False)  # int32 [max_recv, K] global ids, E where the sender filled a -1
    # slot (rows >= total_recv: stale)
    recv_weights: torch.Tensor = field(repr=False)  # fp32 [max_recv, K]
    total_recv: torch.Tensor = field(repr=False)  # int32 [1] on the device


class MoriDispatcher(Dispatcher):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        opts = ctx.options
        current_arch()  # raise early off a supported AMD GPU
        from mori.ops import EpDispatchCombineConfig, EpDispatchCombineKernelType, EpDispatchCombineOp

        if cfg.max_tokens_per_rank is None:
            raise ValueError("mori needs config.max_tokens_per_rank (its buffers have a fixed size)")
        self.wire = ctx.dispatch_dtype
        if self.wire not in (WireDtype.BF16, WireDtype.FP8):
            raise ValueError(f"mori carries bf16 or fp8 activations, not {self.wire}")
        self.max_tokens = cfg.max_tokens_per_rank
        self.top_k = cfg.top_k
        self.num_local = cfg.num_local_experts
        self.first_expert = cfg.local_expert_range.start
        self.num_experts = cfg.num_experts
        self.max_recv = cfg.ep_size * cfg.max_tokens_per_rank
        fp8 = self.wire is WireDtype.FP8
        H = cfg.hidden_size
        self.mori_config = EpDispatchCombineConfig(
            data_type=quant.FP8_DTYPE if fp8 else cfg.params_dtype,
            rank=cfg.ep_rank,
            world_size=cfg.ep_size,
            hidden_dim=H,
            scale_dim=-(-H // quant.FP8_GROUP) if fp8 else 0,
            scale_type_size=4,  # fp32 scales
            max_token_type_size=cfg.params_dtype.itemsize,  # combine carries the params dtype
            max_num_inp_token_per_rank=cfg.max_tokens_per_rank,
            num_experts_per_rank=self.num_local,
            num_experts_per_token=cfg.top_k,
            warp_num_per_block=int(opts.get("warp_num_per_block", 8)),
            block_num=int(opts.get("block_num", 80)),
            use_external_inp_buf=True,
            kernel_type=getattr(EpDispatchCombineKernelType, opts.get("kernel_type", "IntraNode")),
            gpu_per_node=int(opts.get("gpu_per_node", min(8, cfg.ep_size))),
            quant_type=opts.get("combine_quant", "none"),  # quantizes the combine payload
        )
        self.op = EpDispatchCombineOp(self.mori_config)

    def _routing(self, topk: TopK) -> tuple[torch.Tensor, torch.Tensor]:
        """Ids MoRI can route (no -1) and weights (0 where the id was -1)."""
        ids, weights = topk.ids, topk.weights
        valid = ids >= 0
        first = valid.to(torch.int8).argmax(dim=1, keepdim=True)  # first valid slot (0 if none)
        fill = ids.gather(1, first)
        fill = torch.where(valid.any(dim=1, keepdim=True), fill, self.first_expert)
        return torch.where(valid, ids, fill).to(torch.int32), torch.where(valid, weights, -0.0)

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> EPNormalDispatch:
        T = hidden_states.shape[0]
        if T > self.max_tokens:
            raise ValueError(f"mori: {T} tokens exceed max_tokens_per_rank={self.max_tokens} of this layer")
        ids, weights = self._routing(topk)
        if self.wire is WireDtype.FP8:
            qa = quant.quantize_activations(hidden_states, WireDtype.FP8)
            data, scales = qa.data, qa.scale
        else:
            data, scales = hidden_states.contiguous(), None
        out, out_w, out_s, out_i, total_recv = self.op.dispatch(data, weights.contiguous(), scales, ids.contiguous())

        # localize on the device: rows past total_recv and other ranks' experts -> -1, weight 0
        row = torch.arange(out_i.shape[0], device=out_i.device)[:, None]
        local = out_i - self.first_expert
        filled = (out_w == 0) & torch.signbit(out_w)  # a -1 slot the sender filled in (weight -0.0)
        mine = (local >= 0) & (local < self.num_local) & (row < total_recv.to(row.dtype)) & ~filled
        local_ids = torch.where(mine, local, -1).to(torch.int32)
        local_w = torch.where(mine, out_w, 0.0)
        counts = torch.zeros(self.num_local + 1, dtype=torch.int64, device=out_i.device)
        counts.scatter_add_(0, torch.where(mine, local, self.num_local).reshape(-1).long(),
                            torch.ones(local.numel(), dtype=torch.int64, device=out_i.device))
        hidden = QuantizedActivations(out, WireDtype.FP8, out_s) if self.wire is WireDtype.FP8 \
            else QuantizedActivations(out)
        recv_ids = torch.where(filled, self.num_experts, out_i).to(torch.int32)
        handle = MoriHandle(ids, T, recv_ids, out_w, total_recv)
        return EPNormalDispatch(hidden, TopK(local_w, local_ids), counts[:-1].to(torch.int32), handle=handle)

    def combine(self, combine_input: EPNormalCombine) -> torch.Tensor:
        h = combine_input.handle
        if not isinstance(h, MoriHandle):
            raise TypeError("mori.combine needs the EPNormalCombine of a mori dispatch (handle missing)")
        # unweighted sum over unique destination ranks: the experts already weighted
        out, _ = self.op.combine(combine_input.hidden, None, h.src_ids, call_reset=True)
        # the op's output is a view of a buffer the next combine overwrites: return our own copy
        return out[: h.num_tokens].clone()
