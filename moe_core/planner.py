"""The planner: negotiates dispatcher x experts x quant x config, and the dispatch dtype.

``plan(config)`` evaluates every candidate (each dispatcher with each experts backend, and each
fused backend) against the declared capabilities, collects **every** reason a candidate fails,
and returns an immutable ``Plan`` for the highest-priority candidate that passes, or raises
``PlanError`` carrying all rejections. A user's explicit choice (``config.dispatcher`` /
``config.experts`` / ``config.dispatch_dtype``) restricts the candidates and fails closed.

Dispatch dtype chain (DESIGN section 5), evaluated once per candidate through the firstresult
hook ``select_dispatch_dtype``: user choice -> what the experts require -> platform default ->
core default; then hardware validation by plugin hook wrappers. Every step lands in
``Plan.dtype_trail``. No global state is touched and no environment variable is written.
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from moe_core.backends import BackendSpec, Code, EPSupport, Reason, Role, from_exception
from moe_core.config import AUTO, MoEConfig
from moe_core.contracts import NVFP4_BLOCK, Format, WireDtype
from moe_core.devices import DeviceKind, local_device_kind
from moe_core.dtype_chain import (  # noqa: F401  (NATURAL_DTYPE, the Core* rules: re-exported, their old home)
    NATURAL_DTYPE,
    CoreDtypeDefault,
    CoreDtypeRules,
    DtypeDecision,
    DtypeRequest,
    DtypeStep,
)
from moe_core.plugins import PluginManager, get_plugin_manager
from moe_core.runtime import BackendContext

if TYPE_CHECKING:
    from moe_core.runtime import Dispatcher, Experts, FusedMoE

log = logging.getLogger("moe_core")

__all__ = ["plan", "Plan", "PlanError", "Rejection", "DtypeRequest", "DtypeDecision", "DtypeStep", "negotiate_dtype"]


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Rejection:
    dispatcher: str
    experts: str
    reasons: tuple[Reason, ...]

    def to_json(self) -> dict[str, Any]:
        return {"dispatcher": self.dispatcher, "experts": self.experts,
                "reasons": [r.to_json() for r in self.reasons]}

    def __str__(self) -> str:
        lines = [f"  {self.dispatcher} x {self.experts}:"]
        lines += [f"    - {r}" for r in self.reasons]
        return "\n".join(lines)


class PlanError(Exception):
    """No candidate satisfies the config; ``rejected`` holds every reason of every candidate."""

    def __init__(self, summary: str, rejected: tuple[Rejection, ...]) -> None:
        self.summary = summary
        self.rejected = rejected
        super().__init__(summary + "\n" + "\n".join(str(r) for r in rejected))

    def to_json(self) -> dict[str, Any]:
        return {"ok": False, "error": self.summary, "plan": None,
                "rejected": [r.to_json() for r in self.rejected]}


@dataclass(frozen=True)
class Plan:
    """The negotiated choice for one layer. Immutable; ``build()`` instantiates the backends."""

    config: MoEConfig
    dispatcher: Optional[BackendSpec]  # None when a fused backend owns the whole pipeline
    experts: BackendSpec  # experts (or fused) backend
    format: Format
    dispatch_dtype: WireDtype
    dtype_trail: tuple[DtypeStep, ...]
    rejected: tuple[Rejection, ...] = ()
    notes: tuple[str, ...] = ()
    dry_run: bool = False

    @property
    def fused(self) -> bool:
        return self.experts.role is Role.FUSED

    @property
    def graph_safe(self) -> bool:
        specs = [self.experts] + ([self.dispatcher] if self.dispatcher else [])
        return all(_graph_safe(s, self.format, self.config) for s in specs)

    @property
    def dispatcher_name(self) -> str:
        return self.dispatcher.name if self.dispatcher else self.experts.name

    def build(self) -> tuple[Optional["Dispatcher"], "Experts | FusedMoE"]:
        """Instantiate the implementations (imports the vendor code of the chosen backends)."""
        if self.dry_run:
            raise RuntimeError("a dry-run plan (availability not checked) cannot be built")

        def make(spec: BackendSpec, peer: Optional[BackendSpec]) -> Any:
            try:
                cls = spec.load_impl()
                return cls(BackendContext(self.config, spec, self.format, self.dispatch_dtype, peer))
            except Exception as exc:
                exc.moe_core_backend = spec  # which backend failed: MoELayer may fall back past it
                raise

        dispatcher = None if self.dispatcher is None else make(self.dispatcher, self.experts)
        return dispatcher, make(self.experts, self.dispatcher)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": True,
            "plan": {
                "dispatcher": self.dispatcher_name,
                "experts": self.experts.name,
                "dispatcher_plugin": self.dispatcher.plugin if self.dispatcher else self.experts.plugin,
                "experts_plugin": self.experts.plugin,
                "dispatch_dtype": str(self.dispatch_dtype),
                "format": str(self.format),
                "graph_safe": self.graph_safe,
                "dtype_trail": [s.to_json() for s in self.dtype_trail],
                "notes": list(self.notes),
                "dry_run": self.dry_run,
            },
            "rejected": [r.to_json() for r in self.rejected],
        }

    def explain(self) -> str:
        c = self.config
        lines = [
            f"MoE plan for E={c.num_experts} top-{c.top_k} H={c.hidden_size} I={c.intermediate_size} "
            f"quant={c.quant} act={c.activation} ep={c.ep_size} device={c.device}"
            + (" cuda_graph" if c.cuda_graph else "") + (" (dry run: availability not enforced)" if self.dry_run else ""),
            f"  dispatcher:     {self.dispatcher.qualified_name if self.dispatcher else '(fused)'}",
            f"  experts:        {self.experts.qualified_name}" + (" (fused)" if self.fused else ""),
            f"  format:         {self.format}",
            f"  dispatch dtype: {self.dispatch_dtype}",
            f"  graph-safe:     {'yes' if self.graph_safe else 'no'}",
            "  dtype chain:",
        ]
        lines += [f"    {i + 1}. {step}" for i, step in enumerate(self.dtype_trail)]
        lines += [f"  note: {n}" for n in self.notes]
        if self.rejected:
            lines.append(f"  rejected candidates ({len(self.rejected)}):")
            lines += [str(r) for r in self.rejected]
        return "\n".join(lines)


# --------------------------------------------------------------------------- negotiation


def _preference_notes(accepted: list[Plan]) -> tuple[str, ...]:
    """Why the chosen plan's dispatcher (experts) beat another that could serve with the same experts
    (dispatcher): the priorities, and the winner's declared ``priority_reason``."""
    chosen, notes = accepted[0], []
    for role in ("dispatcher", "experts"):
        other_role = "experts" if role == "dispatcher" else "dispatcher"
        mine = getattr(chosen, role)
        if mine is None:
            continue
        losers = {getattr(p, role).qualified_name: getattr(p, role).priority for p in accepted[1:]
                  if getattr(p, role) is not None and getattr(p, other_role) == getattr(chosen, other_role)
                  and getattr(p, role).priority < mine.priority}
        if losers:
            others = ", ".join(f"{name} ({prio})" for name, prio in sorted(losers.items(), key=lambda kv: -kv[1]))
            why = f": {mine.priority_reason}" if mine.priority_reason else ""
            notes.append(f"{role} {mine.qualified_name} (priority {mine.priority}) preferred over {others}, "
                         f"which could also serve{why}")
    return tuple(notes)


