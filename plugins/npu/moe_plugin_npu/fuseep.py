"""Fused backend ``fuseep``: one DeepEP-Ascend ``fused_deep_moe`` call owns dispatch, the W8A8 INT8
experts and the weighted combine (SGLang PR #25678's ``forward_fuseep``, as a plain backend).

- W8A8 INT8 only (the registered op's weights are int8; its activations are quantized per token
  inside the kernel), declared in the spec so the planner rejects other schemes;
- the fuse mode comes from ``config.backend_options["fuseep"]["fuse_mode"]`` (default 1,
  FUSED_DEEP_MOE), never from an environment variable;
- the buffer is this layer's own, sized from its config (``max_tokens_per_rank``, hidden size,
  experts, EP size), not by whichever layer asked first;
- ``process_weights`` does the layout of sgl-kernel-npu's test: w13 ``[E, 2I, H]`` -> ``[E, H, 2I]``
  with gate/up interleaved in 64-column tiles, its scale likewise, w2 kept ``[E, H, I]``, NZ casts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_core.plugin_api import BackendContext, FusedMoE, TopK
from moe_plugin_npu.checks import fuse_mode
from moe_plugin_npu.dispatcher import ep_group
from moe_plugin_npu.layout import ACL_FORMAT_FRACTAL_NZ, LayoutTracker, interleave_64

if TYPE_CHECKING:
    from moe_core.plugin_api import MoELayer

QUANT_MODE_INT8 = 1


class FuseEP(FusedMoE):
    WEIGHTS = ("w13", "w2", "w13_scale", "w2_scale")

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        import torch_npu
        from deep_ep import Buffer
        from deep_ep.buffer import FuseMode

        self.npu = torch_npu
        cfg = ctx.config
        group = ep_group(ctx)
        if cfg.max_tokens_per_rank is None:
            raise ValueError("fuseep needs MoEConfig.max_tokens_per_rank (its buffer capacity)")
        self.fuse_mode = FuseMode(fuse_mode(cfg, ctx.spec.name))
        self.num_max = cfg.max_tokens_per_rank
        self.num_experts = cfg.num_experts
        self.hidden = cfg.hidden_size
        self.top_k = cfg.top_k
        self.rsf = float(cfg.routed_scaling_factor)
        self.out_dtype = cfg.params_dtype
        rdma = Buffer.get_low_latency_rdma_size_hint(self.num_max, cfg.hidden_size, cfg.ep_size, cfg.num_experts)
        self.buffer = Buffer(group, 0, rdma, low_latency_mode=True, num_qps_per_rank=cfg.num_local_experts)
        self.layout = LayoutTracker()

    def process_weights(self, layer: "MoELayer") -> None:
        if self.layout.is_current(layer, self.WEIGHTS):
            return
        npu = self.npu
        w13 = interleave_64(layer.w13.detach().transpose(1, 2))  # [E, H, 2I], 64-tile gate/up interleave
        self.layout.replace(layer, "w13", npu.npu_format_cast(w13, ACL_FORMAT_FRACTAL_NZ))
        self.layout.replace(layer, "w13_scale", interleave_64(layer.w13_scale.detach().to(torch.float32)))
        self.layout.replace(layer, "w2", npu.npu_format_cast(layer.w2.detach().contiguous(), ACL_FORMAT_FRACTAL_NZ))
        self.layout.replace(layer, "w2_scale", layer.w2_scale.detach().to(torch.float32).contiguous())

    def forward(self, layer: "MoELayer", hidden_states: torch.Tensor, topk: TopK) -> torch.Tensor:
        t = hidden_states.shape[0]
        if t > self.num_max:
            raise ValueError(f"fuseep: {t} tokens exceed max_tokens_per_rank={self.num_max} (the buffer "
                             "capacity); no silent truncation")
        x, ids, weights = hidden_states, topk.ids.to(torch.int64), topk.weights
        if t == 0:
            # the kernel needs bs >= 1 and every rank must join the exchange: one token routed nowhere
            x = hidden_states.new_zeros(1, self.hidden)
            ids = torch.full((1, self.top_k), -1, dtype=torch.int64, device=x.device)
            weights = torch.zeros(1, self.top_k, dtype=torch.float32, device=x.device)
        out, _ = self.buffer.fused_deep_moe(
            x, ids, weights, layer.w13, layer.w13_scale, layer.w2, layer.w2_scale,
            self.num_max, self.num_experts, quant_mode=QUANT_MODE_INT8, fuse_mode=self.fuse_mode)
        if self.rsf != 1.0:
            out = out * self.rsf
        return out[:t].to(self.out_dtype)
