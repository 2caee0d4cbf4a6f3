"""``deepep``: expert-parallel dispatch and combine through DeepEP's V1 ``deep_ep.Buffer``.

Written strictly to the V1 API of DeepEP v1.2.1 (``vendor-apis.md`` section 1; DeepEP 2.x still
exports it as the legacy ``deep_ep.Buffer``). Checked against DeepEP v1.2.1 built from source on
2x H100 (``benchmarks/ep/run_deepep_h100x2.sh``) and, in CI, against the emulation in
``plugins/cuda/tests/emulation``, whose fidelity test runs the same cases on both.

The plan's format picks the mode:

- **EP_NORMAL** (normal kernels): ``get_dispatch_layout`` -> ``dispatch`` -> ``combine``. Each token
  arrives once per destination rank, rows grouped by source rank, ids local (-1 / weight 0
  elsewhere). FP8 wire: quantized here (128-channel groups) and carried as ``(e4m3, scales)``.
  DeepEP busy-waits on the host for the receive counts, so this mode is not graph-safe.
- **EP_MASKED** (low-latency kernels): ``low_latency_dispatch`` -> ``low_latency_combine``, a
  ``[E_local, R * num_max, H]`` slab with ``masked_m`` valid rows per expert, in no particular order.
  FP8 is quantized by DeepEP itself; ``backend_options={"deepep": {"ue8m0": True}}`` asks for
  power-of-two (UE8M0) scales, which are unpacked to fp32 here (exact) because the contract's
  scales are fp32. ``num_max`` is ``max_tokens_per_rank`` rounded up so ``R * num_max % 4 == 0``.

DeepEP takes bf16 activations only: other activation dtypes are cast to bf16 for the wire and the
output is cast back. The DeepEP handle travels in the dispatch output's ``handle``, never on
``self``. For engines that overlap communication with compute, ``dispatch_async`` and
``combine_async`` return a ``Pending`` whose ``wait()`` performs the receive (the low-latency
receive hook, or a stream wait on the normal kernels' event) and returns the result. At most two
low-latency calls may be in flight per buffer (a third, async or not, raises before it is issued).
The slab and its scales are fresh tensors each call (v1.2.1 allocates them per call). The synchronous
low-latency dispatch calls DeepEP's C++ runtime (``Buffer.runtime``) itself where ``Buffer.low_latency_dispatch``
is v1.2.1's wrapper of it, statement for statement (checked when the buffer is built; docs/decisions.md entry 69),
and builds the same handle; any other wrapper is called by its keywords on the same hot path.

Low-latency FP8 is DeepEP's own cast, not ``moe_core.quant``'s: ``scale = amax * fl(1/448)`` and
``q = x * (448/amax)`` round differently from ``amax/448`` and ``x/scale`` (most scales differ in the
last bit, ~3 e4m3 bytes in 10^4 by one step; docs/decisions.md "low-latency FP8 is DeepEP's cast").
Scales are column-major views ``[E_local, C, H/128]`` (strides ``(H/128 * C, 1, C)``), kept as they are.

Buffers: one ``deep_ep.Buffer`` per process group, shared by every layer on that group and sized
for the largest need declared when the layers were built (see ``BufferRegistry``).
"""

from __future__ import annotations

import ast
import inspect
import textwrap
from dataclasses import dataclass
from typing import Any, Callable, Generic, NamedTuple, Optional, TypeVar

import torch
import torch.distributed as dist

from moe_core.plugin_api import (
    BackendContext,
    CombineInput,
    Dispatcher,
    DispatchOutput,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Format,
    QuantizedActivations,
    TopK,
    WireDtype,
    masked_dispatch_unchecked,
    quant,
)
from moe_plugin_cuda.probes import deepep_num_max, deepep_problems

__all__ = ["DeepEPDispatcher", "BufferRegistry", "BUFFERS", "Pending", "unpack_ue8m0"]

WIRE_DTYPES = (WireDtype.BF16, WireDtype.FP8)
_Tensor, _BF16 = torch.Tensor, torch.bfloat16  # (global reads on the hot paths)
# a named tuple made from its fields' tuple in one C call: its generated __new__ is a Python frame around it
_new_tuple = tuple.__new__
# DeepEP's low-latency buffer has two halves used in turn: a third call issued before the first was
# received would overwrite data still being read (DeepEP #166, #513). Enforced on the async API.
MAX_LOW_LATENCY_IN_FLIGHT = 2
T = TypeVar("T")

