"""Device kinds: what a ``MoEConfig`` targets and a ``BackendSpec`` declares, in one place.

A kind is not a torch device type: ROCm runs under torch's ``cuda`` device type, so each kind
says which torch device type it uses and whether this machine has it.
"""

from __future__ import annotations

import torch

from moe_core.contracts import _StrEnum

__all__ = ["DeviceKind", "DEVICE_KINDS", "local_device_kind"]


class DeviceKind(_StrEnum):
    """The device kinds moe-core knows. Members compare and hash equal to their strings
    (``DeviceKind.CUDA == "cuda"``), so specs and configs written with strings keep working."""

    CPU = "cpu"
    CUDA = "cuda"
    ROCM = "rocm"
    NPU = "npu"

    @property
    def torch_device_type(self) -> str:
        """The torch device type tensors of this kind live on (ROCm: ``cuda``)."""
        return "cuda" if self is DeviceKind.ROCM else self.value

    @classmethod
    def of(cls, device: torch.device) -> "DeviceKind":
        """The kind of a torch device (a ``cuda`` device of a ROCm build is ``rocm``)."""
        if device.type == "cuda" and getattr(torch.version, "hip", None):
            return cls.ROCM
        return cls(device.type)

    def is_present(self) -> bool:
        """Whether this machine has a device of this kind (never raises)."""
        if self is DeviceKind.CPU:
            return True
        if self in (DeviceKind.CUDA, DeviceKind.ROCM):
            is_hip = getattr(torch.version, "hip", None) is not None
            return torch.cuda.is_available() and (is_hip if self is DeviceKind.ROCM else not is_hip)
        npu = getattr(torch, "npu", None)  # torch_npu registers it
        try:
            return npu is not None and bool(npu.is_available())
        except Exception:
            return False


DEVICE_KINDS = tuple(kind.value for kind in DeviceKind)


def local_device_kind() -> DeviceKind:
    """This machine's accelerator kind, else ``cpu``."""
    for kind in (DeviceKind.CUDA, DeviceKind.ROCM, DeviceKind.NPU):
        if kind.is_present():
            return kind
    return DeviceKind.CPU
