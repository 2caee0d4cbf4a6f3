"""A pipeline call's launches kept and issued again with the next call's pointers (docs/decisions.md, "A decode
forward replays its launches").

A decode forward's host time was the Python around its four to six launches, not the launches: per launch the
arguments rebuilt (strides, grid, constexprs, the direct launcher's key), per call the configs, the workspace
layout and its views. Everything but the data pointers is a function of the call's shapes, strides, dtypes,
pointer alignments and configs (the pipelines read no device value on the host), so the first call of each such
key runs the pipeline as usual under ``launch.recording()``, and a ``Program`` keeps what it launched: per launch
the compiled kernel's launcher, grid and parameters, each tensor parameter as (which of the call's tensors, byte
offset into it). Later calls with the same key allocate the workspace and the output (one ``torch.empty`` each)
and call the launchers with integer pointers (Triton's launchers take an int for a pointer parameter, and skip
the pointer attribute query they make for a tensor).

A call is kept only where replaying it is exactly the call: every launch went straight through a compiled
launcher; every tensor parameter lies in exactly one of the call's tensors (a temporary made inside the call,
e.g. a cast or a copy, is in none: not kept); the only torch operations the call made were allocations and views
(nothing computed outside the launches); descriptor parameters are over the weights (fixed for the key). The key
holds whatever the pipeline read from its inputs: the activations' and routing's shapes, strides, dtypes, device
and data pointers modulo 16 (what Triton specializes on); the weights by identity and whole address (their cached
TMA descriptors hold it; the program keeps them alive, and a weight reshaped in place is a weight change, after
which the owner's ``process_weights`` empties the cache: docs/decisions.md, "The decode host path"), the config
object, the options and ``launch.direct_state()``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Hashable, Optional, Sequence

import torch
import triton
from torch.utils._python_dispatch import TorchDispatchMode

from moe_plugin_cuda.triton import launch

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton
    TensorDescriptor = ()  # type: ignore[assignment,misc]

enabled = True  # False: no call recorded or replayed (the baseline to measure against: host_time.py --no-replay)
_ALLOCATIONS = frozenset(("aten::empty", "aten::empty_strided"))


class _OnlyViews(TorchDispatchMode):
    """Notes whether any torch operation other than an allocation or a view ran (it would compute something a
    replay would not)."""

    def __init__(self) -> None:
        super().__init__()
        self.computed: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not (func.is_view or func._schema.name in _ALLOCATIONS or func._schema.name == "aten::detach"):
            self.computed.append(str(func))
        return func(*args, **(kwargs or {}))


def span(t: Optional[torch.Tensor]) -> Optional[tuple[int, int]]:
    """[start, end) bytes a tensor's elements cover (a zero-size one: its start only); None for None."""
    if t is None:
        return None
    p = t.data_ptr()
    if t.numel() == 0:
        return p, p + 1
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True))
    return p, p + (last + 1) * t.element_size()


class Program:
    """The launches of one recorded call: ``run(pointers, stream)`` issues them again, the call's tensors at
    ``pointers`` (the order of ``build``'s spans). ``info``: what the caller kept with it (e.g. what to allocate).

    ``run`` is a function generated for the program (as Triton generates its own argument binders): one
    statement per distinct address (which tensor + byte offset) and one launcher call per launch, its grid and
    its constant parameters written as literals (ints, bools, None, finite floats), its launcher, kernel handle,
    metadata and other constants as the function's globals. A loop that built each launch's parameters from a
    list cost about as much as the launches' own Python (docs/decisions.md, "The decode host path")."""

    __slots__ = ("run", "launches", "info", "keep", "source")

    def __init__(self, run: Callable[[Sequence[int], int], None], launches: int, info: Any, keep: Any,
                 source: str) -> None:
        self.run = run  # run(pointers, stream)
        self.launches = launches
        self.info = info
        self.keep = keep  # what the key names by identity (kept alive, so that its id is not reused)
        self.source = source  # run's generated code (for reading: what a replay issues)


