"""Experts backend ``cutlass``: MoE on grouped GEMMs (see ``cutlass.ops``), FP8 block-scaled or bf16, on
CUTLASS's or DeepGEMM's; the Triton kernels where those do not pay."""

from __future__ import annotations

import functools
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


# Untuned default (no cutlass table for the shape): the CUTLASS GEMMs from 128 rows per expert (docs/decisions.md,
# "The CUDA plugin's measured defaults"). ``moe-cuda-tune --backend cutlass`` measures the crossover per shape instead.
MIN_ROWS = 128


@dataclass(frozen=True)
class CutlassDecision:
    """What the cutlass experts take from the plan and their options, decided once at construction and passed
    down by name (the torch.compile custom ops take the same values as arguments)."""

    fp8_block: bool  # FP8 block 128x128 W8A8, else bf16 throughout
    table_dtype: str  # the tuned tables' dtype key (tuning_configs.table_dtype)
    w13_interleaved: bool  # bf16: gate/up interleaved as the triton backend keeps it; FP8: the checkpoint layout
    out_dtype: torch.dtype
    routed_scaling_factor: float
    top_k: int
    min_rows: Optional[int] = None  # the grouped GEMMs from this many rows per expert; None: the table decides
    grouped_gemm: Optional[str] = None  # "cutlass" or "deepgemm" wherever a grouped GEMM runs; None: the table's
    config_dir: Optional[str] = None  # an extra directory of tuned tables
    # token lists of up to this many tokens run the triton decode kernels (``triton.decode``); None: the device's
    # decode table decides (``tuning_configs.decode_plan``)
    decode_max_tokens: Optional[int] = None

    @classmethod
    def from_context(cls, ctx) -> "CutlassDecision":
        config, options = ctx.config, ctx.options
        fp8_block = config.quant is QuantScheme.FP8_BLOCK
        grouped_gemm = options.get("grouped_gemm") or None
        if grouped_gemm not in (None, "cutlass", "deepgemm"):
            raise ValueError(f"grouped_gemm must be 'cutlass' or 'deepgemm', not {grouped_gemm!r}")
        min_rows = options.get("min_rows")
        return cls(fp8_block=fp8_block, table_dtype=tuning_configs.table_dtype(config.quant, config.params_dtype),
                   w13_interleaved=not fp8_block, out_dtype=config.params_dtype,
                   routed_scaling_factor=float(config.routed_scaling_factor), top_k=config.top_k,
                   min_rows=None if min_rows is None else int(min_rows), grouped_gemm=grouped_gemm,
                   config_dir=str(options.get("config_dir") or "") or None,
                   decode_max_tokens=None if options.get("decode_max_tokens") is None
                   else int(options["decode_max_tokens"]))


