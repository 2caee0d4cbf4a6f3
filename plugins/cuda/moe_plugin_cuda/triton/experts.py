"""Experts backend ``triton``: the fused-MoE Triton pipeline (see ``triton.kernels``)."""

from __future__ import annotations

import itertools
import weakref
from typing import TYPE_CHECKING, Optional

import torch

from moe_core.plugin_api import (
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Experts,
    QuantizedActivations,
    QuantScheme,
    StandardCombine,
    StandardDispatch,
    WireDtype,
)
from moe_plugin_cuda.triton import tuning_configs
from moe_plugin_cuda.weights import InterleavedW13, expert_weights, interleave_gate_up_

if TYPE_CHECKING:
    from moe_core.plugin_api import MoELayer

FP8 = torch.float8_e4m3fn
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def config_dtype(quant: QuantScheme, params_dtype: torch.dtype) -> str:
    return "fp8_block" if quant is QuantScheme.FP8_BLOCK else _DTYPE_NAMES[params_dtype]


# ---------------------------------------------------------------- torch.compile: custom ops
# Under torch.compile the pipeline is one opaque custom op per call (no graph break, fullgraph
# works): inductor does not trace into it, so it never re-compiles our Triton kernels (its build
# of the FP8 GEMM failed in Triton's LLVM lowering on H100). Eager calls skip the op dispatch.
# The op finds its backend (launch configs, options) by a key: ops take tensors and scalars only
# (the fake function, which computes shapes only, must not depend on the key: it may be symbolic).
_BACKENDS: "weakref.WeakValueDictionary[int, TritonExperts]" = weakref.WeakValueDictionary()
_KEYS = itertools.count()


@torch.library.custom_op("moe_cuda::triton_fused_experts", mutates_args=())
def _fused_experts_op(backend: int, hidden: torch.Tensor, scale: Optional[torch.Tensor], w13: torch.Tensor,
                      w2: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor],
                      topk_weights: torch.Tensor, topk_ids: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return _BACKENDS[backend].run_fused(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids)


@_fused_experts_op.register_fake
def _(backend, hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, out_dtype):
    return hidden.new_empty((hidden.shape[0], w2.shape[1]), dtype=out_dtype)


