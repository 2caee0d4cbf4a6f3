"""Hugging Face transformers: every MoE layer of a supported family through a planned ``MoELayer``.

    import moe_core.integrations.transformers as moe_hf
    moe_hf.register()
    model = AutoModelForCausalLM.from_pretrained(path, experts_implementation="moe_core")
    # or model.set_experts_implementation("moe_core") on a loaded model
    moe_hf.prepare(model)            # optional: plan every layer now (before CUDA-graph capture)
    print(moe_hf.plans(model))       # {module name: Plan} of every MoE layer

``register()`` adds ``"moe_core"`` to transformers' ``ExpertsInterface`` (and to the FP8 one, for
``FineGrainedFP8Config`` models with 128x128 weight blocks). The model's own router stays in
charge: the experts function receives its ``top_k_index`` / ``top_k_weights`` (routed scaling
already applied by HF) and runs a ``MoELayer`` planned for the module's sizes, dtype, device and
features (the best installed backends for them). The layer takes the module's weights once: as
views when the backend keeps loaded weights as they are, else one copy (see ``register``;
gpt-oss's interleaved ``gate_up_proj`` is de-interleaved once, a copy either way). It takes them
again when a weight tensor is replaced or modified in place (its ``data_ptr`` or ``_version``
changes), e.g. by ``load_state_dict`` or ``model.to(dtype)``.

Llama-4 (transformers 5.17) does not route its experts through the interface (its experts
compute every token against every expert, weighted on the input); ``register()`` gives
``Llama4TextMoe`` the same switch the decorator gives other families (docs/decisions.md). What is
refused, and why: ``UNSUPPORTED`` below and the README.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from transformers.activations import GELUActivation, SiLUActivation
from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _default_apply_gate
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts
from transformers.models.llama4 import modeling_llama4

from moe_core.config import MoEConfig
from moe_core.contracts import Activation, QuantScheme, TopK
from moe_core.devices import DeviceKind
from moe_core.layer import MoELayer
from moe_core.planner import Plan

__all__ = ["NAME", "register", "prepare", "plans", "layers", "UNSUPPORTED"]

NAME = "moe_core"
_STATE = "_moe_core_state"  # kept in the module's __dict__: not a submodule, not in its state_dict

# families transformers 5.17 runs through the experts interface but moe-core refuses, and why
UNSUPPORTED = {
    "has_gate=False experts (NemotronH)": "non-gated experts (act(up) only): the core's experts are gated (w13 = gate; up)",
    "custom _apply_gate (DeepSeek-V4, GLM-5-next, HY-V4, MiniMax-M3-VL, Step-3.7, privacy-filter)":
        "gates other than act(gate) * up and gpt-oss's clamped SwiGLU are not core activations",
    "hidden_act other than silu / gelu": "only SiLU and exact GELU are core activations",
    "FP8 experts other than 128x128 float-scale blocks, dynamic activations": "not the core's fp8_block scheme",
    "DBRX": "its experts are not behind the experts interface in transformers 5.17",
}
_FP8_BLOCK = (128, 128)


@dataclass
class _State:
    layer: MoELayer
    key: tuple  # (data_ptr, _version) of every source tensor, dtype and device


def register(*, share_weights: bool = False, **config_overrides: Any) -> None:
    """Make ``experts_implementation="moe_core"`` available. ``config_overrides`` go into every
    layer's ``MoEConfig`` (e.g. ``cuda_graph=True`` to plan graph-safe backends, ``experts=`` to
    force a backend, ``backend_options=``). Calling it again replaces the settings.

    Weights are shared with the HF module (views, no copy) when the planned experts backend
    declares ``keeps_loaded_weights`` (the core ``reference``); otherwise the layer copies them
    once, because such a backend may rewrite them in place (the cuda plugin interleaves gate and
    up rows). ``share_weights=True`` shares them anyway and halves the memory: the HF modules'
    expert weights are then in the backend's layout, so only ``moe_core`` may run that model."""
    global _OVERRIDES, _SHARE
    _OVERRIDES, _SHARE = dict(config_overrides), share_weights
    ALL_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    ALL_FP8_EXPERTS_FUNCTIONS.register(NAME, experts_forward)
    _register_llama4()


_OVERRIDES: dict[str, Any] = {}
_SHARE = False


