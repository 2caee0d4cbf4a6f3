"""Experts ``aiter``: AITER's ``fused_moe`` with one adapter per dispatch format.

The adapter is chosen once, in ``__init__``, from the plan's format:

- ``STANDARD`` / ``EP_NORMAL`` (DeepEP-like): -1 ids (padding, experts of other ranks) are
  rewritten to a sink expert ``E_local`` and ``expert_mask`` (int32 ``[E_local + 1]``) masks
  the sink off, because AITER cannot take -1 ids.
- ``EP_NORMAL`` from the ``mori`` dispatcher: the received **global** int32 ids go straight to
  ``fused_moe`` with ``expert_mask [E + 1]`` set on this rank's expert range (``E``: the fake id
  of slots the dispatcher filled in for -1, masked off) (AITER maps a masked-in
  id to ``cumsum(mask) - 1``), and ``num_local_tokens = total_recv`` (a device tensor) so the
  kernels read only the valid rows of MoRI's buffer, never the stale ones.
- ``EP_MASKED``: the ``[E_local, C, H]`` slab becomes ``E_local * C`` rows routed to their own
  expert (rows at or past ``masked_m`` go to the sink), output unweighted as the format requires.

Weights: ``process_weights`` shuffles ``w13``/``w2`` in place with ``aiter.ops.shuffle.
shuffle_weight`` (the preshuffled layout AITER's fast kernels read). The kernel decides the
layout from ``w1.is_shuffled``; a tensor attribute is lost whenever a parameter is re-wrapped
(vLLM #42061, SGLang #26884), so the kernel is given views owned by this backend that carry the
flag, the layer's parameters get the flag too (re-set on every ``process_weights``), and the
layer records what it holds (data pointer and a content fingerprint) so that calling
``process_weights`` again, after a re-wrap or not, never shuffles twice, while a reload
(new content, even into the same storage) is shuffled again. The layer's weights keep their
checkpoint dtype: on gfx942 the kernel reads the e4m3fn weights as e4m3fnuz (same bits after
clearing -0, scales doubled; see ``moe_plugin_rocm.fp8``).

FP8 schemes: ``fp8_block`` is ``QuantType.per_1x128`` (128x128 weight blocks, 1x128 activation
groups), ``fp8_per_token`` is ``QuantType.per_Token`` (per-channel weight scales passed as
``[E, N, 1]``, one activation scale per token). The GEMM1 input is the core scheme's
quantization (amax/448 e4m3fn): dispatched FP8 (1x128) is passed pre-quantized (``a1_scale``)
to ``fp8_block`` and requantized per token for ``fp8_per_token``; BF16 input is quantized by
AITER itself on gfx950 (its recipe is the core's), and by the adapter on gfx942, because AITER
would round on the fnuz grid (amax/240); pre-quantized e4m3fn is converted bit-exactly to fnuz
on gfx942. The intermediate activation (GEMM2 input) is requantized inside the kernel in the
architecture's flavour: on gfx942 that is another FP8 grid than the reference's, an inherent
~3% difference (see the README and ``docs/decisions.md``).

``routed_scaling_factor`` is folded into the routing weights passed to ``fused_moe`` (for the
masked format, into its unit weights), so it is applied exactly once in every format.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from moe_core.plugin_api import (
    Activation,
    BackendContext,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Experts,
    Format,
    QuantizedActivations,
    QuantScheme,
    StandardCombine,
    StandardDispatch,
    WireDtype,
    quant,
)
from moe_plugin_rocm.fp8 import clear_negative_zero_, fn_to_fnuz
from moe_plugin_rocm.mori_dispatcher import MoriHandle
from moe_plugin_rocm.platform import current_arch, fp8_flavour

if TYPE_CHECKING:
    from moe_core.plugin_api import MoELayer

__all__ = ["AiterExperts", "LAYOUT_ATTR", "weight_fingerprint"]

LAYOUT_ATTR = "_moe_plugin_rocm_aiter_layout"  # on the layer: {name: (data_ptr, fingerprint)}
_WEIGHTS = ("w13", "w2")


def weight_fingerprint(t: torch.Tensor, chunk: int = 1 << 22) -> int:
    """Order-sensitive hash of a tensor's bytes (a shuffled copy hashes differently). One pass,
    in chunks (bounded temporary memory), one host sync; run at weight-processing time only."""
    data = t.detach().contiguous().view(-1).view(torch.uint8)
    pos = torch.arange(1, min(chunk, data.numel()) + 1, device=data.device, dtype=torch.int64)
    h = torch.zeros((), dtype=torch.int64, device=data.device)
    for part in data.split(chunk):
        h = h * 1000003 + (part.to(torch.int64) * pos[: part.numel()]).sum()  # wraps: fine for a hash
    return int(h) ^ data.numel()


@dataclass(frozen=True)
class _KernelWeights:
    w13: torch.Tensor  # views of the layer's storage, flagged is_shuffled, in the kernel's dtype
    w2: torch.Tensor
    w13_scale: Optional[torch.Tensor]
    w2_scale: Optional[torch.Tensor]
    sink_mask: torch.Tensor  # int32 [E_local + 1], the last (sink) expert off
    rank_mask: torch.Tensor  # int32 [E + 1]: 1 on this rank's experts (MoRI global ids); E: fake id, off


class AiterExperts(Experts):
    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        # the architecture decides the FP8 flavour, once, at plan (build) time
        self.arch = current_arch()
        self.fp8 = fp8_flavour(self.arch)
        self.fnuz = self.fp8.dtype == torch.float8_e4m3fnuz
        from aiter import ActivationType, QuantType
        from aiter.fused_moe import fused_moe
        from aiter.ops.shuffle import shuffle_weight

        self._fused_moe = fused_moe
        self._shuffle_weight = shuffle_weight
        self.activation = {Activation.SILU: ActivationType.Silu, Activation.GELU: ActivationType.Gelu}[cfg.activation]
        # AITER remaps per_128x128 to per_1x128: 128x128 weight blocks, 1x128 activation groups.
        # per_Token: per-output-channel weight scales [E, N, 1], activations one scale per row.
        self.quant_type = {QuantScheme.UNQUANTIZED: QuantType.No,
                           QuantScheme.FP8_BLOCK: QuantType.per_1x128,
                           QuantScheme.FP8_PER_TOKEN: QuantType.per_Token}[cfg.quant]
        self.fp8_weights = cfg.quant in (QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN)
        self.per_token = cfg.quant is QuantScheme.FP8_PER_TOKEN
        if cfg.params_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"aiter fused_moe outputs bf16 or fp16, the layer's params_dtype is {cfg.params_dtype}")
        self.out_dtype = cfg.params_dtype
        self.num_local = cfg.num_local_experts
        self.num_experts = cfg.num_experts
        self.first_expert = cfg.local_expert_range.start
        self.scale = float(cfg.routed_scaling_factor)
        self.wire = ctx.dispatch_dtype
        self._kw: Optional[_KernelWeights] = None
        self._adapter = {
            Format.STANDARD: self._apply_standard,
            Format.EP_NORMAL: self._apply_ep_normal,
            Format.EP_MASKED: self._apply_masked,
        }[ctx.format]

    # ------------------------------------------------------------------ weights

    @torch.no_grad()
    def process_weights(self, layer: "MoELayer") -> None:
        state: dict[str, tuple[int, int]] = dict(getattr(layer, LAYOUT_ATTR, None) or {})
        for name in _WEIGHTS:
            param = getattr(layer, name)
            data = param.data
            if state.get(name) != (data.data_ptr(), weight_fingerprint(data)):
                # fresh (or reloaded) checkpoint layout: convert, then shuffle in place
                if self.fp8_weights and self.fnuz:
                    clear_negative_zero_(data)  # value-preserving in e4m3fn; makes the bits valid e4m3fnuz
                data.copy_(self._shuffle_weight(data))
                state[name] = (data.data_ptr(), weight_fingerprint(data))
            param.is_shuffled = True  # for anyone else reading the layer (re-set after a re-wrap)
        setattr(layer, LAYOUT_ATTR, state)

        views = []
        for name in _WEIGHTS:
            data = getattr(layer, name).data
            view = data.view(self.fp8.dtype) if self.fp8_weights else data.view(data.dtype)
            view.is_shuffled = True  # this object is ours: nobody re-wraps it
            views.append(view)
        scales: list[Optional[torch.Tensor]] = [None, None]
        if self.fp8_weights:
            factor = 2.0 if self.fnuz else 1.0  # fnuz reads the same bits as half the value
            scales = [getattr(layer, f"{n}_scale").float() * factor for n in _WEIGHTS]
            if self.per_token:  # the core's [E, N] per-channel scales as AITER's [E, N, 1]
                scales = [sc.unsqueeze(-1) for sc in scales]
        dev = views[0].device
        sink = torch.ones(self.num_local + 1, dtype=torch.int32, device=dev)
        sink[-1] = 0
        rank = torch.zeros(self.num_experts + 1, dtype=torch.int32, device=dev)
        rank[self.first_expert:self.first_expert + self.num_local] = 1
        self._kw = _KernelWeights(views[0], views[1], scales[0], scales[1], sink, rank)

    # ------------------------------------------------------------------ apply

    def apply(self, layer: "MoELayer", dispatched: Any):
        kw = self._kw
        if kw is None:
            raise RuntimeError("aiter: process_weights(layer) must run before apply")
        return self._adapter(kw, dispatched)

    def _hidden(self, qa: QuantizedActivations) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The activations as fused_moe takes them, and ``a1_scale`` when pre-quantized.

        With FP8 weights the GEMM1 input is always the core scheme's quantization (amax/448
        e4m3fn, per 1x128 group or per token): on gfx950 that is AITER's own dynamic quantization
        of bf16 input; otherwise it is done here and passed pre-quantized (as fnuz on gfx942,
        where AITER would quantize on the fnuz grid, amax/240)."""
        if qa.dtype not in (WireDtype.BF16, WireDtype.FP8):
            raise TypeError(f"aiter takes bf16 or fp8 activations, got {qa.dtype}")
        if not self.fp8_weights:
            return (qa.data, None) if qa.dtype is WireDtype.BF16 else (qa.dequantize(self.out_dtype), None)
        if qa.dtype is WireDtype.BF16 and not self.fnuz:
            return qa.data, None
        if self.per_token:
            # the FP8 wire's 1x128 groups are not per-token scales: requantize (decisions.md 10)
            x = qa.data if qa.dtype is WireDtype.BF16 else qa.dequantize(torch.float32)
            data, scale = quant.quantize_fp8_per_token(x)
        elif qa.dtype is WireDtype.BF16:
            data, scale = quant.quantize_fp8_per_token_group(qa.data)
        else:
            data, scale = qa.data, qa.scale  # already the scheme's 1x128 activations
        lead = data.shape[:-1]
        data, scale = data.reshape(-1, data.shape[-1]), scale.reshape(-1, scale.shape[-1])
        if self.fnuz:
            data, scale = fn_to_fnuz(data, scale)
        return data.view(*lead, data.shape[-1]), scale.view(*lead, scale.shape[-1])

    def _run(self, kw: _KernelWeights, x, a1_scale, weights, ids, mask, num_local_tokens=None) -> torch.Tensor:
        return self._fused_moe(
            x, kw.w13, kw.w2, weights, ids,
            expert_mask=mask, activation=self.activation, quant_type=self.quant_type,
            w1_scale=kw.w13_scale, w2_scale=kw.w2_scale, a1_scale=a1_scale,
            num_local_tokens=num_local_tokens, dtype=self.out_dtype,
        )

    def _sinked(self, kw: _KernelWeights, x, a1_scale, weights, ids) -> torch.Tensor:
        """Local ids with -1 -> sink expert ``E_local`` (masked off)."""
        if ids.shape[0] == 0:
            return torch.empty(0, x.shape[-1], dtype=self.out_dtype, device=x.device)
        ids = torch.where(ids < 0, self.num_local, ids).to(torch.int32)
        weights = weights * self.scale if self.scale != 1.0 else weights
        return self._run(kw, x, a1_scale, weights, ids, kw.sink_mask)

    def _apply_standard(self, kw: _KernelWeights, d: StandardDispatch) -> StandardCombine:
        x, a1 = self._hidden(d.hidden)
        return StandardCombine(self._sinked(kw, x, a1, d.topk.weights, d.topk.ids))

    def _apply_ep_normal(self, kw: _KernelWeights, d: EPNormalDispatch) -> EPNormalCombine:
        x, a1 = self._hidden(d.hidden)
        h = d.handle
        # Which dispatcher fed us is not in the BackendContext; MoRI's handle type says it (one
        # type check per call; see the report: a peer spec in the context would move it to __init__).
        if type(h) is MoriHandle:
            # MoRI: global ids through the rank's expert range; only total_recv rows are valid
            weights = h.recv_weights * self.scale if self.scale != 1.0 else h.recv_weights
            out = self._run(kw, x, a1, weights, h.recv_ids, kw.rank_mask, num_local_tokens=h.total_recv)
            return EPNormalCombine(out, h)
        return EPNormalCombine(self._sinked(kw, x, a1, d.topk.weights, d.topk.ids), h)

    def _apply_masked(self, kw: _KernelWeights, d: EPMaskedDispatch) -> EPMaskedCombine:
        E, C, H = d.hidden.shape
        x, a1 = self._hidden(d.hidden)
        x = x.reshape(E * C, H)
        a1 = None if a1 is None else a1.reshape(E * C, -1)
        slot = torch.arange(C, device=x.device)
        owner = torch.arange(E, device=x.device, dtype=torch.int32)[:, None].expand(E, C)
        ids = torch.where(slot[None, :] < d.masked_m[:, None], owner, self.num_local).reshape(E * C, 1)
        unit = torch.full((E * C, 1), self.scale, dtype=torch.float32, device=x.device)  # unweighted (x rsf)
        out = self._run(kw, x, a1, unit, ids.to(torch.int32), kw.sink_mask) if E * C else \
            torch.empty(0, H, dtype=self.out_dtype, device=x.device)
        return EPMaskedCombine(out.view(E, C, H), d.topk, d.handle)
