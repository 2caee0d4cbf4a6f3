"""Launch compiled Triton kernels without ``JITFunction.run``'s per-call work (docs/decisions.md, "Triton
kernels are launched through their compiled launcher").

``kernel[grid](*args, **kw)`` binds every argument, specializes each one (dtype, pointer alignment, int
values), hashes that into Triton's cache key and builds launch metadata on every call: on the H100 that was
about half of a decode forward's host time (four launches of up to ~50 arguments each, with Triton 3.6).
``launch`` does it once: the first call for a given specialization goes through ``kernel[grid]`` (which
compiles or finds the kernel) and keeps the ``CompiledKernel`` it returns; later calls with the same
specialization call the compiled kernel's launcher directly.

The key is never coarser than Triton's own: the arguments' types; tensors' dtypes and data pointers modulo 16
(Triton: whether 16-byte aligned); tensor descriptors' (base dtype, 16-byte alignment, block shape, rank,
padding); ints, floats, bools and None by value (finer than Triton's == 1 / % 16 / int32-range
specialization, and cheaper: a decode step's row counts take a handful of values, each one more entry); the
keyword arguments (constexprs and options such as ``num_warps``) by value and type, plus the device and
Triton's debug and instrumentation knobs. A finer key only costs an extra ``kernel[grid]`` call, never a wrong
variant. It is built by C-level ``map``/``itemgetter`` over positions worked out once per argument-type
signature (a Python loop over ~40 arguments cost as much as Triton's own binding). Where the direct call would skip something Triton does (the interpreter,
launch hooks such as a profiler's, pre-run hooks, parameters left to their defaults), every call goes
through ``kernel[grid]``.
"""

from __future__ import annotations

import operator
import threading
from typing import Any, Callable

import torch
import triton
from triton.runtime.jit import JITFunction

try:  # (not needed to launch: only to key a host-side descriptor by its specialization)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = ()  # type: ignore[assignment,misc]

