"""Experts ``npu_gmm``: torch_npu ``npu_grouped_matmul`` pipelines (SGLang's NPU MoE paths).

One pipeline per quant scheme, bound at construction (no per-call branching on config):

- unquantized: GMM1 -> ``npu_swiglu`` -> GMM2;
- W8A8 INT8 dynamic: per-token INT8 input (from the wire, or ``npu_dynamic_quant``), int8 GMM1 with
  weight scale and per-token scale (bf16 out) -> swiglu -> ``npu_dynamic_quant`` -> int8 GMM2;
- W4A4 INT4 dynamic (``apply_without_routing_weights`` of SGLang PR #22822): the same with
  ``npu_dynamic_quant(dst_type=quint4x2)`` and int32-packed int4 weights.

Group lists are counts (``group_list_type=1``, int64), whatever the format:

- ``STANDARD`` / ``EP_NORMAL`` (token lists with local ids, -1 elsewhere): ``npu_moe_init_routing_v2``
  expands and sorts the slots of the local experts, the pipeline runs, ``npu_moe_finalize_routing``
  weights and sums them back per token -> the weighted ``[T, H]`` / ``[R, H]`` combine input;
- ``EP_MASKED`` (``[E, C, H]`` slab, ``masked_m``): valid rows are gathered to the front, the
  pipeline runs with ``masked_m`` as group list, rows go back to the slab -> unweighted combine input.

All index work stays on the device with fixed shapes (no host sync).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch

from moe_core.plugin_api import (
    BackendContext,
    DispatchOutput,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    Experts,
    Format,
    QuantizedActivations,
    QuantScheme,
    StandardCombine,
    WireDtype,
)
from moe_plugin_npu.layout import (
    ACL_FORMAT_FRACTAL_NZ,
    LayoutTracker,
    pack_int4,
    packed_to_slab_index,
    slab_to_packed_index,
)

if TYPE_CHECKING:
    from moe_core.plugin_api import MoELayer

GROUP_LIST_COUNTS = 1
FINALIZE_ROW_MAJOR = 2  # drop_pad_mode of npu_moe_finalize_routing matching init_routing_v2's slot order


class NpuGmmExperts(Experts):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        import torch_npu  # lazy: the vendor library is only needed once this backend is chosen

        self.npu = torch_npu
        cfg = ctx.config
        self.num_local = cfg.num_local_experts
        self.out_dtype = cfg.params_dtype
        self.rsf = float(cfg.routed_scaling_factor)
        self.scheme = cfg.quant
        self.weight_names: tuple[str, ...] = ("w13", "w2") if cfg.quant is QuantScheme.UNQUANTIZED \
            else ("w13", "w2", "w13_scale", "w2_scale")
        self.layout = LayoutTracker()
        # GMM1's output is requantized (to 8 or 4 bits) right after the swiglu: fp16's 10-bit mantissa
        # keeps its rounding from pushing values across a quantization step, which bf16 does often
        # enough to double the error at INT4. Set "bfloat16" for activations beyond fp16's range.
        self.mid_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}[
            str(ctx.options.get("intermediate_dtype", "float16"))]
        # INT8 wire into a scheme that wants floats: dequantize for the next consumer (the bf16 GEMM of
        # unquantized weights, or a requantization, which gets the finer dtype for the same reason)
        self.float_in_dtype = self.out_dtype if cfg.quant is QuantScheme.UNQUANTIZED else self.mid_dtype
        self._mlp: Callable[..., torch.Tensor] = {
            QuantScheme.UNQUANTIZED: self._mlp_bf16,
            QuantScheme.INT8_W8A8: self._mlp_w8a8,
            QuantScheme.W4A4: self._mlp_w4a4,
        }[cfg.quant]
        # W8A8 takes the wire's INT8 as it is; every other scheme wants the float activations
        self.keep_int8 = cfg.quant is QuantScheme.INT8_W8A8 and ctx.dispatch_dtype is WireDtype.INT8
        self._run = {
            Format.STANDARD: self._apply_routed,
            Format.EP_NORMAL: self._apply_routed,
            Format.EP_MASKED: self._apply_masked,
        }[ctx.format]
        self._combine_input = EPNormalCombine if ctx.format is Format.EP_NORMAL else None

    # ------------------------------------------------------------------ weights

    def process_weights(self, layer: "MoELayer") -> None:
        """``[E, N, K]`` checkpoint weights -> the ``[E, K, N]`` right operands GMM wants, in FRACTAL_NZ;
        int4 packed 8 per int32 along N (kept ND); scales fp32 ``[E, N]``. Idempotent."""
        if self.layout.is_current(layer, self.weight_names):
            return
        npu = self.npu
        for name in ("w13", "w2"):
            w = getattr(layer, name).detach().transpose(1, 2).contiguous()  # [E, K, N]
            if self.scheme is QuantScheme.W4A4:
                w = pack_int4(w)
            else:
                w = npu.npu_format_cast(w, ACL_FORMAT_FRACTAL_NZ)
            self.layout.replace(layer, name, w)
        if self.scheme is not QuantScheme.UNQUANTIZED:
            for name in ("w13_scale", "w2_scale"):
                self.layout.replace(layer, name, getattr(layer, name).detach().to(torch.float32).contiguous())

    # ------------------------------------------------------------------ pipelines (rows grouped by expert)

    def _gmm(self, x: torch.Tensor, w: torch.Tensor, group_list: torch.Tensor, **quant) -> torch.Tensor:
        return self.npu.npu_grouped_matmul([x], [w], group_list=group_list, split_item=2, group_type=0,
                                           group_list_type=GROUP_LIST_COUNTS, **quant)[0]

    def _mlp_bf16(self, layer, x: torch.Tensor, x_scale: Optional[torch.Tensor], gl: torch.Tensor) -> torch.Tensor:
        h = self.npu.npu_swiglu(self._gmm(x, layer.w13, gl))
        return self._gmm(h, layer.w2, gl)

    def _mlp_quant(self, layer, x, x_scale, gl, dst_type: Optional[torch.dtype]) -> torch.Tensor:
        npu = self.npu
        if x_scale is None:
            x, x_scale = npu.npu_dynamic_quant(x, dst_type=dst_type)
        h = self._gmm(x, layer.w13, gl, scale=[layer.w13_scale], per_token_scale=[x_scale],
                      output_dtype=self.mid_dtype)
        hq, h_scale = npu.npu_dynamic_quant(npu.npu_swiglu(h), dst_type=dst_type)
        return self._gmm(hq, layer.w2, gl, scale=[layer.w2_scale], per_token_scale=[h_scale],
                         output_dtype=self.out_dtype)

    def _mlp_w8a8(self, layer, x, x_scale, gl):
        return self._mlp_quant(layer, x, x_scale, gl, None)

    def _mlp_w4a4(self, layer, x, x_scale, gl):
        return self._mlp_quant(layer, x, None, gl, torch.quint4x2)

    def _float_input(self, hidden: QuantizedActivations) -> torch.Tensor:
        if hidden.dtype is WireDtype.BF16:
            return hidden.data
        if hidden.dtype is WireDtype.INT8:  # e.g. an explicit int8 wire with bf16 / int4 weights
            return (hidden.data.float() * hidden.scale.float()).to(self.float_in_dtype)
        raise TypeError(f"npu_gmm takes bf16 or int8 activations, got {hidden.dtype}")

    # ------------------------------------------------------------------ formats

    def apply(self, layer: "MoELayer", dispatched: DispatchOutput):
        return self._run(layer, dispatched)

    def _apply_routed(self, layer, d):
        """STANDARD and EP_NORMAL: the same code path (token list with local ids)."""
        npu = self.npu
        ids, weights = d.topk.ids, d.topk.weights
        n, k = ids.shape
        if n == 0:
            out = torch.zeros(0, d.hidden.shape[-1], dtype=self.out_dtype, device=ids.device)
        else:
            if self.keep_int8:  # pre-quantized rows: the routing op expands their per-token scales too
                x, scale, quant_mode = d.hidden.data, d.hidden.scale.reshape(-1).float(), -1
            elif self.scheme is QuantScheme.INT8_W8A8:  # quantize while expanding
                x, scale, quant_mode = self._float_input(d.hidden), None, 1
            else:
                x, scale, quant_mode = self._float_input(d.hidden), None, -1
            expanded, src_to_dst, counts, expanded_scale = npu.npu_moe_init_routing_v2(
                x, ids, scale=scale, active_num=n * k, expert_num=self.num_local, expert_tokens_num_type=1,
                expert_tokens_num_flag=True, quant_mode=quant_mode, active_expert_range=[0, self.num_local])
            y = self._mlp(layer, expanded, expanded_scale, counts)
            scales = weights * self.rsf if self.rsf != 1.0 else weights
            out = npu.npu_moe_finalize_routing(y, None, None, None, scales, src_to_dst, ids,
                                               drop_pad_mode=FINALIZE_ROW_MAJOR).to(self.out_dtype)
        if self._combine_input is EPNormalCombine:
            return EPNormalCombine(out, d.handle)
        return StandardCombine(out)

    def _apply_masked(self, layer, d: EPMaskedDispatch) -> EPMaskedCombine:
        e, cap, h = d.hidden.shape
        counts = d.masked_m.to(torch.int64)
        rows = e * cap
        to_packed = slab_to_packed_index(counts, cap, rows)
        if self.keep_int8:
            x = d.hidden.data.reshape(rows, h)[to_packed]
            x_scale = d.hidden.scale.reshape(rows).float()[to_packed]
        else:
            x, x_scale = self._float_input(d.hidden).reshape(rows, h)[to_packed], None
        y = self._mlp(layer, x, x_scale, counts)  # rows past sum(counts) are not computed (garbage)
        out = y[packed_to_slab_index(counts, cap)].reshape(e, cap, h)
        if self.rsf != 1.0:
            out = out * self.rsf
        return EPMaskedCombine(out.to(self.out_dtype), d.topk, d.handle)