@torch.library.custom_op("moe_cuda::triton_masked_experts", mutates_args=())
def _masked_experts_op(backend: int, hidden: torch.Tensor, scale: Optional[torch.Tensor], masked_m: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, w13_scale: Optional[torch.Tensor],
                       w2_scale: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
    return _BACKENDS[backend].run_masked(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale)


@_masked_experts_op.register_fake
def _(backend, hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, out_dtype):
    return hidden.new_empty((hidden.shape[0], hidden.shape[1], w2.shape[1]), dtype=out_dtype)


class TritonExperts(Experts):
    """Fused-MoE Triton experts for STANDARD, EP_NORMAL (ids -1 skipped) and EP_MASKED.

    Options (``backend_options["triton"]``): ``config_dir`` (extra directory of tuned JSON
    configs), ``config`` (a fixed ``{"gemm1": {...}, "gemm2": {...}}`` for every T),
    ``gemm1_two_acc`` (True: run GEMM1 on the two-accumulator fallback kernel whatever the
    config says, e.g. where the one-accumulator epilogue does not compile).
    """

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        from moe_plugin_cuda.triton import ops as triton_ops  # imports triton

        self._ops = triton_ops
        c = self.config
        self.fp8 = c.quant is QuantScheme.FP8_BLOCK
        self.dtype_name = config_dtype(c.quant, c.params_dtype)
        self.activation = str(c.activation)
        self.fixed_config = ctx.options.get("config")
        self.config_dir = ctx.options.get("config_dir")
        self.two_acc = bool(ctx.options.get("gemm1_two_acc", False))
        self._configs: dict[int, dict] = {}
        self._device_name: Optional[str] = None
        # the weights' TMA descriptors (B_TMA configs), built once per weight tensor and tile instead of per
        # call; emptied when process_weights runs (a new checkpoint may sit at another address)
        self._descriptors: dict = {}
        self.w13_layout = InterleavedW13()  # layer.w13 is gate/up interleaved once process_weights ran
        self.op_key = next(_KEYS)  # how the torch.compile custom ops find this backend
        _BACKENDS[self.op_key] = self

    # ------------------------------------------------------------------ configs
    def launch_config(self, m: int, device: torch.device) -> dict:
        cfg = self._configs.get(m)
        if cfg is None:
            if self.fixed_config is not None:
                cfg = self.fixed_config
            else:
                if self._device_name is None and device.type == "cuda":
                    self._device_name = torch.cuda.get_device_name(device)
                c = self.config
                cfg, _ = tuning_configs.get_config(m, c.num_local_experts, c.top_k, c.intermediate_size,
                                                   c.hidden_size, self.dtype_name, self._device_name,
                                                   self.config_dir)
            if self.two_acc:
                cfg = tuning_configs.as_two_acc(cfg)
            self._configs[m] = cfg
        return cfg

    # ------------------------------------------------------------------ weights
    def process_weights(self, layer: "MoELayer") -> None:
        # w13 rows become gate/up interleaved (one GEMM1 accumulator, see triton.kernels), in place
        # and once per loaded checkpoint (``InterleavedW13``); w2 and the 128x128 block scales stay
        # in the checkpoint layout (the kernels map interleaved rows back to their scale rows).
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                setattr(layer, name, type(t)(t.contiguous()) if isinstance(t, torch.nn.Parameter) else t.contiguous())
        if not self.w13_layout.is_interleaved(layer.w13):
            interleave_gate_up_(layer.w13)
            self.w13_layout.mark(layer.w13)
        self._descriptors.clear()

    # ------------------------------------------------------------------ apply
    def _activations(self, qa: QuantizedActivations, flat: bool = True):
        """(data, scale) in what the kernels take: compute dtype, or FP8 + group scales."""
        if qa.dtype is WireDtype.BF16:
            return qa.data, None
        if qa.dtype is WireDtype.FP8 and self.fp8:
            return qa.data, qa.scale
        # any other wire dtype: back to the compute dtype (the FP8 kernels requantize)
        return qa.dequantize(self.config.params_dtype), None

    def run_fused(self, hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids) -> torch.Tensor:
        """STANDARD / EP_NORMAL token list through the pipeline -> ``[T, H]`` in the params dtype."""
        c = self.config
        return self._ops.fused_experts(
            hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
            activation=self.activation, routed_scaling_factor=c.routed_scaling_factor, out_dtype=c.params_dtype,
            cfg=self.launch_config(hidden.shape[0], hidden.device), w13_interleaved=True,
            descriptors=self._descriptors)

    def run_masked(self, hidden, scale, masked_m, w13, w2, w13_scale, w2_scale) -> torch.Tensor:
        """EP_MASKED slab ``[E_local, C, H]`` -> expert outputs ``[E_local, C, H]`` (unweighted)."""
        E, C, _ = hidden.shape
        # mean rows per expert is unknown without a sync: size tiles for a full slab
        cfg = self.launch_config(max(1, E * C // max(1, self.config.top_k)), hidden.device)
        return self._ops.masked_experts(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale,
                                        activation=self.activation,
                                        routed_scaling_factor=self.config.routed_scaling_factor,
                                        out_dtype=self.config.params_dtype, cfg=cfg, w13_interleaved=True)

    def _fused(self, layer, qa: QuantizedActivations, topk) -> torch.Tensor:
        w = expert_weights(layer, self.fp8)
        data, scale = self._activations(qa)
        args = (data, scale, w.w13, w.w2, w.w13_scale, w.w2_scale, topk.weights, topk.ids)
        if torch.compiler.is_compiling():
            return torch.ops.moe_cuda.triton_fused_experts(self.op_key, *args, self.config.params_dtype)
        return self.run_fused(*args)

    def apply(self, layer: "MoELayer", dispatched):
        if isinstance(dispatched, StandardDispatch):
            return StandardCombine(hidden=self._fused(layer, dispatched.hidden, dispatched.topk))
        if isinstance(dispatched, EPNormalDispatch):
            return EPNormalCombine(hidden=self._fused(layer, dispatched.hidden, dispatched.topk),
                                   handle=dispatched.handle)
        if isinstance(dispatched, EPMaskedDispatch):
            w = expert_weights(layer, self.fp8)
            data, scale = self._activations(dispatched.hidden)
            args = (data, scale, dispatched.masked_m, w.w13, w.w2, w.w13_scale, w.w2_scale)
            if torch.compiler.is_compiling():
                out = torch.ops.moe_cuda.triton_masked_experts(self.op_key, *args, self.config.params_dtype)
            else:
                out = self.run_masked(*args)
            return EPMaskedCombine(hidden=out, topk=dispatched.topk, handle=dispatched.handle)
        raise TypeError(f"triton experts do not accept {type(dispatched).__name__}")
