"""``torch_a2a``: expert-parallel dispatch and combine over ``torch.distributed.all_to_all_single``.

Experts are split evenly over the EP group: global expert ``e`` lives on rank ``e // E_local``
as local expert ``e % E_local``. Two modes, chosen by the plan's format:

**EP_NORMAL** (DeepEP normal-mode semantics). Each token is sent once to every rank that holds at
least one of its experts (not once per expert), with its top-k ids made local (-1 and weight 0
for experts elsewhere). Received rows are grouped by source rank (ascending) and keep the
source's token order. Combine sends the weighted rows back and sums them per token. Two ways
to size the buffers (``backend_options["torch_a2a"]["normal_buffers"]``, decision 56):

- ``"exact"`` (the default without CUDA graphs): the per-rank counts are exchanged with one small
  all-to-all and read on the host in one ``tolist`` (the one host sync per dispatch, so not
  graph-safe); the same read brings the per-local-expert counts (``expert_counts_host``) and a
  collective check of the ids. Exactly the received rows, no padding. Combine reuses the splits.
- ``"worst_case"`` (the default with ``cuda_graph=True``; DeepEP's ``num_worst_tokens``): every
  rank sends ``C = max_tokens_per_rank`` row slots to every rank in equal-split all-to-alls,
  as masked mode does; the received ``[W*C, H]`` rows hold each source's tokens first in its
  ``C`` rows, then padding rows (local ids all -1, weights 0, scales 0). The counts stay on the
  device (``expert_counts_host`` is None) and the checks travel in-band as in masked mode: graph-safe.

**EP_MASKED** (DeepEP low-latency semantics). Fixed capacity ``C = max_tokens_per_rank``: every
rank sends exactly ``C`` row slots to every rank (a token once per destination rank, unused
slots padding) in equal-split all-to-alls, then expands the received rows into the
``[E_local, C * world, H]`` slab with ``masked_m`` valid rows per local expert (valid rows
first, in (source rank, token, k) order). All shapes are fixed and nothing is read on the
host, so this mode is graph-safe. Combine weights each expert output with the sender's top-k
weights (the weights travel with the token at dispatch; if ``EPMaskedCombine.topk`` is a
different TopK, its weights are exchanged again), reduces the K rows of each received token on
the expert's rank (a weighted sum over the slab rows, never an expanded copy; one inductor-compiled
kernel on CUDA, ``embedding_bag`` elsewhere), sends one row per (token, rank) back and sums.

Capacity overflow (``T > max_tokens_per_rank`` on some ranks) must not leave the other ranks
waiting in a collective. The overflowing rank still takes part in the dispatch exchange, with
no tokens and its token count in-band (every row carries its sender's count), then raises a
``ValueError`` naming the limit. The other ranks check the received counts with
``torch._assert_async``: no host sync, so masked mode stays graph-safe; on CPU (gloo) it fails at
once and is re-raised as the same ``ValueError``; on an accelerator it is a device-side assert
that makes the rank's next synchronizing call fail (the CUDA context is then unusable, as after
any device-side assert). Inside a CUDA graph the token count is fixed at capture, so only the
host-side shape check can fire, at capture time. Ids outside ``[-1, E)`` travel the same way (the
sender's count of them in-band, checked by every rank with the same assert): normal mode checks
them in its one host read.

Wire dtypes: BF16 (the activations' own dtype), FP8 (e4m3, per-token 128-channel group scales)
and INT8 (per-token scale), quantized once per token before the rows are gathered per
destination. Each row travels as two parts: the wire data, and an int32 side block
``[scales | K global ids | K weights (fp32 bits) | sender's bad-id count | sender's token count]``
(exact normal mode leaves out the two counts: it checks on the host); receivers make the ids local. Every collective moves bytes, so any dtype works on any backend (gloo has no float8);
row copies use the widest integer word that divides the row (both sides of a copy use the same
word, since both are chosen from the same row size). Combine moves the experts' output dtype.

Layout math is a handful of whole-tensor ops (no loops over ranks or experts, no data-dependent
shapes); ``tests/ep/opcount.py`` counts the kernels, collectives and host syncs of each stage.
Where a plugin registered fused kernels for the device type (``register_torch_a2a_kernels``; the cuda
plugin's Triton kernels on CUDA), exact normal mode runs them instead: three kernels, the count exchange,
the host read and ONE all-to-all of data and side block; combine sums in one kernel (decision 63). Masked
mode's slab expansion and weighted sums are plugin kernels too, and where the plugin can write into the peers'
memory (the cuda plugin: torch symmetric memory, one node) the rows move by direct writes instead of
``all_to_all_single``, per mode and size (``exchange``, ``DIRECT_CAPACITIES``; decision 66).

Top-k ids of one token must be distinct (every router guarantees it): the masked slab holds
at most one row per (token, expert).
"""

from __future__ import annotations

import functools
import importlib
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional

import torch
import torch.distributed as dist

from moe_core.backends import Code, Reason, available, unavailable
from moe_core.contracts import (
    FP8_GROUP,
    CombineInput,
    DispatchOutput,
    EPMaskedCombine,
    EPMaskedDispatch,
    EPNormalCombine,
    EPNormalDispatch,
    Format,
    QuantizedActivations,
    TopK,
    WireDtype,
)
from moe_core.quant import quantize_fp8_per_token_group, quantize_int8_per_token
from moe_core.runtime import BackendContext, Dispatcher

if TYPE_CHECKING:
    from moe_core.backends import BackendSpec
    from moe_core.config import MoEConfig

__all__ = ["TorchA2ADispatcher", "TorchA2AKernels", "register_torch_a2a_kernels", "probe", "check"]

WIRE_DTYPES = (WireDtype.BF16, WireDtype.FP8, WireDtype.INT8)


# --------------------------------------------------------------------------- spec helpers


def probe() -> Reason:
    """``torch_a2a`` needs only ``torch.distributed``."""
    try:
        if not dist.is_available():
            return unavailable(Code.NOT_INSTALLED, "this torch build has no torch.distributed",
                               "install a torch build with distributed support")
        return available("torch.distributed is available")
    except Exception as exc:  # probes never raise
        return unavailable(Code.LOAD_ERROR, f"torch.distributed check failed: {exc!r}")


NORMAL_BUFFERS = ("exact", "worst_case")


def normal_buffers(config: "MoEConfig", name: str = "torch_a2a") -> str:
    """How normal mode sizes its receive buffers: ``"exact"`` (the counts are read on the host
    once per dispatch; not graph-safe) or ``"worst_case"`` (``max_tokens_per_rank`` row slots per
    rank and peer, counts on the device: graph-safe). ``backend_options[name]["normal_buffers"]``
    chooses; the default is ``"worst_case"`` when the layer asks for CUDA graphs, else ``"exact"``.
    Raises ``ValueError`` naming the option for a choice that cannot work."""
    options = dict(config.options(name))
    choice = options.pop("normal_buffers", "worst_case" if config.cuda_graph else "exact")
    options.pop("kernels", None)  # checked by kernels_option
    options.pop("exchange", None)  # checked by exchange_option
    if options:
        raise ValueError(f"backend_options[{name!r}] has unknown keys {sorted(options)}; "
                         "torch_a2a takes 'normal_buffers', 'kernels' and 'exchange'")
    if choice not in NORMAL_BUFFERS:
        raise ValueError(f"backend_options[{name!r}]['normal_buffers'] must be one of {NORMAL_BUFFERS}, got {choice!r}")
    if choice == "exact" and config.cuda_graph:
        raise ValueError(f"backend_options[{name!r}]['normal_buffers']='exact' reads the counts on the host, which "
                         "a CUDA graph cannot capture (cuda_graph=True); use 'worst_case'")
    if choice == "worst_case" and config.max_tokens_per_rank is None:
        raise ValueError("torch_a2a's graph-safe normal mode ('worst_case' buffers) sends max_tokens_per_rank row "
                         "slots to every rank; max_tokens_per_rank is None: set it")
    return choice


KERNEL_CHOICES = ("auto", "torch")


