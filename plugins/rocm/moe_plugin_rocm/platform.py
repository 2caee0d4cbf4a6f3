"""ROCm device facts the backends depend on: the gfx architecture and its FP8 flavour.

Everything here is cheap and never raises from a probe. The single place
that asks PyTorch for the device is ``query_device``; tests that run the backends against
emulated vendor ops patch it (the emulation fixture), nothing else does.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Optional

import torch

from moe_core.plugin_api import Code, Reason, available, from_exception, unavailable

__all__ = [
    "SUPPORTED_ARCHS",
    "Fp8Flavour",
    "fp8_flavour",
    "query_device",
    "current_arch",
    "device_reason",
    "probe_package",
]

# gfx942: MI300X/MI308X/MI325X; gfx950: MI350X/MI355X. Both are what AITER's fused_moe and
# MoRI's EP kernels are built and tuned for.
SUPPORTED_ARCHS = ("gfx942", "gfx950")


@dataclass(frozen=True)
class Fp8Flavour:
    """The FP8 e4m3 variant the hardware computes in."""

    dtype: torch.dtype
    max: float
    name: str


_FNUZ = Fp8Flavour(torch.float8_e4m3fnuz, 240.0, "e4m3fnuz")  # MI300 (gfx942) native FP8
_FN = Fp8Flavour(torch.float8_e4m3fn, 448.0, "e4m3fn")  # OCP FP8 (gfx950)


def fp8_flavour(arch: str) -> Fp8Flavour:
    """e4m3fnuz (max 240) on gfx942, OCP e4m3fn (max 448) on gfx950."""
    if arch == "gfx942":
        return _FNUZ
    if arch == "gfx950":
        return _FN
    raise ValueError(f"no FP8 flavour known for {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}")


def query_device() -> tuple[Optional[str], str]:
    """``(arch, "")`` for device 0 (``"gfx942"``), or ``(None, why)`` without a ROCm GPU.

    The one place that asks PyTorch about the device (tests of emulated ops patch it).
    """
    if getattr(torch.version, "hip", None) is None:
        return None, f"PyTorch {torch.__version__} is not a ROCm build"
    if not torch.cuda.is_available():
        return None, "no AMD GPU visible to PyTorch"
    name = torch.cuda.get_device_properties(0).gcnArchName  # "gfx942:sramecc+:xnack-"
    return name.split(":")[0], ""


def device_reason() -> tuple[Optional[str], Reason]:
    """``(arch, OK)`` on a supported AMD GPU, else ``(arch or None, NO_DEVICE / UNSUPPORTED_ARCH)``."""
    try:
        arch, why = query_device()
    except Exception as exc:  # a broken driver must not break listing
        return None, from_exception(Code.NO_DEVICE, "querying the ROCm device failed", exc)
    if arch is None:
        return None, unavailable(Code.NO_DEVICE, why,
                                 "run on an AMD Instinct GPU with a ROCm build of PyTorch (check rocm-smi, "
                                 "HIP_VISIBLE_DEVICES)")
    if arch not in SUPPORTED_ARCHS:
        return arch, unavailable(Code.UNSUPPORTED_ARCH, f"GPU architecture {arch} is not supported",
                                 f"supported architectures: {', '.join(SUPPORTED_ARCHS)}")
    return arch, available(f"ROCm device {arch}")


def current_arch() -> str:
    """The architecture, read once by implementations built at plan time; raises if unusable."""
    arch, reason = device_reason()
    if not reason.ok:
        raise RuntimeError(f"moe-plugin-rocm: {reason}")
    assert arch is not None
    return arch


def probe_package(package: str, modules: tuple[str, ...], install_hint: str) -> Reason:
    """NOT_INSTALLED / NO_DEVICE / UNSUPPORTED_ARCH / LOAD_ERROR / OK for a vendor package.

    The device is checked before the import so that a machine without AMD GPUs never imports
    the (heavy, ROCm-linked) vendor library just to list backends.
    """
    try:
        if importlib.util.find_spec(package) is None:
            return unavailable(Code.NOT_INSTALLED, f"python package {package!r} is not installed", install_hint)
    except Exception as exc:  # find_spec raises for broken parent packages
        return from_exception(Code.LOAD_ERROR, f"looking up {package!r} failed", exc)
    arch, reason = device_reason()
    if not reason.ok:
        return reason
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception as exc:
            reason = from_exception(Code.LOAD_ERROR, f"importing {module} failed", exc)
            return Reason(reason.code, reason.message,
                          f"reinstall {package} built for this ROCm and PyTorch", reason.traceback)
    return available(f"{package} on {arch}")
