"""Entry point of moe-plugin-cuda: static backend declarations (no vendor import here)."""

from __future__ import annotations

from moe_core.plugin_api import (
    Activation,
    BackendPlugin,
    BackendSpec,
    Format,
    QuantScheme,
    Role,
    WireDtype,
    hookimpl,
    register_torch_a2a_kernels,
)

PACKAGE = "moe_plugin_cuda"  # where the specs' impl / probe / check live
_ALL_ACTS = frozenset({Activation.SILU, Activation.GELU})

# Priorities: the planner adds dispatcher + experts priority. The reference experts and the
# standard dispatcher are 0. On an H100 the Triton pipeline measured fastest on every preset, so it outranks
# grouped_mm; cutedsl is for SM100 only (docs/decisions.md, "The CUDA plugin's measured defaults").
PRIORITY_TRITON = 30
# cutlass (SM90) outranks triton: FP8 block: from 128 rows per expert its CUTLASS/DeepGEMM GEMMs made the
# layer up to 18% faster than the Triton kernels (7 of 8 cells at T >= 4096); below that it runs the tuned
# Triton kernels on the checkpoint layout, 0-1% slower than triton's own at T <= 256. bf16: triton's own
# kernels and configs wherever its table does not measure a grouped GEMM faster (H100; the same decisions.md entry)
PRIORITY_CUTLASS = 35
PRIORITY_GROUPED_MM = 20
PRIORITY_CUTEDSL = 40
# deepep outranks torch_a2a (10) wherever both can serve: measured faster on 2x H100 (its priority_reason)
PRIORITY_DEEPEP = 20


