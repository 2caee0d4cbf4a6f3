"""Triton's compiled launchers emulated on the CPU, for the tests of ``triton.launch`` and ``triton.replay``.

Under Triton's interpreter ``launch`` always goes through ``kernel[grid]`` (nothing compiled to call). ``install``
makes the interpreter look like a GPU to it: ``kernel[grid]`` runs the kernel in the interpreter and returns an
``Emulated`` "compiled kernel" whose launcher (``run``, called as Triton's ``CompiledKernel.run`` is) runs the
kernel in the interpreter again; pointer parameters given as ints (what a replay passes) become tensors over
that memory, with the dtype and extent the parameter had when the kernel was first launched. ``log`` lists every
launch the kernels saw: ("triton" | "launcher", kernel name).
"""

from __future__ import annotations

import ctypes
import inspect

import torch
import triton
import triton.language as tl
from torch.utils._python_dispatch import _disable_current_modes
from triton.runtime.interpreter import InterpretedFunction


def _signature(kernel):
    params = inspect.signature(kernel.fn).parameters
    names = tuple(params)
    first = next((i for i, p in enumerate(params.values()) if p.annotation in ("tl.constexpr", tl.constexpr)),
                 len(names))
    return names, first


def _alias(ptr: int, dtype: torch.dtype, nbytes: int) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` over ``nbytes`` bytes of CPU memory at ``ptr`` (no copy)."""
    return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(ptr), dtype=torch.uint8).view(dtype)


def _nbytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return t.element_size()
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * t.element_size()


class _Driver:
    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device=None) -> int:
        return 0


class Emulated:
    """What ``kernel[grid]`` returns under the emulation: a launcher that runs the kernel in the interpreter."""

    def __init__(self, kernel, args, log, interpret, execute: bool = True) -> None:
        self.kernel, self.log, self._interpret, self.execute = kernel, log, interpret, execute
        self.names, self.first = _signature(kernel)
        # pointer parameters: (dtype, extent in bytes) of the tensor first passed
        self.pointers = {i: (a.dtype, _nbytes(a)) for i, a in enumerate(args) if isinstance(a, torch.Tensor)}
        self.packed_metadata = ("emulated",)
        self.function = 0

    def run(self, g0, g1, g2, stream, function, metadata, launch_metadata, enter_hook, exit_hook, *params):
        assert (function, metadata, launch_metadata, enter_hook, exit_hook) == (0, ("emulated",), None, None, None)
        self.log.append(("launcher", self.kernel.fn.__name__))
        if not self.execute:
            return
        with _disable_current_modes():  # (the interpreter's own copies are the device's work, not the host's)
            args = [_alias(p, *self.pointers[i]) if i in self.pointers and type(p) is int else p
                    for i, p in enumerate(params[:self.first])]
            self._interpret(self.kernel, *args, grid=(g0, g1, g2), warmup=False,
                            **dict(zip(self.names[self.first:], params[self.first:], strict=True)))


def install(monkeypatch, execute: bool = True) -> list:
    """Emulate compiled launchers for the rest of the test (the kernels must be the interpreter's); the log.
    ``execute=False``: launches are logged, no kernel runs (to count what the host does with unfilled weights)."""
    from moe_plugin_cuda.triton import launch

    log: list = []
    interpret = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        log.append(("triton", self.fn.__name__))
        if execute:
            with _disable_current_modes():
                interpret(self, *args, grid=grid, warmup=warmup, **kwargs)
        return Emulated(self, args, log, interpret, execute)

    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setattr(launch, "_interpreting", lambda: False)
    monkeypatch.setattr(launch, "_signature", lambda kernel: _signature(kernel) if isinstance(
        kernel, InterpretedFunction) else None)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Driver())
    launch.clear()
    monkeypatch.setattr(launch, "_compiled", {})  # (this test's emulated kernels never outlive it)
    return log
