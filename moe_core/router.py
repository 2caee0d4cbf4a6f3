"""Reference router: softmax or sigmoid scores, (grouped) top-k with correction bias, renormalize."""

from __future__ import annotations

from typing import Optional

import torch

from moe_core.config import RouterConfig
from moe_core.contracts import TopK

__all__ = ["route", "balanced_correction_bias"]


def route(
    router_logits: torch.Tensor,
    top_k: int,
    config: RouterConfig = RouterConfig(),
    correction_bias: Optional[torch.Tensor] = None,
) -> TopK:
    """``router_logits [T, E]`` -> ``TopK``.

    DeepSeek-V3 style when ``config.num_expert_group`` is set: the bias-corrected scores pick
    the ``topk_group`` best groups (a group scores the sum of its two best experts or its best
    one, per ``config.group_scoring``), then the top-k experts inside them; the weights are the
    uncorrected scores. ``router_logits`` may have any leading shape ``[..., E]``.
    """
    if router_logits.dim() < 1:
        raise ValueError(f"router_logits must be [..., E], got shape {tuple(router_logits.shape)}")
    router_logits = router_logits.reshape(-1, router_logits.shape[-1])
    t, e = router_logits.shape
    logits = router_logits.float()
    scores = torch.softmax(logits, dim=-1) if config.scoring == "softmax" else torch.sigmoid(logits)
    choice = scores
    if config.use_correction_bias:
        if correction_bias is None or correction_bias.shape != (e,):
            raise ValueError(f"correction_bias must be a [{e}] tensor when RouterConfig.use_correction_bias is set")
        choice = scores + correction_bias.float()
    if config.num_expert_group is not None:
        g = config.num_expert_group
        if e % g:
            raise ValueError(f"num_experts={e} is not divisible by num_expert_group={g}")
        grouped = choice.view(t, g, e // g)
        top2 = config.group_scoring == "top2_sum" or (config.group_scoring == "auto" and config.use_correction_bias)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1) if top2 and e // g >= 2 else grouped.amax(dim=-1)
        keep = group_scores.topk(config.topk_group, dim=-1).indices
        group_mask = torch.zeros(t, g, dtype=torch.bool, device=logits.device).scatter_(1, keep, True)
        choice = choice.masked_fill(~group_mask.repeat_interleave(e // g, dim=1), float("-inf"))
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp(min=1e-20)
    return TopK(weights.float().contiguous(), ids.contiguous())  # int64: TopK keeps it for ids_int64


def balanced_correction_bias(num_experts: int, generator: torch.Generator, device) -> torch.Tensor:
    """A routing correction bias (DeepSeek-V3's ``e_score_correction_bias``) for benchmarks and tuners.

    A trained model's bias is what keeps its experts' load balanced; for random logits the
    balanced bias is flat, so this is noise of 1e-3 that only breaks ties. N(0, 1) outweighs
    the sigmoid scores and sends every token to the same 8 of DeepSeek-V3's 256 experts.
    """
    return 1e-3 * torch.randn(num_experts, generator=generator, device=device)