# DeepEP v1.2.1's ``Buffer.low_latency_dispatch`` after its docstring (``deep_ep/buffer.py``): its C++ runtime's call
# with the arguments unchanged, then the results regrouped into a handle and an ``EventOverlap``. Where the installed
# wrapper is exactly this, the synchronous hot path calls the runtime itself and builds the same handle
# (docs/decisions.md, entry 69); any other wrapper is called by its keywords.
_V121_LL_DISPATCH_BODY = """
packed_recv_x, packed_recv_x_scales, packed_recv_count, packed_recv_src_info, packed_recv_layout_range, event, hook = \
    self.runtime.low_latency_dispatch(x, topk_idx, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats,
                                      num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0,
                                      async_finish, return_recv_hook)
handle = (packed_recv_src_info, packed_recv_layout_range, num_max_dispatch_tokens_per_rank, x.size(1), num_experts)
tensors_to_record = (x, topk_idx, packed_recv_x, packed_recv_x_scales, packed_recv_count, packed_recv_src_info,
                     packed_recv_layout_range, cumulative_local_expert_recv_stats)
return (packed_recv_x, packed_recv_x_scales) if use_fp8 else packed_recv_x, packed_recv_count, handle, \
    EventOverlap(event, tensors_to_record if async_finish else None), hook
"""


def _statements(body: list) -> list[str]:
    """A function body's statements as ``ast.unparse`` writes them (layout and comments aside), docstring dropped."""
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return [ast.unparse(node) for node in body]


def wraps_runtime_dispatch(buffer_cls: type) -> bool:
    """Whether ``buffer_cls.low_latency_dispatch`` is DeepEP v1.2.1's wrapper of ``runtime.low_latency_dispatch``
    (the same statements; a wrapper without Python source is not)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(getattr(buffer_cls, "low_latency_dispatch", None))))
    except (OSError, TypeError, SyntaxError):
        return False
    fn = tree.body[0]
    return (isinstance(fn, ast.FunctionDef)
            and _statements(fn.body) == _statements(ast.parse(_V121_LL_DISPATCH_BODY).body))


# --------------------------------------------------------------------------- buffers


@dataclass(frozen=True)
class BufferNeed:
    """What one layer needs from its group's ``deep_ep.Buffer``."""

    num_nvl_bytes: int = 0
    num_rdma_bytes: int = 0
    low_latency_mode: bool = False
    num_qps_per_rank: Optional[int] = None  # None: DeepEP's default (normal mode only)

    def merge(self, other: "BufferNeed") -> "BufferNeed":
        if self.low_latency_mode and other.low_latency_mode and self.num_qps_per_rank != other.num_qps_per_rank:
            raise ValueError(f"deepep: low-latency layers on one group need num_qps_per_rank = local experts, "
                             f"and two layers disagree ({self.num_qps_per_rank} vs {other.num_qps_per_rank}); "
                             "give them different EP groups")
        qps = next((n.num_qps_per_rank for n in (self, other) if n.low_latency_mode), None)
        return BufferNeed(max(self.num_nvl_bytes, other.num_nvl_bytes), max(self.num_rdma_bytes, other.num_rdma_bytes),
                          self.low_latency_mode or other.low_latency_mode,
                          qps if qps is not None else self.num_qps_per_rank or other.num_qps_per_rank)

    def covers(self, other: "BufferNeed") -> bool:
        return self.merge(other) == self


@dataclass
class _GroupBuffer:
    group: Any
    need: BufferNeed = BufferNeed()
    buffer: Any = None  # the deep_ep.Buffer, created at the first call after the needs were declared
    built_for: Optional[BufferNeed] = None
    used_normal: bool = False  # normal kernels ran since the last low-latency clean
    low_latency_in_flight: int = 0  # async low-latency calls issued and not yet received (wait())
    # the buffer while a low-latency call may go straight to it (built for the need, clean, nothing in
    # flight), else None: the one read of the low-latency hot path; whatever changes that state resets it
    low_latency_ready: Any = None
    wraps_runtime: bool = False  # the buffer's low_latency_dispatch is v1.2.1's wrapper of its runtime's