def _generate(addresses: list, constants: list, steps: list) -> tuple[Callable, str]:
    """``Program.run`` for launches ``steps`` = (launcher, grid, function, metadata, parameters as (is an
    address, index into ``addresses`` or ``constants``))."""
    names: dict[str, Any] = {}
    lines = ["def run(pointers, stream):"]
    lines += [f"    a{i} = pointers[{which}] + {offset}" for i, (which, offset) in enumerate(addresses)]

    def constant(i: int) -> str:  # (ints, bools, None and finite floats as literals: no lookup per call)
        value = constants[i]
        if value is None or type(value) in (int, bool) or (type(value) is float and math.isfinite(value)):
            return repr(value)
        names[f"c{i}"] = value
        return f"c{i}"

    for j, (launcher, grid, function, metadata, pick) in enumerate(steps):
        names[f"launcher{j}"], names[f"function{j}"], names[f"metadata{j}"] = launcher, function, metadata
        g = [int(x) for x in grid] + [1] * (3 - len(grid))
        params = "".join(f", a{i}" if address else f", {constant(i)}" for address, i in pick)
        lines.append(f"    launcher{j}({g[0]}, {g[1]}, {g[2]}, stream, function{j}, metadata{j}, None, None, None"
                     f"{params})")
    source = "\n".join(lines) + "\n"
    exec(compile(source, "<moe_plugin_cuda.triton.replay program>", "exec"), names)  # noqa: S102 (our own text)
    return names["run"], source


def build(recorded: list, spans: Sequence[Optional[tuple[int, int]]], fixed: Sequence[int], info: Any = None,
          keep: Any = None) -> Optional[Program]:
    """A ``Program`` from ``launch.recording()``'s launches, or None where replaying would not be the call.
    ``spans``: the byte ranges of the call's tensors (``span``; None: absent), in the order ``Program.run`` will get
    their pointers; ``fixed``: the positions of those whose pointers the key holds whole (descriptors may be over
    them)."""

    def owner(ptr: int) -> Optional[int]:
        hits = [i for i, s in enumerate(spans) if s is not None and s[0] <= ptr < s[1]]
        return hits[0] if len(hits) == 1 else None

    if not recorded:  # (a T > 0 call launches; none recorded: they went around ``launch``)
        return None
    addresses: dict[tuple[int, int], int] = {}  # (which, offset) -> its index in Program.run's values
    constants: list = []
    steps = []
    for compiled, grid, params in recorded:
        if compiled is None:
            return None
        pick = []
        for a in params:
            if isinstance(a, torch.Tensor):
                ptr = a.data_ptr()
                which = owner(ptr)
                if which is None:
                    return None
                pick.append((True, addresses.setdefault((which, ptr - spans[which][0]), len(addresses))))
                continue
            if TensorDescriptor and isinstance(a, TensorDescriptor):
                if owner(a.base.data_ptr()) not in fixed:
                    return None
            elif not isinstance(a, (int, float, bool, type(None), str, triton.language.dtype)):
                return None
            pick.append((False, len(constants)))
            constants.append(a)
        steps.append((compiled.run, grid, compiled.function, compiled.packed_metadata, pick))
    run, source = _generate(list(addresses), constants, steps)
    return Program(run, len(steps), info, keep, source)


class recording:
    """``with recording() as (launches, views):`` ``launch.recording()``'s launches, and ``views.computed``: the torch
    operations other than allocations and views that ran inside (a call that made any cannot be replayed)."""

    def __enter__(self) -> tuple[list, _OnlyViews]:
        self._launches = launch.recording()
        self._views = _OnlyViews()
        recorded = self._launches.__enter__()
        self._views.__enter__()
        return recorded, self._views

    def __exit__(self, *exc: Any) -> None:
        try:
            self._views.__exit__(*exc)
        finally:
            self._launches.__exit__(*exc)


class Programs(dict):
    """``Program``s by key (a dict: ``get`` is the hot path's one lookup), at most ``max_entries`` (emptied when
    full); the owner empties it when its weights change (``clear``). A key kept with None was recorded and cannot
    be replayed: its calls run as usual."""

    def __init__(self, max_entries: int = 4096) -> None:  # (every T up to 1024 slots, a few alignments: no churn)
        super().__init__()
        self.max_entries = max_entries

    def put(self, key: Hashable, program: Optional[Program]) -> None:
        if len(self) >= self.max_entries:
            self.clear()
        self[key] = program