def _matches(choice: str, spec: BackendSpec, manager: PluginManager) -> bool:
    """``choice`` names ``spec``: ``auto``, its qualified name, or a bare name that the manager
    resolves to it (a bare name shared by two plugins means one of them, see ``PluginManager``)."""
    return choice in (AUTO, spec.qualified_name) or (choice == spec.name and manager.spec(choice) is spec)


def _spec_reasons(spec: BackendSpec, config: MoEConfig, manager: PluginManager, dry_run: bool,
                  notes: list[str], probe_anyway: bool = False) -> list[Reason]:
    """Reasons one backend alone cannot serve ``config``. Its probe (which can be slow) runs only when
    its declarations let it serve the config, or when the user named it (then every reason is shown)."""
    reasons: list[Reason] = []
    if manager.spec(spec.qualified_name) is None:  # its plugin was taken out during this plan (decision 44)
        record = next((r for r in manager.records if r.name == spec.plugin), None)
        return [record.status if record else Reason(Code.LOAD_ERROR, f"{spec.qualified_name} was unregistered")]
    if config.device not in spec.devices:
        reasons.append(Reason(Code.NO_DEVICE, f"{spec.qualified_name} runs on {'/'.join(sorted(spec.devices))}, "
                              f"the layer targets {config.device}",
                              f"plan with --device {sorted(spec.devices)[0]} on such a machine"))
    if spec.ep is EPSupport.NONE and config.ep_size > 1:
        reasons.append(Reason(Code.UNSUPPORTED_PARALLEL, f"{spec.qualified_name} does not support expert "
                              f"parallelism (ep_size={config.ep_size})", "use an EP-capable dispatcher"))
    if spec.ep is EPSupport.REQUIRED and config.ep_size == 1:
        reasons.append(Reason(Code.UNSUPPORTED_PARALLEL, f"{spec.qualified_name} needs an EP group of size > 1",
                              "use the 'standard' dispatcher on a single rank"))
    if spec.role is not Role.DISPATCHER:
        if config.quant not in spec.quant_schemes:
            reasons.append(Reason(Code.UNSUPPORTED_QUANT, f"{spec.qualified_name} does not support quant scheme "
                                  f"{config.quant}", "supported: " + ", ".join(sorted(map(str, spec.quant_schemes)))))
        if config.activation not in spec.activations:
            reasons.append(Reason(Code.UNSUPPORTED_SHAPE, f"{spec.qualified_name} does not support activation "
                                  f"{config.activation}", "supported: " + ", ".join(sorted(map(str, spec.activations)))))
        if config.expert_bias and not spec.expert_bias:
            reasons.append(Reason(Code.UNSUPPORTED_FEATURE, f"{spec.qualified_name} does not declare expert biases "
                                  "(MoEConfig.expert_bias=True, e.g. gpt-oss)",
                                  "use a backend whose BackendSpec sets expert_bias=True (the core 'reference')"))
    if probe_anyway or not reasons:
        availability = manager.availability(spec)
        if not availability.ok:
            if dry_run:
                notes.append(f"{spec.qualified_name} is not usable on this machine ({availability.code}); "
                             "assumed available for the dry run")
            else:
                reasons.append(availability)
    reasons += spec.run_check(config)
    return reasons


