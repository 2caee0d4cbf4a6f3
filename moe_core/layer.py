"""``MoELayer``: one MoE layer whose stages are the plan's bound backends.

Plan once, call direct: the constructor negotiates (or takes) a ``Plan``, instantiates its
backends and binds their methods; ``forward`` then calls them with no hook loop and no
branching on config. ``trace=True`` instead routes each stage through pluggy's hook callers
with call monitoring (logged at DEBUG on the ``moe_core.trace`` logger), for debugging.
"""

from __future__ import annotations

import logging
from typing import Any, Mapping, Optional

import torch
from torch import nn

from moe_core import loading, quant
from moe_core.backends import Code, from_exception
from moe_core.config import AUTO, MoEConfig
from moe_core.contracts import TopK
from moe_core.devices import DeviceKind
from moe_core.distributed import layer_collectives
from moe_core.planner import Plan
from moe_core.planner import plan as make_plan
from moe_core.plugins import get_plugin_manager
from moe_core.router import route
from moe_core.shared import SharedExperts

__all__ = ["MoELayer"]

_PARAMS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
trace_log = logging.getLogger("moe_core.trace")


def _with_index(device: torch.device) -> torch.device:
    """``cuda`` -> ``cuda:<current>``: tensors report an indexed device, and the layer compares them."""
    if device.type == "cpu" or device.index is not None:
        return device
    module = getattr(torch, device.type, None)
    try:
        return torch.device(device.type, module.current_device())
    except Exception:  # backend not usable here: keep it as given (tensors cannot be made on it anyway)
        return device


def _fingerprint(plan: Plan) -> dict[str, Any]:
    """What every rank of an EP group must agree on: the layer's sizes and semantics, and its plan."""
    c = plan.config
    fields = ("num_experts", "top_k", "hidden_size", "intermediate_size", "activation", "quant", "params_dtype",
              "routed_scaling_factor", "apply_router_weight_on_input", "router", "ep_size", "max_tokens_per_rank",
              "cuda_graph", "device")
    return {**{f: str(getattr(c, f)) for f in fields},
            "dispatcher": plan.dispatcher.qualified_name if plan.dispatcher else None,
            "experts": plan.experts.qualified_name, "format": str(plan.format),
            "dispatch_dtype": str(plan.dispatch_dtype)}


def _mark_loaded(layer: "MoELayer", incompatible_keys: Any) -> None:
    """``load_state_dict`` post-hook: a complete state dict loads the layer like ``load_weights``."""
    if not any(k.rsplit(".", 1)[-1] in layer._weight_names for k in incompatible_keys.missing_keys):
        layer._loaded, layer._processed = True, False


# dtypes a checkpoint may hold in place of another one (a lossless or intended cast); quantized
# data and its scales must come in their own dtype (a cast would lose the scheme)
_WIDE_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# checkpoint scales that multiply or divide the data: 0, negative or non-finite ones give NaN or zeros
_POSITIVE_SCALES = ("_scale_2", "_global_scale")
_FINITE = _POSITIVE_SCALES + ("_scale", "correction_bias")


