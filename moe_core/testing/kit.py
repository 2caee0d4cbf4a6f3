"""The conformance kit's engine: options, cases generated from a ``BackendSpec``, running, report.

It does not depend on pytest: ``run_kit`` runs every case in-process and returns a ``KitReport``
(handy inside a plugin's own test suite, after its fixtures installed emulated vendor ops), and the
pytest plugin (``moe_core.testing.plugin``) turns the same cases into test items.
"""

from __future__ import annotations

import time
import traceback
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Union

import torch

from moe_core.backends import BackendSpec, EPSupport, Role
from moe_core.contracts import Activation, Format
from moe_core.testing import checks, ep
from moe_core.testing.cases import (  # noqa: F401  (re-exported: the vocabulary's old home)
    Case,
    CaseResult,
    KitContext,
    KitFailure,
    KitOptions,
    KitSkip,
    ManagerFactory,
    make_manager,
    run_setup,
)
from moe_core.testing.data import Shape  # noqa: F401  (re-exported: imported from here by plugins' tests)

__all__ = ["KitOptions", "Case", "KitContext", "KitReport", "CaseResult", "KitFailure", "KitSkip",
           "generate_cases", "run_kit"]


# --------------------------------------------------------------------------- generation


def _sorted(values: Iterable[Any]) -> list[Any]:
    return sorted(values, key=str)


def generate_cases(spec: BackendSpec, options: KitOptions, manager: Any = None) -> list[Case]:
    """Every conformance case for ``spec``, derived from its declaration.

    :param manager: the ``PluginManager`` whose dtype rules pick each scheme's wire dtype
        (default: from ``options.manager_factory``, else the installed plugins).
    """
    ctx = KitContext(options, manager)
    shape = options.shape
    name = spec.qualified_name
    cases: list[Case] = []

    def add(case_id: str, fn: Callable[[KitContext, Case], None], **params: Any) -> None:
        cases.append(Case(name, case_id, fn, params))

    token_counts = (0, 1, shape.tokens_odd, shape.tokens_large)
    top_ks = sorted({1, shape.top_k})
    if spec.role is Role.FUSED and spec.ep is EPSupport.REQUIRED:  # checked whole, in EP worlds (like dispatchers)
        for world in options.ep_sizes:
            for sub in ep.fused_subcases(spec, world, shape):
                add(sub.case_id, ep.dispatcher_case, world=world, sub=sub)
    elif spec.role in (Role.EXPERTS, Role.FUSED):
        formats = [f for f in spec.formats if f in (Format.STANDARD, Format.EP_NORMAL, Format.EP_MASKED)]
        if spec.role is Role.FUSED:
            formats = [Format.FUSED]
        # the full matrix runs with the primary activation (SiLU, the common one, when declared); every
        # other declared activation runs in every format x scheme too: a kernel with the activation
        # hard-wired fails there, by name
        primary = Activation.SILU if Activation.SILU in spec.activations else _sorted(spec.activations)[0]
        others = [a for a in _sorted(spec.activations) if a is not primary]
        for scheme in _sorted(spec.quant_schemes):
            wire = ctx.natural_wire(spec, scheme, formats[0])
            base = dict(scheme=scheme, wire=wire, activation=primary)
            for fmt in formats:
                tag = f"{fmt}-{scheme}-{wire}-{primary}"
                for t in token_counts:
                    for k in top_ks:
                        add(f"experts-{tag}-T{t}-K{k}", checks.experts_numeric, fmt=fmt, tokens=t, top_k=k, **base)
                add(f"experts-{tag}-scaling", checks.experts_numeric, fmt=fmt, tokens=shape.tokens_odd,
                    top_k=shape.top_k, routed_scaling_factor=2.5, **base)
                add(f"experts-{tag}-poisoned", checks.experts_numeric, fmt=fmt, tokens=shape.tokens_odd,
                    top_k=shape.top_k, poison=True, **base)
                if fmt is not Format.EP_MASKED:  # masked outputs are unweighted: no weight on input
                    add(f"experts-{tag}-weight-on-input", checks.experts_numeric, fmt=fmt, tokens=shape.tokens_odd,
                        top_k=1, apply_router_weight_on_input=True, **base)
                for act in others:
                    add(f"experts-{fmt}-{scheme}-{wire}-{act}-T{shape.tokens_odd}-K{shape.top_k}",
                        checks.experts_numeric, fmt=fmt, tokens=shape.tokens_odd, top_k=shape.top_k,
                        **{**base, "activation": act})
            fmt = formats[0]
            tag = f"{fmt}-{scheme}-{wire}-{primary}"
            add(f"experts-{tag}-repeat", checks.experts_repeat, fmt=fmt, tokens=shape.tokens_odd,
                top_k=shape.top_k, **base)
            add(f"experts-{tag}-process-weights-idempotent", checks.experts_idempotent, fmt=fmt,
                tokens=shape.tokens_odd, top_k=shape.top_k, **base)
            for other in spec.wire_dtypes:
                if other is not wire:
                    add(f"experts-{fmt}-{scheme}-{other}-{primary}-wire", checks.experts_numeric, fmt=fmt,
                        tokens=shape.tokens_odd, top_k=shape.top_k, scheme=scheme, wire=other, activation=primary)
    if spec.role is Role.DISPATCHER:
        for world in options.ep_sizes:
            for sub in ep.dispatcher_subcases(spec, world, shape):
                add(sub.case_id, ep.dispatcher_case, world=world, sub=sub)
    checks.add_honesty_cases(spec, lambda case_id, fn, **kw: add(case_id, fn, needs_available=False, **kw))
    graph_formats = _sorted(spec.graph_safe_formats)
    if spec.role is not Role.DISPATCHER or spec.ep is not EPSupport.REQUIRED:
        for fmt in graph_formats:
            add(f"graph-{fmt}", checks.graph_capture, fmt=fmt)
    if options.select:
        cases = [c for c in cases if any(s in c.id for s in options.select)]
    return cases


