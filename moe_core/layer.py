"""``MoELayer``: one MoE layer whose stages are the plan's bound backends.

Plan once, call direct: the constructor negotiates (or takes) a ``Plan``, instantiates its
backends and binds their methods; ``forward`` then calls them with no hook loop and no
branching on config. ``trace=True`` instead routes each stage through pluggy's hook callers
with call monitoring (logged at DEBUG on the ``moe_core.trace`` logger), for debugging.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
from torch import nn

from moe_core import loading, quant
from moe_core.config import MoEConfig
from moe_core.contracts import TopK
from moe_core.planner import Plan
from moe_core.planner import plan as make_plan
from moe_core.router import route
from moe_core.shared import SharedExperts

__all__ = ["MoELayer"]

_TORCH_DEVICE = {"cpu": "cpu", "cuda": "cuda", "rocm": "cuda", "npu": "npu"}
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
    ) -> None:
        super().__init__()
        if plan is None:
            plan = make_plan(config, manager=manager)
        elif plan.config != config:
            raise ValueError("plan was made for a different config")
        self.config = config
        self.plan = plan
        self.device = _with_index(torch.device(device if device is not None else _TORCH_DEVICE[config.device]))
        if check_ids not in (None, True, False, "sync"):
            raise ValueError(f"check_ids must be None, True, False or 'sync', got {check_ids!r}")
        self.check_ids = (not config.cuda_graph) if check_ids is None else bool(check_ids)
        self._sync_check = check_ids == "sync" or self.device.type == "cpu"
        # the checkpoint layout, kept to validate reloads after process_weights changed the slots
        self._weight_specs = quant.weight_shapes(config.quant, config.num_local_experts, config.hidden_size,
                                                 config.intermediate_size, config.params_dtype)
        if config.expert_bias:  # per expert, sliced and loaded like the weights (whatever the quant scheme)
            e, dtype = config.num_local_experts, config.params_dtype
            self._weight_specs.update(w13_bias=((e, 2 * config.intermediate_size), dtype),
                                      w2_bias=((e, config.hidden_size), dtype))
        self._weight_names = tuple(self._allocate(self._weight_specs))
        self.correction_bias: Optional[torch.Tensor]
        if config.router.use_correction_bias:
            self.register_buffer("correction_bias", torch.zeros(config.num_experts, device=self.device))
        else:
            self.correction_bias = None
        self._loaded = False
        self._processed = False
        self.shared_experts = SharedExperts(config, self.device) if config.shared_intermediate_size else None
        # plain attributes read on every forward (cheaper than going through config / plan)
        self._hidden, self._top_k, self._num_experts = config.hidden_size, config.top_k, config.num_experts
        self._dtype, self._fused = config.params_dtype, plan.fused

        self.dispatcher, self.experts = plan.build()
        if trace:
            if manager is None:
                from moe_core.plugins import get_plugin_manager

                manager = get_plugin_manager()
            self._bind_traced(manager)
        else:
            self._process = self.experts.process_weights
            if plan.fused:
                self._fused_forward = self.experts.forward
            else:
                self._dispatch = self.dispatcher.dispatch
                self._apply = self.experts.apply
                self._combine = self.dispatcher.combine

    def _allocate(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> list[str]:
        for name, (shape, dtype) in shapes.items():
            self.register_parameter(name, nn.Parameter(torch.empty(shape, dtype=dtype, device=self.device),
                                                       requires_grad=False))
        return list(shapes)

    def _bind_traced(self, manager: Any) -> None:
        hook = manager.hook
        manager.pm.add_hookcall_monitoring(
            lambda name, impls, kwargs: trace_log.debug("-> %s via %s", name, [i.plugin_name for i in impls]),
            lambda outcome, name, impls, kwargs: trace_log.debug("<- %s", name),
        )
        d, e = self.dispatcher, self.experts
        if self.plan.fused:
            self._fused_forward = lambda layer, x, topk: e.forward(layer, x, topk)
        else:
            self._dispatch = lambda x, topk: hook.dispatch(backend=d, hidden_states=x, topk=topk)
            self._apply = lambda layer, dispatched: hook.apply(backend=e, layer=layer, dispatched=dispatched)
            self._combine = lambda c: hook.combine(backend=d, combine_input=c)
        self._process = lambda layer: hook.process_weights(backend=e, layer=layer)

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
        for name, full in tensors.items():
            target = getattr(self, name)
            part = full if name == "correction_bias" else full[experts.start:experts.stop]
            shape, dtype = (tuple(target.shape), target.dtype) if name == "correction_bias" \
                else self._weight_specs[name]
            if tuple(part.shape) != tuple(shape) or (name != "correction_bias" and full.shape[0] != self.config.num_experts):
                want = (self.config.num_experts,) + tuple(shape[1:]) if name != "correction_bias" else tuple(shape)
                raise ValueError(f"load_weights: {name} must have shape {want} (full checkpoint), got {tuple(full.shape)}")
            if part.dtype != dtype and (part.dtype.is_floating_point != dtype.is_floating_point
                                        or dtype.itemsize == 1):
                raise TypeError(f"load_weights: {name} must be {dtype}, got {part.dtype}")
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
        for name, full in tensors.items():
            shape, dtype = self._weight_specs[name]
            want = (self.config.num_experts,) + tuple(shape[1:])
            if tuple(full.shape) != want or full.dtype != dtype or full.device != self.device:
                raise ValueError(f"adopt_weights: {name} must be a {want} {dtype} tensor on {self.device}, got "
                                 f"{tuple(full.shape)} {full.dtype} on {full.device}")
            setattr(self, name, nn.Parameter(full[experts.start:experts.stop], requires_grad=False))
        self._loaded = True
        self._processed = False

    def process_weights(self) -> None:
        """Convert the loaded weights to the plan's experts layout (idempotent)."""
        if not self._loaded:
            raise RuntimeError("MoELayer.process_weights() called before load_weights()")
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
        if self.check_ids and shape[0] and (not self._sync_check or torch.compiler.is_compiling()):
            ids = topk.ids
            torch._assert_async(((ids >= -1) & (ids < self._num_experts)).all(),
                                f"moe_core.MoELayer: topk.ids must be in [-1, {self._num_experts}) (-1 = no expert)")
        elif self.check_ids and shape[0]:
            lo, hi = torch.aminmax(topk.ids)
            lo, hi = int(lo), int(hi)
            if lo < -1 or hi >= self._num_experts:
                raise ValueError(f"topk.ids must be in [-1, {self._num_experts}) (-1 = no expert), "
                                 f"got values in [{lo}, {hi}]")
        if self.shared_experts is not None:
            return self._forward_with_shared(hidden_states, topk)
        if self._fused:
            return self._fused_forward(self, hidden_states, topk)
        return self._combine(self._apply(self, self._dispatch(hidden_states, topk)))

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
        if self._fused:
            return self._fused_forward(self, hidden_states, topk) + self.shared_experts(hidden_states)
        dispatched = self._dispatch(hidden_states, topk)
        shared = self.shared_experts(hidden_states)
        return self._combine(self._apply(self, dispatched)) + shared

    def _route_or_raise(self, hidden_states: Any, topk: Any, router_logits: Any) -> TopK:
        if not self._processed:
            raise RuntimeError("MoELayer: call load_weights(...) then process_weights() before forward")
        if (topk is None) == (router_logits is None):
            raise TypeError("MoELayer.forward takes exactly one of topk and router_logits")
        if topk is not None:
            raise TypeError(f"topk must be a moe_core.TopK, got {type(topk).__name__}")
        if not isinstance(hidden_states, torch.Tensor):
            raise TypeError(f"hidden_states must be a torch.Tensor, got {type(hidden_states).__name__}")
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