def _graph_safe(spec: BackendSpec, fmt: Format, config: MoEConfig) -> bool:
    """Whether ``spec`` in ``fmt`` never syncs with the host for this config."""
    return fmt in spec.graph_safe_formats or (config.cuda_graph and fmt in spec.graph_safe_on_request)


def _choose_format(d: Optional[BackendSpec], e: BackendSpec, config: MoEConfig) -> tuple[Optional[Format], list[Reason]]:
    if d is None:
        formats = [Format.FUSED]
    else:
        formats = [f for f in d.formats if f in e.formats]
        if not formats:
            return None, [Reason(Code.FORMAT_MISMATCH,
                                 f"{d.qualified_name} produces {'/'.join(map(str, d.formats))}, "
                                 f"{e.qualified_name} accepts {'/'.join(map(str, e.formats))}",
                                 "pick experts that accept one of the dispatcher's formats")]
    reasons: list[Reason] = []
    if config.dispatch_format != AUTO and d is not None:
        if Format(config.dispatch_format) not in formats:
            return None, [Reason(Code.FORMAT_MISMATCH, f"dispatch format {config.dispatch_format} requested; "
                                 f"{d.qualified_name} x {e.qualified_name} can use {'/'.join(map(str, formats))}",
                                 "choose backends that support it, or dispatch_format='auto'")]
        formats = [Format(config.dispatch_format)]
    if config.cuda_graph:
        specs = [s for s in (d, e) if s is not None]
        safe = [f for f in formats if all(_graph_safe(s, f, config) for s in specs)]
        # formats that are graph-safe only on request rank after those that always are
        safe.sort(key=lambda f: not all(f in s.graph_safe_formats for s in specs))
        if not safe:
            return None, [Reason(Code.NOT_GRAPH_SAFE, "no graph-safe format for "
                                 + " x ".join(s.qualified_name for s in specs) + " (" + "/".join(map(str, formats)) + ")",
                                 "disable cuda_graph or choose graph-safe backends (e.g. masked dispatch)")]
        formats = safe
    if Format.EP_MASKED in formats and config.apply_router_weight_on_input:
        # masked combine always applies the top-k weights; weighting the input too would apply them twice
        if len(formats) == 1:
            return None, [Reason(Code.FORMAT_MISMATCH, "masked dispatch weights in combine, so router weights "
                                 "cannot also be applied on the input", "unset apply_router_weight_on_input")]
        formats.remove(Format.EP_MASKED)
    if Format.EP_MASKED in formats and config.max_tokens_per_rank is None:
        if len(formats) == 1:
            reasons.append(Reason(Code.UNSUPPORTED_SHAPE, "masked (low-latency) dispatch needs a fixed capacity",
                                  "set max_tokens_per_rank"))
            return None, reasons
        formats.remove(Format.EP_MASKED)
    return formats[0], reasons


