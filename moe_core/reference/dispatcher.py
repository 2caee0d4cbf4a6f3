"""Dispatcher ``standard``: no communication.

Single rank: ids pass through. Under EP (every rank holds all T tokens: ``MoELayer`` gathers
every rank's own tokens first, decision 43): ids are remapped to local experts (-1 elsewhere) and ``combine`` all-reduces the
partial outputs over the EP group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from moe_core import quant
from moe_core.backends import Code, Reason
from moe_core.contracts import StandardCombine, StandardDispatch, TopK, WireDtype
from moe_core.runtime import BackendContext, Dispatcher


def check(config, spec) -> list[Reason]:
    """Under EP the layer gathers every rank's tokens (a host read of the counts): not capturable."""
    if config.ep_size > 1 and config.cuda_graph:
        return [Reason(Code.NOT_GRAPH_SAFE, "standard under expert parallelism gathers every rank's tokens "
                       "(a host read of the counts)", "use a graph-safe EP dispatcher (torch_a2a masked mode)")]
    return []


class StandardDispatcher(Dispatcher):
    expects_replicated_input = True  # under EP; MoELayer gathers every rank's tokens (decision 43)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        self.first_expert = cfg.local_expert_range.start
        self.num_local = cfg.num_local_experts
        self.ep = cfg.ep_size > 1
        self.wire = ctx.dispatch_dtype
        self.passes_tokens_through = not self.ep and self.wire is WireDtype.BF16

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> StandardDispatch:
        if self.ep:
            ids = topk.ids - self.first_expert
            local = (ids >= 0) & (ids < self.num_local)
            topk = TopK(torch.where(local, topk.weights, 0.0), torch.where(local, ids, -1))
        hidden = quant.quantize_activations(hidden_states, self.wire) if self.wire is not WireDtype.BF16 \
            else quant.QuantizedActivations(hidden_states)
        return StandardDispatch(hidden, topk)

    def combine(self, combine_input: StandardCombine) -> torch.Tensor:
        out = combine_input.hidden
        if self.ep:
            dist.all_reduce(out, group=self.config.ep_group)
        return out
