"""Layer configuration (``MoEConfig``), router configuration and published model presets."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch

from moe_core.contracts import Activation, Format, QuantScheme, WireDtype
from moe_core.devices import DEVICE_KINDS

__all__ = ["MoEConfig", "RouterConfig", "PRESETS", "preset", "scaled_preset", "DEVICE_KINDS"]

AUTO = "auto"


@dataclass(frozen=True)
class RouterConfig:
    """Reference router: scores -> (optionally grouped) top-k -> renormalize -> scale.

    ``scoring``: ``"softmax"`` or ``"sigmoid"``. Grouped top-k (DeepSeek-V3) keeps the best
    ``topk_group`` of ``num_expert_group`` groups, a group's score being the sum of its two best
    biased scores. ``correction_bias`` only affects selection, not the weights.

    ``group_scoring`` says how a group is scored: ``"top2_sum"`` (DeepSeek-V3, GLM4-MoE: the sum
    of its two best, with or without a correction bias), ``"max"`` (DeepSeek-V2's
    ``group_limited_greedy``: its best expert) or ``"auto"`` (``top2_sum`` with a correction
    bias, ``max`` without: the behaviour before the option existed).
    """

    scoring: str = "softmax"
    renormalize: bool = True
    num_expert_group: Optional[int] = None
    topk_group: Optional[int] = None
    use_correction_bias: bool = False
    group_scoring: str = "auto"

    def __post_init__(self) -> None:
        if self.scoring not in ("softmax", "sigmoid"):
            raise ValueError(f"RouterConfig.scoring must be 'softmax' or 'sigmoid', got {self.scoring!r}")
        if self.group_scoring not in ("auto", "top2_sum", "max"):
            raise ValueError(f"RouterConfig.group_scoring must be 'auto', 'top2_sum' or 'max', got {self.group_scoring!r}")
        if (self.num_expert_group is None) != (self.topk_group is None):
            raise ValueError("RouterConfig: set both num_expert_group and topk_group, or neither")
        for name in ("num_expert_group", "topk_group"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or value < 1):
                raise ValueError(f"RouterConfig.{name} must be a positive int or None, got {value!r}")
        if self.topk_group is not None and self.topk_group > self.num_expert_group:
            raise ValueError(f"RouterConfig.topk_group={self.topk_group} exceeds "
                             f"num_expert_group={self.num_expert_group}")


@dataclass(frozen=True)
class MoEConfig:
    """Everything the planner needs to choose backends for one MoE layer.

    Sizes are global (``num_experts`` over the whole EP group). ``dispatcher``, ``experts`` and
    ``dispatch_dtype`` are user choices: ``"auto"`` lets the planner negotiate; a name fails
    closed. ``backend_options`` carries per-backend settings keyed by backend name (for example
    ``{"fuseep": {"fuse_mode": 2}}``), so no backend reads an environment variable.

    Model features (docs/decisions.md, "model coverage"): ``expert_bias`` adds ``w13_bias
    [E, 2I]`` / ``w2_bias [E, H]`` to every expert (gpt-oss); ``swiglu_alpha`` / ``swiglu_limit``
    parametrize ``Activation.SWIGLU_OAI``; ``shared_intermediate_size > 0`` adds shared experts
    (one dense gated MLP of that width, run on every token beside the routed ones), behind a
    per-token sigmoid gate ``sigmoid(x @ shared_gate)`` when ``shared_expert_gate`` (Qwen2-MoE).
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
    # model features
    expert_bias: bool = False
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0
    shared_expert_gate: bool = False

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "hidden_size", "intermediate_size", "ep_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:  # not isinstance: True is an int
                raise ValueError(f"MoEConfig.{name} must be a positive int, got {value!r}")
        if type(self.ep_rank) is not int:
            raise ValueError(f"MoEConfig.ep_rank must be an int, got {self.ep_rank!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if (isinstance(self.routed_scaling_factor, bool) or not isinstance(self.routed_scaling_factor, (int, float))
                or not math.isfinite(self.routed_scaling_factor) or self.routed_scaling_factor <= 0):
            raise ValueError(f"MoEConfig.routed_scaling_factor must be a finite positive number, "
                             f"got {self.routed_scaling_factor!r}")
        self._check_router()
        if not 0 <= self.ep_rank < self.ep_size:
            raise ValueError(f"MoEConfig.ep_rank={self.ep_rank} not in [0, ep_size={self.ep_size})")
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"MoEConfig.num_experts={self.num_experts} is not divisible by ep_size={self.ep_size}: "
                "experts are split evenly over the EP group"
            )
        if self.device not in DEVICE_KINDS:
            raise ValueError(f"MoEConfig.device must be one of {DEVICE_KINDS}, got {self.device!r}")
        if self.max_tokens_per_rank is not None and (type(self.max_tokens_per_rank) is not int
                                                     or self.max_tokens_per_rank < 1):
            raise ValueError(f"MoEConfig.max_tokens_per_rank must be a positive int or None, "
                             f"got {self.max_tokens_per_rank!r}")
        # accept strings for enums, so configs can come from JSON / the CLI
        object.__setattr__(self, "activation", Activation(self.activation))
        object.__setattr__(self, "quant", QuantScheme(self.quant))
        if self.dispatch_dtype != AUTO:
            object.__setattr__(self, "dispatch_dtype", str(WireDtype(self.dispatch_dtype)))
        if self.dispatch_format != AUTO:
            object.__setattr__(self, "dispatch_format", str(Format(self.dispatch_format)))
        if self.params_dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"MoEConfig.params_dtype must be bf16, fp16 or fp32, got {self.params_dtype}")
        if not isinstance(self.shared_intermediate_size, int) or self.shared_intermediate_size < 0:
            raise ValueError(f"MoEConfig.shared_intermediate_size must be an int >= 0 (0: no shared experts), "
                             f"got {self.shared_intermediate_size!r}")
        if self.shared_expert_gate and not self.shared_intermediate_size:
            raise ValueError("MoEConfig.shared_expert_gate=True needs shared experts (shared_intermediate_size > 0)")

    def _check_router(self) -> None:
        """Grouped top-k must be satisfiable: the kept groups hold at least top_k experts."""
        groups, kept = self.router.num_expert_group, self.router.topk_group
        if groups is None:
            return
        if self.num_experts % groups:
            raise ValueError(f"RouterConfig.num_expert_group={groups} does not divide num_experts={self.num_experts}")
        if kept * (self.num_experts // groups) < self.top_k:
            raise ValueError(f"RouterConfig.topk_group={kept} of num_expert_group={groups} keeps "
                             f"{kept * (self.num_experts // groups)} of num_experts={self.num_experts} experts, "
                             f"fewer than top_k={self.top_k}: raise topk_group to at least "
                             f"{-(-self.top_k // (self.num_experts // groups))}")

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

    @classmethod
    def from_hf_config(cls, hf_config: Any, layer_idx: Optional[int] = None, **overrides: Any) -> Optional["MoEConfig"]:
        """The ``MoEConfig`` of layer ``layer_idx`` of a Hugging Face transformers config object
        (``AutoConfig.from_pretrained(...)``; transformers itself is not imported), or ``None`` when
        that layer is dense (DeepSeek's first ``first_k_dense_replace`` layers, Qwen's
        ``mlp_only_layers``, Llama-4's non-MoE layers). ``layer_idx=None``: the first MoE layer's.

        Families: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, DeepSeek-V2/V3, GLM4-MoE, ERNIE-4.5-MoE,
        MiniMax-M2, Llama-4 (its ``text_config``), gpt-oss. ``params_dtype`` comes from the
        config's dtype (bf16 if unset); ``overrides`` (``quant=``, ``ep_size=``, ``device=``, ...)
        win. Another ``model_type`` raises ``ValueError`` naming the known ones.
        """
        return _from_hf_config(cls, hf_config, layer_idx, overrides)


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


# --------------------------------------------------------------------------- Hugging Face configs

_HF_ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu": Activation.GELU}


def _hf_dense_layer(model_type: str, c: Any, layer_idx: int) -> bool:
    """Whether layer ``layer_idx`` of ``c`` is a dense MLP (the modeling files' own conditions)."""
    if model_type in ("qwen2_moe", "qwen3_moe"):
        return (layer_idx in (getattr(c, "mlp_only_layers", None) or [])
                or (layer_idx + 1) % getattr(c, "decoder_sparse_step", 1) != 0)
    if model_type in ("deepseek_v2", "deepseek_v3", "glm4_moe"):
        return layer_idx < (getattr(c, "first_k_dense_replace", 0) or 0)
    if model_type == "ernie4_5_moe":
        return not ((layer_idx + 1) % c.moe_layer_interval == 0
                    and c.moe_layer_start_index <= layer_idx <= c.moe_layer_end_index)
    if model_type == "llama4_text":
        return layer_idx not in c.moe_layers
    return False


def _hf_family(model_type: str, c: Any) -> dict[str, Any]:
    """The family-specific part of the ``MoEConfig`` (routers as each modeling file computes them)."""
    get = lambda name, default=None: getattr(c, name, default)  # noqa: E731
    if model_type in ("mixtral", "minimax_m2", "gpt_oss"):
        sizes = dict(num_experts=c.num_local_experts, intermediate_size=c.intermediate_size)
    elif model_type in ("qwen2_moe", "qwen3_moe", "olmoe", "ernie4_5_moe"):
        sizes = dict(num_experts=c.num_experts, intermediate_size=get("moe_intermediate_size") or c.intermediate_size)
    elif model_type == "llama4_text":
        sizes = dict(num_experts=c.num_local_experts, intermediate_size=c.intermediate_size)
    else:  # deepseek_v2, deepseek_v3, glm4_moe
        sizes = dict(num_experts=c.n_routed_experts, intermediate_size=c.moe_intermediate_size)
    if model_type in ("mixtral", "gpt_oss"):  # softmax over the top-k logits
        out = dict(router=RouterConfig(scoring="softmax", renormalize=True))
        if model_type == "gpt_oss":  # expert biases, clamped SwiGLU (router bias: in the logits)
            out.update(expert_bias=True, activation=Activation.SWIGLU_OAI,
                       swiglu_limit=float(get("swiglu_limit", 7.0)), swiglu_alpha=1.702)
    elif model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
        out = dict(router=RouterConfig(scoring="softmax", renormalize=bool(get("norm_topk_prob", False))))
        if model_type == "qwen2_moe" and get("shared_expert_intermediate_size", 0):
            out.update(shared_intermediate_size=c.shared_expert_intermediate_size, shared_expert_gate=True)
    elif model_type in ("deepseek_v3", "glm4_moe"):
        groups = get("n_group") or 1
        out = dict(router=RouterConfig(scoring="sigmoid", renormalize=bool(get("norm_topk_prob", True)),
                                       num_expert_group=groups if groups > 1 else None,
                                       topk_group=get("topk_group") if groups > 1 else None,
                                       use_correction_bias=True, group_scoring="top2_sum"),
                   routed_scaling_factor=float(get("routed_scaling_factor", 1.0)))
    elif model_type == "deepseek_v2":  # softmax, no renormalization, groups scored by their best expert
        grouped = get("topk_method") == "group_limited_greedy"
        out = dict(router=RouterConfig(scoring="softmax", renormalize=False,
                                       num_expert_group=c.n_group if grouped else None,
                                       topk_group=c.topk_group if grouped else None, group_scoring="max"),
                   routed_scaling_factor=float(get("routed_scaling_factor", 1.0)))
    elif model_type == "ernie4_5_moe":  # softmax + correction bias ([1, E] in the checkpoint), renormalized
        out = dict(router=RouterConfig(scoring="softmax", renormalize=True, use_correction_bias=True))
    elif model_type == "minimax_m2":
        out = dict(router=RouterConfig(scoring="sigmoid", renormalize=True, use_correction_bias=True))
    else:  # llama4_text: sigmoid of the top-1 logit, applied to the input
        out = dict(router=RouterConfig(scoring="sigmoid", renormalize=False), apply_router_weight_on_input=True)
    n_shared = {"deepseek_v2": "n_shared_experts", "deepseek_v3": "n_shared_experts", "glm4_moe": "n_shared_experts",
                "ernie4_5_moe": "moe_num_shared_experts"}.get(model_type)
    if n_shared and get(n_shared):
        out["shared_intermediate_size"] = get(n_shared) * sizes["intermediate_size"]
    if model_type == "llama4_text":
        out["shared_intermediate_size"] = c.intermediate_size
    return {**sizes, **out}


_HF_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "glm4_moe",
                "ernie4_5_moe", "minimax_m2", "llama4_text", "gpt_oss")


