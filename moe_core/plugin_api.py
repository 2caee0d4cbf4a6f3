"""Everything a backend plugin needs from moe-core, in one place.

Plugins (the three shipped ones, the example, and third-party ones) import from this module
only, so the core's internal modules can move without breaking any vendor. What is here is the
plugin-facing contract: the data that flows between stages, the declarations a plugin makes, the
runtime base classes it subclasses, the quantization definitions it must match, and the helpers
its tuners and probes use. The conformance kit is ``moe_core.testing``.
"""

from moe_core import quant
from moe_core.backends import BackendSpec, Code, EPSupport, Reason, Role, available, from_exception, unavailable
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
    masked_dispatch_unchecked,
)
from moe_core.devices import DeviceKind, local_device_kind
from moe_core.distributed.torch_a2a import TorchA2AKernels, register_torch_a2a_kernels
from moe_core.dtype_chain import DtypeDecision, DtypeRequest
from moe_core.hookspecs import HOOKSPEC_VERSION, hookimpl
from moe_core.layer import MoELayer
from moe_core.plugin_base import BackendPlugin
from moe_core.router import balanced_correction_bias, route
from moe_core.runtime import BackendContext, Dispatcher, Experts, FusedMoE

__all__ = [
    "Activation", "BackendContext", "BackendPlugin", "BackendSpec", "Code", "CombineInput", "DeviceKind", "DispatchOutput",
    "Dispatcher", "DtypeDecision", "DtypeRequest", "EPMaskedCombine", "EPSupport", "EPMaskedDispatch", "EPNormalCombine",
    "EPNormalDispatch", "Experts", "Format", "FusedMoE", "HOOKSPEC_VERSION", "MoEConfig", "MoELayer", "PRESETS",
    "QuantScheme", "QuantizedActivations", "Reason", "Role", "RouterConfig", "StandardCombine", "StandardDispatch",
    "TopK", "TorchA2AKernels", "WireDtype", "available", "balanced_correction_bias", "from_exception", "hookimpl", "local_device_kind",
    "masked_dispatch_unchecked",
    "preset", "quant", "register_torch_a2a_kernels", "route", "unavailable",
]
