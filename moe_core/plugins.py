"""Plugin discovery and registration: entry points -> pluggy, with every failure recorded.

Rules (DESIGN section 4):
- plugins come from the entry-point group ``moe_core.plugins`` (``importlib.metadata``); the
  built-in reference backends register the same way, under the name ``reference``;
- a plugin that fails to import or to validate is recorded (``LOAD_ERROR`` / ``API_MISMATCH``,
  traceback kept) and skipped, unless ``strict=True``, which raises ``PluginLoadError``;
- ``allow`` / ``block`` filter by plugin (entry-point) name;
- backends with the same name in two plugins: the first in (priority desc, plugin name) order
  keeps the bare name, the others are still reachable as ``plugin.name``; the clash is reported.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time
from dataclasses import dataclass, field
from importlib import metadata  # the stdlib's entry_points(group=...) selects since Python 3.10
from typing import Any, Iterable, Optional

import pluggy

from moe_core import hookspecs
from moe_core.backends import BackendSpec, Code, Reason, from_exception
from moe_core.dtype_chain import CoreDtypeDefault, CoreDtypeRules
from moe_core.hookspecs import HOOKSPEC_VERSION
from moe_core.plugin_base import BackendPlugin
from moe_core.reference.plugin import plugin as reference_plugin

log = logging.getLogger("moe_core")

ENTRY_POINT_GROUP = "moe_core.plugins"
BUILTIN_PLUGIN = "reference"

__all__ = ["BackendPlugin", "PluginManager", "PluginRecord", "PluginLoadError", "get_plugin_manager", "PLUGINS_ENV"]


class PluginLoadError(RuntimeError):
    """Raised in strict mode when a plugin cannot be loaded."""


@dataclass(frozen=True)
class PluginRecord:
    """One discovered plugin and what became of it."""

    name: str
    version: str
    source: str  # entry-point value, or "builtin"
    status: Reason  # OK, LOAD_ERROR, API_MISMATCH or DISABLED
    distribution: str = ""  # the installed distribution providing it ("moe-core" for the built-in plugin)


@dataclass
class _Registry:
    specs: dict[str, BackendSpec] = field(default_factory=dict)  # bare and qualified names
    ordered: list[BackendSpec] = field(default_factory=list)
    duplicates: list[str] = field(default_factory=list)


class PluginManager:
    """Discovers plugins and holds their backend specs.

    :param allow: plugin names to load (``None``: all). The built-in ``reference`` plugin is
        always loaded unless blocked.
    :param block: plugin names never to load.
    :param strict: raise ``PluginLoadError`` instead of recording a broken plugin.
    :param entry_points: use these entry points instead of the installed ones (tests).
    """

    def __init__(
        self,
        *,
        allow: Optional[Iterable[str]] = None,
        block: Iterable[str] = (),
        strict: bool = False,
        entry_points: Optional[Iterable[Any]] = None,
        load_builtin: bool = True,
    ) -> None:
        self.pm = pluggy.PluginManager(hookspecs.PROJECT)
        self.pm.add_hookspecs(hookspecs)
        self.allow = None if allow is None else frozenset(allow)
        self.block = frozenset(block)
        self.strict = strict
        self.records: list[PluginRecord] = []
        self._availability: dict[str, Reason] = {}
        self.pm.register(CoreDtypeRules(), name="moe_core.dtype_rules")
        self.pm.register(CoreDtypeDefault(), name="moe_core.dtype_default")
        if load_builtin:
            self._load_builtin()
        eps = metadata.entry_points(group=ENTRY_POINT_GROUP) if entry_points is None else entry_points
        for ep in sorted(eps, key=lambda e: e.name):
            self._load_entry_point(ep)
        self._registry = self._collect_specs()

    # ---------------------------------------------------------------- loading

    def _load_builtin(self) -> None:
        if BUILTIN_PLUGIN in self.block:
            self.records.append(PluginRecord(BUILTIN_PLUGIN, _core_version(), "builtin",
                                             Reason(Code.DISABLED, "blocked by the block-list"), "moe-core"))
            return
        self._register(BUILTIN_PLUGIN, _core_version(), "builtin", reference_plugin, "moe-core")

    def _load_entry_point(self, ep: Any) -> None:
        name = ep.name
        version = _dist_version(ep)
        dist = _dist_name(ep)
        if name == BUILTIN_PLUGIN:
            self._fail(PluginRecord(name, version, ep.value, Reason(
                Code.LOAD_ERROR, f"plugin name {name!r} is reserved for the built-in backends",
                "rename the entry point"), dist))
            return
        if name in self.block or (self.allow is not None and name not in self.allow):
            why = "blocked by the block-list" if name in self.block else "not in the allow-list"
            self.records.append(PluginRecord(name, version, ep.value, Reason(Code.DISABLED, why), dist))
            return
        start = time.monotonic()
        try:
            obj = ep.load()
        except (Exception, SystemExit) as exc:  # a plugin calling sys.exit() on import must not end the process
            reason = from_exception(Code.LOAD_ERROR, f"importing plugin {name!r} ({ep.value}) failed", exc)
            self._fail(PluginRecord(name, version, ep.value, dataclasses.replace(
                reason, hint=f"fix or uninstall the distribution providing {ep.value.split(':')[0]}"), dist))
            return
        _warn_if_slow(f"importing plugin {name!r} ({ep.value})", time.monotonic() - start)
        self._register(name, version, ep.value, obj, dist)

    def _register(self, name: str, version: str, source: str, obj: Any, dist: str = "") -> None:
        declared = getattr(obj, "moe_core_hookspec_version", None)
        well_formed = isinstance(declared, tuple) and bool(declared) and all(type(v) is int for v in declared)
        if not well_formed or declared[0] != HOOKSPEC_VERSION[0] or declared > HOOKSPEC_VERSION:
            self._fail(PluginRecord(name, version, source, Reason(
                Code.API_MISMATCH,
                f"plugin {name!r} declares hookspec version {declared!r}, core has {HOOKSPEC_VERSION} "
                "(a tuple of ints, same major)",
                "set moe_core_hookspec_version on the plugin object and upgrade the plugin or moe-core",
            )))
            return
        try:
            self.pm.register(obj, name=name)
            self._validate(name)
        except pluggy.PluginValidationError as exc:
            if self.pm.is_registered(obj):
                self.pm.unregister(obj)
            reason = from_exception(Code.API_MISMATCH, f"plugin {name!r} does not match the hook specs", exc)
            self._fail(PluginRecord(name, version, source, dataclasses.replace(
                reason, hint="compare the hookimpl signatures with moe_core.hookspecs"), dist))
            return
        except Exception as exc:
            if self.pm.is_registered(obj):
                self.pm.unregister(obj)
            self._fail(PluginRecord(name, version, source,
                                    from_exception(Code.LOAD_ERROR, f"registering plugin {name!r} failed", exc), dist))
            return
        self.records.append(PluginRecord(name, version, source, Reason(Code.OK, "loaded"), dist))

    def _validate(self, name: str) -> None:
        """Every hookimpl must name a known hook (pluggy checks argument subsets at register)."""
        plugin = self.pm.get_plugin(name)
        for hook_caller in self.pm.get_hookcallers(plugin) or []:
            if not hook_caller.has_spec():
                raise pluggy.PluginValidationError(plugin, f"unknown hook {hook_caller.name!r}")

    def _fail(self, record: PluginRecord) -> None:
        if self.strict:
            raise PluginLoadError(_describe(record))
        log.warning("moe-core plugin %s skipped: %s", record.name, record.status)
        self.records.append(record)

    # ---------------------------------------------------------------- specs

    def _collect_specs(self) -> _Registry:
        reg = _Registry()
        collected: list[BackendSpec] = []
        for record in list(self.records):
            if not record.status.ok:
                continue
            plugin = self.pm.get_plugin(record.name)
            try:
                declare = getattr(plugin, "moe_core_backends", None)  # a rules-only plugin declares none
                specs = declare() if declare is not None else []
                if not isinstance(specs, (list, tuple)) or not all(isinstance(s, BackendSpec) for s in specs):
                    raise TypeError(f"moe_core_backends() must return a list of BackendSpec, got {specs!r}")
            except (Exception, SystemExit) as exc:
                self.pm.unregister(plugin)
                failed = dataclasses.replace(
                    record, status=from_exception(Code.LOAD_ERROR, f"moe_core_backends() of {record.name!r} failed", exc))
                self.records[self.records.index(record)] = failed
                if self.strict:
                    raise PluginLoadError(_describe(failed)) from exc
                continue
            for spec in specs:
                collected.append(dataclasses.replace(spec, plugin=record.name, plugin_version=record.version))
        # deterministic: highest priority first, then plugin name, then backend name
        collected.sort(key=lambda s: (-s.priority, s.plugin != BUILTIN_PLUGIN, s.plugin, s.name))
        # the core's bare names ("reference", "standard", ...) always mean the core backends: a plugin
        # cannot take them over by declaring a higher priority
        for spec in collected:
            if spec.plugin == BUILTIN_PLUGIN:
                reg.specs[spec.name] = spec
        for spec in collected:
            reg.specs[spec.qualified_name] = spec
            kept = reg.specs.get(spec.name)
            if kept is None:
                reg.specs[spec.name] = spec
            elif kept is not spec:
                reg.duplicates.append(
                    f"backend name {spec.name!r} is declared by plugins {kept.plugin!r} and {spec.plugin!r}: "
                    f"'{spec.name}' means {kept.qualified_name}; use '{spec.qualified_name}' for the other"
                )
                log.warning(reg.duplicates[-1])
            reg.ordered.append(spec)
        return reg

    @property
    def specs(self) -> list[BackendSpec]:
        """Every declared backend, highest priority first."""
        return list(self._registry.ordered)

    @property
    def duplicates(self) -> list[str]:
        return list(self._registry.duplicates)

    def spec(self, name: str) -> Optional[BackendSpec]:
        """A backend by bare name (``triton``) or qualified name (``cuda.triton``)."""
        return self._registry.specs.get(name)

    def register(self, plugin: Any, name: str, version: str = "0", source: str = "direct") -> PluginRecord:
        """Register a plugin object directly (not through an entry point): tests, benchmarks,
        and engines that ship backends in-tree. The same checks apply as for entry points."""
        self._register(name, version, source, plugin)
        self._registry = self._collect_specs()
        return next(r for r in reversed(self.records) if r.name == name)

    def quarantine(self, plugin_name: str, status: Reason) -> None:
        """Take a loaded plugin out after a fault at run time (a hook that raised or answered
        garbage): it is unregistered, its backends leave the registry and its record says why.
        Strict mode raises instead (decision 44)."""
        if self.strict:
            raise PluginLoadError(f"{plugin_name}: {status}")
        log.warning("moe-core plugin %s disabled: %s", plugin_name, status)
        plugin = self.pm.get_plugin(plugin_name)
        if plugin is not None:
            self.pm.unregister(plugin)
        self.records = [dataclasses.replace(r, status=status) if r.name == plugin_name else r for r in self.records]
        self._registry = self._collect_specs()

    def mark_unusable(self, spec: BackendSpec, reason: Reason) -> None:
        """Record that ``spec`` cannot be used on this machine after all (its implementation failed to
        import or to build): the planner then rejects it with ``reason`` (``auto`` falls back)."""
        self._availability[spec.qualified_name] = reason

    def availability(self, spec: BackendSpec) -> Reason:
        """The spec's probe result, cached for the life of this manager."""
        key = spec.qualified_name
        if key not in self._availability:
            start = time.monotonic()
            self._availability[key] = spec.run_probe()
            _warn_if_slow(f"probe of backend {key}", time.monotonic() - start)
        return self._availability[key]

    @property
    def hook(self) -> Any:
        return self.pm.hook

    def failed(self) -> list[PluginRecord]:
        return [r for r in self.records if not r.status.ok and r.status.code is not Code.DISABLED]