# host-side arithmetic for launch grids and constexprs: Triton's ``cdiv`` and ``next_power_of_2`` are constexpr
# functions, 5-12 us a call on the host (a torch_a2a dispatch made ~15 such calls, 2026-11-26)
def pow2(n: int) -> int:
    """The least power of two >= ``n`` (1 for ``n`` <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


enabled = True  # False: every launch through kernel[grid] (a baseline to measure against: host_time.py)
MAX_ENTRIES = 4096  # compiled kernels kept (all kernels, devices and specializations); emptied when full

_compiled: dict[tuple, tuple[JITFunction, Any]] = {}  # key (kernel by id) -> (the kernel, its CompiledKernel)
# per kernel (by id, JITFunction's own hash is slow): (the kernel, (parameter names, how many come before the
# first constexpr), or None: always through kernel[grid])
_params: dict[int, tuple[Any, tuple[tuple[str, ...], int] | None]] = {}
stats = {"direct": 0, "triton": 0, "replayed": 0}  # launches by path (what the tests read; replayed: replay.py)
# per thread, while a ``recording()`` is open: each launch as (its CompiledKernel, or None where the call could not
# be replayed directly, grid, every parameter's value in order); see ``replay.py``
_local = threading.local()
_local.recording = None


_PLAIN = frozenset((int, float, bool, type(None)))  # keyed by value (their types are in the key too)
# per (kernel id, argument types): how to pick the tensors, the plain values and the rest out of the arguments
_pickers: dict[tuple, tuple[Callable, Callable, tuple[int, ...]]] = {}
_dtype = operator.attrgetter("dtype")
_data_ptr = torch.Tensor.data_ptr
_mod16 = (15).__and__  # data pointer modulo 16


def _getter(positions: list[int]) -> Callable[[tuple], tuple]:
    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


def _picker(kernel_id: int, types: tuple) -> tuple[Callable, Callable, tuple[int, ...]]:
    pick = _pickers.get((kernel_id, types))
    if pick is None:
        tensors = [i for i, t in enumerate(types) if issubclass(t, torch.Tensor)]
        plain = [i for i, t in enumerate(types) if t in _PLAIN]
        other = tuple(i for i, t in enumerate(types) if i not in tensors and i not in plain)
        if len(_pickers) >= MAX_ENTRIES:
            _pickers.clear()
        pick = _pickers[kernel_id, types] = _getter(tensors), _getter(plain), other
    return pick


def _arg_key(a: Any) -> Any:
    """What Triton specializes an argument on, or more (tensors and plain values are keyed in ``launch``)."""
    if TensorDescriptor and isinstance(a, TensorDescriptor):
        base = a.base
        return (TensorDescriptor, base.dtype, base.data_ptr() % 16 == 0, tuple(a.block_shape), len(a.shape),
                getattr(a, "padding", None))
    return type(a), a  # (constexprs, unhashable ones fail loudly)


def _hooks_idle() -> bool:
    """No launch hook is installed (Triton 3.6 keeps them in ``HookChain``s, later ones as None or a callable)."""
    rt = triton.knobs.runtime
    for hook in (rt.launch_enter_hook, rt.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def _interpreting() -> bool:
    return triton.knobs.runtime.interpret


def _signature(kernel: JITFunction) -> tuple[tuple[str, ...], int] | None:
    entry = _params.get(id(kernel))
    if entry is not None and entry[0] is kernel:
        return entry[1]
    sig = None
    if isinstance(kernel, JITFunction) and not _interpreting():
        params = kernel.params
        first_constexpr = next((i for i, p in enumerate(params) if p.is_constexpr), len(params))
        sig = tuple(p.name for p in params), first_constexpr
    if len(_params) >= MAX_ENTRIES:
        _params.clear()
    _params[id(kernel)] = kernel, sig
    return sig


def launch(kernel: JITFunction, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """``kernel[grid](*args, **kwargs)``, by the compiled kernel's launcher once Triton has built it.

    Every parameter after the positional ones must be given by keyword, constexprs always (a positional
    constexpr or a parameter left to its default: every call goes through ``kernel[grid]``)."""
    sig = _signature(kernel)
    if sig is None or not enabled or len(args) > sig[1] or kernel.pre_run_hooks or not _hooks_idle():
        stats["triton"] += 1
        kernel[grid](*args, **kwargs)
        recording = getattr(_local, "recording", None)
        if recording is not None:
            recording.append((None, grid, args))
        return
    names = sig[0]
    rt = triton.knobs.runtime
    driver = triton.runtime.driver.active
    device = driver.get_current_device()
    # (types too: 1, 1.0 and True hash alike)
    types = tuple(map(type, args))
    tensors_of, plain_of, other = _picker(id(kernel), types)
    tensors = tensors_of(args)
    key = (id(kernel), device, rt.debug, getattr(triton.knobs.compilation, "instrumentation_mode", None),
           tuple(kwargs.items()), tuple(map(type, kwargs.values())), types, plain_of(args),
           tuple(map(_dtype, tensors)), tuple(map(_mod16, map(_data_ptr, tensors))),
           tuple([_arg_key(args[i]) for i in other]) if other else ())
    entry = _compiled.get(key)
    if entry is None or entry[0] is not kernel:  # (an id can be reused once its kernel is gone)
        stats["triton"] += 1
        compiled = kernel[grid](*args, **kwargs)
        if hasattr(compiled, "result"):  # (an asynchronous compile's future)
            compiled = compiled.result()
        # only a complete call can be replayed: every parameter given, a launcher to call
        complete = (all(n in kwargs for n in names[len(args):]) and hasattr(compiled, "packed_metadata")
                    and hasattr(compiled, "run"))
        if complete:
            if len(_compiled) >= MAX_ENTRIES:
                _compiled.clear()
            _compiled[key] = kernel, compiled
        recording = getattr(_local, "recording", None)
        if recording is not None:
            recording.append((compiled if complete else None, grid,
                               (*args, *[kwargs[n] for n in names[len(args):]]) if complete else args))
        return
    compiled = entry[1]
    stats["direct"] += 1
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    params = (*args, *[kwargs[n] for n in names[len(args):]])
    recording = getattr(_local, "recording", None)
    if recording is not None:
        recording.append((compiled, grid, params))
    compiled.run(grid[0], g1, g2, driver.get_current_stream(device), compiled.function, compiled.packed_metadata,
                 None, None, None, *params)


def direct_state() -> tuple | None:
    """What a replayed launch depends on beyond its kernel and arguments (the current device, Triton's debug
    and instrumentation knobs), or None where launches must go through ``kernel[grid]`` now (``enabled`` off,
    the interpreter, a launch hook such as a profiler's)."""
    rt = triton.knobs.runtime
    if not enabled or _interpreting() or not _hooks_idle():
        return None
    return (triton.runtime.driver.active.get_current_device(), rt.debug,
            getattr(triton.knobs.compilation, "instrumentation_mode", None))


class recording:
    """``with recording() as launches:`` this thread's launches made inside, as ``_local.recording`` describes them."""

    def __enter__(self) -> list:
        if getattr(_local, "recording", None) is not None:
            raise RuntimeError("launch.recording() does not nest")
        _local.recording = []
        return _local.recording

    def __exit__(self, *exc: Any) -> None:
        _local.recording = None


def clear() -> None:
    """Forget every kept kernel (the next launch of each goes through ``kernel[grid]`` again)."""
    _compiled.clear()
    _params.clear()
    _pickers.clear()