@functools.cache
def _triton_ops():
    """``moe_plugin_cuda.triton.ops`` (imports triton, an optional dependency: on first use, not with this module;
    cached: a function-local import costs a microsecond per decode forward)."""
    from moe_plugin_cuda.triton import ops

    return ops


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@functools.cache
def choose_path(T: int, E: int, top_k: int, inter: int, H: int, device_name: str, config_dir: Optional[str],
                min_rows: Optional[int], grouped_gemm: Optional[str] = None,
                dtype: str = "fp8_block", decode_max_tokens: Optional[int] = 0) -> tuple[str, dict, tuple[int, int]]:
    """("triton", "cutlass" or "deepgemm": whose kernels run, the Triton launch for "triton", the
    grouped GEMM's (GEMM1, GEMM2) kernels otherwise) for T tokens of ``dtype`` ("fp8_block" or "bf16").

    The cutlass table (``tuning_configs.CUTLASS_TABLE``) holds, per T, which path measured fastest, the
    fastest kernels of each grouped GEMM (``cutlass_variants``, ``deepgemm_variants``: indices into
    their variant lists) and, FP8, the Triton path's two-accumulator configs for the checkpoint layout;
    without one: triton's table, the grouped GEMMs from ``MIN_ROWS`` rows per expert on their default
    kernels (FP8: DeepGEMM's where its library can be built; bf16: CUTLASS's, which a probe
    measured 6-21% faster than DeepGEMM's on ~256-row experts: docs/decisions.md, "The CUDA plugin's measured
    defaults"). bf16's Triton path is always
    the triton backend's own configs for T (same kernels, same layout: never slower than it). A
    "deepgemm" entry runs CUTLASS where DeepGEMM cannot. ``min_rows`` (not None) overrides the path
    (grouped from that many rows per expert), ``grouped_gemm`` ("cutlass" or "deepgemm") the grouped GEMM;
    "cutlass" on FP8 also keeps GEMM1 on an fp32-output kernel. Where ``tuning_configs.decode_plan`` says (up to
    ``decode_max_tokens`` tokens when not None): the triton decode kernels (path "triton", no variants).
    """
    from moe_plugin_cuda.cutlass import lib as cutlass_lib
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    fp8 = dtype == "fp8_block"
    decode = tuning_configs.decode_plan(T, E, top_k, inter, H, dtype, device_name, config_dir, decode_max_tokens)
    if decode is not None:
        return "triton", decode, ()
    deepgemm = deepgemm_lib.missing() is None and E <= deepgemm_lib.MAX_EXPERTS
    grouped = "deepgemm" if deepgemm and fp8 else "cutlass"
    entry, _ = tuning_configs.lookup(T, E, inter, H, dtype, device_name, config_dir, tuning_configs.CUTLASS_TABLE)
    if entry is None or not fp8:
        triton_cfg, _ = tuning_configs.get_config(T, E, top_k, inter, H, dtype, device_name, config_dir)
    if entry is None:
        entry = {**(tuning_configs.as_two_acc(triton_cfg, keep_tma=True) if fp8 else triton_cfg),
                 "path": grouped if T * top_k >= MIN_ROWS * E else "triton"}
    elif not fp8:
        entry = {**entry, **triton_cfg}
    path = entry.get("path", "triton")
    if min_rows is not None:
        path = grouped if T * top_k >= min_rows * E else "triton"
    if path != "triton" and grouped_gemm:
        path = grouped_gemm
    elif path == "deepgemm" and not deepgemm:
        path = grouped
    if path == "deepgemm":
        default = deepgemm_lib.DEFAULT_FP8_VARIANTS if fp8 else deepgemm_lib.DEFAULT_BF16_VARIANTS
        variants = tuple(entry.get("deepgemm_variants", default))
    else:
        variants = tuple(entry.get("cutlass_variants", cutlass_lib.DEFAULT_VARIANTS["fp8" if fp8 else "bf16"]))
        if fp8 and grouped_gemm == "cutlass" and cutlass_lib.VARIANTS[variants[0]][3] != "fp32":
            # forcing CUTLASS keeps h in fp32 until its requantization (the README's promise), whatever the
            # table found fastest
            variants = (cutlass_lib.DEFAULT_VARIANTS["fp8"][0], variants[1])
    return path, {"gemm1": entry["gemm1"], "gemm2": entry["gemm2"]}, variants


