"""The ``rocm`` plugin object (entry point ``moe_core.plugins: rocm``) and its backend specs.

Listing these backends imports neither AITER nor MoRI: implementations and probes are lazy
``"module:attr"`` strings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_core.plugin_api import (
    Activation,
    BackendPlugin,
    BackendSpec,
    Code,
    Format,
    QuantScheme,
    Reason,
    Role,
    WireDtype,
    unavailable,
)
from moe_plugin_rocm import __version__

if TYPE_CHECKING:
    from moe_core.plugin_api import MoEConfig

__all__ = ["RocmPlugin", "plugin", "AITER_SPEC", "MORI_SPEC"]

AITER_INSTALL = ("install AITER built for your ROCm: pip install git+https://github.com/ROCm/aiter "
                 "(or use a ROCm PyTorch image that ships it)")
MORI_INSTALL = ("install MoRI built for your ROCm: pip install git+https://github.com/ROCm/mori "
                "(or use a ROCm PyTorch image that ships it)")

# MoRI combine-payload quantizations exposed through backend_options["mori"]["combine_quant"]
MORI_COMBINE_QUANTS = ("none", "fp8_direct_cast")
MORI_KERNEL_TYPES = ("IntraNode", "InterNode", "InterNodeV1", "InterNodeV1LL", "AsyncLL")


def probe_aiter() -> Reason:
    from moe_plugin_rocm.platform import probe_package

    return probe_package("aiter", ("aiter", "aiter.fused_moe", "aiter.ops.shuffle"), AITER_INSTALL)


def probe_mori() -> Reason:
    from moe_plugin_rocm.platform import probe_package

    return probe_package("mori", ("mori", "mori.ops", "mori.shmem"), MORI_INSTALL)


def check_aiter(config: "MoEConfig", spec: BackendSpec) -> list[Reason]:
    """Shape limits of AITER's fused_moe kernels and its preshuffled weight layout."""
    reasons = []
    H, inter = config.hidden_size, config.intermediate_size
    # shuffle_weight((16, 16)) needs rows % 16 and columns % 32 for w13 [E, 2I, H] and w2 [E, H, I]
    if H % 32 or inter % 32:
        reasons.append(unavailable(
            Code.UNSUPPORTED_SHAPE,
            f"aiter needs hidden_size and intermediate_size divisible by 32 (preshuffled 16x32 weight tiles); "
            f"got H={H}, I={inter}", "pad the layer or use another experts backend"))
    if config.quant is QuantScheme.FP8_BLOCK and (H % 128 or inter % 128):
        reasons.append(unavailable(
            Code.UNSUPPORTED_SHAPE,
            f"aiter FP8 block-scale kernels need hidden_size and intermediate_size divisible by 128; "
            f"got H={H}, I={inter}", "use unquantized weights or another experts backend"))
    if config.params_dtype not in (torch.bfloat16, torch.float16):
        reasons.append(unavailable(
            Code.UNSUPPORTED_SHAPE, f"aiter fused_moe computes in bf16/fp16, params_dtype is {config.params_dtype}",
            "use bf16 or fp16 params"))
    if config.apply_router_weight_on_input:
        reasons.append(unavailable(
            Code.UNSUPPORTED_SHAPE,
            "aiter fused_moe weights after the first GEMM (doweight_stage1), not the input",
            "disable apply_router_weight_on_input or use another experts backend"))
    return reasons


def check_mori(config: "MoEConfig", spec: BackendSpec) -> list[Reason]:
    """MoRI sizes its symmetric buffers from the maximum tokens per rank."""
    reasons = []
    if config.max_tokens_per_rank is None:
        reasons.append(unavailable(
            Code.UNSUPPORTED_SHAPE, "mori allocates its symmetric buffers for a fixed number of tokens per rank",
            "set max_tokens_per_rank in the layer config"))
    options = config.options(spec.name)
    quant = options.get("combine_quant", "none")
    if quant not in MORI_COMBINE_QUANTS:
        reasons.append(unavailable(
            Code.UNSUPPORTED_QUANT, f"mori combine_quant={quant!r} is not supported",
            f"choose one of {', '.join(MORI_COMBINE_QUANTS)}"))
    kernel = options.get("kernel_type", "IntraNode")
    if kernel not in MORI_KERNEL_TYPES:
        reasons.append(unavailable(
            Code.UNSUPPORTED_PARALLEL, f"mori kernel_type={kernel!r} is unknown",
            f"choose one of {', '.join(MORI_KERNEL_TYPES)}"))
    return reasons


AITER_SPEC = BackendSpec(
    name="aiter",
    role=Role.EXPERTS,
    impl="moe_plugin_rocm.aiter_experts:AiterExperts",
    formats=(Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED),
    devices=frozenset({"rocm"}),
    wire_dtypes=(WireDtype.BF16, WireDtype.FP8),
    quant_schemes=frozenset({QuantScheme.UNQUANTIZED, QuantScheme.FP8_BLOCK, QuantScheme.FP8_PER_TOKEN}),
    activations=frozenset({Activation.SILU, Activation.GELU}),
    # fused_moe reads counts and the valid-row count on the device: no host sync in any format
    graph_safe_formats=frozenset({Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED}),
    ep="any",
    packages=("aiter",),
    priority=50,
    probe="moe_plugin_rocm.plugin:probe_aiter",
    check="moe_plugin_rocm.plugin:check_aiter",
    description="AITER fused_moe (CK/asm kernels) with per-format adapters; BF16, FP8 block-scale and FP8 "
                "per-token (fnuz on gfx942, OCP on gfx950); preshuffled weights",
)

MORI_SPEC = BackendSpec(
    name="mori",
    role=Role.DISPATCHER,
    impl="moe_plugin_rocm.mori_dispatcher:MoriDispatcher",
    formats=(Format.EP_NORMAL,),
    devices=frozenset({"rocm"}),
    wire_dtypes=(WireDtype.BF16, WireDtype.FP8),
    ep="required",
    packages=("mori",),
    priority=50,
    probe="moe_plugin_rocm.plugin:probe_mori",
    check="moe_plugin_rocm.plugin:check_mori",
    description="MoRI EpDispatchCombineOp: each token once per destination rank with global ids; "
                "unweighted combine over unique ranks (the experts weight)",
)


class RocmPlugin(BackendPlugin):
    """AITER experts and MoRI dispatcher."""

    version = __version__

    def backends(self) -> list[BackendSpec]:
        return [AITER_SPEC, MORI_SPEC]


plugin = RocmPlugin()
