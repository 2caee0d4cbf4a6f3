"""Plan-time config checks of the Ascend backends (limits that capabilities cannot express).

Each is ``(config, spec) -> list[Reason]``; the planner collects every reason. Numbers come from
the op documentation summarized in ``vendor-apis.md`` sections 6-7.
"""

from __future__ import annotations

import torch

from moe_core.plugin_api import BackendSpec, Code, MoEConfig, QuantScheme, Reason

GMM_MAX_GROUPS = 1024  # npu_grouped_matmul: at most 1024 groups
GMM_MAX_INNER = 65536  # ... and an inner (K) dimension below 65536
LL_MAX_TOKENS = 512  # DeepEP-Ascend low_latency_dispatch: num_tokens <= 512
DEEPEP_MAX_HIDDEN = 7168
FUSED_TOKENS = (1, 256)  # fused_deep_moe: bs in [1, 256]
FUSED_HIDDEN = (512, 7168)
FUSED_INTERMEDIATE = (1024, 6144)
FUSED_MAX_TOPK = 12
FUSED_MAX_EXPERTS = 512
FUSE_MODE_FUSED_DEEP_MOE = 1  # deep_ep.buffer.FuseMode.FUSED_DEEP_MOE
SUPPORTED_FUSE_MODES = (FUSE_MODE_FUSED_DEEP_MOE,)


def _shape(message: str, hint: str) -> Reason:
    return Reason(Code.UNSUPPORTED_SHAPE, message, hint)


def _common(config: MoEConfig, name: str) -> list[Reason]:
    reasons = []
    if config.params_dtype not in (torch.bfloat16, torch.float16):
        reasons.append(_shape(f"{name} computes in bf16/fp16, params_dtype is {config.params_dtype}",
                              "use params_dtype=torch.bfloat16"))
    if config.apply_router_weight_on_input:
        reasons.append(_shape(f"{name} applies the routing weights after the experts "
                              "(apply_router_weight_on_input is not supported)", "use the reference experts"))
    return reasons


def check_npu_gmm(config: MoEConfig, spec: BackendSpec) -> list[Reason]:
    reasons = _common(config, spec.name)
    if config.num_local_experts > GMM_MAX_GROUPS:
        reasons.append(_shape(f"npu_grouped_matmul takes at most {GMM_MAX_GROUPS} groups, "
                              f"got {config.num_local_experts} local experts", "use a larger EP group"))
    if max(config.hidden_size, config.intermediate_size) >= GMM_MAX_INNER:
        reasons.append(_shape(f"npu_grouped_matmul needs inner dims < {GMM_MAX_INNER}", ""))
    if config.quant is QuantScheme.W4A4 and (config.hidden_size % 8 or config.intermediate_size % 8):
        reasons.append(_shape("W4A4 packs 8 int4 values per int32: hidden and intermediate sizes must be "
                              f"multiples of 8, got {config.hidden_size} and {config.intermediate_size}", ""))
    return reasons


def check_deepep_npu(config: MoEConfig, spec: BackendSpec) -> list[Reason]:
    reasons = []
    if config.params_dtype is not torch.bfloat16:
        reasons.append(_shape(f"DeepEP-Ascend carries bf16 activations, params_dtype is {config.params_dtype}",
                              "use params_dtype=torch.bfloat16"))
    if config.hidden_size > DEEPEP_MAX_HIDDEN:
        reasons.append(_shape(f"DeepEP-Ascend supports hidden sizes up to {DEEPEP_MAX_HIDDEN}, "
                              f"got {config.hidden_size}", ""))
    if config.max_tokens_per_rank is not None and config.max_tokens_per_rank > LL_MAX_TOKENS and config.cuda_graph:
        reasons.append(_shape(f"DeepEP-Ascend low-latency dispatch takes at most {LL_MAX_TOKENS} tokens per rank, "
                              f"max_tokens_per_rank={config.max_tokens_per_rank}", f"set max_tokens_per_rank <= {LL_MAX_TOKENS}"))
    return reasons


def fuse_mode(config: MoEConfig, name: str = "fuseep") -> int:
    return int(config.options(name).get("fuse_mode", FUSE_MODE_FUSED_DEEP_MOE))


def check_fuseep(config: MoEConfig, spec: BackendSpec) -> list[Reason]:
    reasons = _common(config, spec.name)
    if config.params_dtype is not torch.bfloat16:
        reasons.append(_shape("fused_deep_moe takes bf16 activations", "use params_dtype=torch.bfloat16"))
    c = config

    def within(value: int, bounds: tuple[int, int], what: str) -> None:
        if not bounds[0] <= value <= bounds[1]:
            reasons.append(_shape(f"fused_deep_moe needs {what} in [{bounds[0]}, {bounds[1]}], got {value}",
                                  "use deepep_npu x npu_gmm for this shape"))

    within(c.hidden_size, FUSED_HIDDEN, "hidden_size")
    within(c.intermediate_size, FUSED_INTERMEDIATE, "intermediate_size")
    if c.intermediate_size % 64:
        reasons.append(_shape(f"fused_deep_moe interleaves gate/up in 64-column tiles: intermediate_size must be a "
                              f"multiple of 64, got {c.intermediate_size}", ""))
    if c.top_k > FUSED_MAX_TOPK:
        reasons.append(_shape(f"fused_deep_moe supports top_k <= {FUSED_MAX_TOPK}, got {c.top_k}", ""))
    if c.num_experts > FUSED_MAX_EXPERTS:
        reasons.append(_shape(f"fused_deep_moe supports at most {FUSED_MAX_EXPERTS} experts, got {c.num_experts}", ""))
    if c.max_tokens_per_rank is None:
        reasons.append(_shape("fused_deep_moe sizes its buffer from max_tokens_per_rank, which is not set",
                              f"set max_tokens_per_rank (1..{FUSED_TOKENS[1]})"))
    else:
        within(c.max_tokens_per_rank, FUSED_TOKENS, "max_tokens_per_rank")
    mode = fuse_mode(c, spec.name)
    if mode not in SUPPORTED_FUSE_MODES:
        # Mode 2 (DispatchFFNCombine): the references say only that SGLang applies a "128-tile scale
        # permute" and passes scales as int64 bit patterns of fp32, for modelslim checkpoints; the permute
        # itself is not defined anywhere we have, so we cannot lay the weights out for it.
        reasons.append(Reason(Code.DISABLED, f"fuse_mode={mode} is not supported by this plugin: mode 2 "
                              "(DispatchFFNCombine) needs modelslim weights and a 128-tile scale permute that "
                              "no documentation available to us defines",
                              "use backend_options={'fuseep': {'fuse_mode': 1}} (FUSED_DEEP_MOE)"))
    return reasons