# --------------------------------------------------------------------------- running


def execute(ctx: KitContext, case: Case) -> CaseResult:
    """Run one case and record its result (the exception is kept for the caller to re-raise)."""
    start = time.perf_counter()
    try:
        spec = ctx.spec(case.backend)
        reason = ctx.manager.availability(spec)
        if not reason.ok and case.params.get("needs_available", True):  # honesty needs only the declaration
            raise KitSkip(f"backend unavailable: {reason}")
        threads = torch.get_num_threads()
        # the kit's shapes are small: intra-op threads cost more than they save, and on a loaded
        # CI machine OpenMP contention makes tiny ops (index_add_) up to 1000x slower
        torch.set_num_threads(1)
        try:
            case.run(ctx, case)
        finally:
            torch.set_num_threads(threads)
    except KitSkip as exc:
        result = CaseResult(case.backend, case.id, "skipped", str(exc), time.perf_counter() - start)
    except KitFailure as exc:
        result = CaseResult(case.backend, case.id, "failed", f"{case.title}: {exc}", time.perf_counter() - start)
    except Exception as exc:
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-6))
        result = CaseResult(case.backend, case.id, "failed",
                            f"{case.title}: raised {type(exc).__name__}: {exc}\n{tb}", time.perf_counter() - start)
    else:
        result = CaseResult(case.backend, case.id, "passed", "", time.perf_counter() - start)
    ctx.record(result)
    return result


@dataclass
class KitReport:
    """Results of a kit run, per backend."""

    seed: int
    results: list[CaseResult]
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed and bool(self.results)

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.results if r.status == "failed"]

    def by_backend(self) -> dict[str, list[CaseResult]]:
        out: dict[str, list[CaseResult]] = {}
        for r in self.results:
            out.setdefault(r.backend, []).append(r)
        return out

    def text(self, *, failures: bool = True) -> str:
        lines = [f"moe-core conformance kit (seed {self.seed}; replay with --moe-kit-seed {self.seed})"]
        lines += [f"  note: {n}" for n in self.notes]
        lines.append(f"  {'backend':<28} {'passed':>6} {'failed':>6} {'skipped':>7}")
        for backend, results in self.by_backend().items():
            counts = Counter(r.status for r in results)
            lines.append(f"  {backend:<28} {counts['passed']:>6} {counts['failed']:>6} {counts['skipped']:>7}")
            skips = Counter(_first_line(r.message) for r in results if r.status == "skipped")
            for why, n in sorted(skips.items(), key=lambda x: -x[1]):
                lines.append(f"      skipped {n:>3} x {why}")
            for r in results:
                if r.status == "failed":  # in full: the numbers that decide a failure come last
                    lines.append(f"      FAILED {r.case_id}")
                    if failures:
                        lines += [f"          {line}" for line in r.message.strip().splitlines()]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.text()


def _first_line(text: str, limit: int = 220) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 3] + "..."


def run_kit(backends: Union[str, Iterable[str]], *, manager: Any = None, **options: Any) -> KitReport:
    """Run the conformance kit in this process and return its report (never raises for a failing
    case: check ``report.ok`` and print ``report.text()``).

    :param backends: backend name(s), bare or qualified.
    :param manager: a ``PluginManager`` to use in this process (EP workers build their own from
        ``manager_factory``); default: from ``manager_factory``, else the installed plugins.
    :param options: the fields of ``KitOptions`` (``setup=``, ``device=``, ``select=``, ...).
    """
    names = (backends,) if isinstance(backends, str) else tuple(backends)
    opts = KitOptions(backends=names, **options)
    ctx = KitContext(opts, manager)
    for case in collect(ctx):
        execute(ctx, case)
    return KitReport(opts.seed, ctx.results)


def collect(ctx: KitContext) -> list[Case]:
    """The cases of every selected backend (a missing backend is a ``KitFailure``)."""
    cases: list[Case] = []
    for name in ctx.options.backends:
        cases += generate_cases(ctx.spec(name), ctx.options, ctx.manager)
    return cases