def _describe(record: PluginRecord) -> str:
    """A failed record for ``PluginLoadError``: the plugin, its verdict and the traceback."""
    return f"{record.name}: {record.status}\n{record.status.traceback or ''}"


SLOW_SECONDS = 1.0  # a plugin import or probe slower than this delays every command: say so


def _warn_if_slow(what: str, seconds: float) -> None:
    if seconds > SLOW_SECONDS:
        log.warning("moe-core: %s took %.1f s (every command that loads plugins pays it; "
                    "MOE_CORE_PLUGINS=-NAME skips a plugin)", what, seconds)


def _core_version() -> str:
    try:
        return metadata.version("moe-core")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def _dist_name(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) or ""


def _dist_version(ep: Any) -> str:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "version", None) or "unknown"


PLUGINS_ENV = "MOE_CORE_PLUGINS"


def plugin_filter_from_env(value: Optional[str]) -> tuple[Optional[frozenset[str]], frozenset[str]]:
    """``MOE_CORE_PLUGINS`` -> (allow, block), as vLLM's ``VLLM_PLUGINS``: unset, every installed
    plugin; ``"a,b"`` only those; ``""`` none but the core; ``"-c"`` entries block (``"-c,-d"``: all
    but those). The core's own ``reference`` plugin loads unless blocked by name."""
    if value is None:
        return None, frozenset()
    names = [n.strip() for n in value.split(",") if n.strip()]
    block = frozenset(n[1:] for n in names if n.startswith("-"))
    allow = [n for n in names if not n.startswith("-")]
    return (frozenset(allow) if allow or not block else None), block


@functools.lru_cache(maxsize=None)
def get_plugin_manager() -> PluginManager:
    """The process-wide default manager: installed plugins, filtered by ``MOE_CORE_PLUGINS``
    (see ``plugin_filter_from_env``), non-strict. Cached; build your own ``PluginManager`` for
    other allow/block-lists or strict mode and pass it to ``plan``."""
    allow, block = plugin_filter_from_env(os.environ.get(PLUGINS_ENV))
    return PluginManager(allow=allow, block=block)