class BufferRegistry:
    """One ``deep_ep.Buffer`` per process group, sized to the max of every layer's declared need.

    A DeepEP buffer is a collective allocation (NVLink IPC / NVSHMEM memory on every rank), so it is a
    process-wide resource, like the process group it belongs to: this is the one piece of
    module-level state of the plugin. Layers ``declare`` their need when they are built; the buffer is
    (re)created at the first call after a need grew, on every rank at the same point, as every rank
    builds the same layers in the same order. SGLang's singleton, by contrast, is sized by its first
    caller.
    """

    def __init__(self) -> None:
        self._groups: dict[Any, _GroupBuffer] = {}

    def declare(self, group: Any, need: BufferNeed) -> _GroupBuffer:
        entry = self._groups.setdefault(group, _GroupBuffer(group))
        entry.need = entry.need.merge(need)
        entry.low_latency_ready = None  # the buffer may have to grow first
        return entry

    @staticmethod
    def get(entry: _GroupBuffer, deep_ep: Any) -> Any:
        if entry.built_for is entry.need:  # the hot path: nothing declared since the buffer was built
            return entry.buffer
        if entry.buffer is None or not entry.built_for.covers(entry.need):
            need = entry.need
            kwargs = {} if need.num_qps_per_rank is None else {"num_qps_per_rank": need.num_qps_per_rank}
            entry.buffer = None  # release the old one first
            entry.buffer = deep_ep.Buffer(entry.group, need.num_nvl_bytes, need.num_rdma_bytes,
                                          low_latency_mode=need.low_latency_mode, **kwargs)
            entry.built_for = need
            entry.used_normal = False
            entry.low_latency_ready = None
            entry.wraps_runtime = wraps_runtime_dispatch(type(entry.buffer))
        else:  # a later need the buffer already covers: size it as built, so the hot path applies again
            entry.need = entry.built_for
        return entry.buffer

    def clear(self) -> None:
        self._groups.clear()


BUFFERS = BufferRegistry()


# --------------------------------------------------------------------------- per-call state


class Pending(Generic[T]):
    """An asynchronous DeepEP call in flight: ``wait()`` receives and returns its result (once)."""

    def __init__(self, finish: Callable[[], T], event: Any = None, hook: Optional[Callable[[], None]] = None) -> None:
        self._finish, self._event, self._hook = finish, event, hook
        self._result: Optional[T] = None
        self._done = False

    def wait(self) -> T:
        if not self._done:
            if self._hook is not None:
                self._hook()  # low-latency: the receive itself
            if self._event is not None:
                self._event.current_stream_wait()  # normal kernels: order the current stream after them
            self._result, self._done = self._finish(), True
        return self._result  # type: ignore[return-value]


# The dispatch handles are named tuples, immutable like the contract's dataclasses and made in
# about half a frozen dataclass's time (one is made per dispatch, after DeepEP's launch).
class _NormalHandle(NamedTuple):
    deepep: tuple  # DeepEP's dispatch handle (intranode or internode layout)
    num_recv: int
    dtype: torch.dtype  # the caller's activation dtype (output of combine)


class _LowLatencyHandle(NamedTuple):
    deepep: tuple  # (src_info, layout_range, num_max, H, E)
    topk_idx: torch.Tensor  # int64 [T, K]: the ids dispatched (low_latency_combine needs the same ones)
    dtype: torch.dtype


def unpack_ue8m0(packed: torch.Tensor, groups: int) -> torch.Tensor:
    """DeepEP's UE8M0 scales (int32 ``[..., H/512]``, 4 exponent bytes per int, low byte first) as fp32
    ``[..., H/128]`` powers of two: ``2^(byte - 127)``, i.e. the byte in the fp32 exponent field.
    DeepEP's column-major scales take two kernels (the bytes gathered into int32, shifted in place),
    any other layout three (a contiguous copy first)."""
    lead, n = packed.shape[:-1], packed.shape[-1]
    if packed.dim() >= 2 and packed.numel() and groups == 4 * n and packed.transpose(-1, -2).is_contiguous():
        # the storage is row-major [..., H/512, C] ints: its bytes [..., H/512, C, 4] -> [..., C, H/512, 4]
        data = packed.transpose(-1, -2).view(torch.uint8).unflatten(-1, (packed.shape[-2], 4)).transpose(-3, -2)
        exp = torch.empty(data.shape, dtype=torch.int32, device=packed.device).copy_(data)
    else:
        exp = packed.contiguous().view(torch.uint8)[..., :groups].to(torch.int32)
    return exp.bitwise_left_shift_(23).view(torch.float32).reshape(*lead, groups)


