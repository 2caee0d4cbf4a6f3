"""The ``npu`` plugin object: backend declarations and the Ascend dispatch-dtype rules.

Entry point (pyproject.toml)::

    [project.entry-points."moe_core.plugins"]
    npu = "moe_plugin_npu.plugin:plugin"

Importing this module imports no vendor library: implementations and probes are lazy strings.
"""

from __future__ import annotations

from typing import Optional

from moe_core.plugin_api import (
    Activation,
    BackendPlugin,
    BackendSpec,
    Code,
    DtypeDecision,
    DtypeRequest,
    Format,
    QuantScheme,
    Role,
    WireDtype,
    hookimpl,
)

NPU = frozenset({"npu"})
SOURCE = "npu"  # name recorded in the plan's dtype trail

# Ranking (the planner adds dispatcher + experts priorities for a pair; a fused backend counts its
# own): deepep_npu x npu_gmm = 60 beats torch_a2a (10) / standard (0) with the reference experts
# (0); fuseep = 100 beats every pair wherever its capabilities (W8A8 INT8, EP) and checks pass.
PRIORITY_NPU_GMM = 30
PRIORITY_DEEPEP_NPU = 30
PRIORITY_FUSEEP = 100


class NpuPlugin(BackendPlugin):
    """Ascend backends: ``npu_gmm`` (experts), ``deepep_npu`` (dispatcher), ``fuseep`` (fused)."""

    def backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                name="npu_gmm", role=Role.EXPERTS, impl="moe_plugin_npu.experts:NpuGmmExperts",
                formats=(Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED), devices=NPU,
                wire_dtypes=(WireDtype.BF16, WireDtype.INT8),
                quant_schemes=frozenset({QuantScheme.UNQUANTIZED, QuantScheme.INT8_W8A8, QuantScheme.W4A4}),
                activations=frozenset({Activation.SILU}),
                graph_safe_formats=frozenset({Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED}),
                ep="any", packages=("torch_npu",), priority=PRIORITY_NPU_GMM,
                probe="moe_plugin_npu.probes:probe_npu_gmm", check="moe_plugin_npu.checks:check_npu_gmm",
                description="torch_npu npu_grouped_matmul pipelines (BF16, W8A8 INT8 and W4A4 dynamic); "
                            "STANDARD/EP_NORMAL via init/finalize routing, EP_MASKED via group lists",
            ),
            BackendSpec(
                name="deepep_npu", role=Role.DISPATCHER, impl="moe_plugin_npu.dispatcher:DeepEPNpuDispatcher",
                formats=(Format.EP_NORMAL, Format.EP_MASKED), devices=NPU,
                wire_dtypes=(WireDtype.BF16, WireDtype.INT8),
                graph_safe_formats=frozenset({Format.EP_MASKED}), ep="required", packages=("torch_npu", "deep_ep"),
                priority=PRIORITY_DEEPEP_NPU,
                probe="moe_plugin_npu.probes:probe_deepep_npu", check="moe_plugin_npu.checks:check_deepep_npu",
                description="DeepEP for Ascend: normal (EP_NORMAL) and low-latency (EP_MASKED); INT8 per-token "
                            "wire (its use_fp8 flag) or BF16",
            ),
            BackendSpec(
                name="fuseep", role=Role.FUSED, impl="moe_plugin_npu.fuseep:FuseEP",
                formats=(Format.FUSED,), devices=NPU, wire_dtypes=(WireDtype.INT8,),
                quant_schemes=frozenset({QuantScheme.INT8_W8A8}), activations=frozenset({Activation.SILU}),
                graph_safe_formats=frozenset({Format.FUSED}), ep="required", packages=("torch_npu", "deep_ep"),
                priority=PRIORITY_FUSEEP,
                probe="moe_plugin_npu.probes:probe_fuseep", check="moe_plugin_npu.checks:check_fuseep",
                description="DeepEP-Ascend fused_deep_moe: dispatch + W8A8 INT8 experts + combine in one call",
            ),
        ]

    # ------------------------------------------------------------------ dispatch dtype

    @hookimpl(specname="select_dispatch_dtype")
    def npu_dispatch_dtype(self, request: DtypeRequest) -> Optional[DtypeDecision]:
        """Steps 2-3 of the chain on Ascend: what the quant scheme needs, then the platform default."""
        cfg = request.config
        if cfg.device != "npu":
            return None
        if cfg.quant is QuantScheme.INT8_W8A8:
            if WireDtype.INT8 in request.common:
                return request.decide(WireDtype.INT8, "NPU W8A8 experts take per-token INT8 activations "
                                      "(DeepEP-Ascend's use_fp8 flag means INT8)", source=SOURCE)
            return request.decide(WireDtype.BF16, "NPU W8A8: INT8 not carried by both sides, BF16 and the "
                                  "experts quantize per token", source=SOURCE)
        if cfg.quant is QuantScheme.W4A4:
            return request.decide(WireDtype.BF16, "NPU W4A4 experts quantize to INT4 themselves: BF16 on the wire",
                                  source=SOURCE)
        return request.decide(WireDtype.BF16, "NPU platform default", source=SOURCE)

    @hookimpl(wrapper=True, specname="select_dispatch_dtype")
    def ascend_dtype_validation(self, request: DtypeRequest):
        """Hardware validation on Ascend: no FP8 wire (becomes INT8, with a warning), no NVFP4."""
        decision = yield
        if request.config.device != "npu" or decision is None or decision.dtype is None:
            return decision
        if decision.dtype is WireDtype.FP8:
            return decision.then(WireDtype.INT8, "Ascend has no FP8 dispatch: FP8 requested, INT8 per-token used "
                                 "instead", source=SOURCE, warning=True)
        if decision.dtype is WireDtype.NVFP4:
            return decision.reject(Code.UNSUPPORTED_QUANT, "NVFP4 dispatch is not supported on Ascend",
                                   "use --dispatch-dtype int8 or bf16 on npu (NVFP4 needs CUDA SM100+)",
                                   source=SOURCE)
        return decision


plugin = NpuPlugin()
