"""Experts backend ``triton``: the fused-MoE Triton pipeline (see ``triton.kernels``)."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass
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
from moe_plugin_cuda.workspace import Layouts

if TYPE_CHECKING:
    from moe_core.plugin_api import MoELayer



@dataclass(frozen=True)
class TritonDecision:
    """What the triton experts take from the plan, decided once at construction and passed down by name."""

    fp8_block: bool  # FP8 block 128x128 W8A8 (weights e4m3 with block scales), else the params dtype throughout
    table_dtype: str  # the tuned tables' dtype key (tuning_configs.table_dtype)
    compute_dtype: torch.dtype  # the params dtype: outputs, and activations that are not FP8
    activation: str  # "silu" or "gelu"
    routed_scaling_factor: float
    w13_interleaved: bool = True  # process_weights interleaves w13's gate/up rows (one GEMM1 accumulator)

    @classmethod
    def from_config(cls, config) -> "TritonDecision":
        return cls(fp8_block=config.quant is QuantScheme.FP8_BLOCK,
                   table_dtype=tuning_configs.table_dtype(config.quant, config.params_dtype),
                   compute_dtype=config.params_dtype, activation=str(config.activation),
                   routed_scaling_factor=float(config.routed_scaling_factor))


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
    config says, e.g. where the one-accumulator epilogue does not compile), ``decode_max_tokens`` (token lists of
    up to that many tokens run the decode kernels, ``triton.decode``; default: the device's decode table,
    ``tuning_configs.decode_plan``; 0 with a fixed ``config``), ``decode_config`` (a fixed decode launch).
    """

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        from moe_plugin_cuda.triton import ops as triton_ops  # imports triton

        self._ops = triton_ops
        self._programs = triton_ops.Programs()  # recorded calls (triton.replay), emptied when process_weights runs
        self.decision = TritonDecision.from_config(self.config)
        self.fixed_config = ctx.options.get("config")
        self.config_dir = ctx.options.get("config_dir")
        self.two_acc = bool(ctx.options.get("gemm1_two_acc", False))
        # None: the device's decode table decides (tuning_configs.decode_plan); a fixed pipeline config: never
        limit = ctx.options.get("decode_max_tokens", 0 if self.fixed_config is not None else None)
        self.decode_max_tokens: Optional[int] = None if limit is None else int(limit)
        self.decode_config = ctx.options.get("decode_config")
        self._configs: dict[int, dict] = {}
        self._fused_configs: dict[int, dict] = {}  # token lists' launch per T: decode or the pipeline's
        self._device_name: Optional[str] = None
        # the weights' TMA descriptors (B_TMA configs), built once per weight tensor and tile instead of per
        # call; emptied when process_weights runs (a new checkpoint may sit at another address)
        self._descriptors: dict = {}
        self._layouts = Layouts()  # the workspace layout (one allocation per forward) per T
        self.w13_layout = InterleavedW13()  # layer.w13 is gate/up interleaved once process_weights ran
        self.op_key = next(_KEYS)  # how the torch.compile custom ops find this backend
        d = self.decision
        # fused_experts' options but the launch, built once (not per forward)
        self._fused_kwargs = dict(fp8_block=d.fp8_block, activation=d.activation,
                                  routed_scaling_factor=d.routed_scaling_factor, out_dtype=d.compute_dtype,
                                  w13_interleaved=d.w13_interleaved, descriptors=self._descriptors,
                                  layouts=self._layouts, programs=self._programs)
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
                                                   c.hidden_size, self.decision.table_dtype, self._device_name,
                                                   self.config_dir)
            if self.two_acc:
                cfg = tuning_configs.as_two_acc(cfg)
            self._configs[m] = cfg
        return cfg

    def fused_config(self, T: int, device: torch.device) -> dict:
        """A token list's launch: the decode kernels' where ``tuning_configs.decode_plan`` says (or up to the
        ``decode_max_tokens`` option), else the pipeline's. (One dict object per T: the replay's key holds it by
        identity.)"""
        cfg = self._fused_configs.get(T)
        if cfg is None:
            if self._device_name is None and device.type == "cuda":
                self._device_name = torch.cuda.get_device_name(device)
            c = self.config
            cfg = tuning_configs.decode_plan(max(T, 1), c.num_local_experts, c.top_k, c.intermediate_size,
                                             c.hidden_size, self.decision.table_dtype, self._device_name,
                                             self.config_dir, self.decode_max_tokens)
            if cfg is not None and self.decode_config is not None:
                cfg = self.decode_config
            if cfg is None:
                cfg = self.launch_config(T, device)
            if len(self._fused_configs) >= 256:  # (decode runs a few T; a prefill of ever new T only recomputes)
                self._fused_configs.clear()
            self._fused_configs[T] = cfg
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
        self._programs.clear()

    # ------------------------------------------------------------------ apply
    def _activations(self, qa: QuantizedActivations, flat: bool = True):
        """(data, scale) in what the kernels take: compute dtype, or FP8 + group scales."""
        if qa.dtype is WireDtype.BF16:
            return qa.data, None
        if qa.dtype is WireDtype.FP8 and self.decision.fp8_block:
            return qa.data, qa.scale
        # any other wire dtype: back to the compute dtype (the FP8 kernels requantize)
        return qa.dequantize(self.decision.compute_dtype), None

    def run_fused(self, hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids) -> torch.Tensor:
        """STANDARD / EP_NORMAL token list through the pipeline -> ``[T, H]`` in the params dtype."""
        cfg = self._fused_configs.get(hidden.shape[0])
        if cfg is None:
            cfg = self.fused_config(hidden.shape[0], hidden.device)
        return self._ops.fused_experts(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, cfg=cfg,
                                       **self._fused_kwargs)

    def run_masked(self, hidden, scale, masked_m, w13, w2, w13_scale, w2_scale) -> torch.Tensor:
        """EP_MASKED slab ``[E_local, C, H]`` -> expert outputs ``[E_local, C, H]`` (unweighted)."""
        E, C, _ = hidden.shape
        # mean rows per expert is unknown without a sync: size tiles for a full slab
        cfg = self.launch_config(max(1, E * C // max(1, self.config.top_k)), hidden.device)
        d = self.decision
        return self._ops.masked_experts(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale,
                                        fp8_block=d.fp8_block, activation=d.activation,
                                        routed_scaling_factor=d.routed_scaling_factor, out_dtype=d.compute_dtype,
                                        cfg=cfg, w13_interleaved=d.w13_interleaved)

    def _fused(self, layer, data: torch.Tensor, topk, scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Token list (``_activations``' data and scale) -> ``[T, H]``."""
        compiling = torch.compiler.is_compiling()
        # eager: the Parameters themselves (the launches read pointers; ``.data`` is a torch op per weight and call)
        w = expert_weights(layer, self.decision.fp8_block, detach=compiling)
        if compiling:
            return torch.ops.moe_cuda.triton_fused_experts(self.op_key, data, scale, *w, topk.weights, topk.ids,
                                                           self.decision.compute_dtype)
        return self.run_fused(data, scale, *w, topk.weights, topk.ids)

    apply_tokens = _fused  # a pass-through dispatcher's bf16 token list, without the contract objects

    def apply(self, layer: "MoELayer", dispatched):
        if isinstance(dispatched, (StandardDispatch, EPNormalDispatch)):
            data, scale = self._activations(dispatched.hidden)
            out = self._fused(layer, data, dispatched.topk, scale)
            if isinstance(dispatched, StandardDispatch):
                return StandardCombine(hidden=out)
            return EPNormalCombine(hidden=out, handle=dispatched.handle)
        if isinstance(dispatched, EPMaskedDispatch):
            w = expert_weights(layer, self.decision.fp8_block)
            data, scale = self._activations(dispatched.hidden)
            args = (data, scale, dispatched.masked_m, w.w13, w.w2, w.w13_scale, w.w2_scale)
            if torch.compiler.is_compiling():
                out = torch.ops.moe_cuda.triton_masked_experts(self.op_key, *args, self.decision.compute_dtype)
            else:
                out = self.run_masked(*args)
            return EPMaskedCombine(hidden=out, topk=dispatched.topk, handle=dispatched.handle)
        raise TypeError(f"triton experts do not accept {type(dispatched).__name__}")