def _from_hf_config(cls: type, hf_config: Any, layer_idx: Optional[int],
                    overrides: Mapping[str, Any]) -> Optional[MoEConfig]:
    c = getattr(hf_config, "text_config", None) or hf_config  # Llama-4 and other multimodal wrappers
    model_type = getattr(c, "model_type", None)
    if model_type == "llama4":
        model_type = "llama4_text"
    if model_type not in _HF_FAMILIES:
        raise ValueError(f"MoEConfig.from_hf_config: model_type={model_type!r} is not supported; "
                         f"known: {', '.join(_HF_FAMILIES)}")
    if layer_idx is None:
        moe = [i for i in range(c.num_hidden_layers) if not _hf_dense_layer(model_type, c, i)]
        if not moe:
            return None
        layer_idx = moe[0]
    elif not 0 <= layer_idx < c.num_hidden_layers:
        raise ValueError(f"MoEConfig.from_hf_config: layer_idx={layer_idx} not in [0, {c.num_hidden_layers})")
    if _hf_dense_layer(model_type, c, layer_idx):
        return None
    act = getattr(c, "hidden_act", "silu")
    if act not in _HF_ACTIVATIONS:
        raise ValueError(f"MoEConfig.from_hf_config: hidden_act={act!r} is not supported; known: "
                         f"{', '.join(_HF_ACTIVATIONS)}")
    dtype = getattr(c, "dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    fields: dict[str, Any] = dict(top_k=c.num_experts_per_tok, hidden_size=c.hidden_size,
                                  activation=_HF_ACTIVATIONS[act],
                                  params_dtype=dtype if dtype in (torch.bfloat16, torch.float16, torch.float32)
                                  else torch.bfloat16)
    fields.update(_hf_family(model_type, c))
    fields.update(overrides)
    return cls(**fields)