class CudaPlugin(BackendPlugin):
    def declared(self, spec) -> bool:
        """Whether ``spec`` is one of this plugin's backends: by its impl, as ``BackendPlugin`` recognises the
        backend objects it built (not by the entry point's name, which an installer may change)."""
        return spec is not None and spec.impl in self._impls

    def backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                name="triton", role=Role.EXPERTS, impl=f"{PACKAGE}.triton.experts:TritonExperts",
                formats=(Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED), devices=frozenset({"cuda"}),
                wire_dtypes=(WireDtype.FP8, WireDtype.BF16),
                quant_schemes=frozenset({QuantScheme.UNQUANTIZED, QuantScheme.FP8_BLOCK}),
                activations=_ALL_ACTS,
                # no host sync: grids are sized from shapes, counts stay on the device
                graph_safe_formats=frozenset({Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED}),
                ep="any", packages=("triton",), priority=PRIORITY_TRITON,
                probe=f"{PACKAGE}.probes:probe_triton", check=f"{PACKAGE}.probes:check_triton",
                description="fused-MoE Triton kernels (bf16/fp16/fp32, FP8 block 128x128 W8A8), tuned configs",
            ),
            BackendSpec(
                name="cutlass", role=Role.EXPERTS, impl=f"{PACKAGE}.cutlass.experts:CutlassExperts",
                formats=(Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED), devices=frozenset({"cuda"}),
                wire_dtypes=(WireDtype.FP8, WireDtype.BF16),
                quant_schemes=frozenset({QuantScheme.FP8_BLOCK, QuantScheme.UNQUANTIZED}),
                activations=frozenset({Activation.SILU}),
                # no host sync: the sort, counts and the GEMMs' per-expert rows stay on the device
                graph_safe_formats=frozenset({Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED}),
                ep="any", packages=("triton", "cutlass_library", "deep_gemm"),
                priority=PRIORITY_CUTLASS, probe=f"{PACKAGE}.probes:probe_cutlass", check=f"{PACKAGE}.probes:check_cutlass",
                description="grouped GEMMs on SM90: CUTLASS/DeepGEMM FP8 128x128 block-scaled and bf16; "
                            "Triton below the tuned crossover",
            ),
            BackendSpec(
                name="grouped_mm", role=Role.EXPERTS, impl=f"{PACKAGE}.grouped_mm:GroupedMMExperts",
                formats=(Format.STANDARD, Format.EP_NORMAL), devices=frozenset({"cuda"}),
                wire_dtypes=(WireDtype.BF16,),
                # FP8: torch's grouped FP8 GEMM is row-wise scaled = fp8_per_token's layout; fp8_block
                # requantized per row measured 7% relative error on the H100, so it is not declared
                quant_schemes=frozenset({QuantScheme.UNQUANTIZED, QuantScheme.FP8_PER_TOKEN}),
                activations=_ALL_ACTS,
                graph_safe_formats=frozenset({Format.STANDARD, Format.EP_NORMAL}),
                quantizes_internally=True, ep="any",
                priority=PRIORITY_GROUPED_MM, probe=f"{PACKAGE}.probes:probe_grouped_mm",
                check=f"{PACKAGE}.probes:check_grouped_mm",
                description="torch._grouped_mm (bf16) / torch._scaled_grouped_mm (FP8 per token) on SM90+",
            ),
            BackendSpec(
                name="deepep", role=Role.DISPATCHER, impl=f"{PACKAGE}.deepep:DeepEPDispatcher",
                formats=(Format.EP_NORMAL, Format.EP_MASKED), devices=frozenset({"cuda"}),
                # the V1 API has no NVFP4 wire (planning rejects it with a reason, probes.deepep_problems)
                wire_dtypes=(WireDtype.FP8, WireDtype.BF16),
                # normal mode busy-waits on the host for the receive counts
                graph_safe_formats=frozenset({Format.EP_MASKED}),
                ep="required", packages=("deep_ep",), priority=PRIORITY_DEEPEP, probe=f"{PACKAGE}.probes:probe_deepep",
                priority_reason="DeepEP's NVLink/RDMA kernels: dispatch + combine 1.2-1.4x faster than torch_a2a "
                                "in normal mode (4096 tokens a rank) and 15-18x in low-latency mode (128 tokens) on "
                                "2x H100, H=7168, top-8 of 256 (benchmarks/ep/results/deepep-h100x2.json)",
                check=f"{PACKAGE}.probes:check_deepep",
                description="DeepEP V1 Buffer: normal (intranode/internode) and low-latency all-to-all",
            ),
            BackendSpec(
                name="cutedsl", role=Role.EXPERTS, impl=f"{PACKAGE}.cutedsl:CuteDSLExperts",
                formats=(Format.EP_MASKED,), devices=frozenset({"cuda"}),
                wire_dtypes=(WireDtype.NVFP4, WireDtype.BF16),
                quant_schemes=frozenset({QuantScheme.NVFP4}), activations=frozenset({Activation.SILU}),
                graph_safe_formats=frozenset({Format.EP_MASKED}),
                ep="any", packages=("flashinfer",), priority=PRIORITY_CUTEDSL,
                probe=f"{PACKAGE}.probes:probe_cutedsl", check=f"{PACKAGE}.probes:check_cutedsl",
                description="FlashInfer CuteDSL NVFP4 masked grouped GEMM (SM100/SM103)",
            ),
        ]

    @hookimpl
    def select_dispatch_dtype(self, request):
        """Platform step of the dtype chain: with the ``standard`` dispatcher nothing crosses a wire,
        and the triton / cutlass experts quantize FP8 activations in one Triton kernel of their own,
        cheaper than quantizing in the dispatcher; so keep BF16 there. Every other pair: no opinion."""
        cfg = request.config
        if (request.experts.name in ("triton", "cutlass") and self.declared(request.experts)
                and request.dispatcher is not None and request.dispatcher.name == "standard"
                and cfg.dispatch_dtype == "auto" and WireDtype.BF16 in request.common):
            return request.decide(WireDtype.BF16, f"cuda: no wire with the standard dispatcher; {request.experts.name} "
                                  "quantizes activations in its own kernel", source="cuda")
        return None

    @hookimpl(wrapper=True, specname="select_dispatch_dtype")
    def deepep_validation(self, request):
        """DeepEP's constraints that depend on the chosen format (normal / low-latency) and wire dtype,
        known only here; those the spec's plan-time check already reported are not repeated."""
        decision = yield
        d = request.dispatcher
        if not self.declared(d) or d.name != "deepep" or decision is None or decision.dtype is None:
            return decision
        from moe_plugin_cuda.probes import check_deepep, deepep_problems

        known = set(check_deepep(request.config, d))
        problems = [r for r in deepep_problems(request.config, request.format is Format.EP_MASKED,
                                               str(decision.dtype)) if r not in known]
        if not problems:
            return decision
        return decision.reject(problems[0].code, "; ".join(r.message for r in problems),
                               "; ".join(r.hint for r in problems if r.hint), source="cuda")


plugin = CudaPlugin()
# torch_a2a's exact normal mode on CUDA runs these Triton kernels (decision 63); imported at its first dispatch
register_torch_a2a_kernels("cuda", f"{PACKAGE}.triton.a2a:KERNELS")
