"""Layer configuration (``MoEConfig``), router configuration and published model presets."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from moe_core.contracts import Activation, Format, QuantScheme, WireDtype

__all__ = ["MoEConfig", "RouterConfig", "PRESETS", "preset", "scaled_preset", "DEVICE_KINDS"]

DEVICE_KINDS = ("cpu", "cuda", "rocm", "npu")
AUTO = "auto"


@dataclass(frozen=True)
class RouterConfig:
    """Reference router: scores -> (optionally grouped) top-k -> renormalize -> scale.

    ``scoring``: ``"softmax"`` or ``"sigmoid"``. Grouped top-k (DeepSeek-V3) keeps the best
    ``topk_group`` of ``num_expert_group`` groups, a group's score being the sum of its two best
    biased scores. ``correction_bias`` only affects selection, not the weights.
    """

    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    use_correction_bias: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"RouterConfig.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError("RouterConfig: set both num_expert_group and topk_group, or neither")


@dataclass(frozen=True)
class MoEConfig:
    """Everything the planner needs to choose backends for one MoE layer.

    Sizes are global (``num_experts`` over the whole EP group). ``dispatcher``, ``experts`` and
    ``dispatch_dtype`` are user choices: ``"auto"`` lets the planner negotiate; a name fails
    closed. ``backend_options`` carries per-backend settings keyed by backend name (for example
    ``{"fuseep": {"fuse_mode": 2}}``), so no backend reads an environment variable.
    """

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    activation: Activation = Activation.SILU
    quant: QuantScheme = QuantScheme.UNQUANTIZED
    params_dtype: torch.dtype = torch.bfloat16
    routed_scaling_factor: float = 1.0
    apply_router_weight_on_input: bool = False
    router: RouterConfig = field(default_factory=RouterConfig)
    # parallelism
    ep_size: int = 1
    ep_rank: int = 0
    ep_group: Any = field(default=None, compare=False, hash=False, repr=False)
    max_tokens_per_rank: Optional[int] = None  # capacity of masked (low-latency) dispatch
    # execution
    device: str = "cpu"  # device kind: cpu, cuda, rocm, npu
    cuda_graph: bool = False
    # user choices
    dispatcher: str = AUTO
    experts: str = AUTO
    dispatch_dtype: str = AUTO
    dispatch_format: str = AUTO  # ep_normal / ep_masked / standard: restrict the dispatch format
    backend_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "ep_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"MoEConfig.ep_rank={self.ep_rank} not in [0, ep_size={self.ep_size})")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"MoEConfig.num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}: "
                "experts are split evenly over the EP group"
            )
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"MoEConfig.device must be one of {DEVICE_KINDS}, got {self.device!r}")
        if self.max_tokens_per_rank is not None and self.max_tokens_per_rank < 1:
            raise ValueError("MoEConfig.max_tokens_per_rank must be positive")
        # accept strings for enums, so configs can come from JSON / the CLI
        object.__setattr__(self, "activation", Activation(self.activation))
        object.__setattr__(self, "quant", QuantScheme(self.quant))
        if self.dispatch_dtype != AUTO:
            object.__setattr__(self, "dispatch_dtype", str(WireDtype(self.dispatch_dtype)))
        if self.dispatch_format != AUTO:
            object.__setattr__(self, "dispatch_format", str(Format(self.dispatch_format)))
        if self.params_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"MoEConfig.params_dtype must be bf16, fp16 or fp32, got {self.params_dtype}")

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def local_expert_range(self) -> range:
        n = self.num_local_experts
        return range(self.ep_rank * n, (self.ep_rank + 1) * n)

    def options(self, backend: str) -> Mapping[str, Any]:
        return self.backend_options.get(backend, {})

    def replace(self, **changes: Any) -> "MoEConfig":
        return dataclasses.replace(self, **changes)


# Published sizes (config.json of each model on the Hugging Face hub).
PRESETS: dict[str, dict[str, Any]] = {
    "mixtral-8x7b": dict(
        num_experts=8, top_k=2, hidden_size=4096, intermediate_size=14336,
        router=RouterConfig(scoring="softmax", renormalize=True),
    ),
    "qwen3-30b-a3b": dict(
        num_experts=128, top_k=8, hidden_size=2048, intermediate_size=768,
        router=RouterConfig(scoring="softmax", renormalize=True),
    ),
    "qwen3-235b-a22b": dict(
        num_experts=128, top_k=8, hidden_size=4096, intermediate_size=1536,
        router=RouterConfig(scoring="softmax", renormalize=True),
    ),
    "deepseek-v3": dict(
        num_experts=256, top_k=8, hidden_size=7168, intermediate_size=2048,
        routed_scaling_factor=2.5,
        router=RouterConfig(
            scoring="sigmoid", renormalize=True, num_expert_group=8, topk_group=4,
            use_correction_bias=True,
        ),
    ),
}


def preset(name: str, **overrides: Any) -> MoEConfig:
    """``MoEConfig`` of a published model, with overrides (``quant=``, ``ep_size=``, ...)."""
    try:
        base = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known: {', '.join(sorted(PRESETS))}") from None
    return MoEConfig(**{**base, **overrides})


def scaled_preset(name: str, scale: int, **overrides: Any) -> MoEConfig:
    """``preset(name)`` with its hidden and intermediate sizes divided by ``scale`` (kept multiples of
    16, at least 16): the same layer's shape at a size a CPU runs in seconds (``moe-core demo``/``bench``)."""
    if scale < 1:
        raise ValueError(f"scale must be >= 1, got {scale!r}")
    base = preset(name)
    sizes = {k: max(16, getattr(base, k) // scale // 16 * 16) if scale > 1 else getattr(base, k)
             for k in ("hidden_size", "intermediate_size")}
    return preset(name, **{**sizes, **overrides})