def negotiate_dtype(manager: PluginManager, config: MoEConfig, d: Optional[BackendSpec], e: BackendSpec,
                    fmt: Format) -> tuple[Optional[DtypeDecision], list[Reason]]:
    """Run the dtype chain for one candidate (``d`` is None for a fused backend): the decision, and
    why it cannot be used (empty when it can). The planner's and the conformance kit's one way."""
    carried = d.wire_dtypes if d is not None else e.wire_dtypes
    common = tuple(x for x in e.wire_dtypes if x in carried)
    if not common:
        return None, [Reason(Code.NO_COMMON_DTYPE, f"{d.qualified_name if d else e.qualified_name} carries "
                             f"{'/'.join(map(str, carried))}, {e.qualified_name} accepts "
                             f"{'/'.join(map(str, e.wire_dtypes))}")]
    request = DtypeRequest(config, d, e, fmt, common)
    try:
        decision = manager.hook.select_dispatch_dtype(request=request)
        if decision is not None and not isinstance(decision, DtypeDecision):
            raise TypeError(f"select_dispatch_dtype answered {decision!r}, not a DtypeDecision or None")
    except (Exception, SystemExit) as exc:  # a plugin's rule is at fault: take it out, ask the rest (decision 44)
        culprit = _dtype_rule_culprit(manager, request, exc)
        if culprit is None:
            return None, [from_exception(Code.API_MISMATCH, "a select_dispatch_dtype rule failed", exc)]
        manager.quarantine(culprit, from_exception(
            Code.API_MISMATCH, f"plugin {culprit!r}: its select_dispatch_dtype rule failed", exc))
        return negotiate_dtype(manager, config, d, e, fmt)
    if decision is None:
        return None, [Reason(Code.NO_COMMON_DTYPE, "no dtype rule answered")]
    if decision.rejection is not None:
        return decision, [decision.rejection]
    if decision.dtype not in common:
        return decision, [Reason(Code.NO_COMMON_DTYPE, f"dispatch dtype {decision.dtype} (from "
                                 f"{decision.steps[-1].source}: {decision.steps[-1].reason}) is not carried by both "
                                 f"sides; common: {'/'.join(map(str, common))}",
                                 "choose --dispatch-dtype among the common dtypes")]
    if decision.dtype is WireDtype.NVFP4 and config.hidden_size % NVFP4_BLOCK:
        return decision, [Reason(Code.UNSUPPORTED_SHAPE, f"an NVFP4 wire quantizes blocks of {NVFP4_BLOCK} channels; "
                                 f"hidden_size={config.hidden_size} is not a multiple of {NVFP4_BLOCK}",
                                 "choose another --dispatch-dtype (bf16) for this hidden size")]
    return decision, []


def _dtype_rule_culprit(manager: PluginManager, request: DtypeRequest, exc: BaseException) -> Optional[str]:
    """The plugin whose ``select_dispatch_dtype`` raised ``exc`` or answered something else than a
    ``DtypeDecision`` (None when it cannot be told, or when it is the core's own rule)."""
    impls = manager.hook.select_dispatch_dtype.get_hookimpls()
    frames = {frame.f_code for frame, _ in traceback.walk_tb(exc.__traceback__)}
    name = next((i.plugin_name for i in impls if getattr(i.function, "__code__", None) in frames), None)
    if name is None and isinstance(exc, TypeError):  # a bad answer: ask each plain rule alone, in call order
        for impl in reversed(impls):
            if impl.hookwrapper or getattr(impl, "wrapper", False):
                continue
            try:
                answer = impl.function(request=request) if "request" in impl.argnames else impl.function()
            except Exception:
                return impl.plugin_name
            if answer is not None:
                name = None if isinstance(answer, DtypeDecision) else impl.plugin_name
                break
    core = {"moe_core.dtype_rules", "moe_core.dtype_default"}
    return name if name is not None and name not in core else None


def _import_failure(spec: BackendSpec) -> Optional[Reason]:
    """``LOAD_ERROR`` when the spec's implementation cannot be imported (checked for the winner only)."""
    try:
        spec.load_impl()
    except (Exception, SystemExit) as exc:
        return from_exception(Code.LOAD_ERROR, f"importing the implementation of {spec.qualified_name} "
                              f"({spec.impl}) failed", exc)
    return None


