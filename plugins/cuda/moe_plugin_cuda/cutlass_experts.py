"""Experts backend ``cutlass``: FP8 block-scaled MoE on CUTLASS grouped GEMMs (see ``cutlass_ops``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

from moe_core.contracts import (
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    QuantizedActivations,
    StandardCombine,
    StandardDispatch,
    WireDtype,
)
from moe_core.runtime import Experts
from moe_plugin_cuda.weights import expert_weights

if TYPE_CHECKING:
    from moe_core.layer import MoELayer


# Under torch.compile each call is one opaque custom op (dynamo cannot trace the ctypes call).
@torch.library.custom_op("moe_cuda::cutlass_fused_experts", mutates_args=())
def _fused_op(hidden: torch.Tensor, scale: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
              w13_scale: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              routed_scaling_factor: float, out_dtype: torch.dtype) -> torch.Tensor:
    from moe_plugin_cuda import cutlass_ops

    return cutlass_ops.fused_experts(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                     routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype)


@_fused_op.register_fake
def _(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, routed_scaling_factor, out_dtype):
    return hidden.new_empty((hidden.shape[0], w2.shape[1]), dtype=out_dtype)


@torch.library.custom_op("moe_cuda::cutlass_masked_experts", mutates_args=())
def _masked_op(hidden: torch.Tensor, scale: Optional[torch.Tensor], masked_m: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, routed_scaling_factor: float,
               out_dtype: torch.dtype) -> torch.Tensor:
    from moe_plugin_cuda import cutlass_ops

    return cutlass_ops.masked_experts(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale,
                                      routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype)


@_masked_op.register_fake
def _(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, routed_scaling_factor, out_dtype):
    return hidden.new_empty((hidden.shape[0], hidden.shape[1], w2.shape[1]), dtype=out_dtype)


class CutlassExperts(Experts):
    """FP8 block 128x128 W8A8 SiLU experts for STANDARD, EP_NORMAL (ids -1 skipped) and EP_MASKED.

    Weights stay in the checkpoint layout (w13 = [gate | up] rows, 128x128 block scales), which is
    what the CUTLASS blockwise-scaled GEMM reads; the library is compiled at first use.
    """

    def process_weights(self, layer: "MoELayer") -> None:
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                setattr(layer, name, type(t)(t.contiguous()) if isinstance(t, torch.nn.Parameter) else t.contiguous())
        from moe_plugin_cuda import cutlass_lib

        cutlass_lib.library()  # build or load now, not inside the first forward (or a graph capture)

    def _activations(self, qa: QuantizedActivations):
        """(data, scale): FP8 codes + group scales as they came, else the compute dtype (the pipeline quantizes)."""
        if qa.dtype is WireDtype.FP8:
            return qa.data, qa.scale
        if qa.dtype is WireDtype.BF16:
            return qa.data, None
        return qa.dequantize(self.config.params_dtype), None

    def apply(self, layer: "MoELayer", dispatched):
        w = expert_weights(layer, True)
        c = self.config
        if isinstance(dispatched, (StandardDispatch, EPNormalDispatch)):
            data, scale = self._activations(dispatched.hidden)
            out = _fused_op(data, scale, w.w13, w.w2, w.w13_scale, w.w2_scale, dispatched.topk.weights,
                            dispatched.topk.ids, float(c.routed_scaling_factor), c.params_dtype)
            if isinstance(dispatched, StandardDispatch):
                return StandardCombine(hidden=out)
            return EPNormalCombine(hidden=out, handle=dispatched.handle)
        if isinstance(dispatched, EPMaskedDispatch):
            data, scale = self._activations(dispatched.hidden)
            out = _masked_op(data, scale, dispatched.masked_m, w.w13, w.w2, w.w13_scale, w.w2_scale,
                             float(c.routed_scaling_factor), c.params_dtype)
            return EPMaskedCombine(hidden=out, topk=dispatched.topk, handle=dispatched.handle)
        raise TypeError(f"cutlass experts do not accept {type(dispatched).__name__}")
