"""Dispatcher ``deepep_npu``: DeepEP for Ascend (``deep_ep`` of sgl-kernel-npu).

- ``EP_NORMAL`` (normal kernels): ``get_dispatch_layout`` + ``dispatch`` -> tokens once per rank with
  local ids; ``combine`` sums the (already weighted) rows back, unweighted.
- ``EP_MASKED`` (low-latency kernels): ``low_latency_dispatch`` -> a 2-D slab packed by expert with
  int64 counts; it is re-laid into the core's ``[E_local, C, H]`` slab (C = ranks x
  max_tokens_per_rank) by a fixed-shape gather; ``combine`` gathers back and calls
  ``low_latency_combine``, which applies the top-k weights.

The wire dtype is the plan's, fixed at construction for both modes (SGLang PR #23815 fixed one
mode reading a different flag than the other; here there is one attribute): INT8 means
``use_fp8=True`` for the low-latency kernel (the Ascend build's "FP8" is INT8 per token) and
``DEEP_NORMAL_MODE_USE_INT8_QUANT=1`` set around the normal ``dispatch`` call only; BF16 means
``use_fp8=False`` and the variable explicitly ``0`` for that call (a value left in the process
environment by other code cannot change this layer's dtype).

Each dispatcher owns its buffer, sized from its own layer config (not by the first layer that asks).
"""

from __future__ import annotations

from typing import Any

import torch

from moe_core.plugin_api import (
    BackendContext,
    Dispatcher,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Format,
    QuantizedActivations,
    TopK,
    WireDtype,
)
from moe_plugin_npu.layout import packed_to_slab_index, scoped_env, slab_to_packed_index

INT8_ENV = "DEEP_NORMAL_MODE_USE_INT8_QUANT"


def ep_group(ctx: BackendContext) -> Any:
    cfg = ctx.config
    group = cfg.ep_group
    if group is None:
        raise ValueError(f"{ctx.spec.name} needs MoEConfig.ep_group (a torch.distributed process group of "
                         f"size ep_size={cfg.ep_size})")
    if group.size() != cfg.ep_size or group.rank() != cfg.ep_rank:
        raise ValueError(f"{ctx.spec.name}: ep_group has size {group.size()} / rank {group.rank()}, the config "
                         f"says ep_size={cfg.ep_size} / ep_rank={cfg.ep_rank}")
    return group


class DeepEPNpuDispatcher(Dispatcher):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        import torch_npu  # noqa: F401  (DeepEP-Ascend needs it loaded)
        from deep_ep import Buffer

        cfg = ctx.config
        group = ep_group(ctx)
        if cfg.params_dtype is not torch.bfloat16:
            raise ValueError("deepep_npu carries bf16 activations (params_dtype must be torch.bfloat16)")
        self.num_experts = cfg.num_experts
        self.num_local = cfg.num_local_experts
        self.hidden = cfg.hidden_size
        self.out_dtype = cfg.params_dtype
        if ctx.dispatch_dtype not in (WireDtype.BF16, WireDtype.INT8):
            raise ValueError(f"deepep_npu carries bf16 or int8, the plan says {ctx.dispatch_dtype}")
        self.int8 = ctx.dispatch_dtype is WireDtype.INT8
        if ctx.format is Format.EP_MASKED:
            if cfg.max_tokens_per_rank is None:
                raise ValueError("deepep_npu low-latency mode needs MoEConfig.max_tokens_per_rank")
            self.num_max = cfg.max_tokens_per_rank
            self.capacity = cfg.ep_size * self.num_max  # rows per expert in the core's masked slab
            rdma = Buffer.get_low_latency_rdma_size_hint(self.num_max, self.hidden, cfg.ep_size, cfg.num_experts)
            self.buffer = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=self.num_local)
            self._dispatch, self._combine = self._dispatch_ll, self._combine_ll
        else:
            # The Ascend build sizes its normal-mode HCCL buffers from HCCL_BUFFSIZE (NORMAL_API.md);
            # num_nvl_bytes is kept for DeepEP compatibility and can be set per layer.
            nvl = int(ctx.options.get("num_nvl_bytes", 0))
            self.buffer = Buffer(group, nvl, 0, low_latency_mode=False)
            self._dispatch, self._combine = self._dispatch_normal, self._combine_normal
        self._env_value = "1" if self.int8 else "0"

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK):
        return self._dispatch(hidden_states, topk)

    def combine(self, combine_input) -> torch.Tensor:
        return self._combine(combine_input)

    # ------------------------------------------------------------------ normal

    def _dispatch_normal(self, hidden_states: torch.Tensor, topk: TopK) -> EPNormalDispatch:
        idx = topk.ids.to(torch.int64)
        per_rank, per_rdma_rank, per_expert, in_rank, _ = self.buffer.get_dispatch_layout(idx, self.num_experts)
        with scoped_env(INT8_ENV, self._env_value):
            recv_x, recv_idx, recv_w, counts, handle, _ = self.buffer.dispatch(
                hidden_states, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
                topk_weights=topk.weights)
        if self.int8:
            data, scale = recv_x
            hidden = QuantizedActivations(data, WireDtype.INT8, scale.float().reshape(-1, 1))
        else:
            hidden = QuantizedActivations(recv_x)
        counts = list(counts)
        return EPNormalDispatch(
            hidden=hidden,
            topk=TopK(recv_w.float(), recv_idx.to(torch.int32)),
            expert_counts=torch.tensor(counts, dtype=torch.int32, device=recv_idx.device),
            expert_counts_host=tuple(counts),
            handle=handle,
        )

    def _combine_normal(self, c: EPNormalCombine) -> torch.Tensor:
        out, _, _ = self.buffer.combine(c.hidden.to(torch.bfloat16), c.handle)
        return out.to(self.out_dtype)

    # ------------------------------------------------------------------ low latency

    def _dispatch_ll(self, hidden_states: torch.Tensor, topk: TopK) -> EPMaskedDispatch:
        t = hidden_states.shape[0]
        if t > self.num_max:
            raise ValueError(f"deepep_npu low-latency dispatch: {t} tokens exceed max_tokens_per_rank="
                             f"{self.num_max} (the buffer capacity); no silent truncation")
        recv, counts, handle, _, _ = self.buffer.low_latency_dispatch(
            hidden_states, topk.ids.to(torch.int64), self.num_max, self.num_experts, use_fp8=self.int8)
        to_slab = packed_to_slab_index(counts, self.capacity)
        shape = (self.num_local, self.capacity, self.hidden)
        if self.int8:
            data, scale = recv
            hidden = QuantizedActivations(data[to_slab].reshape(shape), WireDtype.INT8,
                                          scale.float()[to_slab].reshape(shape[:2] + (1,)))
        else:
            data = recv
            hidden = QuantizedActivations(data[to_slab].reshape(shape))
        return EPMaskedDispatch(hidden=hidden, masked_m=counts.to(torch.int32), topk=topk,
                                handle=(handle, counts, data.shape[0]))

    def _combine_ll(self, c: EPMaskedCombine) -> torch.Tensor:
        handle, counts, rows = c.handle
        y = c.hidden.reshape(-1, self.hidden)
        packed = y[slab_to_packed_index(counts, self.capacity, rows)].to(torch.bfloat16)
        out, _, _ = self.buffer.low_latency_combine(packed, c.topk.ids.to(torch.int64), c.topk.weights, handle)
        return out.to(self.out_dtype)