def run_fused(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, *, fp8_block: bool,
              table_dtype: str, routed_scaling_factor: float, out_dtype: torch.dtype, min_rows: Optional[int],
              config_dir: Optional[str], grouped_gemm: Optional[str], decode_max_tokens: Optional[int] = 0,
              descriptors: Optional[dict] = None, layouts=None, programs=None, paths: Optional[dict] = None
              ) -> torch.Tensor:
    """Token list: a grouped GEMM pipeline or the Triton kernels, as ``choose_path`` says for T. bf16
    (not ``fp8_block``): w13 is gate/up interleaved, as the triton backend keeps it. ``descriptors``, ``layouts``,
    ``programs``: the Triton path's caches of weight TMA descriptors, workspace layouts and recorded calls
    (``triton_ops.fused_experts``); ``paths``: ``choose_path``'s answers by T for these weights and options (a
    dict the caller owns and empties when they change)."""
    T = hidden.shape[0]
    choice = paths.get(T) if paths is not None else None
    if choice is None:
        choice = choose_path(max(T, 1), w13.shape[0], topk_ids.shape[1], w2.shape[2], w2.shape[1],
                             _device_name(hidden.device.index or 0), config_dir, min_rows, grouped_gemm, table_dtype,
                             decode_max_tokens)
        if paths is not None:
            if len(paths) >= 256:  # (decode runs a few T; a prefill of ever new T only recomputes)
                paths.clear()
            paths[T] = choice
    path, cfg, variants = choice
    if path != "triton":
        from moe_plugin_cuda.cutlass import ops as cutlass_ops

        return cutlass_ops.fused_experts(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                         fp8_block=fp8_block, routed_scaling_factor=routed_scaling_factor,
                                         out_dtype=out_dtype, gemm=cutlass_ops.grouped_gemm(path, fp8_block),
                                         variants=variants, w13_interleaved=not fp8_block)
    return _triton_ops().fused_experts(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                    fp8_block=fp8_block, activation="silu", routed_scaling_factor=routed_scaling_factor,
                                    out_dtype=out_dtype, cfg=cfg, w13_interleaved=not fp8_block,
                                    descriptors=descriptors, layouts=layouts, programs=programs)


def run_masked(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, *, fp8_block: bool, table_dtype: str,
               routed_scaling_factor: float, out_dtype: torch.dtype, min_rows: Optional[int], config_dir: Optional[str],
               top_k: int) -> torch.Tensor:
    """EP_MASKED slab: CUTLASS (FP8) when its capacity per expert reaches ``min_rows`` (default
    ``MIN_ROWS``), else Triton (tuned on token lists, so the table's path choice does not apply to slabs;
    the slab's rows are packed, which DeepGEMM's layout is not; bf16 always runs Triton)."""
    from moe_plugin_cuda.cutlass import ops as cutlass_ops
    from moe_plugin_cuda.triton import ops as triton_ops

    E, C, _ = hidden.shape
    # mean rows per expert is unknown without a sync: configs for a full slab, as the triton backend does
    _, cfg, variants = choose_path(max(1, E * C // top_k), E, top_k, w2.shape[2], w2.shape[1],
                                   _device_name(hidden.device.index or 0), config_dir, min_rows,
                                   "cutlass" if fp8_block else None, table_dtype)
    if fp8_block and C >= (MIN_ROWS if min_rows is None else min_rows):
        return cutlass_ops.masked_experts(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale,
                                          routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype,
                                          variants=variants)
    return triton_ops.masked_experts(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, fp8_block=fp8_block,
                                     activation="silu", routed_scaling_factor=routed_scaling_factor,
                                     out_dtype=out_dtype, cfg=cfg, w13_interleaved=not fp8_block)


# Under torch.compile each call is one opaque custom op (dynamo cannot trace the ctypes call).
@torch.library.custom_op("moe_cuda::cutlass_fused_experts", mutates_args=())
def _fused_op(hidden: torch.Tensor, scale: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
              w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, *, fp8_block: bool, table_dtype: str, routed_scaling_factor: float,
              out_dtype: torch.dtype, min_rows: Optional[int], config_dir: Optional[str],
              grouped_gemm: Optional[str], decode_max_tokens: Optional[int]) -> torch.Tensor:
    return run_fused(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, fp8_block=fp8_block,
                     table_dtype=table_dtype, routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype,
                     min_rows=min_rows, config_dir=config_dir, grouped_gemm=grouped_gemm,
                     decode_max_tokens=decode_max_tokens)


@_fused_op.register_fake
def _(hidden, scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, *, out_dtype, **_):
    return hidden.new_empty((hidden.shape[0], w2.shape[1]), dtype=out_dtype)


@torch.library.custom_op("moe_cuda::cutlass_masked_experts", mutates_args=())
def _masked_op(hidden: torch.Tensor, scale: Optional[torch.Tensor], masked_m: torch.Tensor, w13: torch.Tensor,
               w2: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], *,
               fp8_block: bool, table_dtype: str, routed_scaling_factor: float, out_dtype: torch.dtype,
               min_rows: Optional[int],
               config_dir: Optional[str], top_k: int) -> torch.Tensor:
    return run_masked(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, fp8_block=fp8_block,
                      table_dtype=table_dtype, routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype,
                      min_rows=min_rows, config_dir=config_dir, top_k=top_k)