def _as_dtype(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A combine's output in the caller's activation dtype (DeepEP combines in bf16)."""
    return out if out.dtype is dtype else out.to(dtype)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """``x`` as DeepEP takes activations: bf16, contiguous (``x`` itself when it already is)."""
    return x if x.dtype is torch.bfloat16 and x.is_contiguous() else x.to(torch.bfloat16).contiguous()


def _counts_on_device(counts: list[int], device: torch.device) -> torch.Tensor:
    """int32 ``[E_local]`` on ``device`` from DeepEP's host list of per-expert counts, without a sync:
    one copy from pinned memory (the caching host allocator keeps the block until the copy ran).
    A pageable copy would wait for the stream (+200 us a dispatch on 2x H100); counting the received
    ids on the device took four kernels, one of them a scatter-add of every (token, slot) pair into
    E_local + 1 counters (docs/decisions.md "int64 ids kept")."""
    host = torch.tensor(counts, dtype=torch.int32, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


# --------------------------------------------------------------------------- dispatcher


class DeepEPDispatcher(Dispatcher):
    """EP dispatcher over ``deep_ep.Buffer`` (V1); format EP_NORMAL (normal) or EP_MASKED (low latency)."""

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        if ctx.format not in (Format.EP_NORMAL, Format.EP_MASKED):
            raise ValueError(f"deepep produces ep_normal or ep_masked, not {ctx.format}")
        if ctx.dispatch_dtype not in WIRE_DTYPES:
            raise ValueError(f"deepep carries bf16/fp8 (V1 API), not {ctx.dispatch_dtype}")
        self.low_latency = ctx.format is Format.EP_MASKED
        problems = deepep_problems(cfg, self.low_latency, str(ctx.dispatch_dtype))
        if problems:  # the kit (or a caller) may force a format the plan did not validate
            raise ValueError("deepep cannot serve this layer: " + "; ".join(map(str, problems)))
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("deepep needs an initialized torch.distributed process group before the layer is built")
        self.group = cfg.ep_group if cfg.ep_group is not None else dist.group.WORLD
        world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if (world, rank) != (cfg.ep_size, cfg.ep_rank):
            raise ValueError(f"deepep: EP group has size {world}, rank {rank}; config says ep_size={cfg.ep_size}, "
                             f"ep_rank={cfg.ep_rank}")
        import deep_ep  # the vendor library, at build time only

        self._deep_ep = deep_ep
        self.num_experts, self.hidden, self.top_k = cfg.num_experts, cfg.hidden_size, cfg.top_k
        self.max_tokens = cfg.max_tokens_per_rank
        self.wire = ctx.dispatch_dtype  # (an attribute read: an enum member's lookup costs ~20x on Python 3.11)
        self.fp8 = self.wire is WireDtype.FP8
        self.ue8m0 = bool(cfg.options("deepep").get("ue8m0", False)) and self.fp8
        self.num_max = deepep_num_max(cfg) if self.low_latency else 0
        self.slab_shape = (cfg.num_experts // world, world * self.num_max, cfg.hidden_size)  # low-latency combine input
        # the shapes of hidden_states a low-latency dispatch takes, [T, H] for T = 0..max_tokens: the hot path's
        # one lookup (docs/decisions.md, entry 61)
        tokens = range(self.max_tokens + 1) if self.low_latency else ()
        self._ll_x_shapes = frozenset((t, self.hidden) for t in tokens)
        # the C++ low_latency_dispatch's arguments after (x, topk_idx), positionally in v1.2.1's order: no stats
        # tensors, num_max, num_experts, use_fp8, round_scale, use_ue8m0, async_finish, return_recv_hook (a call
        # with keywords costs ~2x, a ** call 3x)
        self._ll_runtime_args = (None, None, self.num_max, self.num_experts, self.fp8, self.ue8m0, self.ue8m0,
                                 False, False)
        self._registry = BUFFERS
        self._entry = BUFFERS.declare(self.group, self._need(world, cfg.options("deepep")))

    def _need(self, world: int, opts: Any) -> BufferNeed:
        buf = self._deep_ep.Buffer
        if self.low_latency:
            rdma = buf.get_low_latency_rdma_size_hint(self.num_max, self.hidden, world, self.num_experts)
            return BufferNeed(0, rdma, True, self.num_experts // world)
        hidden_bytes = self.hidden * 2  # H * max(element size, 2): bf16 and fp8 alike
        configs = (buf.get_dispatch_config(world), buf.get_combine_config(world))
        qps = opts.get("num_qps_per_rank")
        return BufferNeed(max(c.get_nvl_buffer_size_hint(hidden_bytes, world) for c in configs),
                          max(c.get_rdma_buffer_size_hint(hidden_bytes, world) for c in configs),
                          False, None if qps is None else int(qps))

    @property
    def buffer(self) -> Any:
        """This group's ``deep_ep.Buffer`` (created on first use, sized for every layer built so far)."""
        return self._registry.get(self._entry, self._deep_ep)

    # ----------------------------------------------------------------- public stage calls

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> DispatchOutput:
        if self.low_latency:
            # the hot path (decode; the GPU idles until DeepEP's launch): the buffer's state, TopK's int64
            # ids, the input's class and dtype and one set lookup of its shape, then the launch; the ids'
            # top_k is checked and the results are built after it, at about a tuple's cost each. Anything
            # else (a cast, a refusal, the buffer's bookkeeping) takes the checked path (docs/decisions.md,
            # entries 61 and 64).
            x, buf, idx = hidden_states, self._entry.low_latency_ready, topk.ids_int64(False)
            if (buf is not None and idx is not None and x.__class__ is _Tensor and x.dtype is _BF16
                    and x.shape in self._ll_x_shapes):
                try:  # DeepEP checks x's layout and the ids against x (2-D, as many rows) before it launches
                    if self._entry.wraps_runtime:  # its C++ call, as v1.2.1's Python wrapper makes it (entry 69)
                        data, scale, count, src_info, layout_range, _, _ = buf.runtime.low_latency_dispatch(
                            x, idx, *self._ll_runtime_args)
                        # the wrapper's handle, (src_info, layout_range, num_max, x.size(1), num_experts)
                        deepep_handle = (src_info, layout_range, self.num_max, self.hidden, self.num_experts)
                    else:  # another DeepEP's wrapper (e.g. 2.x's legacy Buffer), called by its keywords
                        recv_x, count, deepep_handle, _, _ = buf.low_latency_dispatch(
                            x, idx, self.num_max, self.num_experts, use_fp8=self.fp8, round_scale=self.ue8m0,
                            use_ue8m0=self.ue8m0)
                        data, scale = recv_x if self.fp8 else (recv_x, None)
                except Exception:
                    if x.is_contiguous():
                        self._validate(x, topk)  # raises the contract's error if the input is at fault
                        raise
                    # refused before the launch for its layout: the checked path below makes x contiguous
                else:
                    if idx.shape[1] != self.top_k:  # harmless to DeepEP (any top-k); the contract's refusal
                        self._validate(x, topk)
                    handle = _new_tuple(_LowLatencyHandle, (deepep_handle, idx, _BF16))
                    if self.ue8m0:
                        scale = unpack_ue8m0(scale, self.hidden // 128)
                    return masked_dispatch_unchecked(data, self.wire, scale, self.ue8m0, count, topk, handle)
            launched, _ = self._launch_low_latency_dispatch(x, topk, None, False)
            return self._masked_dispatch(*launched)
        return self._dispatch_normal(hidden_states, topk, None, False).wait()

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        if self.low_latency:
            ci, buf = combine_input, self._entry.low_latency_ready  # the hot path, as in dispatch
            if buf is not None and ci.__class__ is EPMaskedCombine:
                h, y = ci.handle, ci.hidden
                if (h.__class__ is _LowLatencyHandle and y.__class__ is _Tensor and y.dtype is _BF16
                        and y.shape == self.slab_shape):
                    try:  # DeepEP checks y's layout and the weights against the ids before it launches anything
                        out = buf.low_latency_combine(y, h.topk_idx, ci.topk.weights, h.deepep)[0]
                    except Exception:
                        if y.is_contiguous():
                            self._validate_combine(ci)  # raises the contract's error if the input is at fault
                            raise
                        # refused before the launch for its layout: the checked path makes y contiguous
                    else:
                        return out if h.dtype is _BF16 else out.to(h.dtype)
            out, dtype, _ = self._launch_low_latency_combine(ci, False)
            return _as_dtype(out, dtype)
        return self._combine_normal(combine_input, None, False).wait()

    def dispatch_async(self, hidden_states: torch.Tensor, topk: TopK,
                       previous_event: Any = None) -> Pending[DispatchOutput]:
        """Start a dispatch; ``.wait()`` on the result before the experts read it. ``previous_event``
        (a ``deep_ep.EventOverlap``, e.g. ``Buffer.capture()``) orders normal-mode kernels after it."""
        if self.low_latency:
            # the receive hook (the overlap mode SGLang uses); async_finish would be exclusive with it
            launched, hook = self._launch_low_latency_dispatch(hidden_states, topk, previous_event, True)
            return Pending(lambda: self._masked_dispatch(*launched), None, self._counted(hook))
        return self._dispatch_normal(hidden_states, topk, previous_event, True)

    def combine_async(self, combine_input: CombineInput, previous_event: Any = None) -> Pending[torch.Tensor]:
        """Start a combine; ``.wait()`` returns the ``[T, H]`` output."""
        if self.low_latency:
            out, dtype, hook = self._launch_low_latency_combine(combine_input, True)
            return Pending(lambda: _as_dtype(out, dtype), None, self._counted(hook))
        return self._combine_normal(combine_input, previous_event, True)

    # ----------------------------------------------------------------- implementation

    def _validate(self, x: torch.Tensor, topk: TopK) -> None:
        shape = x.shape if isinstance(x, torch.Tensor) else None
        if shape is None or len(shape) != 2 or shape[1] != self.hidden:
            raise ValueError(f"hidden_states must be [T, {self.hidden}], got "
                             f"{tuple(shape) if shape is not None else type(x).__name__}")
        ids_shape = topk.ids.shape
        if len(ids_shape) != 2 or ids_shape[0] != shape[0] or ids_shape[1] != self.top_k:
            raise ValueError(f"topk.ids must be [T={shape[0]}, top_k={self.top_k}], got {tuple(ids_shape)}")
        if self.low_latency and shape[0] > self.max_tokens:
            raise ValueError(f"low-latency dispatch: {shape[0]} tokens exceed max_tokens_per_rank="
                             f"{self.max_tokens} (the fixed capacity); raise it or split the batch")

    @staticmethod
    def _cast_ids(topk: TopK, previous_event: Any) -> torch.Tensor:
        """``topk.ids`` as DeepEP's ``topk_idx`` (int64) when ``TopK`` did not keep the router's int64
        ids (``ids_int64(cast=False)`` is None); DeepEP is then to wait for this stream, not the event."""
        if previous_event is not None:
            # DeepEP's comm stream would wait for the caller's event instead of this stream, and the
            # id cast below writes on this stream after it: order this stream after the event and
            # let DeepEP wait for this stream (no previous_event) instead
            previous_event.current_stream_wait()
        return topk.ids.to(torch.int64)

    # normal kernels

    def _dispatch_normal(self, x: torch.Tensor, topk: TopK, previous_event: Any,
                         async_: bool) -> Pending[EPNormalDispatch]:
        self._validate(x, topk)
        idx = topk.ids_int64(cast=False)  # deep_ep.topk_idx_t: the router's int64 ids when TopK kept them
        if idx is None:
            idx, previous_event = self._cast_ids(topk, previous_event), None
        entry = self._entry
        buf = self.buffer
        entry.used_normal, entry.low_latency_ready = True, None
        on_comm = previous_event is not None
        per_rank, per_rdma_rank, per_expert, in_rank, event = buf.get_dispatch_layout(
            idx, self.num_experts, previous_event=previous_event, async_finish=async_, allocate_on_comm_stream=on_comm)
        if self.fp8:
            q, s = quant.quantize_fp8_per_token_group(x, ue8m0=self.ue8m0)
            payload: Any = (q, s)
        else:
            payload = _bf16(x)
        # async: DeepEP's comm stream waits for previous_event *instead of* the compute stream, so the
        # event must be taken after the payload was written (the layout's event predates the FP8 cast:
        # async FP8 rows came out wrong on 2x H100, docs/decisions.md); the layout itself ran earlier
        # on the same comm stream
        recv_x, recv_idx, recv_w, counts, handle, event = buf.dispatch(
            payload, topk_idx=idx, topk_weights=topk.weights, num_tokens_per_rank=per_rank,
            num_tokens_per_rdma_rank=per_rdma_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
            previous_event=self._deep_ep.Buffer.capture() if async_ else None, async_finish=async_,
            allocate_on_comm_stream=on_comm and async_)
        dtype = x.dtype

        def finish() -> EPNormalDispatch:
            if self.fp8:
                data, scale = recv_x
                hidden = QuantizedActivations(data, WireDtype.FP8, scale, ue8m0=self.ue8m0)
            else:
                hidden = QuantizedActivations(recv_x)
            n = hidden.data.shape[0]
            # recv_idx int64 -> the contract's int32 in TopK (the one kernel the contract costs here);
            # DeepEP's counts come as a host list: EPNormalDispatch carries it and a device copy
            return EPNormalDispatch(hidden, TopK(recv_w, recv_idx), _counts_on_device(counts, recv_idx.device),
                                    tuple(counts), _NormalHandle(handle, n, dtype))

        return Pending(finish, event if async_ else None)

    def _combine_normal(self, ci: CombineInput, previous_event: Any, async_: bool) -> Pending[torch.Tensor]:
        if not isinstance(ci, EPNormalCombine) or not isinstance(ci.handle, _NormalHandle):
            raise TypeError("deepep (ep_normal) combines an EPNormalCombine carrying its dispatch handle")
        h: _NormalHandle = ci.handle
        y = ci.hidden
        if y.shape != (h.num_recv, self.hidden):
            raise ValueError(f"EPNormalCombine.hidden must be [{h.num_recv}, {self.hidden}], got {tuple(y.shape)}")
        entry = self._entry
        entry.used_normal, entry.low_latency_ready = True, None
        if async_ and previous_event is not None and (y.dtype != torch.bfloat16 or not y.is_contiguous()):
            # DeepEP's comm stream waits for the caller's event instead of this stream, so a cast here
            # must follow that event and DeepEP must follow the cast: wait, cast, hand over this stream
            previous_event.current_stream_wait()
            wire = _bf16(y)
            previous_event = self._deep_ep.Buffer.capture()
        else:
            wire = _bf16(y)
        combined, _, event = self.buffer.combine(
            wire, h.deepep, previous_event=previous_event, async_finish=async_,
            allocate_on_comm_stream=previous_event is not None and async_)
        return Pending(lambda: _as_dtype(combined, h.dtype),
                       event if async_ else None)

    # low-latency kernels: used for decode, where one call is a few tens of us on the GPU and the GPU
    # idles until DeepEP's launch, so the synchronous calls' hot paths (in dispatch / combine) do a few
    # compares before it and build the results after it; the full checks and the buffer's bookkeeping
    # run here, when the hot path does not apply (docs/decisions.md, entries 60 and 61)

    def _low_latency_buffer(self) -> Any:
        """The buffer for a low-latency call, after two checks: raise if the call would be the third in
        flight on the buffer's two halves (a synchronous call is in flight too while it runs; an async
        one counts until its receive hook ran, see ``_counted``), and zero the low-latency part if
        normal kernels ran since."""
        entry = self._entry
        if entry.low_latency_in_flight >= MAX_LOW_LATENCY_IN_FLIGHT:
            raise RuntimeError(f"deepep: {entry.low_latency_in_flight} low-latency calls are in flight on this "
                               "buffer, the most its two halves allow (DeepEP #166/#513): wait() on an earlier "
                               "Pending before issuing another")
        buf = self.buffer
        if entry.used_normal:  # the low-latency kernels need their part of the buffer zeroed
            buf.clean_low_latency_buffer(self.num_max, self.hidden, self.num_experts)
            entry.used_normal = False
        if not entry.low_latency_in_flight:
            entry.low_latency_ready = buf  # the next low-latency call may go straight to it
        return buf

    def _counted(self, hook: Optional[Callable[[], None]]) -> Callable[[], None]:
        """An issued async low-latency call's receive: it counts as in flight until this runs."""
        entry = self._entry
        entry.low_latency_in_flight += 1
        entry.low_latency_ready = None  # the next call counts what is in flight

        def receive() -> None:
            entry.low_latency_in_flight -= 1
            if hook is not None:
                hook()
        return receive

    def _launch_low_latency_dispatch(self, x: torch.Tensor, topk: TopK, previous_event: Any,
                                     return_recv_hook: bool) -> tuple[tuple, Optional[Callable[[], None]]]:
        """Check in full, launch ``low_latency_dispatch``; returns ``_masked_dispatch``'s arguments and the
        receive hook (``return_recv_hook``: the kernel only sends until the hook runs). The async calls'
        path, and the synchronous one's when its hot path does not apply."""
        self._validate(x, topk)
        idx = topk.ids_int64(cast=False)
        if idx is None:  # (DeepEP's low-latency kernels run on this stream or wait for it: no event to pass)
            idx = self._cast_ids(topk, previous_event)
        recv_x, recv_count, handle, _, hook = self._low_latency_buffer().low_latency_dispatch(
            _bf16(x), idx, self.num_max, self.num_experts, use_fp8=self.fp8, round_scale=self.ue8m0,
            use_ue8m0=self.ue8m0, async_finish=False, return_recv_hook=return_recv_hook)
        return (recv_x, recv_count, handle, topk, idx, x.dtype), hook

    def _masked_dispatch(self, recv_x: Any, recv_count: torch.Tensor, handle: tuple, topk: TopK,
                         idx: torch.Tensor, dtype: torch.dtype) -> EPMaskedDispatch:
        """The contract's result of a received low-latency dispatch (no tensor op unless UE8M0)."""
        handle = _new_tuple(_LowLatencyHandle, (handle, idx, dtype))
        if self.fp8:
            data, scale = recv_x
            if self.ue8m0:
                scale = unpack_ue8m0(scale, self.hidden // 128)
            return masked_dispatch_unchecked(data, self.wire, scale, self.ue8m0, recv_count, topk, handle)
        return masked_dispatch_unchecked(recv_x, self.wire, None, False, recv_count, topk, handle)

    def _launch_low_latency_combine(self, ci: CombineInput, return_recv_hook: bool
                                    ) -> tuple[torch.Tensor, torch.dtype, Optional[Callable[[], None]]]:
        """Check in full, launch ``low_latency_combine``; returns its output, the caller's dtype and the hook."""
        self._validate_combine(ci)
        h, y, weights = ci.handle, ci.hidden, ci.topk.weights
        out, _, hook = self._low_latency_buffer().low_latency_combine(
            _bf16(y), h.topk_idx, weights, h.deepep, async_finish=False, return_recv_hook=return_recv_hook)
        return out, h.dtype, hook

    def _validate_combine(self, ci: CombineInput) -> None:
        if not isinstance(ci, EPMaskedCombine) or not isinstance(ci.handle, _LowLatencyHandle):
            raise TypeError("deepep (ep_masked) combines an EPMaskedCombine carrying its dispatch handle")
        h, y, weights = ci.handle, ci.hidden, ci.topk.weights
        if not isinstance(y, torch.Tensor) or y.shape != self.slab_shape:
            raise ValueError(f"EPMaskedCombine.hidden must be a {list(self.slab_shape)} tensor, got "
                             f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}")
        if weights.shape != h.topk_idx.shape:
            raise ValueError(f"EPMaskedCombine.topk must be [T, K] = {list(h.topk_idx.shape)}, "
                             f"got {tuple(weights.shape)}")