def _check_weight(name: str, value: Any, dtype: torch.dtype) -> None:
    """Refuse what ``load_weights`` cannot load as ``name``, naming the weight (before anything is copied)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"load_weights: {name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() == 0:
        raise ValueError(f"load_weights: {name} must be a [num_experts, ...] tensor, got a 0-d tensor")
    if value.is_meta:
        raise ValueError(f"load_weights: {name} is on the meta device (no data); load real tensors")
    if value.dtype != dtype and not (value.dtype in _WIDE_FLOATS and dtype in _WIDE_FLOATS):
        raise TypeError(f"load_weights: {name} must be {dtype}, got {value.dtype}")
    if name.endswith(_FINITE) and value.numel():
        wide = value.float()
        positive = name.endswith(_POSITIVE_SCALES)
        if not bool((wide.isfinite() & ((wide > 0) if positive else True)).all()):
            raise ValueError(f"load_weights: {name} must be finite{' and positive' if positive else ''}, got values "
                             f"in [{wide.min().item()}, {wide.max().item()}] (NaN: {bool(wide.isnan().any())})")


class MoELayer(nn.Module):
    """An MoE layer: ``forward(hidden_states [T, H], topk)`` -> ``[T, H]``.

    :param config: the layer config (sizes, quant scheme, EP group, backend choices).
    :param plan: a plan made earlier for ``config`` (default: ``moe_core.plan(config)``).
    :param manager: plugin manager used for planning and tracing (default: installed plugins).
    :param device: where weights live (default: from ``config.device``). Tests of plugins whose
        vendor ops are emulated on CPU pass ``torch.device("cpu")`` for a plan targeting "npu".
    :param check_ids: check that expert ids are in ``[-1, num_experts)`` on every forward;
        default on unless ``config.cuda_graph``. On CPU the check raises a ``ValueError`` naming the
        bad range (one reduction). On an accelerator it is a device-side assertion
        (``torch._assert_async``, no host sync, so the host keeps running ahead of the device:
        a synchronous check measured 919 -> 1312 us per back-to-back forward on an H100); a bad id
        then fails loudly at the next synchronization, and the device context is unusable after
        it, as with any device-side assert. ``check_ids="sync"`` forces the precise, synchronizing
        check on any device (debugging).
    :param trace: route stage calls through the pluggy hooks, with monitoring.
    :param weights: tensors to adopt as the weights (as ``adopt_weights``) instead of allocating
        empty ones: nothing the size of the weights is allocated (a DeepSeek-V3 layer's is 21 GiB
        in bf16), which a model whose weights exist already needs to fit on its device.

    Weights (this rank's experts only; ``E = config.num_local_experts``): ``w13 [E, 2I, H]``
    (gate rows, then up rows), ``w2 [E, H, I]`` and the scales of ``config.quant`` (see
    ``moe_core.contracts.QuantScheme``); plus ``correction_bias [num_experts]`` when the router
    uses one. Load a full checkpoint with ``load_weights`` (it keeps this rank's slice), then call
    ``process_weights()``.
    """

    def __init__(
        self,
        config: MoEConfig,
        *,
        plan: Optional[Plan] = None,
        manager: Any = None,
        device: Optional[torch.device | str] = None,
        check_ids: Optional[bool | str] = None,
        trace: bool = False,
        weights: Optional[Mapping[str, torch.Tensor]] = None,
    ) -> None:
        super().__init__()
        user_plan = plan is not None
        ep = config.ep_size > 1 and layer_collectives.group_active()
        error: Optional[Exception] = None
        try:
            if plan is None:
                plan = make_plan(config, manager=manager)
            elif plan.config != config:
                raise ValueError("plan was made for a different config")
        except Exception as exc:
            if not ep:
                raise
            error = exc
        if ep:  # once per layer, before any backend is built (some allocate with collectives)
            layer_collectives.agree_on_layer(None if error else _fingerprint(plan), error, config.ep_group)
        self.config = config
        self.plan = plan
        self.device = _with_index(torch.device(device if device is not None else DeviceKind(config.device).torch_device_type))
        if check_ids not in (None, True, False, "sync"):
            raise ValueError(f"check_ids must be None, True, False or 'sync', got {check_ids!r}")
        self.check_ids = (not config.cuda_graph) if check_ids is None else bool(check_ids)
        self._sync_check_requested = check_ids == "sync"
        self._sync_check = self._sync_check_requested or self.device.type == "cpu"
        # the checkpoint layout, kept to validate reloads after process_weights changed the slots
        self._weight_specs = quant.weight_shapes(config.quant, config.num_local_experts, config.hidden_size,
                                                 config.intermediate_size, config.params_dtype)
        if config.expert_bias:  # per expert, sliced and loaded like the weights (whatever the quant scheme)
            e, dtype = config.num_local_experts, config.params_dtype
            self._weight_specs.update(w13_bias=((e, 2 * config.intermediate_size), dtype),
                                      w2_bias=((e, config.hidden_size), dtype))
        self._weight_names = tuple(self._weight_specs) if weights is not None else self._allocate(self._weight_specs)
        self.correction_bias: Optional[torch.Tensor]
        if config.router.use_correction_bias:
            self.register_buffer("correction_bias", torch.zeros(config.num_experts, device=self.device))
        else:
            self.correction_bias = None
        self._loaded = False
        self._processed = False
        if weights is not None:
            self.adopt_weights(**weights)
        self.shared_experts = SharedExperts(config, self.device) if config.shared_intermediate_size else None
        # plain attributes read on every forward (cheaper than going through config / plan)
        self._hidden, self._top_k, self._num_experts = config.hidden_size, config.top_k, config.num_experts
        self._dtype, self._fused = config.params_dtype, plan.fused
        self._ep_group_check = ep

        self._manager, self._trace = manager, trace
        self._build_backends(fall_back=not user_plan and config.ep_size == 1)
        # a state dict is a first-class way to load: process_weights() may follow load_state_dict()
        self.register_load_state_dict_post_hook(_mark_loaded)

    def _build_backends(self, fall_back: bool = False) -> None:
        """Instantiate the plan's backends and bind their stage methods (again after a move).

        ``fall_back``: a backend that ``auto`` chose and whose constructor fails is marked unusable
        in the manager (with the error) and the layer re-plans; the failure is then listed in
        ``plan.rejected`` (decision 44). An explicit choice fails closed. Single rank only: under EP
        the ranks agreed on the plan already.
        """
        while True:
            try:
                self.dispatcher, self.experts = self.plan.build()
                self._fused = self.plan.fused
                break
            except Exception as exc:
                spec = getattr(exc, "moe_core_backend", None)
                choice = None if spec is None else (self.config.experts if spec is self.plan.experts
                                                    else self.config.dispatcher)
                if not fall_back or spec is None or choice != AUTO:
                    raise
                manager = self._manager if self._manager is not None else get_plugin_manager()
                manager.mark_unusable(spec, from_exception(
                    Code.LOAD_ERROR, f"building {spec.qualified_name} ({spec.impl}) failed", exc))
                self.plan = make_plan(self.config, manager=manager)
        # under EP one rank's bad id must reach every rank (decision 15): a dispatcher that checks
        # in-band does it; otherwise the check is exchanged over the group: the id ranges (synchronous
        # check) or a device flag max-reduced before a device-side assert on every rank (no host sync)
        in_band = getattr(self.dispatcher, "checks_ids_on_every_rank", False)
        self._ids_exchanged = self._ep_group_check and not in_band and self._sync_check
        self._ids_flag_reduced = self._ep_group_check and not in_band and not self._sync_check
        self._gathers_tokens = self._ep_group_check and getattr(self.dispatcher, "expects_replicated_input", False)
        if self._trace:
            self._bind_traced(self._manager if self._manager is not None else get_plugin_manager())
        else:
            self._process = self.experts.process_weights
            if self.plan.fused:
                self._fused_forward = self.experts.forward
            else:
                # not ``_apply``: that name is nn.Module's, which .to() / .half() / .cpu() go through
                self._dispatch = self.dispatcher.dispatch
                self._apply_experts = self.experts.apply
                self._combine = self.dispatcher.combine
        # a dispatcher that only wraps and unwraps (single rank, bf16): the experts straight on the token list
        self._apply_tokens = (self.experts.apply_tokens if not self._trace and not self.plan.fused
                              and self.dispatcher.passes_tokens_through else None)

    def _allocate(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> tuple[str, ...]:
        for name, (shape, dtype) in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=self.device),
                                                       requires_grad=False))
        return tuple(shapes)

    def _bind_traced(self, manager: Any) -> None:
        pm = manager.pm

        def owner_hook(name: str, spec: Any) -> Any:
            """The stage hook restricted to the plugin that declared ``spec``: another plugin's
            hookimpl answering for every backend must not hijack this layer's stages."""
            return pm.subset_hook_caller(name, [p for n, p in pm.list_name_plugin() if n != spec.plugin])

        manager.pm.add_hookcall_monitoring(
            lambda name, impls, kwargs: trace_log.debug("-> %s via %s", name, [i.plugin_name for i in impls]),
            lambda outcome, name, impls, kwargs: trace_log.debug("<- %s", name),
        )
        d, e = self.dispatcher, self.experts
        if self.plan.fused:
            self._fused_forward = lambda layer, x, topk: e.forward(layer, x, topk)
        else:
            dispatch, combine = owner_hook("dispatch", d.ctx.spec), owner_hook("combine", d.ctx.spec)
            apply = owner_hook("apply", e.ctx.spec)
            self._dispatch = lambda x, topk: dispatch(backend=d, hidden_states=x, topk=topk)
            self._apply_experts = lambda layer, dispatched: apply(backend=e, layer=layer, dispatched=dispatched)
            self._combine = lambda c: combine(backend=d, combine_input=c)
        process = owner_hook("process_weights", e.ctx.spec)
        self._process = lambda layer: process(backend=e, layer=layer)

    def _apply(self, fn: Any, recurse: bool = True) -> "MoELayer":
        """What ``.to()``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.float()`` and ``share_memory()`` do.

        The device follows ``fn``. A dtype change is a change of ``params_dtype`` (bf16, fp16 or
        fp32): it converts the tensors held in ``params_dtype`` and re-plans for the new config;
        quantized weights, their scales and the router bias keep their dtype (casting them would
        destroy the scheme). The backends are rebuilt on the new device, and weights already
        processed are processed again there (``process_weights`` is idempotent).
        """
        probe = fn(torch.empty(0, dtype=self._dtype, device=self.device))
        device, dtype = _with_index(probe.device), probe.dtype
        plan = self.plan
        if dtype != self._dtype:
            if dtype not in _PARAMS_DTYPES:
                raise TypeError(f"MoELayer: params_dtype can become {', '.join(map(str, _PARAMS_DTYPES))}, "
                                f"not {dtype}")
            plan = make_plan(self.config.replace(params_dtype=dtype), manager=self._manager)
            if self._processed and plan.experts.qualified_name != self.plan.experts.qualified_name:
                raise RuntimeError(f"MoELayer: params_dtype={dtype} plans experts {plan.experts.qualified_name}, "
                                   f"not {self.plan.experts.qualified_name} whose layout the weights were "
                                   "processed into; convert the layer before process_weights()")
            follow = {id(getattr(self, name)) for name in self._params_dtype_weights()}
            super()._apply(lambda t: fn(t) if id(t) in follow else t.to(device), recurse)
        else:
            super()._apply(fn, recurse)
        if device == self.device and plan is self.plan:
            return self  # share_memory() and other in-place conversions: nothing to rebuild
        self.device, self.plan, self.config = device, plan, plan.config
        self._dtype = self.config.params_dtype
        self._weight_specs = quant.weight_shapes(self.config.quant, self.config.num_local_experts,
                                                 self.config.hidden_size, self.config.intermediate_size, self._dtype)
        self._sync_check = self._sync_check_requested or device.type == "cpu"
        self._build_backends()
        if self._processed:
            self.process_weights()
        return self

    def _params_dtype_weights(self) -> list[str]:
        """The weights held in ``params_dtype`` (those whose dtype the scheme ties to it), as loaded."""
        c = self.config
        other = torch.float32 if self._dtype != torch.float32 else torch.float16
        alt = quant.weight_shapes(c.quant, c.num_local_experts, c.hidden_size, c.intermediate_size, other)
        return [n for n, (_, dtype) in self._weight_specs.items()
                if alt[n][1] != dtype and getattr(self, n).dtype == self._dtype]

    def to_empty(self, *, device: Any, recurse: bool = True) -> "MoELayer":
        """As ``nn.Module.to_empty``; the weights are uninitialized afterwards: load them again."""
        super().to_empty(device=device, recurse=recurse)
        self._loaded = self._processed = False
        return self

    # ------------------------------------------------------------------ weights

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's weight tensors by checkpoint name (the scheme's names)."""
        return {name: getattr(self, name) for name in self._weight_names}

    @torch.no_grad()
    def load_weights(self, **tensors: torch.Tensor) -> None:
        """Copy a full checkpoint (``[num_experts, ...]`` per tensor) into this rank's slice.

        Every weight of the scheme must be given (names as ``weight_tensors()``), plus
        ``correction_bias`` when the router uses one. Call ``process_weights()`` afterwards.
        """
        expected = set(self._weight_names) | ({"correction_bias"} if self.correction_bias is not None else set())
        missing, unknown = expected - set(tensors), set(tensors) - expected
        if missing or unknown:
            raise ValueError(f"load_weights for quant={self.config.quant}: missing {sorted(missing)}, "
                             f"unexpected {sorted(unknown)}; expected {sorted(expected)}")
        experts = self.config.local_expert_range
        parts = {}
        for name, full in tensors.items():  # every check before the first copy: nothing half-loaded
            if name == "correction_bias":
                shape, dtype = (self.config.num_experts,), torch.float32
            else:
                shape, dtype = self._weight_specs[name]
                shape = (self.config.num_experts,) + tuple(shape[1:])
            _check_weight(name, full, dtype)
            if tuple(full.shape) != shape:
                raise ValueError(f"load_weights: {name} must have shape {shape} (full checkpoint), got {tuple(full.shape)}")
            parts[name] = full if name == "correction_bias" else full[experts.start:experts.stop]
        for name, part in parts.items():
            target = getattr(self, name)
            dtype = target.dtype if name == "correction_bias" else self._weight_specs[name][1]
            # weights may have been replaced by process_weights (another layout): restore the slot
            if target.shape != part.shape or target.dtype != dtype:
                target = nn.Parameter(torch.empty(part.shape, dtype=dtype, device=self.device), requires_grad=False)
                setattr(self, name, target)
            target.copy_(part)
        self._loaded = True
        self._processed = False

    def weight_loader(self, name: str, tensor: torch.Tensor, *, expert_id: Optional[int] = None,
                      shard: Optional[str] = None) -> bool:
        """Load one checkpoint tensor: one expert (``expert_id``) or one shard of it (``"gate"`` /
        ``"up"`` of ``w13``), keeping only this rank's experts; ``False`` when the expert lives on
        another rank. Names and shapes: ``moe_core.loading``. Call ``process_weights()`` after the
        last one."""
        return loading.load_tensor(self, name, tensor, expert_id=expert_id, shard=shard)

    @torch.no_grad()
    def adopt_weights(self, **tensors: torch.Tensor) -> None:
        """Use ``tensors`` as the layer's weights without copying them (views of a model's own
        parameters, e.g. Hugging Face's); same names and full ``[num_experts, ...]`` shapes as
        ``load_weights``, in the scheme's dtypes. Under EP the layer keeps a view of its slice.
        The tensors must outlive the layer's use of them; call ``process_weights()`` afterwards.
        Backends whose spec does not declare ``keeps_loaded_weights`` may rewrite them in place
        there: share only tensors their owner no longer reads (or pass copies)."""
        expected = set(self._weight_names)
        if set(tensors) != expected:
            raise ValueError(f"adopt_weights for quant={self.config.quant}: expected {sorted(expected)}, "
                             f"got {sorted(tensors)}")
        experts = self.config.local_expert_range
        for name in self._weight_names:  # every check before the first adoption: nothing half-adopted
            full, (shape, dtype) = tensors[name], self._weight_specs[name]
            want = (self.config.num_experts,) + tuple(shape[1:])
            if tuple(full.shape) != want or full.dtype != dtype or full.device != self.device:
                raise ValueError(f"adopt_weights: {name} must be a {want} {dtype} tensor on {self.device}, got "
                                 f"{tuple(full.shape)} {full.dtype} on {full.device}")
        for name in self._weight_names:
            setattr(self, name, nn.Parameter(tensors[name][experts.start:experts.stop], requires_grad=False))
        self._loaded = True
        self._processed = False

    def process_weights(self) -> None:
        """Convert the loaded weights to the plan's experts layout (idempotent)."""
        if not self._loaded:
            raise RuntimeError("MoELayer.process_weights() called before load_weights() or load_state_dict()")
        if self.device.type == "meta":
            raise RuntimeError("MoELayer: the layer is on the meta device (shapes only, no data); "
                               "materialize it with .to_empty(device=...), then load and process the weights")
        self._process(self)
        self._processed = True

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        hidden_states: torch.Tensor,
        topk: Optional[TopK] = None,
        *,
        router_logits: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        if isinstance(hidden_states, torch.Tensor) and hidden_states.dim() != 2:
            return self._forward_flat(hidden_states, topk, router_logits)
        if topk is None or router_logits is not None or type(topk) is not TopK or not self._processed:
            topk = self._route_or_raise(hidden_states, topk, router_logits)
        # one cheap expression on the hot path; _input_error works out the precise message
        shape = hidden_states.shape
        if (len(shape) != 2 or shape[1] != self._hidden or hidden_states.dtype != self._dtype
                or hidden_states.device != self.device or topk.ids.shape != (shape[0], self._top_k)
                or topk.ids.device != self.device):
            raise self._input_error(hidden_states, topk)
        # under torch.compile the check is the device-side assert on every device (a host read would
        # break the graph)
        if self._ep_group_check:
            pass  # under EP: the dispatcher or an exchange makes every rank raise (no rank left waiting)
        elif self.check_ids and shape[0] and (not self._sync_check or torch.compiler.is_compiling()):
            ids = topk.ids
            torch._assert_async(((ids >= -1) & (ids < self._num_experts)).all(),
                                f"moe_core.MoELayer: topk.ids must be in [-1, {self._num_experts}) (-1 = no expert)")
        elif self.check_ids and shape[0]:
            lo, hi = torch.aminmax(topk.ids)
            lo, hi = int(lo), int(hi)
            if lo < -1 or hi >= self._num_experts:
                raise ValueError(f"topk.ids must be in [-1, {self._num_experts}) (-1 = no expert), "
                                 f"got values in [{lo}, {hi}]")
        if self._ids_exchanged and self.check_ids:
            layer_collectives.check_ids_on_every_rank(topk.ids, self._num_experts, self.config.ep_group)
        elif self._ids_flag_reduced and self.check_ids:
            layer_collectives.assert_ids_on_every_rank_async(topk.ids, self._num_experts, self.config.ep_group)
        if self.shared_experts is not None:
            return self._forward_with_shared(hidden_states, topk)
        return self._routed(hidden_states, topk)

    def _routed(self, hidden_states: torch.Tensor, topk: TopK) -> torch.Tensor:
        if self._apply_tokens is not None:
            return self._apply_tokens(self, hidden_states, topk)
        if self._fused:
            return self._fused_forward(self, hidden_states, topk)
        if self._gathers_tokens:  # every rank passes its own tokens, whatever the dispatcher (decision 43)
            every, every_topk, mine = layer_collectives.gather_tokens(hidden_states, topk, self.config.ep_group)
            return self._combine(self._apply_experts(self, self._dispatch(every, every_topk)))[mine]
        return self._combine(self._apply_experts(self, self._dispatch(hidden_states, topk)))

    def _forward_flat(self, hidden_states: torch.Tensor, topk: Optional[TopK],
                      router_logits: Optional[torch.Tensor]) -> torch.Tensor:
        """``[..., H]`` (any leading shape, 1-D included) -> the same shape; ``topk`` is ``[N, K]``
        with ``N`` the number of rows, ``router_logits`` ``[..., E]``."""
        shape = hidden_states.shape
        if router_logits is not None:
            router_logits = router_logits.reshape(-1, router_logits.shape[-1])
        out = self.forward(hidden_states.reshape(-1, shape[-1]), topk, router_logits=router_logits)
        return out.view(shape)

    def _forward_with_shared(self, hidden_states: torch.Tensor, topk: TopK) -> torch.Tensor:
        # shared experts between dispatch and combine: an asynchronous dispatcher overlaps them
        # (moe_core.shared); the EP combine (all-reduce / all-to-all) never sees their output
        if self._fused or self._gathers_tokens:
            return self._routed(hidden_states, topk) + self.shared_experts(hidden_states)
        dispatched = self._dispatch(hidden_states, topk)
        shared = self.shared_experts(hidden_states)
        return self._combine(self._apply_experts(self, dispatched)) + shared

    def _route_or_raise(self, hidden_states: Any, topk: Any, router_logits: Any) -> TopK:
        if not self._processed:
            raise RuntimeError("MoELayer: call load_weights(...) then process_weights() before forward")
        if (topk is None) == (router_logits is None):
            raise TypeError("MoELayer.forward takes exactly one of topk and router_logits")
        if topk is not None:
            raise TypeError(f"topk must be a moe_core.TopK, got {type(topk).__name__}")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
        if not isinstance(router_logits, torch.Tensor):
            raise TypeError(f"router_logits must be a torch.Tensor, got {type(router_logits).__name__}")
        t = hidden_states.shape[0] if hidden_states.dim() else None
        if router_logits.shape != (t, self._num_experts):
            raise ValueError(f"router_logits must be [T={t}, num_experts={self._num_experts}] "
                             f"(T from hidden_states), got {tuple(router_logits.shape)}")
        if not router_logits.is_floating_point():
            raise TypeError(f"router_logits must be a floating-point tensor, got {router_logits.dtype}")
        if router_logits.device != self.device:
            raise ValueError(f"router_logits is on {router_logits.device}, the layer's weights on {self.device}")
        return route(router_logits, self._top_k, self.config.router, self.correction_bias)

    def _input_error(self, hidden_states: torch.Tensor, topk: TopK) -> Exception:
        cfg = self.config
        if hidden_states.dim() != 2 or hidden_states.shape[1] != cfg.hidden_size:
            return ValueError(f"hidden_states must be a [T, {cfg.hidden_size}] tensor, got {tuple(hidden_states.shape)}")
        if hidden_states.dtype != cfg.params_dtype:
            return TypeError(f"hidden_states must be {cfg.params_dtype}, got {hidden_states.dtype}")
        if hidden_states.device != self.device:
            return ValueError(f"hidden_states is on {hidden_states.device}, the layer's weights on {self.device}")
        if topk.ids.shape != (hidden_states.shape[0], cfg.top_k):
            return ValueError(f"topk.ids must be [T={hidden_states.shape[0]}, top_k={cfg.top_k}], "
                              f"got {tuple(topk.ids.shape)}")
        return ValueError(f"topk is on {topk.ids.device}, the layer's weights on {self.device}")

    def extra_repr(self) -> str:
        p = self.plan
        return (f"experts={self.config.num_experts} (local {self.config.num_local_experts}), top_k={self.config.top_k}, "
                f"hidden={self.config.hidden_size}, intermediate={self.config.intermediate_size}, "
                f"quant={self.config.quant}, plan={p.dispatcher_name} x {p.experts.name} "
                f"[{p.format}, {p.dispatch_dtype}]")
