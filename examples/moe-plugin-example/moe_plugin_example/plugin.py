"""The plugin object moe-core loads through the entry point ``example``.

Keep this module light: moe-core imports it to *list* backends (``moe-core backends``), on every
machine, so it must not import a vendor library. Everything heavy goes in the ``impl`` module,
named as a string and imported only when a plan uses the backend.
"""

from __future__ import annotations

import importlib.util

from moe_core.plugin_api import (
    Activation,
    BackendPlugin,
    BackendSpec,
    Code,
    Format,
    QuantScheme,
    Reason,
    Role,
    WireDtype,
    available,
    unavailable,
)


def probe() -> Reason:
    """Is the backend usable on this machine? Cheap, never raises, no heavy imports.

    This example needs only PyTorch. A vendor plugin checks, in this order and with these codes:
    its library installed (``importlib.util.find_spec`` -> ``NOT_INSTALLED``, hint: the package to
    install), importable (``LOAD_ERROR`` with the exception), a device present (``NO_DEVICE``), the
    device's architecture (``UNSUPPORTED_ARCH``).
    """
    try:
        if importlib.util.find_spec("torch") is None:
            return unavailable(Code.NOT_INSTALLED, "PyTorch is not installed", "pip install torch")
        return available("pure PyTorch, no vendor library")
    except Exception as exc:  # a probe never raises
        return unavailable(Code.LOAD_ERROR, f"probe failed: {type(exc).__name__}: {exc}")


class ExamplePlugin(BackendPlugin):
    """Declares the backends. Every capability listed here is checked by the conformance kit:
    a claimed one must pass against the reference, an unclaimed one must be rejected."""

    def backends(self) -> list[BackendSpec]:
        return [
            BackendSpec(
                name="simple",
                role=Role.EXPERTS,
                impl="moe_plugin_example.experts:SimpleExperts",  # imported lazily, at plan time
                formats=(Format.STANDARD, Format.EP_NORMAL),  # both: weighted output, summed over local experts
                devices=frozenset({"cpu", "cuda"}),
                wire_dtypes=(WireDtype.BF16, WireDtype.INT8),
                quant_schemes=frozenset({QuantScheme.UNQUANTIZED, QuantScheme.INT8_W8A8}),
                activations=frozenset({Activation.SILU, Activation.GELU}),
                graph_safe_formats=frozenset(),  # it reads expert counts on the host: not capturable
                ep="any",
                priority=-10,  # an example: never preferred over real kernels by "auto"
                probe="moe_plugin_example.plugin:probe",
                description="example third-party experts: per-expert loop in PyTorch (W8A8 in int8 values)",
            ),
        ]


plugin = ExamplePlugin()
