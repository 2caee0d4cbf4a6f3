"""Experts backend ``cutlass``: FP8 block-scaled MoE on CUTLASS grouped GEMMs (see ``cutlass_ops``)."""

from __future__ import annotations

import functools
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


# Untuned default (no cutlass table for the shape): the CUTLASS GEMMs from 128 rows per expert. H100,
# session 7: at 512+ they beat the Triton kernels on every preset, at 128-256 on most; below, the sort
# and gather do not pay. ``moe-cuda-tune --backend cutlass`` measures the crossover per shape instead.
MIN_ROWS = 128


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def choose_path(T: int, E: int, K: int, inter: int, H: int, device_name: str, config_dir: str,
                min_rows: int) -> tuple[bool, dict, tuple[int, int]]:
    """(run the CUTLASS GEMMs?, the Triton launch otherwise, GEMM1's and GEMM2's CUTLASS kernels) for T tokens.

    The cutlass table (``tuning_configs.CUTLASS_TABLE``) holds, per T, which path measured faster, the
    two-accumulator Triton configs for the checkpoint layout and the fastest CUTLASS kernels
    (``cutlass_variants``, indices into ``cutlass_lib.VARIANTS``); without one: triton's table on two
    accumulators, CUTLASS from ``MIN_ROWS`` rows per expert, its default kernels. ``min_rows`` >= 0
    overrides the path.
    """
    from moe_plugin_cuda import cutlass_lib, tuning_configs

    entry, _ = tuning_configs.lookup(T, E, inter, H, "fp8_block", device_name, config_dir or None,
                                     tuning_configs.CUTLASS_TABLE)
    if entry is None:
        cfg, _ = tuning_configs.get_config(T, E, K, inter, H, "fp8_block", device_name, config_dir or None)
        entry = {**tuning_configs.as_two_acc(cfg, keep_tma=True),
                 "path": "cutlass" if T * K >= MIN_ROWS * E else "triton"}
    use_cutlass = entry.get("path") == "cutlass" if min_rows < 0 else T * K >= min_rows * E
    variants = tuple(entry.get("cutlass_variants", cutlass_lib.DEFAULT_VARIANTS))
    return use_cutlass, {"gemm1": entry["gemm1"], "gemm2": entry["gemm2"]}, variants


def run_fused(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, routed_scaling_factor: float,
              out_dtype: torch.dtype, min_rows: int, config_dir: str) -> torch.Tensor:
    """Token list: the CUTLASS grouped GEMMs or the Triton kernels, as ``choose_path`` says for T."""
    from moe_plugin_cuda import cutlass_ops, triton_ops

    T, K, E = hidden.shape[0], topk_ids.shape[1], w13.shape[0]
    use_cutlass, cfg, variants = choose_path(max(T, 1), E, K, w2.shape[2], w2.shape[1],
                                             _device_name(hidden.device.index or 0), config_dir, min_rows)
    if use_cutlass:
        return cutlass_ops.fused_experts(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                         routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype,
                                         variants=variants)
    return triton_ops.fused_experts(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                    activation="silu", routed_scaling_factor=routed_scaling_factor,
                                    out_dtype=out_dtype, cfg=cfg, w13_interleaved=False)