def kernels_option(config: "MoEConfig", name: str = "torch_a2a") -> str:
    """``backend_options[name]["kernels"]``: ``"auto"`` (the default: a plugin's fused kernels for the
    device where one registered them, decision 63) or ``"torch"`` (always the torch functions)."""
    choice = config.options(name).get("kernels", "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"backend_options[{name!r}]['kernels'] must be one of {KERNEL_CHOICES}, got {choice!r}")
    return choice


EXCHANGE_CHOICES = ("auto", "collective", "direct")


def exchange_option(config: "MoEConfig", name: str = "torch_a2a") -> str:
    """``backend_options[name]["exchange"]``: how the fixed-capacity modes (masked, worst-case normal) move their
    rows and exact normal mode its counts messages and rows (the rows with ``max_tokens_per_rank`` set: chunks of
    that many rows per source), where a plugin's kernels run: ``"collective"`` (``all_to_all_single``),
    ``"direct"`` (the plugin's ``exchange_fixed`` / ``exchange_masked_back`` / ``exchange_counts`` /
    ``exchange_normal`` where registered: the cuda plugin writes into the peers' rows in symmetric memory; else the
    collective) or ``"auto"`` (the default: per mode and ``max_tokens_per_rank``, from measurements,
    ``DIRECT_CAPACITIES``; decision 66)."""
    choice = config.options(name).get("exchange", "auto")
    if choice not in EXCHANGE_CHOICES:
        raise ValueError(f"backend_options[{name!r}]['exchange'] must be one of {EXCHANGE_CHOICES}, got {choice!r}")
    return choice


def check(config: "MoEConfig", spec: "BackendSpec") -> list[Reason]:
    """Plan-time check: the backend options (and, with CUDA graphs, a fixed capacity: both
    graph-safe modes need ``max_tokens_per_rank``); when torch.distributed is initialized, the EP
    group must match the config.

    Planning without an initialized group (the CLI planning for a target) is allowed; building
    the dispatcher then requires it.
    """
    try:
        normal_buffers(config, spec.name)
        kernels_option(config, spec.name)
        exchange_option(config, spec.name)
    except ValueError as exc:
        code = Code.UNSUPPORTED_SHAPE if config.max_tokens_per_rank is None else Code.UNSUPPORTED_FEATURE
        return [unavailable(code, str(exc), "set max_tokens_per_rank, or fix backend_options for torch_a2a")]
    if not (dist.is_available() and dist.is_initialized()):
        return []
    try:
        world = dist.get_world_size(config.ep_group)
        rank = dist.get_rank(config.ep_group)
    except Exception as exc:
        return [unavailable(Code.UNSUPPORTED_PARALLEL, f"cannot query the EP group: {exc!r}",
                            "pass a torch.distributed ProcessGroup this rank belongs to as ep_group")]
    if (world, rank) != (config.ep_size, config.ep_rank):
        return [unavailable(Code.UNSUPPORTED_PARALLEL,
                            f"EP group has size {world} and this rank is {rank}, config says ep_size="
                            f"{config.ep_size} ep_rank={config.ep_rank}",
                            "set ep_size/ep_rank from the group (or pass the right ep_group)")]
    return []


# --------------------------------------------------------------------------- fused kernels (decision 63)


@dataclass(frozen=True)
class TorchA2AKernels:
    """Fused kernels of exact normal mode for one device type, registered by a plugin with
    ``register_torch_a2a_kernels`` (``moe_core.plugin_api``). What each must return, byte for byte
    the torch path's (its functions named):

    - ``layout(ids, world, num_local) -> (row [T, W], msg [2, W, M])``: ``_normal_layout``'s row (int64, the
      transpose of a contiguous ``[W, T]``) and the counts message's send half ``msg[0]`` in its first
      ``3 + E_local`` words; ``M = 4 + E_local`` adds a word that ``exchange_normal`` sets (decision 66), 0 here.
    - ``pack(x, ids, weights, row, wire) -> uint8 [N, B]``: send row ``row[t, r] - 1`` holds token ``t``'s wire
      data and side block (scales, ids, weights) in the kernels' own row format, so that one all-to-all moves
      both; ``N`` is at least the number of rows sent (the core sends the first ones), so that it is sized
      without the counts and runs before the count exchange (decision 66).
    - ``unpack(recv, msg, wire, dtype, hidden, top_k, rank, num_local, rows=None, chunk=0) -> (data [R, H],
      scales or None, local ids int32 [R, K], weights fp32 [R, K], counts int32 [E_local])``: the received rows as
      ``_normal_received`` leaves them (data contiguous), and the per-local-expert counts of the received
      counts message ``msg`` (``[W, M]``); ``chunk``: ``recv`` holds source s's rows at rows ``s * chunk`` (as
      ``exchange_normal`` leaves them), ``rows`` of them in all.
    - ``reduce(back, row, dtype) -> [T, H]``: combine's sum of each token's returned rows
      (``_reduce_pairs_loop`` over ``back`` with a zero row first, in ``dtype``); ``back`` has no zero row.

    Optional, for the fixed-capacity exchange of worst-case normal and masked mode (None: the torch path):

    - ``layout_fixed(ids, world, num_local, capacity, overflow) -> (slot [T, W], src [W*C], bad_ids)``: what
      ``_masked_layout`` and ``_sources(slot, W*C, T)[1:]`` return.
    - ``pack_fixed(x, ids, weights, src, num_tokens, bad_ids, wire) -> uint8 [W*C, B]``: send slot ``s`` holds
      token ``src[s]``'s rows as ``_wire_rows`` and ``_gather_rows`` make them (``src[s] == T``: padding),
      side block in-band counts included, so that one all-to-all moves data and side block.
    - ``split_fixed(recv, wire, dtype, hidden, top_k) -> (data uint8 [W*C, D], side block int32 [W*C, M])``:
      views of the received rows as ``_exchange_fixed`` returns them.
    - ``expand_masked(recv_data, recv_meta, n_scale, top_k, rank, num_local, data_dtype) -> (slab [E_local, W*C, D]
      in ``data_dtype``, slab scales fp32 [E_local, W*C, n_scale] or None, masked_m int32 [E_local], slab_index int64
      [W*C, K], valid bool [W*C, K], weights fp32 [W*C, K])``: masked mode's receive side from the received rows
      (``_exchange_fixed``'s): ``_masked_received``'s slab_index, mine, masked_m and sender's weights (a copy), and the
      slab's valid rows (and scales) as ``expand_pairs`` writes them (rows past masked_m: anything).
    - ``reduce_masked(y, slab_index, valid, weights) -> [W*C, H]``: masked combine's rows on the experts' rank
      (``y`` ``[E_local, W*C, H]``), as ``_masked_pairs`` + ``_reduce_pairs_loop`` compute them (fp32 in the order
      of k, in ``y.dtype``; rows of slots with no pair here: anything, their senders never read them).
    - ``exchange_masked_back(y, slab_index, valid, weights, group) -> [W*C, H]``: ``reduce_masked``'s rows returned
      to their senders as ``all_to_all_single`` would return them, without a collective (like ``exchange_fixed``).
    - ``exchange_counts(msg, group) -> None``: exact normal mode's ``all_to_all_single(msg[1], msg[0])`` of the
      counts messages without a collective (like ``exchange_fixed``).
    - ``exchange_normal(x, ids, weights, row, msg, wire, group, capacity) -> uint8 [W * capacity, B]``: exact
      normal mode's rows AND counts messages moved before the host read (like ``exchange_fixed``; ``msg[1]`` filled
      as by ``exchange_counts``): source s's rows for this rank in rows ``s * capacity ...``; a rank that would
      send some rank more than ``capacity`` rows sends none past it and sets the last word of its message rows to
      1: every rank reads it in the counts and moves the rows again by ``all_to_all_single`` (decision 66).
    - ``direct_ok(group, device) -> bool``: whether the ``exchange_*`` kernels can serve ``group`` (the cuda plugin:
      every rank a GPU of this host that each can reach; the same answer on every rank; may run a collective the
      first time). None: always.
    - ``exchange_fixed(x, ids, weights, src, num_tokens, bad_ids, wire, group) -> uint8 [W*C, B]``: what
      ``all_to_all_single`` of ``pack_fixed``'s rows receives, moved without a collective (the cuda plugin: a
      direct write into the peers' rows in symmetric memory, decision 66); the rows may be reused by the next
      call (the core copies what it keeps). Graph-capturable after a first call outside the capture.
    """

    layout: Callable
    pack: Callable
    unpack: Callable
    reduce: Callable
    layout_fixed: Optional[Callable] = None
    pack_fixed: Optional[Callable] = None
    split_fixed: Optional[Callable] = None
    exchange_fixed: Optional[Callable] = None
    expand_masked: Optional[Callable] = None
    reduce_masked: Optional[Callable] = None
    exchange_masked_back: Optional[Callable] = None
    exchange_counts: Optional[Callable] = None
    exchange_normal: Optional[Callable] = None
    direct_ok: Optional[Callable] = None


_KERNELS: dict[str, "TorchA2AKernels | str | None"] = {}
# Worst-case normal mode takes the fused fixed-capacity exchange up to this capacity (max_tokens_per_rank), the
# torch one above: on 2x H200 (2026-11-26 06:29 UTC, bench_torch_a2a.py, CUDA graphs) the fused dispatch took
# 73 / 76 us (bf16 / fp8) against 98 / 111 us at 128 tokens a rank, but 623 / 443 us against 443 / 390 us at 4096
# (its per-slot pack and the contiguous copy of the received rows move the rows twice). Masked mode always
# takes it (4096: 626 / 468 us against 1403 / 834 us). Sizes in between are not measured (decision 63). This is
# the collective exchange's limit; where the direct one serves (DIRECT_CAPACITIES), it takes its own.
FUSED_WORST_CASE_MAX_CAPACITY = 128
# exchange="auto": the max_tokens_per_rank (lowest, highest or None: no limit) over which each mode moves its rows
# (and exact mode its counts messages) by the plugin's direct writes over symmetric memory instead of
# all_to_all_single (decisions 66, 70). Measured on 2x H100 (2026-11-26, bench_torch_a2a.py, us, bf16 / fp8, same run):
# exact normal dispatch 598 / 536 direct against 1002 / 787 at 4096 tokens a rank, 503 / 451 against 996 / 496 at
# 128; masked (CUDA graphs) dispatch + combine 1002 / 813 against 1213 / 1011 at 4096, 100 / 83 against 112 / 106
# at 128; worst-case normal (CUDA graphs) dispatch 61.5 / 58.6 against 103.5 / 63.9 at 128, but at 4096 its fused
# exchange took 642 / 414 against the torch exchange's 472 / 385 (run D); in between (2026-11-26 13:47 UTC, 2x H100,
# one run, decision 70) 129 / 81 against 162 / 177 at 512, 173 / 172 against 215 / 224 at 1024, 316 / 211 against
# 276 / 247 at 2048: direct up to 1024, the torch exchange from 2048. Exact mode needs max_tokens_per_rank (its
# receive chunks). The direct exchange's NCCL test passes (decision 70: its one failure was the masked combine's
# rounding against the torch path's compiled FMAs, not the exchange).
DIRECT_CAPACITIES: dict[str, Optional[tuple[int, Optional[int]]]] = {"exact": (1, None), "worst_case": (1, 1024),
                                                                     "masked": (1, None)}


def direct_wanted(exchange: str, mode: str, capacity: Optional[int], world: int) -> bool:
    """Whether a dispatcher asks for the direct writes: ``exchange="direct"``, or ``"auto"`` with its ``mode``'s
    (``"exact"``, ``"worst_case"``, ``"masked"``) ``DIRECT_CAPACITIES`` range holding ``capacity`` (the
    ``max_tokens_per_rank``) on more than one rank (decisions 66, 70)."""
    if exchange != "auto":
        return exchange == "direct"
    limits = DIRECT_CAPACITIES[mode]
    if world == 1 or limits is None or capacity is None:  # (one rank: nothing to gain over a local copy)
        return False
    low, high = limits
    return low <= capacity and (high is None or capacity <= high)


def register_torch_a2a_kernels(device_type: str, kernels: "TorchA2AKernels | str") -> None:
    """Use ``kernels`` (a ``TorchA2AKernels``, or ``"module:attr"`` naming one, imported at the first
    dispatch on ``device_type``) for ``torch_a2a``'s exact normal mode on devices of ``device_type``.
    A plugin calls it when it loads; the last registration for a device type wins."""
    if not isinstance(kernels, (TorchA2AKernels, str)):
        raise TypeError(f"kernels must be a TorchA2AKernels or a 'module:attr' string, got {type(kernels).__name__}")
    _KERNELS[device_type] = kernels


def _kernels_for(device_type: str) -> Optional[TorchA2AKernels]:
    """The kernels registered for ``device_type`` (imported now if named lazily), or None. An import that
    fails warns once and leaves the torch path (same results)."""
    kernels = _KERNELS.get(device_type)
    if isinstance(kernels, str):
        module, _, attr = kernels.partition(":")
        try:
            kernels = getattr(importlib.import_module(module), attr)
        except Exception as exc:  # a broken kernel module must not break dispatch
            warnings.warn(f"torch_a2a: loading the fused kernels {_KERNELS[device_type]!r} for {device_type} failed "
                          f"({exc!r}); the torch path runs (same results, more host time)", RuntimeWarning, stacklevel=3)
            kernels = None
        _KERNELS[device_type] = kernels
    return kernels


# --------------------------------------------------------------------------- wire helpers

_WORDS = ((8, torch.int64), (4, torch.int32), (2, torch.int16))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """``[N, ...]`` -> contiguous ``uint8 [N, row_bytes]`` view (collectives move bytes)."""
    if t.numel() == 0:  # an empty tensor may have any strides (a compiled op's output, say)
        return torch.empty(t.shape[0], math.prod(t.shape[1:]) * t.element_size(), dtype=torch.uint8, device=t.device)
    t = t.contiguous()
    return t.view(t.shape[0], math.prod(t.shape[1:])).view(torch.uint8)


def _word(*rows: torch.Tensor) -> torch.dtype:
    """Widest integer word that every ``uint8 [N, B]`` tensor in ``rows`` can be viewed as (the
    row size, the row stride and the storage offset must all be multiples of it), so that a row
    copy between them moves words instead of bytes and both sides agree on the word."""
    for size, dtype in _WORDS:
        if all(r.shape[-1] % size == 0 and r.stride(0) % size == 0 and r.storage_offset() % size == 0
               for r in rows):
            return dtype
    return torch.uint8


def _gather_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table.index_select(0, index)`` for a ``uint8 [N, B]`` table, copying whole words."""
    return table.view(_word(table)).index_select(0, index).view(torch.uint8)


def _a2a(out: torch.Tensor, inp: torch.Tensor, out_splits: Optional[list[int]], in_splits: Optional[list[int]],
         group) -> None:
    """``all_to_all_single`` on byte views of ``out`` and ``inp`` (same row size, dim 0 split)."""
    if not out.is_contiguous():
        raise ValueError("internal: all-to-all output must be contiguous")
    out_b = out.view(out.shape[0], math.prod(out.shape[1:])).view(torch.uint8)
    dist.all_to_all_single(out_b, _bytes(inp), out_splits, in_splits, group=group)


# --------------------------------------------------------------------------- masked slab kernels
# The masked layout writes each received row into its K slab rows (dispatch) and sums K weighted
# slab rows per received token (combine). Eager PyTorch has no fused op for either. DeepSeek-V3
# sizes, 4096 tokens/rank, W = 2, one H200 (benchmarks/ep/masked_layout_variants.py; docs/decisions.md 16):
# expand of int64 words index_put_ 0.51 ms, one compiled scatter 0.25 ms; reduce embedding_bag
# ~1.3 ms, a compiled loop over K (one kernel) 0.14 ms.
# On CUDA devices the compiled loops are used (compiled at the first call: warm up before a CUDA
# graph capture, as for any JIT kernel); elsewhere (gloo CI, NPU) the eager ops.


def _expand_pairs_flat(slab: torch.Tensor, rows: torch.Tensor, write_index: torch.Tensor) -> None:
    """``slab[write_index[i, k]] = rows[i]`` for every k, as one scatter of the broadcast rows
    (inductor: one kernel; a loop over k made K kernels, 2x slower on H200)."""
    n, k = write_index.shape
    slab[write_index.reshape(-1)] = rows.unsqueeze(1).expand(n, k, rows.shape[1]).reshape(n * k, rows.shape[1])


def _reduce_pairs_loop(table: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    """``out[i] = sum_k weights[i, k] * table[index[i, k]]`` (weights None: 1) in fp32, returned
    in ``table.dtype``."""
    acc = None
    for k in range(index.shape[1]):
        term = table[index[:, k]].float()
        term = term if weights is None else term * weights[:, k:k + 1]
        acc = term if acc is None else acc + term
    return acc.to(table.dtype)


@functools.cache
def _compiled(fn, dynamic: Optional[bool] = None):
    """``fn`` under ``torch.compile`` (built once per process, traced per shape by dynamo).

    If compiling fails - dynamo's recompile limit (8 graphs per function: many layer shapes or
    dtypes in one process), or an inductor codegen error (inductor 2.11 on CUDA failed on this
    module's send-side layout at 4096 tokens, seen on H200) - ``fn`` runs eagerly from that
    call on, with one warning: same results, more launches. A compile failure happens before
    anything runs, and every function here is pure or rewrites the same values, so re-running is safe."""
    # (traced by a user's outer compile, this inlines into that graph, which has its own options)
    switch = "" if torch.compiler.is_compiling() else _eager_division_switch()
    compiled = torch.compile(fn, fullgraph=True, dynamic=dynamic, options={switch: True} if switch else {})
    eager = False

    @functools.wraps(fn)
    def run(*args):
        nonlocal eager
        if not eager:
            try:
                return compiled(*args)
            except _compile_failures() as exc:
                eager = True
                warnings.warn(f"torch_a2a: compiling {fn.__name__} failed ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0][:200]}); it runs eagerly from now on (same results, "
                              "slower)", RuntimeWarning, stacklevel=2)
        return fn(*args)

    return run


@functools.cache
def _eager_division_switch() -> str:
    """Inductor's switch for IEEE-rounded fp32 division in its Triton code, under this torch's name
    for it (``emulate_divison_rounding`` in torch 2.10, ``eager_numerics.division_rounding`` in 2.13;
    "" if it has none). Triton's plain ``/`` is approximate (``div.full.f32``): the compiled wire
    quantization's ``x / scale`` then put a value near a rounding boundary one INT8/FP8 code away
    from the core quantizer's (eager IEEE division), on a few elements a call (decision 57).
    Inductor already divides by a constant (``amax / 127``) as eager CUDA does, times the
    reciprocal. Without the switch nothing is compiled (``_fused_layout``)."""
    import torch._inductor.config as inductor_config  # only processes that compile pay for it

    names = inductor_config.get_config_copy()
    return next((n for n in ("eager_numerics.division_rounding", "emulate_divison_rounding") if n in names), "")


@functools.cache
def _compile_failures() -> tuple[type, ...]:
    import torch._dynamo.exc
    import torch._inductor.exc  # imported here: only processes that compile pay for it

    return tuple(c for c in (getattr(torch._dynamo.exc, "FailOnRecompileLimitHit", None),
                             getattr(torch._dynamo.exc, "BackendCompilerFailed", None),
                             getattr(torch._inductor.exc, "InductorError", None)) if c is not None)


def _fused_layout(device: torch.device) -> bool:
    # (a user's outer compile tracing through here decides its own division: the switch is not traceable)
    return device.type == "cuda" and (torch.compiler.is_compiling() or bool(_eager_division_switch()))


def _fast(fn, device: torch.device, static: bool = False):
    """``fn`` compiled on CUDA devices, ``fn`` itself elsewhere (decision 16). ``static``: one
    graph per shape (masked mode's shapes are fixed per layer); else dynamo goes dynamic after
    the first change (normal mode's token counts change every call)."""
    if not _fused_layout(device):
        return fn
    return _compiled(fn, False) if static else _compiled(fn)


def expand_pairs(slab: torch.Tensor, rows: torch.Tensor, write_index: torch.Tensor) -> None:
    """Write row ``i`` of ``rows [N, D]`` into the ``K`` rows ``write_index[i] [N, K]`` of ``slab``
    (in place; pairs may repeat a row with the same data)."""
    if _fused_layout(slab.device):
        _fast(_expand_pairs_flat, slab.device, static=True)(slab, rows, write_index)
    else:
        slab.index_put_((write_index,), rows.unsqueeze(1))


def reduce_pairs(table: torch.Tensor, index: torch.Tensor, weights: Optional[torch.Tensor],
                 static: bool = False) -> torch.Tensor:
    """``[N, H]`` in ``table.dtype``: per row ``i``, the sum over k of the rows ``index[i, k]`` of
    ``table``, times fp32 ``weights[i, k]`` unless ``weights`` is None (fp32 accumulation).
    ``static``: the shapes are fixed per layer (see ``_fast``)."""
    if _fused_layout(table.device):
        return _fast(_reduce_pairs_loop, table.device, static)(table, index, weights)
    if weights is None:  # few terms (one per rank): gather then sum (index: the transpose of a contiguous [W, T])
        n, k = index.shape
        return table.index_select(0, index.T.reshape(-1)).view(k, n, table.shape[1]).sum(0)
    return torch.nn.functional.embedding_bag(index, table, per_sample_weights=weights.to(table.dtype), mode="sum")


# --------------------------------------------------------------------------- layout math
# Each stage's index math is one pure function of tensors and layer constants. On CUDA the
# stages after a transfer and the wire quantization run inductor-compiled (a few fused kernels
# instead of ~10 small launches each; FP8 quantization was ~6 passes over the activations); elsewhere
# they run eagerly. The send side (``_normal_layout``, ``_masked_layout``) stays eager everywhere:
# inductor 2.11 failed to generate CUDA code for it at 4096 tokens with W = 2 (``InductorError``,
# "list indices must be integers or slices, not NoneType"; at 128 and 1000 tokens it compiled; H200).


def _send_rows(ids: torch.Tensor, world: int, num_local: int,
               capacity: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Where each (token, rank) pair goes in a destination-major send buffer.

    A token goes to rank ``r`` when one of its ids is an expert of ``r`` (ids outside ``[0, E)``
    go nowhere). Returns ``hit`` (bool ``[W, T]``: the token goes to rank r) and ``row`` (int64
    ``[T, W]``, the transpose of a contiguous ``[W, T]``): the pair's row counted from 1, 0 where
    the token does not go to ``r`` (so the unused pairs need no offset: each buffer indexed by
    ``row`` has its spare row first). Rows are packed by rank, or with ``capacity`` every rank owns
    ``capacity`` rows.
    """
    t = ids.shape[0]
    ranks = torch.arange(world, device=ids.device, dtype=ids.dtype).view(world, 1, 1)
    # built [W, T] and scanned along its contiguous dim (an outer-dim scan over T runs serially per
    # column: 0.37 ms per dispatch at 4096 tokens/rank on H200, profiled)
    hit = (ids.div(num_local, rounding_mode="floor").unsqueeze(0) == ranks).any(2)
    if capacity is None:  # packed: one scan of the flattened [W, T] counts the rows of lower ranks too
        row = torch.where(hit, hit.view(-1).cumsum(0).view(world, t), 0)
    else:  # rank r's rows are r * capacity + 1 ...
        first = torch.arange(0, world * capacity, capacity, device=ids.device).view(world, 1)
        row = torch.where(hit, hit.cumsum(1) + first, 0)
    return hit, row.T


def _sources(row: torch.Tensor, size: int, fill: Optional[int]) -> torch.Tensor:
    """Inverse of ``row`` (``_send_rows``): int64 ``[size + 1]``, entry ``i`` >= 1 the source token of
    send-buffer row ``i - 1`` (``fill`` where no token lands); entry 0 collects the unused pairs."""
    t = row.shape[0]
    src = (torch.full((size + 1,), fill, dtype=torch.int64, device=row.device) if fill is not None
           else torch.empty(size + 1, dtype=torch.int64, device=row.device))
    return src.index_put_((row.T,), torch.arange(t, device=row.device))


def _normal_layout(ids: torch.Tensor, world: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Normal dispatch, before the host read: ``row [T, W]`` (see ``_send_rows``) and the counts
    messages ``int64 [2, W, 3 + E_local]``: ``[0]`` is what this rank sends (row r for rank r: [ids
    below -1, ids from E up, rows for r, (token, expert) pairs per expert of r]), ``[1]`` receives the
    peers' (one buffer, so that the host reads both in one ``tolist``)."""
    e = world * num_local
    hit, row = _send_rows(ids, world, num_local, None)
    # one histogram of the ids: bin 0 below -1, 1 for -1, 2..E+1 the experts, E+2 from E up
    key = torch.add(ids.clamp(-2, e), 2, out=torch.empty(ids.shape, dtype=torch.int64, device=ids.device))
    bins = torch.zeros(e + 3, dtype=torch.int64, device=ids.device).scatter_add_(0, key.view(-1), torch.ones_like(key.view(-1)))
    msg = torch.empty(2, world, 3 + num_local, dtype=torch.int64, device=ids.device)
    torch.cat([bins[0:1].expand(world, 1), bins[e + 2:].expand(world, 1), hit.sum(1, keepdim=True),
               bins[2:e + 2].view(world, num_local)], dim=1, out=msg[0])
    return row, msg


def _masked_layout(ids: torch.Tensor, world: int, num_local: int, capacity: int,
                   num_experts: int, overflow: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked dispatch's send side: ``slot [T, W]`` (see ``_send_rows``; every rank owns C slots)
    and the count of ids outside ``[-1, E)`` (int32 scalar). An overflowing rank sends no tokens
    (and still counts its ids)."""
    bad = ((ids < -1) | (ids >= num_experts)).sum(dtype=torch.int32)
    _, slot = _send_rows(ids[:0] if overflow else ids, world, num_local, capacity)
    return slot, bad


def _wire_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, wire: WireDtype, meta_words: int,
               num_tokens: int, bad_ids: Optional[torch.Tensor]) -> tuple[torch.Tensor, Optional[torch.Tensor],
                                                                        torch.Tensor]:
    """Per-token wire rows, quantized once: (wire data ``[T, H]``, scales or None, side block
    ``int32 [T + 1, M]``); the extra side-block row is padding (no expert) for unused slots.
    Every row, padding included, carries the sender's token count and ``bad_ids`` (its count of
    ids outside ``[-1, E)``, when given): the in-band checks of masked mode."""
    t, k = ids.shape
    data, scale = _quantize_wire(x, wire)
    ns = 0 if scale is None else scale.shape[-1]
    meta = ids.new_full((t + 1, meta_words), num_tokens)
    if bad_ids is not None:  # masked mode's in-band check (normal mode checks its histogram on the host)
        meta[:, -2] = bad_ids
    if ns:
        meta[:t, :ns] = scale.view(torch.int32)
    meta[:t, ns:ns + k] = ids
    meta[:t, ns + k:ns + 2 * k] = weights.float().view(torch.int32)
    meta[t, :ns] = 0  # padding row: scales 0 (its data dequantizes to zeros), no expert, weights 0
    meta[t, ns:ns + k] = -1
    meta[t, ns + k:ns + 2 * k] = 0
    return data, scale, meta


def _quantize_wire(x: torch.Tensor, wire: WireDtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(wire data, scales or None) of ``x`` as the core quantizer makes them."""
    if wire is WireDtype.FP8:
        return quantize_fp8_per_token_group(x)
    if wire is WireDtype.INT8:
        return quantize_int8_per_token(x)
    return x, None


def _normal_wire_rows(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      wire: WireDtype) -> tuple[torch.Tensor, Optional[torch.Tensor], torch.Tensor]:
    """Exact normal mode's per-token wire rows: (wire data ``[T, H]``, scales or None, side block
    ``int32 [T, n_scale + 2K]``) built in one ``cat``: no padding row (only real tokens are sent) and
    no in-band counts (this mode checks on the host)."""
    data, scale = _quantize_wire(x, wire)
    parts = [] if scale is None else [scale.view(torch.int32)]
    parts += [ids.to(torch.int32), weights.to(torch.float32).view(torch.int32)]
    return data, scale, torch.cat(parts, dim=1)


def _split_meta(meta: torch.Tensor, n_scale: int, top_k: int) -> tuple[Optional[torch.Tensor], torch.Tensor,
                                                                      torch.Tensor]:
    """Received side block -> (scales or None (contiguous, as the experts read them), global ids
    int32, weights fp32). The fixed-capacity modes' last two words: ``_in_band_counts``."""
    ns, k = n_scale, top_k
    scale = meta[:, :ns].view(torch.float32).contiguous() if ns else None
    return scale, meta[:, ns:ns + k], meta[:, ns + k:ns + 2 * k].view(torch.float32)


def _in_band_counts(meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The senders' bad-id and token counts that every row of the fixed-capacity modes carries."""
    return meta[:, -2], meta[:, -1]


def _local_ids(ids: torch.Tensor, weights: torch.Tensor, rank: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Global ids -> (local ids (-1: expert elsewhere, or no expert), weights (0 for those))."""
    mine = ids.div(num_local, rounding_mode="floor") == rank
    return torch.where(mine, ids - rank * num_local, -1), torch.where(mine, weights, 0.0)


def _normal_received(meta: torch.Tensor, n_scale: int, top_k: int,
                     local_of: torch.Tensor) -> tuple[Optional[torch.Tensor], torch.Tensor, torch.Tensor]:
    """Received side block of exact normal mode -> (scales or None, local ids, weights: see ``_local_ids``).
    ``local_of`` (int32 ``[E + 1]``, ``_local_table``) maps the ids, checked on the host before: one gather."""
    scale, ids, weights = _split_meta(meta, n_scale, top_k)
    local = local_of[ids]
    return scale, local, torch.where(local >= 0, weights, 0.0)


def _local_table(rank: int, num_local: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """int32 ``[E + 1]``: global expert -> its local id on ``rank``, -1 elsewhere; the last entry (id -1) -1."""
    table = torch.full((num_experts + 1,), -1, dtype=torch.int32, device=device)
    table[rank * num_local:(rank + 1) * num_local] = torch.arange(num_local, dtype=torch.int32, device=device)
    return table


def _worst_case_received(meta: torch.Tensor, n_scale: int, top_k: int, rank: int, num_local: int):
    """Received side block of worst-case normal mode -> (scales or None, local ids, weights), the
    senders' bad-id and token counts (the in-band checks), and the (row, local expert) pairs per
    local expert (int32 ``[E_local]``), all computed on the device. A padding row (ids -1) comes out
    as a token with no expert here."""
    scale, ids, weights = _split_meta(meta, n_scale, top_k)
    local, weights = _local_ids(ids, weights, rank, num_local)
    bad, tokens = _in_band_counts(meta)
    key = torch.where(local >= 0, local, num_local).long().reshape(-1)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=meta.device).scatter_add_(0, key, torch.ones_like(key))
    return scale, local, weights, bad, tokens, counts[:num_local].to(torch.int32)


def _masked_received(meta: torch.Tensor, n_scale: int, top_k: int, rank: int, num_local: int):
    """Received side block of masked mode -> where each received (slot, k) pair goes in the slab.

    Returns (scales or None, sender's weights, sender's bad-id counts, sender's token counts,
    ``mine`` (the pair's expert is here), ``slab_index`` (slab row of each pair here: expert *
    C*W + its rank among that expert's pairs in (source rank, token, k) order), ``masked_m``,
    ``write_index`` (the row each pair writes, see below))."""
    el = num_local
    cw = meta.shape[0]
    scale, ids, weights = _split_meta(meta, n_scale, top_k)
    bad, tokens = _in_band_counts(meta)
    mine = ids.div(el, rounding_mode="floor") == rank
    key = torch.where(mine, ids - rank * el, el).long()  # [CW, K]; el: not here
    # [el + 1, CW], scanned along its contiguous dim (the [CW, el + 1] outer-dim scan took 1.9 ms
    # per dispatch at 4096 tokens/rank on H200, profiled)
    seen = torch.zeros(el + 1, cw, dtype=torch.int32, device=meta.device).scatter(0, key.T, 1).cumsum(1, dtype=torch.int32)
    slab_index = torch.add(seen.gather(0, key.T).T, key, alpha=cw).sub(1).clamp(max=el * cw)
    masked_m = seen[:el, -1].to(torch.int32)
    # expand: one row write per pair (fixed shape). A pair that is not here rewrites the same
    # data into its slot's first row here; a slot with no pair here writes its own scratch row
    # past the slab. (All of them into ONE scratch row serialized ~32k writes of 14 KB on one
    # address range: 3.1 ms for 4096 tokens/rank on 2x H200.)
    first_here = slab_index.gather(1, mine.to(torch.int8).argmax(1, keepdim=True))
    scratch = torch.arange(el * cw, el * cw + cw, device=meta.device).unsqueeze(1)
    write_index = torch.where(mine, slab_index, torch.where(mine.any(1, keepdim=True), first_here, scratch))
    return scale, weights, bad, tokens, mine, slab_index, masked_m, write_index


def _masked_pairs(slab_index: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                  last_row: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine's read index and weights per received (slot, k) pair. Pairs not here read their
    slot's first pair here with weight 0, so they never touch a row past masked_m (garbage, maybe
    NaN); slots with no pair here read garbage, and their sender never reads those rows back."""
    first = slab_index.gather(1, valid.to(torch.int8).argmax(1, keepdim=True))
    return torch.where(valid, slab_index, first).clamp(max=last_row), torch.where(valid, weights, 0.0)


class _HostCopy:
    """A device tensor's copy to the host, started in stream order; ``wait()`` waits for that copy only (not for
    work queued after it) and gives the host tensor. The pinned buffer and the event are kept for the next copy
    of the same shape (one dispatcher, one thread: each copy is read before the next one starts); on the CPU the
    tensor itself."""

    def __init__(self) -> None:
        self.host: Optional[torch.Tensor] = None
        self.copied: Optional[torch.Event] = None

    def start(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        if t.device.type == "cpu":
            return lambda: t
        host = self.host
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = self.host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # (an asynchronous copy)
            self.copied = torch.Event(device=t.device)
        host.copy_(t, non_blocking=True)
        self.copied.record()
        return self.wait

    def wait(self) -> torch.Tensor:
        self.copied.synchronize()
        return self.host


def _scale_words(dtype: WireDtype, hidden: int) -> int:
    """fp32 scale words per row on the wire."""
    if dtype is WireDtype.FP8:
        return -(-hidden // FP8_GROUP)
    if dtype is WireDtype.INT8:
        return 1
    return 0


@dataclass(frozen=True)
class _NormalHandle:
    row: torch.Tensor  # int64 [T, W]: 1 + row of (token, rank) in the send buffer, 0 where not sent
    send_counts: list[int]  # rows sent to each rank
    recv_counts: list[int]  # rows received from each rank
    num_tokens: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _WorstCaseHandle:
    slot: torch.Tensor  # int64 [T, W]: 1 + slot of (token, rank) in the send buffer, 0 where not sent
    num_tokens: int
    dtype: torch.dtype


@dataclass(frozen=True)
class _MaskedHandle:
    slot: torch.Tensor  # int64 [T, W]: 1 + slot of (token, rank) in the send buffer, 0 where not sent
    src: torch.Tensor  # int64 [W*C]: source token of each sent slot, T for unused slots (sender side)
    slab_index: torch.Tensor  # int64 [W*C, K]: slab row of each received (slot, k) pair, E_local*W*C if none
    valid: torch.Tensor  # bool [W*C, K]: (slot, k) pair is an expert of this rank
    weights: torch.Tensor  # fp32 [W*C, K]: the sender's weights of the received pairs
    topk_weights: torch.Tensor  # the dispatch TopK's weights (identity check in combine)
    num_tokens: int
    dtype: torch.dtype


# --------------------------------------------------------------------------- dispatcher


class TorchA2ADispatcher(Dispatcher):
    """EP dispatcher over ``torch.distributed`` all-to-all; format EP_NORMAL or EP_MASKED."""

    checks_ids_on_every_rank = True  # normal mode: in the counts exchange; masked: in-band (decision 15)

    def __init__(self, ctx: BackendContext) -> None:
        super().__init__(ctx)
        cfg = ctx.config
        if ctx.format not in (Format.EP_NORMAL, Format.EP_MASKED):
            raise ValueError(f"torch_a2a produces ep_normal or ep_masked, not {ctx.format}")
        if ctx.dispatch_dtype not in WIRE_DTYPES:
            raise ValueError(f"torch_a2a carries {'/'.join(map(str, WIRE_DTYPES))}, not {ctx.dispatch_dtype}")
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("torch_a2a needs an initialized torch.distributed process group "
                               "(torch.distributed.init_process_group) before the layer is built")
        self.group = cfg.ep_group  # None: the default group
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if (self.world, self.rank) != (cfg.ep_size, cfg.ep_rank):
            raise ValueError(f"torch_a2a: EP group has size {self.world}, rank {self.rank}; config says "
                             f"ep_size={cfg.ep_size}, ep_rank={cfg.ep_rank}")
        if cfg.num_experts % self.world:
            raise ValueError(f"num_experts={cfg.num_experts} is not divisible by the EP group size {self.world}")
        self.num_experts = cfg.num_experts
        self.num_local = cfg.num_experts // self.world
        self.top_k = cfg.top_k
        self.hidden = cfg.hidden_size
        self.wire = ctx.dispatch_dtype
        self.masked = ctx.format is Format.EP_MASKED
        self.capacity = cfg.max_tokens_per_rank
        if self.masked and self.capacity is None:
            raise ValueError("torch_a2a masked mode needs config.max_tokens_per_rank (the fixed capacity)")
        # normal mode with worst-case buffers: graph-safe (decision 56)
        self.worst_case = not self.masked and normal_buffers(cfg, ctx.spec.name) == "worst_case"
        # int32 side block of each row: [scales | K global ids | K weights | bad-id count | token count]
        # (the counts are the fixed-capacity exchange's in-band checks; exact normal mode has none)
        self.n_scale = _scale_words(self.wire, self.hidden)
        self.meta_words = self.n_scale + 2 * self.top_k + 2  # + sender's bad-id count, token count
        self._local_of: Optional[torch.Tensor] = None  # exact normal mode's id map (_local_table), built at first use
        self._msg_host = _HostCopy()  # exact normal mode's counts messages on their way to the host read
        self.fused = kernels_option(cfg, ctx.spec.name) == "auto"  # a plugin's kernels where registered (decision 63)
        self.exchange = exchange_option(cfg, ctx.spec.name)  # the fixed-capacity modes' transport (decision 66)
        mode = "masked" if self.masked else "worst_case" if self.worst_case else "exact"
        self._direct_wanted = direct_wanted(self.exchange, mode, self.capacity, self.world)

    # ----------------------------------------------------------------- common

    def _validate(self, x: torch.Tensor, topk: TopK) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"hidden_states must be [T, {self.hidden}], got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise TypeError(f"hidden_states must be bf16, fp16 or fp32, got {x.dtype}")
        if topk.ids.shape != (x.shape[0], self.top_k):
            raise ValueError(f"topk.ids must be [T={x.shape[0]}, top_k={self.top_k}], got {tuple(topk.ids.shape)}")
        if topk.ids.device != x.device:
            raise ValueError(f"topk on {topk.ids.device} but hidden_states on {x.device}")

    def _wire_torch_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.wire is WireDtype.BF16:
            return x.dtype
        return torch.float8_e4m3fn if self.wire is WireDtype.FP8 else torch.int8

    def dispatch(self, hidden_states: torch.Tensor, topk: TopK) -> DispatchOutput:
        self._validate(hidden_states, topk)
        if self.masked:
            return self._dispatch_masked(hidden_states, topk)
        if self.worst_case:
            return self._dispatch_worst_case(hidden_states, topk)
        return self._dispatch_normal(hidden_states, topk)

    def combine(self, combine_input: CombineInput) -> torch.Tensor:
        if self.masked:
            if not isinstance(combine_input, EPMaskedCombine):
                raise TypeError(f"torch_a2a (ep_masked) combines EPMaskedCombine, got {type(combine_input).__name__}")
            return self._combine_masked(combine_input)
        if not isinstance(combine_input, EPNormalCombine):
            raise TypeError(f"torch_a2a (ep_normal) combines EPNormalCombine, got {type(combine_input).__name__}")
        return self._combine_normal(combine_input)

    # ----------------------------------------------------------------- normal mode

    def _read_counts(self, msg: torch.Tensor) -> tuple[list[int], list[int], tuple[int, ...], bool]:
        """The one host sync of exact normal mode: the counts message (``_normal_layout``), exchanged, read
        in one ``tolist`` -> (rows sent to each rank, rows received from each, pairs per local expert, whether
        some rank's direct exchange overflowed its chunks: every rank reads the same flags, decision 66).
        Raises ``ValueError`` on every rank alike when any rank has ids outside ``[-1, E)``."""
        sent_msg, recv_msg = msg.tolist()
        bad_by_rank = [m[0] + m[1] for m in recv_msg]
        if any(bad_by_rank):  # every rank learns it from the same message, so all raise together
            ranks = [r for r, b in enumerate(bad_by_rank) if b]
            raise ValueError(f"topk.ids out of range [-1, {self.num_experts}) on EP rank(s) {ranks} "
                             f"({bad_by_rank[self.rank]} on this rank {self.rank})")
        el = self.num_local
        # (on the critical path: a sum per expert by generator took ~4x as long, 256 experts over 2 ranks)
        counts_host = tuple(map(sum, zip(*[m[3:3 + el] for m in recv_msg], strict=True)))
        overflowed = any(m[3 + el] for m in recv_msg if len(m) > 3 + el)
        return [m[2] for m in sent_msg], [m[2] for m in recv_msg], counts_host, overflowed

    def _dispatch_normal(self, x: torch.Tensor, topk: TopK) -> EPNormalDispatch:
        kernels = _kernels_for(x.device.type) if self.fused else None
        if kernels is not None:
            return self._dispatch_normal_fused(x, topk, kernels)
        dev, t, w, el = x.device, x.shape[0], self.world, self.num_local
        row, msg = _normal_layout(topk.ids, w, el)
        src = _sources(row, w * t, None)
        dist.all_to_all_single(msg[1], msg[0], group=self.group)
        counts = msg[1, :, 3:].sum(0, dtype=torch.int32)
        # compiled only where it fuses a quantization: a compiled call costs more host time than
        # the one cat of the BF16 side block (decision 56)
        wire_rows = _normal_wire_rows if self.wire is WireDtype.BF16 else _fast(_normal_wire_rows, dev)
        q, scale, meta = wire_rows(x, topk.ids, topk.weights, self.wire)
        send_counts, recv_counts, counts_host, _ = self._read_counts(msg)

        n_send, n_recv = sum(send_counts), sum(recv_counts)
        data = _bytes(q)
        recv_data = torch.empty(n_recv, data.shape[1], dtype=torch.uint8, device=dev)
        recv_meta = torch.empty(n_recv, meta.shape[1], dtype=torch.int32, device=dev)
        src = src[1:n_send + 1]
        _a2a(recv_data, _gather_rows(data, src), recv_counts, send_counts, self.group)
        _a2a(recv_meta, meta.index_select(0, src), recv_counts, send_counts, self.group)

        if self._local_of is None or self._local_of.device != dev:
            self._local_of = _local_table(self.rank, el, self.num_experts, dev)
        scale, lids, weights = _normal_received(recv_meta, self.n_scale, self.top_k, self._local_of)
        hidden = QuantizedActivations(recv_data.view(self._wire_torch_dtype(x)), self.wire, scale)
        handle = _NormalHandle(row, send_counts, recv_counts, t, x.dtype)
        return EPNormalDispatch(hidden, TopK(weights, lids), counts, counts_host, handle)

    def _dispatch_normal_fused(self, x: torch.Tensor, topk: TopK, kernels: TorchA2AKernels) -> EPNormalDispatch:
        """Exact normal dispatch with a plugin's kernels (decisions 63, 66): layout, pack, the count exchange, the
        host read, ONE all-to-all of data and side block, unpack."""
        row, msg = kernels.layout(topk.ids, self.world, self.num_local)
        direct = self._direct_exchange(kernels, x.device)
        # the rows depend only on the local layout: packed (direct: moved) before the count exchange, on the device
        # while the host issues that exchange and waits for the counts (decision 66)
        chunk = self.capacity if direct and kernels.exchange_normal is not None and self.capacity else 0
        early = None
        if chunk:  # the rows and the counts messages (decision 66)
            recv = kernels.exchange_normal(x, topk.ids, topk.weights, row, msg, self.wire, self.group, chunk)
            host = self._msg_host.start(msg)
            if 2 * x.shape[0] >= chunk:  # unpacked at the chunks' size while the host reads (decision 70)
                early = kernels.unpack(recv, msg[1], self.wire, x.dtype, self.hidden, self.top_k, self.rank,
                                       self.num_local, rows=self.world * chunk, chunk=chunk)
            msg_host = host()
        else:
            send = kernels.pack(x, topk.ids, topk.weights, row, self.wire)
            if direct and kernels.exchange_counts is not None:
                kernels.exchange_counts(msg, self.group)
            else:
                dist.all_to_all_single(msg[1], msg[0], group=self.group)
            msg_host = msg
        send_counts, recv_counts, counts_host, overflowed = self._read_counts(msg_host)
        n_recv = sum(recv_counts)
        if overflowed:  # some rank sent one rank more rows than a chunk holds: every rank moves them again, below
            chunk, early = 0, None
            send = kernels.pack(x, topk.ids, topk.weights, row, self.wire)
        if not chunk:
            recv = torch.empty(n_recv, send.shape[1], dtype=torch.uint8, device=x.device)
            dist.all_to_all_single(recv, send[:sum(send_counts)], recv_counts, send_counts, group=self.group)
        if early is not None:
            data, scale, lids, weights, counts = early
            data, lids, weights = data[:n_recv], lids[:n_recv], weights[:n_recv]
            scale = scale if scale is None else scale[:n_recv]
        else:
            data, scale, lids, weights, counts = kernels.unpack(recv, msg[1], self.wire, x.dtype, self.hidden,
                                                                self.top_k, self.rank, self.num_local, rows=n_recv,
                                                                chunk=chunk)
        hidden = QuantizedActivations(data, self.wire, scale)
        handle = _NormalHandle(row, send_counts, recv_counts, x.shape[0], x.dtype)
        return EPNormalDispatch(hidden, TopK(weights, lids), counts, counts_host, handle)

    def _combine_normal(self, ci: EPNormalCombine) -> torch.Tensor:
        h = ci.handle
        if isinstance(h, _WorstCaseHandle):
            cw = self.capacity * self.world
            if ci.hidden.shape != (cw, self.hidden):
                raise ValueError(f"EPNormalCombine.hidden must be [{cw}, {self.hidden}] (worst-case buffers: "
                                 f"max_tokens_per_rank x EP size rows), got {tuple(ci.hidden.shape)}")
            return self._return_rows(ci.hidden, None, None, cw, h.slot, h.dtype)
        if not isinstance(h, _NormalHandle):
            raise ValueError("EPNormalCombine.handle must be the handle of this dispatcher's dispatch")
        y = ci.hidden
        if y.dim() != 2 or y.shape != (sum(h.recv_counts), self.hidden):
            raise ValueError(f"EPNormalCombine.hidden must be [{sum(h.recv_counts)}, {self.hidden}], "
                             f"got {tuple(y.shape)}")
        return self._return_rows(y, h.send_counts, h.recv_counts, sum(h.send_counts), h.row, h.dtype)

    def _return_rows(self, y: torch.Tensor, back_counts, y_counts, n_back: int, row: torch.Tensor,
                     dtype: torch.dtype) -> torch.Tensor:
        """Send ``y`` back to the ranks its rows came from (``n_back`` rows return, after a zero row);
        sum each token's rows (``row [T, W]`` from ``_send_rows``: 0, the zero row, where the token was
        not sent to a rank). The sum accumulates in fp32."""
        kernels = _kernels_for(y.device.type) if self.fused else None
        if kernels is not None:  # one kernel sums the rows (decision 63); no zero row needed
            back = torch.empty(n_back, self.hidden, dtype=y.dtype, device=y.device)
            _a2a(back, y, back_counts, y_counts, self.group)
            return kernels.reduce(back, row, dtype)
        back = torch.empty(n_back + 1, self.hidden, dtype=y.dtype, device=y.device)
        back[0].zero_()
        _a2a(back[1:], y, back_counts, y_counts, self.group)
        return reduce_pairs(back, row, None).to(dtype)

    # ----------------------------------------------------------------- masked mode

    def _exchange_fixed(self, x: torch.Tensor, topk: TopK) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                     torch.Tensor, int, bool]:
        """The fixed-capacity exchange of masked and worst-case normal mode: every rank sends
        ``C`` row slots (wire data, side block) to every rank, a token once per destination rank, unused slots
        padding. Returns (received data ``uint8 [W*C, B]``, received side blocks ``int32 [W*C, M]``, ``slot [T, W]``,
        ``src [W*C]``, tokens sent, whether the received rows are a plugin's buffer that its next exchange reuses:
        the caller copies what it keeps)."""
        dev, w, el, c = x.device, self.world, self.num_local, self.capacity
        t_in, cw, ids_in = x.shape[0], c * w, topk.ids
        overflow = t_in > c
        if overflow:  # take part in the exchange with no tokens (the count travels in-band), raise after it
            x, topk = x[:0], TopK(topk.weights[:0], topk.ids[:0])
        t = x.shape[0]
        # (worst-case normal: the fused exchange up to a measured capacity, or wherever the direct one is asked for)
        kernels = _kernels_for(dev.type) if self.fused else None
        direct = kernels is not None and kernels.exchange_fixed is not None and self._direct_exchange(kernels, dev)
        if not (self.masked or c <= FUSED_WORST_CASE_MAX_CAPACITY or direct):
            kernels = None
        if kernels is not None and kernels.pack_fixed is not None:  # two kernels, one all-to-all (decision 63)
            slot, src, bad = kernels.layout_fixed(ids_in, w, el, c, overflow)
            if direct:  # the rows written straight into the peers' (decision 66)
                recv = kernels.exchange_fixed(x, topk.ids, topk.weights, src, t_in, bad, self.wire, self.group)
            else:
                send = kernels.pack_fixed(x, topk.ids, topk.weights, src, t_in, bad, self.wire)
                recv = torch.empty_like(send)
                dist.all_to_all_single(recv, send, group=self.group)
            if overflow:
                raise ValueError(self._overflow_message(f"{t_in} tokens on EP rank {self.rank} exceed"))
            recv_data, recv_meta = kernels.split_fixed(recv, self.wire, x.dtype, self.hidden, self.top_k)
            return recv_data, recv_meta, slot, src, t, direct
        slot, bad = _masked_layout(ids_in, w, el, c, self.num_experts, overflow)
        src = _sources(slot, cw, t)[1:]
        q, scale, meta = _fast(_wire_rows, dev)(x, topk.ids, topk.weights, self.wire, self.meta_words, t_in, bad)
        data = _bytes(q)
        send_data = _gather_rows(data, src.clamp(max=t - 1)) if t else data.new_zeros(cw, data.shape[1])
        recv_data = torch.empty_like(send_data)
        recv_meta = torch.empty(cw, self.meta_words, dtype=torch.int32, device=dev)
        _a2a(recv_data, send_data, None, None, self.group)
        _a2a(recv_meta, meta.index_select(0, src), None, None, self.group)
        if overflow:
            raise ValueError(self._overflow_message(f"{t_in} tokens on EP rank {self.rank} exceed"))
        return recv_data, recv_meta, slot, src, t, False

    def _direct_exchange(self, kernels: TorchA2AKernels, device: torch.device) -> bool:
        """Whether this dispatcher moves its rows by the plugin's direct writes: asked for (``direct_wanted``, at
        construction) and possible for this group (the plugin's ``direct_ok``: every rank a GPU this one reaches;
        decision 66)."""
        return self._direct_wanted and (kernels.direct_ok is None or kernels.direct_ok(self.group, device))

    def _dispatch_worst_case(self, x: torch.Tensor, topk: TopK) -> EPNormalDispatch:
        """Normal mode with worst-case buffers (DeepEP's ``num_worst_tokens``): ``[W*C, H]`` rows,
        rank-major, each source's tokens first in its ``C`` rows, then padding rows (local ids
        all -1, weights 0, FP8/INT8 scales 0). Nothing is read on the host: graph-safe."""
        recv_data, recv_meta, slot, _, _, shared = self._exchange_fixed(x, topk)
        received = _fast(_worst_case_received, x.device, static=True)(recv_meta, self.n_scale, self.top_k, self.rank,
                                                                      self.num_local)
        scale, lids, weights, rbad, rtokens, counts = received
        self._check_senders(rtokens, rbad)
        if shared or not recv_data.is_contiguous():  # a view into the fused exchange's rows: the experts read it
            recv_data = recv_data.clone(memory_format=torch.contiguous_format)  # contiguous, and after the next one
        if shared and scale is not None:
            scale = scale.clone()
        hidden = QuantizedActivations(recv_data.view(self._wire_torch_dtype(x)), self.wire, scale)
        return EPNormalDispatch(hidden, TopK(weights, lids), counts, None, _WorstCaseHandle(slot, x.shape[0], x.dtype))

    def _dispatch_masked(self, x: torch.Tensor, topk: TopK) -> EPMaskedDispatch:
        dev, w, el, c, k = x.device, self.world, self.num_local, self.capacity, self.top_k
        cw = c * w
        recv_data, recv_meta, slot, src, t, shared = self._exchange_fixed(x, topk)
        kernels = _kernels_for(dev.type) if self.fused else None
        if kernels is not None and kernels.expand_masked is not None:  # three kernels (decision 66)
            data_slab, slab_scale, masked_m, slab_index, mine, rweights = kernels.expand_masked(
                recv_data, recv_meta, self.n_scale, k, self.rank, el, self._wire_torch_dtype(x))
            rbad, rtokens = _in_band_counts(recv_meta)
            self._check_senders(rtokens, rbad)
            hidden = QuantizedActivations(data_slab, self.wire, slab_scale)
            handle = _MaskedHandle(slot, src, slab_index, mine, rweights, topk.weights, t, x.dtype)
            return EPMaskedDispatch(hidden, masked_m, topk, handle)
        received = _fast(_masked_received, dev, static=True)(recv_meta, self.n_scale, k, self.rank, el)
        scale, rweights, rbad, rtokens, mine, slab_index, masked_m, write_index = received
        if shared:  # the handle keeps the weights past the next exchange, which reuses the received rows
            rweights = rweights.clone()
        self._check_senders(rtokens, rbad)
        db = recv_data.shape[1]
        slab = torch.empty(el * cw + cw, db, dtype=torch.uint8, device=dev)
        word = _word(slab, recv_data)
        expand_pairs(slab.view(word), recv_data.view(word), write_index)
        slab_scale = None
        if scale is not None:
            slab_scale = torch.empty(el * cw + cw, self.n_scale, dtype=torch.float32, device=dev)
            expand_pairs(slab_scale, scale, write_index)
            slab_scale = slab_scale[:el * cw].view(el, cw, self.n_scale)
        data_slab = slab[:el * cw].view(el, cw, db).view(self._wire_torch_dtype(x))
        hidden = QuantizedActivations(data_slab, self.wire, slab_scale)
        handle = _MaskedHandle(slot, src, slab_index, mine, rweights, topk.weights, t, x.dtype)
        return EPMaskedDispatch(hidden, masked_m, topk, handle)

    def _overflow_message(self, what: str) -> str:
        return (f"masked dispatch: {what} max_tokens_per_rank={self.capacity} (the fixed capacity of the "
                "masked slab); raise max_tokens_per_rank or split the batch")

    def _check_senders(self, tokens: torch.Tensor, bad_ids: torch.Tensor) -> None:
        """Every rank learns of an overflow or of out-of-range ids on any rank (its own included:
        each rank receives its own rows too) without a host sync (see the module doc)."""
        checks = ((tokens <= self.capacity).all(), self._overflow_message("an EP rank's tokens exceed")), \
            ((bad_ids == 0).all(), f"masked dispatch: topk.ids out of range [-1, {self.num_experts}) on an EP rank "
                                   "(those pairs would be dropped silently)")
        for ok, msg in checks:
            try:
                torch._assert_async(ok, msg)
            except RuntimeError as exc:  # CPU: checked at once
                raise ValueError(msg) from exc

    def _combine_masked(self, ci: EPMaskedCombine) -> torch.Tensor:
        h: _MaskedHandle = ci.handle
        if not isinstance(h, _MaskedHandle):
            raise ValueError("EPMaskedCombine.handle must be the handle of this dispatcher's dispatch")
        w, el, c, k = self.world, self.num_local, self.capacity, self.top_k
        cw = c * w
        y = ci.hidden
        if y.shape != (el, cw, self.hidden):
            raise ValueError(f"EPMaskedCombine.hidden must be [{el}, {cw}, {self.hidden}], got {tuple(y.shape)}")
        if ci.topk.weights.shape != (h.num_tokens, k):
            raise ValueError(f"EPMaskedCombine.topk must be [T={h.num_tokens}, {k}], got {tuple(ci.topk.weights.shape)}")
        weights = h.weights
        if ci.topk.weights is not h.topk_weights:  # other weights than dispatched: send them again
            table = torch.cat([ci.topk.weights, ci.topk.weights.new_zeros(1, k)])  # + the padding row
            weights = torch.empty(cw, k, dtype=torch.float32, device=y.device)
            _a2a(weights, table.index_select(0, h.src), None, None, self.group)

        kernels = _kernels_for(y.device.type) if self.fused else None
        if kernels is not None and kernels.reduce_masked is not None:  # one kernel each side (decision 66)
            if kernels.exchange_masked_back is not None and self._direct_exchange(kernels, y.device):
                back = kernels.exchange_masked_back(y, h.slab_index, h.valid, weights, self.group)
            else:
                back = torch.empty(cw, self.hidden, dtype=y.dtype, device=y.device)
                _a2a(back, kernels.reduce_masked(y, h.slab_index, h.valid, weights), None, None, self.group)
            return kernels.reduce(back, h.slot, h.dtype)
        # weighted sum of each received token's rows on this rank (fp32 accumulation)
        index, pair_w = _fast(_masked_pairs, y.device, static=True)(h.slab_index, h.valid, weights, el * cw - 1)
        send = reduce_pairs(y.reshape(el * cw, self.hidden), index, pair_w, static=True)
        return self._return_rows(send, None, None, cw, h.slot, h.dtype)