def experts_forward(module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """The registered experts function: ``hidden_states [T, H]``, HF's routing -> ``[T, H]``."""
    layer = _layer(module, top_k_index.shape[-1])
    return layer(hidden_states, TopK(top_k_weights, top_k_index))


def prepare(model: nn.Module) -> dict[str, Plan]:
    """Plan and build the ``MoELayer`` of every MoE module of ``model`` now (rather than at its
    first forward: do this before capturing CUDA graphs); returns ``plans(model)``."""
    for _, module, top_k in _moe_modules(model):
        _layer(module, top_k)
    return plans(model)


def plans(model: nn.Module) -> dict[str, Plan]:
    """``{module name: Plan}`` of the MoE modules that have a ``MoELayer`` (see ``prepare``)."""
    return {name: layer.plan for name, layer in layers(model).items()}


def layers(model: nn.Module) -> dict[str, MoELayer]:
    """``{module name: MoELayer}`` of the MoE modules that have one (see ``prepare``)."""
    out = {}
    for name, module, _ in _moe_modules(model):
        state = module.__dict__.get(_STATE)
        if state is not None:
            out[name] = state.layer
    return out


def _moe_modules(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    found = []
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if isinstance(module, modeling_llama4.Llama4TextMoe):
            llama4_config = module.__dict__.get("_moe_core_config")
            if llama4_config is not None and llama4_config._experts_implementation == NAME:
                found.append((name + ".experts", module.experts, module.top_k))
        elif hasattr(module, "has_gate") and config is not None and getattr(config, "_experts_implementation", None) == NAME:
            found.append((name, module, config.num_experts_per_tok))
    return found


# --------------------------------------------------------------------------- weights and layers


def _sources(module: nn.Module) -> dict[str, torch.Tensor]:
    names = ["gate_up_proj", "down_proj"]
    if getattr(module, "has_bias", False):
        names += ["gate_up_proj_bias", "down_proj_bias"]
    if isinstance(module, FP8Experts):
        names += ["gate_up_proj_scale_inv", "down_proj_scale_inv"]
    return {n: getattr(module, n) for n in names}


def _key(sources: dict[str, torch.Tensor]) -> tuple:
    return tuple((t.data_ptr(), t._version, t.dtype, t.device) for t in sources.values())


def _layer(module: nn.Module, top_k: int) -> MoELayer:
    sources = _sources(module)
    key = _key(sources)
    state = module.__dict__.get(_STATE)
    if state is not None and state.key == key:
        return state.layer
    tensors, config = _convert(module, sources, top_k)
    if state is not None and state.layer.config == config:
        layer = state.layer  # same plan: take the new weights
        layer.adopt_weights(**tensors)
    else:  # built around the module's tensors: no empty weights the size of the layer's (OOM beside HF's)
        layer = MoELayer(config, device=sources["gate_up_proj"].device, weights=tensors)
    if not (_SHARE or layer.plan.experts.keeps_loaded_weights):
        layer.adopt_weights(**{k: v.clone(memory_format=torch.contiguous_format) for k, v in tensors.items()})
    layer.process_weights()
    module.__dict__[_STATE] = _State(layer, _key(sources))
    return layer


def _activation(module: nn.Module) -> tuple[Activation, dict[str, float]]:
    cls_name = type(module).__name__
    gate = getattr(type(module), "_apply_gate", _default_apply_gate)  # Llama-4's experts have none
    if isinstance(module, GptOssExperts):
        return Activation.SWIGLU_OAI, dict(swiglu_alpha=float(module.alpha), swiglu_limit=float(module.limit))
    if isinstance(module, FP8Experts):
        if module.swiglu_alpha is not None:
            return Activation.SWIGLU_OAI, dict(swiglu_alpha=float(module.swiglu_alpha),
                                               swiglu_limit=float(module.swiglu_limit))
        if module.limit is not None:
            raise NotImplementedError(f"moe_core: {cls_name} clamps gate and up (swiglu_limit) without "
                                      "swiglu_alpha; not a core activation")
    elif gate is not _default_apply_gate:
        raise NotImplementedError(f"moe_core: {cls_name} has its own _apply_gate; the core activations are "
                                  "act(gate) * up (silu, gelu) and gpt-oss's clamped SwiGLU")
    act = getattr(module, "act_fn", None)
    if isinstance(act, (SiLUActivation, nn.SiLU)):
        return Activation.SILU, {}
    if isinstance(act, GELUActivation) and act.act is torch.nn.functional.gelu:
        return Activation.GELU, {}
    raise NotImplementedError(f"moe_core: {cls_name}'s activation {type(act).__name__} is not a core activation "
                              "(silu, exact gelu)")


def _convert(module: nn.Module, src: dict[str, torch.Tensor], top_k: int) -> tuple[dict[str, torch.Tensor], MoEConfig]:
    """The module's tensors in the core layout (views where the layout allows) and its config."""
    cls_name = type(module).__name__
    llama4 = isinstance(module, modeling_llama4.Llama4TextExperts)
    if llama4:
        transposed, concatenated, has_bias = True, True, False
    else:
        if not module.has_gate:
            raise NotImplementedError(f"moe_core: {cls_name} has non-gated experts (has_gate=False); "
                                      "the core's experts are gated")
        transposed, concatenated, has_bias = module.is_transposed, module.is_concatenated, module.has_bias
    activation, act_params = _activation(module)
    w13, w2 = src["gate_up_proj"], src["down_proj"]
    if transposed:  # [E, H, 2I] / [E, I, H] -> [E, 2I, H] / [E, H, I]
        w13, w2 = w13.transpose(1, 2), w2.transpose(1, 2)
    tensors = {"w13": w13.detach(), "w2": w2.detach()}
    if has_bias:
        tensors.update(w13_bias=src["gate_up_proj_bias"].detach(), w2_bias=src["down_proj_bias"].detach())
    if not concatenated:  # gpt-oss: gate and up interleaved row by row -> gate rows, then up rows (one copy)
        tensors["w13"] = torch.cat([tensors["w13"][:, 0::2], tensors["w13"][:, 1::2]], dim=1)
        if has_bias:
            tensors["w13_bias"] = torch.cat([tensors["w13_bias"][:, 0::2], tensors["w13_bias"][:, 1::2]], dim=1)
    quant = QuantScheme.UNQUANTIZED
    params_dtype = w13.dtype
    if isinstance(module, FP8Experts):
        if tuple(module.block_size or ()) != _FP8_BLOCK or module.activation_scheme != "dynamic" \
                or src["gate_up_proj_scale_inv"].dtype != torch.float32 or transposed:
            raise NotImplementedError(f"moe_core: {cls_name} with block_size={module.block_size}, activation_scheme="
                                      f"{module.activation_scheme!r}, scales {src['gate_up_proj_scale_inv'].dtype}: "
                                      "the core's fp8_block scheme is 128x128 float32 blocks, dynamic activations")
        quant = QuantScheme.FP8_BLOCK
        tensors.update(w13_scale=src["gate_up_proj_scale_inv"].detach(), w2_scale=src["down_proj_scale_inv"].detach())
        params_dtype = module.config.dtype if module.config.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
    config = MoEConfig(
        num_experts=w13.shape[0], top_k=top_k, hidden_size=w2.shape[1], intermediate_size=w2.shape[2],
        activation=activation, quant=quant, params_dtype=params_dtype, expert_bias=has_bias,
        apply_router_weight_on_input=llama4, device=str(DeviceKind.of(w13.device)), **act_params, **_OVERRIDES,
    )
    return tensors, config


# --------------------------------------------------------------------------- Llama-4


def _register_llama4() -> None:
    """Give ``Llama4TextMoe`` the switch ``@use_experts_implementation`` gives other families: it
    keeps its config and runs ``_llama4_forward`` when ``config._experts_implementation`` names us."""
    cls = modeling_llama4.Llama4TextMoe
    if getattr(cls, "_moe_core_original", None) is not None:
        return
    original_init, original_forward = cls.__init__, cls.forward

    def __init__(self: nn.Module, config: Any) -> None:
        original_init(self, config)
        self.__dict__["_moe_core_config"] = config  # not an attribute HF knows

    def forward(self: nn.Module, hidden_states: torch.Tensor) -> Any:
        config = self.__dict__.get("_moe_core_config")
        if config is not None and config._experts_implementation == NAME:
            return _llama4_forward(self, hidden_states)
        return original_forward(self, hidden_states)

    cls._moe_core_original = (original_init, original_forward)
    cls.__init__, cls.forward = __init__, forward
    # transformers decides from the modeling source whether set_experts_implementation may act
    for model_cls in (modeling_llama4.Llama4PreTrainedModel, modeling_llama4.Llama4TextModel,
                      modeling_llama4.Llama4ForCausalLM, modeling_llama4.Llama4ForConditionalGeneration):
        model_cls._can_set_experts_implementation_cached_value = True


def _llama4_forward(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama-4's MoE with its own router (sigmoid of the top-k logits, applied to the input)."""
    x = hidden_states.reshape(-1, self.hidden_dim)
    router_scores, router_logits = self.router(x)  # scores: sigmoid(top-k logits), 0 elsewhere
    weights, ids = router_scores.topk(self.top_k, dim=-1)
    layer = _layer(self.experts, self.top_k)
    routed = layer(x, TopK(weights, ids))
    out = self.shared_expert(x)
    out.add_(routed)
    return out, router_logits

