"""``BackendPlugin``: the base class of a plugin object, apart from discovery.

A plugin object declares its backends (``backends()``); the stage hooks answer for the backend
objects built from those specs and pass on everything else. Discovery and loading
(``moe_core.plugins``) sit above this module, as does the built-in plugin that subclasses it
(docs/decisions.md).
"""

from __future__ import annotations

import functools
from typing import Any

from moe_core.backends import BackendSpec
from moe_core.hookspecs import HOOKSPEC_VERSION, hookimpl

__all__ = ["BackendPlugin"]


class BackendPlugin:
    """Convenient base for a plugin object: declare ``backends()``; the stage hooks answer for
    backend objects built from those specs and pass on everything else.

    Entry point example (pyproject.toml)::

        [project.entry-points."moe_core.plugins"]
        acme = "moe_plugin_acme.plugin:plugin"   # plugin = AcmePlugin()
    """

    moe_core_hookspec_version = HOOKSPEC_VERSION

    def backends(self) -> list[BackendSpec]:
        raise NotImplementedError

    @functools.cached_property
    def _impls(self) -> frozenset[str]:
        return frozenset(spec.impl for spec in self.backends())

    def _owns(self, backend: Any) -> bool:
        ctx = getattr(backend, "ctx", None)
        return ctx is not None and ctx.spec.impl in self._impls

    @hookimpl
    def moe_core_backends(self) -> list[BackendSpec]:
        return self.backends()

    @hookimpl
    def dispatch(self, backend, hidden_states, topk):
        return backend.dispatch(hidden_states, topk) if self._owns(backend) else None

    @hookimpl
    def apply(self, backend, layer, dispatched):
        return backend.apply(layer, dispatched) if self._owns(backend) else None

    @hookimpl
    def combine(self, backend, combine_input):
        return backend.combine(combine_input) if self._owns(backend) else None

    @hookimpl
    def process_weights(self, backend, layer):
        if not self._owns(backend):
            return None
        backend.process_weights(layer)
        return True
