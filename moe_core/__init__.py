"""moe-core: a hardware-neutral Mixture-of-Experts core.

The pipeline is route -> dispatch -> apply -> combine. Plugins (entry-point group
``moe_core.plugins``) declare dispatchers and experts backends; ``plan`` negotiates them for a
layer; ``MoELayer`` runs the plan's bound backends.
"""

import importlib.metadata

from moe_core import _quiet  # noqa: F401 (first: it filters a warning torch prints at import)
from moe_core.backends import BackendSpec, Code, EPSupport, Reason, Role, available, unavailable
from moe_core.config import PRESETS, MoEConfig, RouterConfig, preset
from moe_core.contracts import (
    Activation,
    CombineInput,
    DispatchOutput,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Format,
    QuantizedActivations,
    QuantScheme,
    StandardCombine,
    StandardDispatch,
    TopK,
    WireDtype,
)
from moe_core.devices import DeviceKind
from moe_core.dtype_chain import DtypeDecision, DtypeRequest
from moe_core.hookspecs import HOOKSPEC_VERSION, hookimpl, hookspec
from moe_core.layer import MoELayer
from moe_core.planner import Plan, PlanError, plan
from moe_core.plugin_base import BackendPlugin
from moe_core.plugins import PluginLoadError, PluginManager, get_plugin_manager
from moe_core.router import route
from moe_core.runtime import BackendContext, Dispatcher, Experts, FusedMoE

try:
    __version__ = importlib.metadata.version("moe-core")
except importlib.metadata.PackageNotFoundError:  # a source tree that is not installed
    __version__ = "0+unknown"

__all__ = [
    "Activation", "BackendContext", "BackendPlugin", "BackendSpec", "Code", "CombineInput", "DeviceKind", "DispatchOutput",
    "Dispatcher", "DtypeDecision", "DtypeRequest", "EPMaskedCombine", "EPSupport", "EPMaskedDispatch", "EPNormalCombine",
    "EPNormalDispatch", "Experts", "Format", "FusedMoE", "HOOKSPEC_VERSION", "MoEConfig", "MoELayer", "PRESETS",
    "Plan", "PlanError", "PluginLoadError", "PluginManager", "QuantScheme", "QuantizedActivations", "Reason", "Role",
    "RouterConfig", "StandardCombine", "StandardDispatch", "TopK", "WireDtype", "__version__", "available", "get_plugin_manager",
    "hookimpl", "hookspec", "plan", "preset", "route", "unavailable",
]
