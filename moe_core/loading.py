"""Loading as engines load: one expert (or one shard of one expert) at a time.

``MoELayer.weight_loader(name, tensor, expert_id=..., shard=...)`` copies one checkpoint tensor
into the layer and keeps only this EP rank's experts, in the spirit of vLLM's
``expert_params_mapping``; ``expert_params_mapping`` below lists, for a per-expert checkpoint
(``...experts.{e}.gate_proj.weight`` and the like, FP8 ``weight_scale_inv`` included), which
layer tensor, expert and shard each name goes to.

Names (the layer's own; the vLLM spellings on the right are accepted too):

========================= ================================== ======================================
name                      per expert (``expert_id=e``)        shards
========================= ================================== ======================================
``w13``                   ``[2I, H]``, or ``[I, H]`` a shard   ``"gate"`` (rows ``:I``), ``"up"`` (``I:``)
``w2``                    ``[H, I]``                          -
``w13_scale``             the scheme's per-expert scale       ``"gate"`` / ``"up"``: its half of the rows
``w2_scale``              idem                                -
``w13_bias`` / ``w2_bias`` ``[2I]`` / ``[H]``                  ``"gate"`` / ``"up"`` for ``w13_bias``
``correction_bias``       ``[E]`` or ``[1, E]`` (no expert)   -
``shared_experts.w13``    ``[2Is, H]`` (no expert)            ``"gate"`` / ``"up"``
``shared_experts.w2``     ``[H, Is]``                         -
``shared_experts.gate``   ``[1, H]`` or ``[H]``               -
========================= ================================== ======================================

Without ``expert_id`` an expert tensor is the full stacked ``[num_experts, ...]`` one (sliced to
this rank). FP8 block scales (``w13_scale [ceil(2I/128), ceil(H/128)]`` per expert) split by
shard only when ``I`` is a multiple of 128, as in every FP8 block checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch
from torch import nn

from moe_core.contracts import FP8_GROUP, QuantScheme

if TYPE_CHECKING:
    from moe_core.layer import MoELayer

__all__ = ["load_tensor", "expert_params_mapping", "ALIASES"]

# vLLM's FusedMoE parameter names -> the layer's
ALIASES = {
    "w13_weight": "w13", "w2_weight": "w2",
    "w13_weight_scale_inv": "w13_scale", "w2_weight_scale_inv": "w2_scale",
    "w13_weight_scale": "w13_scale", "w2_weight_scale": "w2_scale",
    "w13_weight_bias": "w13_bias", "w2_weight_bias": "w2_bias",
    "e_score_correction_bias": "correction_bias",
}
SHARDS = ("gate", "up")


def expert_params_mapping(
    num_experts: int,
    *,
    gate: str = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    fp8_scales: bool = False,
) -> list[tuple[str, str, int, Optional[str]]]:
    """``(layer_name, checkpoint_infix, expert_id, shard)`` for per-expert checkpoints.

    ``checkpoint_infix`` is ``"experts.{e}.{proj}.weight"`` (and ``...weight_scale_inv`` when
    ``fp8_scales``): an engine matches it against a checkpoint key, strips the layer prefix and
    calls ``layer.weight_loader(layer_name, tensor, expert_id=e, shard=shard)``. Mixtral's
    ``w1`` / ``w3`` / ``w2``: ``gate="w1", up="w3", down="w2"``.
    """
    mapping: list[tuple[str, str, int, Optional[str]]] = []
    suffixes = [("weight", "")] + ([("weight_scale_inv", "_scale")] if fp8_scales else [])
    for e in range(num_experts):
        for suffix, tail in suffixes:
            mapping.append((f"w13{tail}", f"experts.{e}.{gate}.{suffix}", e, "gate"))
            mapping.append((f"w13{tail}", f"experts.{e}.{up}.{suffix}", e, "up"))
            mapping.append((f"w2{tail}", f"experts.{e}.{down}.{suffix}", e, None))
    return mapping


def _shard_rows(name: str, rows: int, shard: Optional[str], layer: "MoELayer") -> slice:
    """The rows of a ``w13``-like tensor (``rows`` of them) that ``shard`` covers."""
    if shard is None:
        return slice(0, rows)
    if shard not in SHARDS:
        raise ValueError(f"weight_loader: shard must be None, 'gate' or 'up', got {shard!r}")
    if name == "w13_scale" and layer.config.quant is QuantScheme.FP8_BLOCK \
            and layer.config.intermediate_size % FP8_GROUP:
        raise ValueError(f"weight_loader: FP8 block scales of w13 split by shard only when the intermediate size "
                         f"is a multiple of {FP8_GROUP}, got {layer.config.intermediate_size}; load w13_scale whole")
    if rows % 2:
        raise ValueError(f"weight_loader: {name} has {rows} rows, which do not split into gate and up halves")
    half = rows // 2
    return slice(0, half) if shard == "gate" else slice(half, rows)


@torch.no_grad()
def load_tensor(layer: "MoELayer", name: str, tensor: torch.Tensor, *, expert_id: Optional[int] = None,
                shard: Optional[str] = None) -> bool:
    """See the module docstring. Returns whether the tensor (or the slice of it) was kept here."""
    name = ALIASES.get(name, name)
    cfg = layer.config
    if name.startswith("shared_experts."):
        shared = layer.shared_experts
        if shared is None:
            raise ValueError(f"weight_loader: {name} given but the layer has no shared experts "
                             "(MoEConfig.shared_intermediate_size=0)")
        target = getattr(shared, name.split(".", 1)[1], None)
        if target is None:
            raise ValueError(f"weight_loader: unknown shared-experts tensor {name!r}")
        rows = _shard_rows(name, target.shape[0], shard if name.endswith("w13") else _no_shard(name, shard), layer)
        _copy(name, target[rows], tensor.reshape(target[rows].shape) if name.endswith("gate") else tensor)
        return True
    if name == "correction_bias":
        _no_shard(name, shard)
        if layer.correction_bias is None:
            raise ValueError("weight_loader: correction_bias given but the router uses none "
                             "(RouterConfig.use_correction_bias=False)")
        _copy(name, layer.correction_bias, tensor.reshape(-1))
        return True
    specs = layer._weight_specs
    if name not in specs:
        raise ValueError(f"weight_loader: unknown tensor {name!r} for quant={cfg.quant}; expected one of "
                         f"{sorted(specs) + ['correction_bias'] + sorted(ALIASES)}")
    shape, dtype = specs[name]
    target = getattr(layer, name)
    if tuple(target.shape) != tuple(shape) or target.dtype != dtype:
        # process_weights changed this slot to the backend's layout: start a checkpoint-layout slot again
        target = nn.Parameter(torch.empty(shape, dtype=dtype, device=layer.device), requires_grad=False)
        setattr(layer, name, target)
    local = cfg.local_expert_range
    if expert_id is None:
        if tensor.shape[0] != cfg.num_experts:
            raise ValueError(f"weight_loader: {name} without expert_id must be the full [num_experts="
                             f"{cfg.num_experts}, ...] tensor, got {tuple(tensor.shape)}")
        part, dest = tensor[local.start:local.stop], target
    else:
        if not 0 <= expert_id < cfg.num_experts:
            raise ValueError(f"weight_loader: expert_id={expert_id} not in [0, {cfg.num_experts})")
        if expert_id not in local:
            return False  # another EP rank's expert
        part, dest = tensor, target[expert_id - local.start]
    if shard is not None:
        if not name.startswith("w13"):
            _no_shard(name, shard)
        rows_dim = 0 if expert_id is not None else 1
        rows = _shard_rows(name, dest.shape[rows_dim], shard, layer)
        dest = dest[rows] if rows_dim == 0 else dest[:, rows]
    if part.dtype != dtype and (part.dtype.is_floating_point != dtype.is_floating_point or dtype.itemsize == 1):
        raise TypeError(f"weight_loader: {name} must be {dtype}, got {part.dtype}")
    _copy(name, dest, part)
    layer._loaded = True
    layer._processed = False
    return True


def _no_shard(name: str, shard: Optional[str]) -> None:
    if shard is not None:
        raise ValueError(f"weight_loader: {name} has no shards, got shard={shard!r}")
    return None


def _copy(name: str, dest: torch.Tensor, src: torch.Tensor) -> None:
    if tuple(dest.shape) != tuple(src.shape):
        raise ValueError(f"weight_loader: {name} must have shape {tuple(dest.shape)} here, got {tuple(src.shape)}")
    dest.copy_(src)
