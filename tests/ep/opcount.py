"""Count what one dispatch or combine asks of the device, on any backend (CPU/gloo included).

``OpCounter`` is a context manager with two hooks:
- a ``TorchDispatchMode`` that sees every aten op: ``kernels`` counts the ops that launch work on a
  device (not views, not bare allocations), ``collectives`` the c10d ops, and ``sync_ops`` the
  ops whose output size depends on the data (on an accelerator each is a device -> host wait:
  ``nonzero``, boolean-mask indexing, ``repeat_interleave`` without ``output_size``, ``bincount``...);
- a ``TorchFunctionMode`` that sees the Python-level reads of tensor values (``tolist``, ``item``,
  ``bool(t)``, ``int(t)``...), each a device -> host wait on an accelerator.

On CPU none of these waits costs anything, which is why they are counted rather than timed:
the counts are the same on CUDA, where each kernel is a launch and each read a host sync.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops whose output shape depends on tensor values (a host sync on an accelerator)
_SYNC_ATEN = {"nonzero", "masked_select", "bincount", "unique", "_unique", "_unique2",
              "unique_consecutive", "unique_dim", "histc", "_local_scalar_dense", "is_nonzero", "argwhere"}
# Python-level reads of values
_SYNC_PY = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "__format__"}
# ops that allocate or describe memory without launching a kernel
# (``scalar_tensor``: a Python scalar wrapped as a 0-dim CPU tensor, e.g. by ``torch.where(c, t, 0)``)
_NO_KERNEL = {"scalar_tensor", "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "detach",
              "_local_scalar_dense", "is_nonzero", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset"}


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


class _Dispatch(TorchDispatchMode):
    def __init__(self, owner: "OpCounter") -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        o = self.owner
        name = func._schema.name.split("::")[-1]
        if func.namespace == "c10d":
            o.collectives[name] += 1
        elif name in _SYNC_ATEN:
            o.sync_ops[name] += 1
        elif name in ("index", "index_put", "index_put_", "_index_put_impl_") and _bool_index(args):
            o.sync_ops[f"{name}(bool mask)"] += 1
        elif name == "repeat_interleave" and func._overloadname != "self_int" and kwargs.get("output_size") is None:
            o.sync_ops["repeat_interleave(no output_size)"] += 1
        if func.namespace == "aten" and not _is_view(func) and name not in _NO_KERNEL:
            o.kernels[name] += 1
        return func(*args, **kwargs)


def _bool_index(args) -> bool:
    idx = args[1] if len(args) > 1 else None
    return isinstance(idx, (list, tuple)) and any(
        isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx)


class _Function(TorchFunctionMode):
    def __init__(self, owner: "OpCounter") -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _SYNC_PY:
            self.owner.host_reads[name] += 1
        return func(*args, **(kwargs or {}))


class OpCounter:
    """``with OpCounter() as c: ...`` then ``c.summary()``."""

    def __init__(self) -> None:
        self.kernels: Counter = Counter()
        self.collectives: Counter = Counter()
        self.sync_ops: Counter = Counter()
        self.host_reads: Counter = Counter()

    def __enter__(self) -> "OpCounter":
        self._modes = [_Function(self), _Dispatch(self)]
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for m in reversed(self._modes):
            m.__exit__(*exc)

    @property
    def host_syncs(self) -> int:
        """Device -> host waits: Python reads of values plus data-dependent-shape ops."""
        return sum(self.host_reads.values()) + sum(self.sync_ops.values())

    def summary(self) -> dict:
        return {"kernels": sum(self.kernels.values()), "collectives": sum(self.collectives.values()),
                "host_syncs": self.host_syncs, "host_reads": dict(self.host_reads), "sync_ops": dict(self.sync_ops),
                "kernel_ops": dict(self.kernels.most_common())}