def plan(config: MoEConfig, *, manager: Optional[PluginManager] = None, dry_run: bool = False) -> Plan:
    """Negotiate the backends for ``config``.

    :param manager: the plugin manager (default: installed plugins).
    :param dry_run: plan for a target device this machine lacks: availability probes are
        reported in ``Plan.notes`` but do not reject (the plan cannot be built).
    :raises PlanError: no candidate fits; every rejected candidate with every reason.
    """
    if manager is None:
        manager = get_plugin_manager()
    target = DeviceKind(config.device)
    if not dry_run and not target.is_present():  # the reference runs anywhere: it must not stand in
        raise PlanError(f"no {target} device on this machine", (Rejection(
            config.dispatcher, config.experts,
            (Reason(Code.NO_DEVICE, f"the layer targets device {target!s}, this machine has none "
                    f"(it has {local_device_kind()!s})",
                    f"plan for a target machine with dry_run=True (moe-core plan --dry-run), or use "
                    f"device={local_device_kind()!s}"),)),))
    specs = manager.specs
    dispatchers = [s for s in specs if s.role is Role.DISPATCHER]
    experts = [s for s in specs if s.role is Role.EXPERTS]
    fused = [s for s in specs if s.role is Role.FUSED]

    unknown = [f"{what} {choice!r}" for what, choice in (("dispatcher", config.dispatcher), ("experts", config.experts))
               if choice != AUTO and manager.spec(choice) is None]
    if unknown:
        known = ", ".join(sorted({s.name for s in specs}))
        raise PlanError(f"unknown backend: {', '.join(unknown)}", (Rejection(
            config.dispatcher, config.experts,
            (Reason(Code.NOT_INSTALLED, f"no installed plugin declares {', '.join(unknown)}",
                    f"known backends: {known}; run `moe-core backends`"),)),))

    candidates: list[tuple[Optional[BackendSpec], BackendSpec]] = []
    for f in fused:  # a fused backend answers to either choice
        if _matches(config.dispatcher, f, manager) and _matches(config.experts, f, manager):
            candidates.append((None, f))
    for d in dispatchers:
        for e in experts:
            if _matches(config.dispatcher, d, manager) and _matches(config.experts, e, manager):
                candidates.append((d, e))
    # score: dispatcher + experts priority for a pair, the fused backend's own priority for fused
    candidates.sort(key=lambda c: (-(c[1].priority + (c[0].priority if c[0] else 0)),
                                   c[0].qualified_name if c[0] else "", c[1].qualified_name))

    accepted: list[Plan] = []
    rejected: list[Rejection] = []
    for d, e in candidates:
        notes: list[str] = []
        reasons: list[Reason] = []
        for spec in ([d] if d else []) + [e]:
            named = (config.dispatcher if spec is d else config.experts) != AUTO
            reasons += _spec_reasons(spec, config, manager, dry_run, notes, probe_anyway=named)
        fmt, format_reasons = _choose_format(d, e, config)
        reasons += format_reasons
        decision = None
        if fmt is not None:
            decision, dtype_reasons = negotiate_dtype(manager, config, d, e, fmt)
            reasons += dtype_reasons
        d_name = d.qualified_name if d else e.qualified_name
        if reasons:
            rejected.append(Rejection(d_name, e.qualified_name, tuple(reasons)))
            log.debug("moe-core plan: rejected %s x %s: %s", d_name, e.qualified_name, "; ".join(map(str, reasons)))
            continue
        assert fmt is not None and decision is not None and decision.dtype is not None
        accepted.append(Plan(config, d, e, fmt, decision.dtype, decision.steps, notes=tuple(notes), dry_run=dry_run))

    if not accepted:
        choice = ", ".join(f"{k}={v}" for k, v in (("dispatcher", config.dispatcher), ("experts", config.experts),
                                                   ("dispatch_dtype", config.dispatch_dtype)) if v != AUTO)
        summary = f"no MoE backend combination fits this layer{' with ' + choice if choice else ''} " \
                  f"({len(rejected)} candidate(s) rejected)"
        raise PlanError(summary, tuple(rejected))
    # the winner's implementation must import; else it is rejected (recorded) and the next one wins
    # (an explicit choice has no next one: it fails closed)
    while not dry_run and accepted:
        failures = [(s, r) for s in (accepted[0].dispatcher, accepted[0].experts) if s is not None
                    for r in [_import_failure(s)] if r is not None]
        if not failures:
            break
        for spec, reason in failures:
            manager.mark_unusable(spec, reason)
        top = accepted.pop(0)
        rejected.append(Rejection(top.dispatcher.qualified_name if top.dispatcher else top.experts.qualified_name,
                                  top.experts.qualified_name, tuple(r for _, r in failures)))
    if not accepted:
        raise PlanError(f"no MoE backend combination fits this layer ({len(rejected)} candidate(s) rejected; "
                        "the best ones failed to import)", tuple(rejected))
    chosen = dataclasses.replace(accepted[0], rejected=tuple(rejected),
                                 notes=accepted[0].notes + _preference_notes(accepted))
    log.info("moe-core plan: %s x %s, format %s, dispatch dtype %s", chosen.dispatcher_name,
             chosen.experts.name, chosen.format, chosen.dispatch_dtype)
    return chosen
