"""Deliberately broken backends the conformance kit must catch (test support for tests/conformance).

Importable by name (the tests put this directory on ``sys.path``) so that spawned EP workers can
build the same plugin manager through ``manager_factory="moe_kit_broken_backends:make_manager"``.
Each backend is the reference experts (or the torch_a2a dispatcher) with one realistic bug.
"""

from __future__ import annotations

import dataclasses

import torch

from moe_core import quant
from moe_core.backends import BackendSpec, Role
from moe_core.contracts import Activation, EPNormalDispatch, Format, QuantScheme, StandardCombine, WireDtype
from moe_core.distributed.torch_a2a import TorchA2ADispatcher
from moe_core.plugins import BackendPlugin, PluginManager
from moe_core.reference.experts import ReferenceExperts, gated_activation

HERE = __name__


class WrongWeighting(ReferenceExperts):
    """Applies the top-k weights twice (a kernel weighting the output while the caller also did)."""

    def apply(self, layer, dispatched):
        t = dispatched.topk
        twice = dataclasses.replace(dispatched, topk=type(t)(t.weights * t.weights, t.ids))
        return super().apply(layer, twice)


class OffByOneCounts(ReferenceExperts):
    """Computes each expert's segment of the sorted token list with an off-by-one count: the last
    (token, k) slot of every expert is dropped."""

    def _apply_token_list(self, d):
        ids = d.topk.ids
        flat = ids.reshape(-1).long()
        keep = torch.ones_like(flat, dtype=torch.bool)
        for e in range(self.w13.shape[0]):
            slots = (flat == e).nonzero().flatten()
            if slots.numel():
                keep[slots[-1]] = False  # counts[e] - 1 rows processed
        dropped = torch.where(keep.view_as(ids), ids, torch.full_like(ids, -1))
        return super()._apply_token_list(dataclasses.replace(d, topk=type(d.topk)(d.topk.weights, dropped)))


class ClaimsFP8(ReferenceExperts):
    """Declares fp8_block but ignores the block scales (treats raw fp8 values as the weights)."""

    def process_weights(self, layer):
        super().process_weights(layer)
        if self.config.quant is QuantScheme.FP8_BLOCK:
            self.w13, self.w2 = layer.w13.float(), layer.w2.float()


class UnwrittenRows(ReferenceExperts):
    """Allocates its output with ``torch.empty`` and writes only tokens that have an expert."""

    def apply(self, layer, dispatched):
        out = super().apply(layer, dispatched)
        if not isinstance(out, StandardCombine):
            return out
        routed = (dispatched.topk.ids >= 0).any(dim=1)
        result = torch.empty_like(out.hidden)
        result[routed] = out.hidden[routed]
        return StandardCombine(result)


class NotIdempotent(ReferenceExperts):
    """process_weights rescales the loaded weights in place (a second call doubles them)."""

    def process_weights(self, layer):
        with torch.no_grad():
            layer.w2.mul_(2.0)  # "fold a factor 2 into w2", undone in apply
        super().process_weights(layer)

    def apply(self, layer, dispatched):
        out = super().apply(layer, dispatched)
        return dataclasses.replace(out, hidden=out.hidden / 2)


class DropsScaling(ReferenceExperts):
    """Ignores ``routed_scaling_factor`` (DeepSeek-V3's 2.5): the output is 1/2.5 of what it must be."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.scale = 1.0


class SiluForGelu(ReferenceExperts):
    """Declares SiLU and GELU but always computes SiLU (a kernel with the activation hard-wired)."""

    def __init__(self, ctx) -> None:
        super().__init__(ctx)
        self.glu = gated_activation(Activation.SILU)


class MirroredRounding(ReferenceExperts):
    """Not broken: an FP8 backend whose error against the exact float64 math is exactly ``FACTOR``
    times the reference's, mirrored (``exact - FACTOR * (ref - exact)``), so it is far from the
    reference (``(1 + FACTOR)`` times the reference's error) and the kit must decide by its
    exact-math rule: the allowed ratio is 2x over 1-4 token slots, 1.5x beyond."""

    FACTOR = 1.8

    def apply(self, layer, dispatched):
        from moe_core.reference.oracle import moe_float64

        out = super().apply(layer, dispatched)
        w13, w2 = quant.dequantize_weights(layer.weight_tensors(), self.config.quant)
        cfg = self.config
        exact = moe_float64(dispatched.hidden.dequantize(torch.float32), dispatched.topk.weights,
                            dispatched.topk.ids, w13, w2, activation=cfg.activation,
                            routed_scaling_factor=cfg.routed_scaling_factor,
                            apply_router_weight_on_input=cfg.apply_router_weight_on_input)
        mirrored = exact - self.FACTOR * (out.hidden.double() - exact)
        return StandardCombine(mirrored.to(out.hidden.dtype))


class OffByOneDispatcher(TorchA2ADispatcher):
    """torch_a2a whose EP_NORMAL expert_counts are off by one for local expert 0."""

    def dispatch(self, hidden_states, topk):
        d = super().dispatch(hidden_states, topk)
        if isinstance(d, EPNormalDispatch):
            counts = d.expert_counts.clone()
            counts[0] += 1
            d = dataclasses.replace(d, expert_counts=counts, expert_counts_host=None)
        return d


def _experts(name: str, cls: str, **kw) -> BackendSpec:
    fields = dict(name=name, role=Role.EXPERTS, impl=f"{HERE}:{cls}", formats=(Format.STANDARD,),
                  devices=frozenset({"cpu"}), wire_dtypes=(WireDtype.BF16,), ep="any")
    return BackendSpec(**{**fields, **kw})


class BrokenPlugin(BackendPlugin):
    def backends(self) -> list[BackendSpec]:
        return [
            _experts("wrong_weighting", "WrongWeighting"),
            _experts("off_by_one", "OffByOneCounts"),
            _experts("claims_fp8", "ClaimsFP8", wire_dtypes=(WireDtype.BF16, WireDtype.FP8),
                     quant_schemes=frozenset({QuantScheme.UNQUANTIZED, QuantScheme.FP8_BLOCK})),
            _experts("unwritten_rows", "UnwrittenRows"),
            _experts("not_idempotent", "NotIdempotent"),
            _experts("drops_scaling", "DropsScaling"),
            _experts("silu_for_gelu", "SiluForGelu", activations=frozenset({Activation.SILU, Activation.GELU})),
            _experts("mirrored_rounding", "MirroredRounding", wire_dtypes=(WireDtype.FP8,),
                     quant_schemes=frozenset({QuantScheme.FP8_BLOCK})),
            BackendSpec(name="bad_counts", role=Role.DISPATCHER, impl=f"{HERE}:OffByOneDispatcher",
                        formats=(Format.EP_NORMAL,), devices=frozenset({"cpu"}), wire_dtypes=(WireDtype.BF16,),
                        ep="required"),
        ]


class _EntryPoint:
    """Stands in for an installed entry point (``PluginManager(entry_points=...)``)."""

    def __init__(self, name: str, obj) -> None:
        self.name, self.value, self.dist, self._obj = name, f"{HERE}:plugin", None, obj

    def load(self):
        return self._obj


plugin = BrokenPlugin()


def make_manager() -> PluginManager:
    """Reference backends + the broken plugin (no installed plugins)."""
    return PluginManager(entry_points=[_EntryPoint("broken", plugin)])


__all__ = ["make_manager", "plugin", "quant"]