@_masked_op.register_fake
def _(hidden, scale, masked_m, w13, w2, w13_scale, w2_scale, *, out_dtype, **_):
    return hidden.new_empty((hidden.shape[0], hidden.shape[1], w2.shape[1]), dtype=out_dtype)


class CutlassExperts(Experts):
    """FP8 block 128x128 W8A8 and bf16 SiLU experts for STANDARD, EP_NORMAL (ids -1 skipped) and EP_MASKED.

    FP8: weights stay in the checkpoint layout (w13 = [gate | up] rows, 128x128 block scales), which is
    what the CUTLASS blockwise-scaled GEMM reads; the library is compiled at first use. Where the
    sort and gather do not pay (small T) the Triton kernels run instead, on the two-accumulator
    GEMM1 that reads this layout: the tuned table says which path at which T (``choose_path``).

    The grouped GEMMs are CUTLASS's (fp32 GEMM1 output, or bf16 where the table picked such a kernel) or
    DeepGEMM's SM90 kernel (bf16 GEMM1 output; needs the ``sgl-deep-gemm`` headers), whichever the table
    measured faster at that T. A bf16 GEMM1 output rounds h before its FP8 requantization, as SGLang's
    DeepGEMM runner does; the tables run those kernels from T=1024 only (at one token a flipped e4m3 code
    of h can cost more than the conformance kit allows).

    bf16: w13 gate/up interleaved as the triton backend keeps it, and below the table's crossover
    exactly the triton backend's kernels and configs; above it CUTLASS's or DeepGEMM's SM90 bf16
    grouped GEMM, whichever the table measured faster (GEMM1 written in bf16, as SGLang's unfused
    path writes it, then SiLU x up). EP_MASKED slabs run the Triton kernels.

    Options (``backend_options["cutlass"]``): ``config_dir`` (extra directory of tuned tables),
    ``min_rows`` (run the grouped GEMMs from this many rows per expert, whatever the table says),
    ``grouped_gemm`` ("cutlass" or "deepgemm": that grouped GEMM wherever one runs).
    """

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.decision = CutlassDecision.from_context(ctx)
        self.w13_layout = InterleavedW13()  # bf16: layer.w13 is gate/up interleaved once process_weights ran
        self._descriptors: dict = {}  # the Triton path's weight TMA descriptors, emptied by process_weights
        self._layouts = Layouts()  # the Triton path's workspace layouts per T
        from moe_plugin_cuda.triton.replay import Programs  # imports triton

        self._programs = Programs()  # the Triton path's recorded calls (triton.replay), emptied by process_weights
        self._paths: dict = {}  # choose_path's answers by T (run_fused), emptied by process_weights
        d = self.decision
        # run_fused's options, built once (not per forward): the custom op's, and eager calls' with the caches
        self._op_kwargs = dict(fp8_block=d.fp8_block, table_dtype=d.table_dtype,
                               routed_scaling_factor=d.routed_scaling_factor, out_dtype=d.out_dtype,
                               min_rows=d.min_rows, config_dir=d.config_dir, grouped_gemm=d.grouped_gemm,
                               decode_max_tokens=d.decode_max_tokens)
        self._run_kwargs = dict(self._op_kwargs, descriptors=self._descriptors, layouts=self._layouts,
                                programs=self._programs, paths=self._paths)
        if self.decision.grouped_gemm == "deepgemm":
            from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

            if deepgemm_lib.missing():
                raise ValueError(f"grouped_gemm='deepgemm': {deepgemm_lib.missing()}")

    def process_weights(self, layer: "MoELayer") -> None:
        for name in ("w13", "w2", "w13_scale", "w2_scale"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor) and not t.is_contiguous():
                setattr(layer, name, type(t)(t.contiguous()) if isinstance(t, torch.nn.Parameter) else t.contiguous())
        from moe_plugin_cuda.cutlass import lib as cutlass_lib
        from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

        if self.decision.w13_interleaved and not self.w13_layout.is_interleaved(layer.w13):  # once per checkpoint
            interleave_gate_up_(layer.w13)
            self.w13_layout.mark(layer.w13)
        self._descriptors.clear()
        self._programs.clear()
        self._paths.clear()
        # build or load now, not inside the first forward (or a graph capture)
        cutlass_lib.library()
        if deepgemm_lib.missing() is None:
            deepgemm_lib.library(torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count)

    def _activations(self, qa: QuantizedActivations):
        """(data, scale): FP8 codes + group scales as they came (FP8 experts), else the compute dtype (the
        FP8 pipeline quantizes)."""
        if qa.dtype is WireDtype.FP8 and self.decision.fp8_block:
            return qa.data, qa.scale
        if qa.dtype is WireDtype.BF16:
            return qa.data, None
        return qa.dequantize(self.decision.out_dtype), None

    def apply_tokens(self, layer: "MoELayer", hidden_states: torch.Tensor, topk) -> torch.Tensor:
        """A pass-through dispatcher's token list (bf16): ``apply``'s token-list branch without the contract
        objects."""
        if torch.compiler.is_compiling():
            w = expert_weights(layer, self.decision.fp8_block, detach=True)
            return _fused_op(hidden_states, None, *w, topk.weights, topk.ids, **self._op_kwargs)
        w = expert_weights(layer, self.decision.fp8_block, detach=False)
        return run_fused(hidden_states, None, *w, topk.weights, topk.ids, **self._run_kwargs)

    def apply(self, layer: "MoELayer", dispatched):
        d = self.decision
        compiling = torch.compiler.is_compiling()
        # eager: the Parameters themselves (the launches read pointers; ``.data`` is a torch op per weight and call)
        w = expert_weights(layer, d.fp8_block, detach=compiling)
        if isinstance(dispatched, (StandardDispatch, EPNormalDispatch)):
            data, scale = self._activations(dispatched.hidden)
            topk = dispatched.topk
            if compiling:
                out = _fused_op(data, scale, *w, topk.weights, topk.ids, **self._op_kwargs)
            else:  # eager calls skip the custom op's dispatch (host time), as the triton backend's do
                out = run_fused(data, scale, *w, topk.weights, topk.ids, **self._run_kwargs)
            if isinstance(dispatched, StandardDispatch):
                return StandardCombine(hidden=out)
            return EPNormalCombine(hidden=out, handle=dispatched.handle)
        if isinstance(dispatched, EPMaskedDispatch):
            data, scale = self._activations(dispatched.hidden)
            run = _masked_op if compiling else run_masked
            out = run(data, scale, dispatched.masked_m, w.w13, w.w2, w.w13_scale, w.w2_scale,
                      fp8_block=d.fp8_block, table_dtype=d.table_dtype,
                      routed_scaling_factor=d.routed_scaling_factor, out_dtype=d.out_dtype,
                      min_rows=d.min_rows, config_dir=d.config_dir, top_k=d.top_k)
            return EPMaskedCombine(hidden=out, topk=dispatched.topk, handle=dispatched.handle)
        raise TypeError(f"cutlass experts do not accept {type(dispatched).__name__}")