def run_masked(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, routed_scaling_factor: float,
               out_dtype: torch.dtype, min_rows: int, config_dir: str, top_k: int) -> torch.Tensor:
    """EP_MASKED slab: CUTLASS when its capacity per expert reaches ``min_rows`` (default ``MIN_ROWS``),
    else Triton (tuned on token lists, so the table's path choice does not apply to slabs)."""
    from moe_plugin_cuda import cutlass_ops, triton_ops

    E, C, _ = hidden.shape
    # mean rows per expert is unknown without a sync: configs for a full slab, as the triton backend does
    _, cfg, variants = choose_path(max(1, E * C // top_k), E, top_k, w2.shape[2], w2.shape[1],
                                   _device_name(hidden.device.index or 0), config_dir, min_rows)
    if C >= (MIN_ROWS if min_rows < 0 else min_rows):
        return cutlass_ops.masked_experts(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale,
                                          routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype,
                                          variants=variants)
    return triton_ops.masked_experts(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, activation="silu",
                                     routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype, cfg=cfg,
                                     w13_interleaved=False)


# Under torch.compile each call is one opaque custom op (dynamo cannot trace the ctypes call).
@torch.library.custom_op("moe_cuda::cutlass_fused_experts", mutates_args=())
def _fused_op(hidden: torch.Tensor, scale: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
              w13_scale: torch.Tensor, w2_scale: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
              routed_scaling_factor: float, out_dtype: torch.dtype, min_rows: int, config_dir: str) -> torch.Tensor:
    return run_fused(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, routed_scaling_factor,
                     out_dtype, min_rows, config_dir)


@_fused_op.register_fake
def _(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, routed_scaling_factor, out_dtype,
      min_rows, config_dir):
    return hidden.new_empty((hidden.shape[0], w2.shape[1]), dtype=out_dtype)


@torch.library.custom_op("moe_cuda::cutlass_masked_experts", mutates_args=())
def _masked_op(hidden: torch.Tensor, scale: Optional[torch.Tensor], masked_m: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, routed_scaling_factor: float,
               out_dtype: torch.dtype, min_rows: int, config_dir: str, top_k: int) -> torch.Tensor:
    return run_masked(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, routed_scaling_factor, out_dtype,
                      min_rows, config_dir, top_k)


@_masked_op.register_fake
def _(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, routed_scaling_factor, out_dtype, min_rows, config_dir,
      top_k):
    return hidden.new_empty((hidden.shape[0], hidden.shape[1], w2.shape[1]), dtype=out_dtype)


class CutlassExperts(Experts):
    """FP8 block 128x128 W8A8 SiLU experts for STANDARD, EP_NORMAL (ids -1 skipped) and EP_MASKED.

    Weights stay in the checkpoint layout (w13 = [gate | up] rows, 128x128 block scales), which is
    what the CUTLASS blockwise-scaled GEMM reads; the library is compiled at first use. Where the
    sort and gather do not pay (small T) the Triton kernels run instead, on the two-accumulator
    GEMM1 that reads this layout: the tuned table says which path at which T (``choose_path``).

    Options (``backend_options["cutlass"]``): ``config_dir`` (extra directory of tuned tables),
    ``min_rows`` (run CUTLASS from this many rows per expert, whatever the table says).
    """

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        min_rows = ctx.options.get("min_rows")
        self.min_rows = -1 if min_rows is None else int(min_rows)
        self.config_dir = str(ctx.options.get("config_dir") or "")

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
            # eager calls skip the custom op's dispatch (host time), as the triton backend's do
            run = _fused_op if torch.compiler.is_compiling() else run_fused
            out = run(data, scale, w.w13, w.w2, w.w13_scale, w.w2_scale, dispatched.topk.weights,
                      dispatched.topk.ids, float(c.routed_scaling_factor), c.params_dtype, self.min_rows,
                      self.config_dir)
            if isinstance(dispatched, StandardDispatch):
                return StandardCombine(hidden=out)
            return EPNormalCombine(hidden=out, handle=dispatched.handle)
        if isinstance(dispatched, EPMaskedDispatch):
            data, scale = self._activations(dispatched.hidden)
            run = _masked_op if torch.compiler.is_compiling() else run_masked
            out = run(data, scale, dispatched.masked_m, w.w13, w.w2, w.w13_scale, w.w2_scale,
                      float(c.routed_scaling_factor), c.params_dtype, self.min_rows, self.config_dir, c.top_k)
            return EPMaskedCombine(hidden=out, topk=dispatched.topk, handle=dispatched.handle)
        raise TypeError(f"cutlass experts do not accept {type(dispatched).__name__}")
