"""Typed contracts of the MoE pipeline: route -> dispatch -> apply -> combine.

Every object that crosses a stage boundary is a frozen dataclass defined here. There are no
positional tuples and no ``hasattr`` probing: the format of a dispatch output is its type.

Who applies the top-k routing weights is fixed per format (see ``CombineInput`` subclasses):

========== ============================================ ===========================================
format     experts output (combine input)               combine
========== ============================================ ===========================================
STANDARD   ``[T, H]`` weighted, summed over the local     identity (plus an all-reduce over the EP
           experts of each token                          group when experts are split)
EP_NORMAL  ``[R, H]`` weighted, summed over the local     sends rows back to their source rank and
           experts of each received token                 sums them (no weights)
EP_MASKED  ``[E_local, C, H]`` **unweighted**             weights with the sender's TopK, sums
FUSED      the fused backend returns the final ``[T, H]``
========== ============================================ ===========================================
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, ClassVar, Optional

import torch

__all__ = [
    "Format",
    "WireDtype",
    "QuantScheme",
    "Activation",
    "TopK",
    "QuantizedActivations",
    "DispatchOutput",
    "StandardDispatch",
    "EPNormalDispatch",
    "EPMaskedDispatch",
    "CombineInput",
    "StandardCombine",
    "EPNormalCombine",
    "EPMaskedCombine",
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_GROUP",
    "NVFP4_BLOCK",
    "E2M1_GRID",
    "dequantize_fp8_per_token_group",
    "dequantize_nvfp4",
    "masked_dispatch_unchecked",
]

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_GROUP = 128  # channels per activation scale group (and weight block edge)
NVFP4_BLOCK = 16  # elements per NVFP4 block scale
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # the e2m1 magnitudes, by 3-bit code


# What the quantized wire data mean: the decoders live with the data they decode, so that
# ``QuantizedActivations.dequantize`` needs nothing above this module; the encoders are in
# ``moe_core.quant``, which re-exports these (docs/decisions.md).


def dequantize_fp8_per_token_group(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    h = q.shape[-1]
    qg = torch.nn.functional.pad(q.float(), (0, (-h) % group)).unflatten(-1, (-1, group))
    return (qg * scale.unsqueeze(-1)).flatten(-2)[..., :h]


def dequantize_nvfp4(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    codes = torch.stack([lo, hi], dim=-1).flatten(-2).long()
    grid = E2M1_GRID.to(packed.device)
    values = grid[codes & 0x7] * torch.where(codes >= 8, -1.0, 1.0)
    vb = values.unflatten(-1, (-1, NVFP4_BLOCK)) * scale.float().unsqueeze(-1)
    gs = torch.as_tensor(global_scale, dtype=torch.float32, device=packed.device)
    return vb.flatten(-2) / gs


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:  # "bf16", not "WireDtype.BF16", in messages and JSON
        return self.value


class Format(_StrEnum):
    """What the experts receive from the dispatcher."""

    STANDARD = "standard"
    EP_NORMAL = "ep_normal"
    EP_MASKED = "ep_masked"
    FUSED = "fused"  # the backend owns dispatch + apply + combine


class WireDtype(_StrEnum):
    """Dtype of dispatched activations ("on the wire")."""

    BF16 = "bf16"  # unquantized, in the layer's activation dtype (bf16, fp16 or fp32)
    FP8 = "fp8"  # e4m3fn, per-token 128-channel group scales (fp32; power-of-two if ue8m0)
    INT8 = "int8"  # per-token symmetric scale
    NVFP4 = "nvfp4"  # e2m1 packed 2 per byte + e4m3 scale per 16 elements + fp32 global scale


# read as globals by per-call code: on Python 3.11 looking an enum member up on its class costs ~20x that
_BF16, _NVFP4 = WireDtype.BF16, WireDtype.NVFP4
# read as globals by TopK.ids_int64. Dynamo folds is_dynamo_compiling() to True (it knows the function by
# identity); eager, it is one frame returning False, where is_compiling() is two and reads a flag that is True
# beyond dynamo only while export or a compile session runs Python for real, on tensors whose version
# counters move as in eager code (docs/decisions.md, entry 61)
_dynamo_tracing = torch.compiler.is_dynamo_compiling
# The capture query, asked only off the default stream: CUDA cannot capture the legacy default stream (and
# torch.cuda.graph refuses to), whose handle torch gives as 0, and the handle is a thread-local read where the
# query is a CUDA call, 0.3-0.6 us on the lent hosts: the dearest check of a low-latency dispatch (entry 64).
# Both are torch's bindings without the Python frame of torch.cuda's wrappers; a CPU-only torch has neither
# (nor CUDA tensors, so they are never asked there).
if hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a CUDA (or ROCm) build
    _current_raw_stream, _cuda_capturing = torch._C._cuda_getCurrentRawStream, torch._C._cuda_isCurrentStreamCapturing
else:
    def _current_raw_stream(device: int) -> int:
        return 1  # (no handle to read: ask the query)

    _cuda_capturing = torch.cuda.is_current_stream_capturing


def _set_fields(obj: Any, **fields: Any) -> None:
    """A frozen dataclass's fields as its generated ``__init__`` writes them (``object.__setattr__`` each): what
    the hand-written ``__init__``s below do while dynamo traces, which cannot trace their ``__dict__`` update
    in torch 2.11 (``torch.compile(fullgraph=True)`` of a layer broke). Eager, the update is 2-2.5x cheaper."""
    for name, value in fields.items():
        object.__setattr__(obj, name, value)


class QuantScheme(_StrEnum):
    """How the expert weights are stored (and, for W8A8 schemes, how activations are quantized).

    Weight tensors per scheme (``E`` local experts, ``N1 = 2 * I``):

    - ``unquantized``: ``w13 [E, N1, H]``, ``w2 [E, H, I]`` in the params dtype.
    - ``fp8_block``: fp8 e4m3fn weights; ``w13_scale [E, ceil(N1/128), ceil(H/128)]`` and
      ``w2_scale [E, ceil(H/128), ceil(I/128)]`` fp32 (dequant = q * scale per 128x128 block);
      activations quantized per token and 128-channel group.
    - ``fp8_per_token``: fp8 e4m3fn weights; ``w13_scale [E, N1]``, ``w2_scale [E, H]`` fp32 per
      output channel (dequant = q * scale[row], the int8_w8a8 layout); activations fp8 e4m3fn per
      token, dynamic (``scale = max(amax_row, 1e-4) / 448``). This is AITER's ``per_Token`` and
      torch's rowwise ``_scaled_grouped_mm``. The FP8 wire (1x128 groups) is not this format:
      such input is requantized per token.
    - ``int8_w8a8``: int8 weights; ``w13_scale [E, N1]``, ``w2_scale [E, H]`` fp32 per output
      channel; activations int8 per token, dynamic.
    - ``w4a4``: int4 values in [-7, 7] stored one per int8; per-channel scales as int8_w8a8;
      activations int4 per token, dynamic.
    - ``nvfp4``: packed e2m1 ``w13 [E, N1, H/2]`` uint8 (even element in the low nibble),
      ``w13_scale [E, N1, H/16]`` e4m3fn block scales, ``w13_scale_2 [E]`` fp32 global dequant
      scale (dequant = e2m1 * block_scale * scale_2); same for w2. Activations are quantized to
      NVFP4 with the global scale ``a13_global_scale`` / ``a2_global_scale`` (fp32 [E]).
    """

    UNQUANTIZED = "unquantized"
    FP8_BLOCK = "fp8_block"
    FP8_PER_TOKEN = "fp8_per_token"
    INT8_W8A8 = "int8_w8a8"
    W4A4 = "w4a4"
    NVFP4 = "nvfp4"


class Activation(_StrEnum):
    """Gated activation of the first GEMM's output ``[gate | up]``: ``act(gate) * up``.

    ``swiglu_oai`` (gpt-oss) is clamped: ``g = clamp(gate, max=limit)``,
    ``(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with ``MoEConfig.swiglu_alpha`` /
    ``swiglu_limit``; the weights keep the core layout (gate rows, then up rows; gpt-oss's
    interleaved checkpoints are de-interleaved at load).
    """

    SILU = "silu"  # SwiGLU
    GELU = "gelu"  # gated GELU (tanh approximation off)
    SWIGLU_OAI = "swiglu_oai"  # gpt-oss's clamped SwiGLU


# --------------------------------------------------------------------------- routing


@dataclass(frozen=True)
class TopK:
    """Routing of T tokens to K experts each.

    ``weights``: float32 ``[T, K]``; ``ids``: int32 ``[T, K]``; id ``-1`` means "no expert"
    (padding, or an expert on another rank after a local remap) and its weight is ignored.

    Routers that return bf16/fp16 weights or int64 ids (Hugging Face's do) may pass them as they
    are: they are converted once, here, to float32 / int32 (one cast each; no copy when already
    in the contract's dtypes). Every stage after this sees only float32 / int32, except a
    dispatcher whose library takes int64 ids (``ids_int64``: the router's own tensor, no cast).
    """

    weights: torch.Tensor
    ids: torch.Tensor
    # for ids_int64: the router's int64 ids, the sum of both tensors' versions when this TopK was made,
    # and whether they are on a CUDA device (where a graph may be captured)
    _int64: Optional[torch.Tensor] = field(default=None, init=False, repr=False, compare=False)
    _int64_versions: int = field(default=0, init=False, repr=False, compare=False)
    _int64_cuda: bool = field(default=False, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        w, i = self.weights, self.ids
        if not isinstance(w, torch.Tensor) or not isinstance(i, torch.Tensor):
            raise TypeError("TopK.weights and TopK.ids must be torch.Tensor")
        if w.dtype in (torch.bfloat16, torch.float16):
            w = w.float()
            object.__setattr__(self, "weights", w)
        if i.dtype == torch.int64:
            source, i = i, i.to(torch.int32)
            object.__setattr__(self, "ids", i)
            object.__setattr__(self, "_int64", source)
            object.__setattr__(self, "_int64_versions", source._version + i._version)
            object.__setattr__(self, "_int64_cuda", source.is_cuda)
        if w.dtype != torch.float32:
            raise TypeError(f"TopK.weights must be torch.float32 (or bf16/fp16, converted), got {w.dtype}")
        if i.dtype != torch.int32:
            raise TypeError(f"TopK.ids must be torch.int32 (or int64, converted), got {i.dtype}")
        if w.dim() != 2 or w.shape != i.shape:
            raise ValueError(
                f"TopK.weights and TopK.ids must both be [T, K]; got {tuple(w.shape)} and "
                f"{tuple(i.shape)}"
            )
        if w.device != i.device:
            raise ValueError(f"TopK.weights on {w.device} but TopK.ids on {i.device}")

    def ids_int64(self, cast: bool = True) -> Optional[torch.Tensor]:
        """The ids as int64 (``torch.topk``'s dtype, which DeepEP's kernels take): the router's own
        tensor when this TopK was made from int64 ids and neither tensor changed in place since (no
        cast: a kernel launch fewer per call; docs/decisions.md "int64 ids kept"), else ``ids``
        cast (``cast=False``: ``None`` instead). While a CUDA graph is captured (or dynamo traces)
        it is always the cast, so that replays read ``ids``, which graph users update in place."""
        # on a dispatcher's hot path: two counter reads, a compare and two queries, the capture query only off
        # the default stream (docs/decisions.md, entries 61 and 64). Version counters only grow, so the sum is
        # unchanged only if both are.
        source = self._int64
        if (source is not None and not _dynamo_tracing()  # (first: traced, a version is a data-dependent value)
                and source._version + self.ids._version == self._int64_versions
                and not (self._int64_cuda and _current_raw_stream(-1) and _cuda_capturing())):
            return source
        return self.ids.to(torch.int64) if cast else None

    @property
    def num_tokens(self) -> int:
        return self.ids.shape[0]

    @property
    def top_k(self) -> int:
        return self.ids.shape[1]


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True, init=False)
class QuantizedActivations:
    """A tensor of activations that may be quantized, travelling with its scales.

    Leading dims are free (``[T, H]`` for token lists, ``[E, C, H]`` for masked slabs); ``H`` is
    the logical hidden size (``data`` has ``H/2`` bytes per row for NVFP4).

    - ``bf16``: ``data`` in the activation dtype; no scale.
    - ``fp8``: ``data`` e4m3fn; ``scale`` fp32 ``[..., H/128]``; ``ue8m0`` marks power-of-two scales.
    - ``int8``: ``data`` int8; ``scale`` fp32 ``[..., 1]``.
    - ``nvfp4``: ``data`` uint8 ``[..., H/2]``; ``scale`` e4m3fn ``[..., H/16]``;
      ``global_scale`` fp32 scalar tensor; dequant = e2m1 * scale / global_scale.
    """

    data: torch.Tensor
    dtype: WireDtype = WireDtype.BF16
    scale: Optional[torch.Tensor] = None
    global_scale: Optional[torch.Tensor] = None
    ue8m0: bool = False

    def __init__(self, data: torch.Tensor, dtype: WireDtype = WireDtype.BF16, scale: Optional[torch.Tensor] = None,
                 global_scale: Optional[torch.Tensor] = None, ue8m0: bool = False) -> None:
        # the fields above, written once into __dict__: one is made per dispatch, and the frozen
        # dataclass's generated __init__ (object.__setattr__ per field) cost twice as much
        # (docs/decisions.md "deepep's low-latency calls")
        if dtype is _BF16:
            if scale is not None:
                raise ValueError("bf16 activations carry no scale")
        elif scale is None:
            raise ValueError(f"{dtype} activations need a scale tensor")
        elif dtype is _NVFP4 and global_scale is None:
            raise ValueError("nvfp4 activations need a global_scale")
        if _dynamo_tracing():  # (see _set_fields)
            _set_fields(self, data=data, dtype=dtype, scale=scale, global_scale=global_scale, ue8m0=ue8m0)
        else:
            self.__dict__.update(data=data, dtype=dtype, scale=scale, global_scale=global_scale, ue8m0=ue8m0)

    @property
    def shape(self) -> torch.Size:
        """Logical shape (``H`` unpacked for NVFP4)."""
        if self.dtype is WireDtype.NVFP4:
            return self.data.shape[:-1] + (self.data.shape[-1] * 2,)
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dequantize(self, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.dtype is WireDtype.BF16:
            return self.data.to(out_dtype)
        if self.dtype is WireDtype.FP8:
            return dequantize_fp8_per_token_group(self.data, self.scale).to(out_dtype)
        if self.dtype is WireDtype.INT8:
            return (self.data.float() * self.scale).to(out_dtype)
        return dequantize_nvfp4(self.data, self.scale, self.global_scale).to(out_dtype)


# --------------------------------------------------------------------------- dispatch outputs


@dataclass(frozen=True)
class DispatchOutput:
    """Base of what a dispatcher hands to the experts. ``format`` names the subclass."""

    format: ClassVar[Format]


@dataclass(frozen=True)
class StandardDispatch(DispatchOutput):
    """All T tokens; ``topk`` ids are local expert ids, -1 for experts on other ranks."""

    format: ClassVar[Format] = Format.STANDARD
    hidden: QuantizedActivations  # [T, H]
    topk: TopK  # [T, K], local ids


@dataclass(frozen=True)
class EPNormalDispatch(DispatchOutput):
    """Tokens received from every rank, each once per destination rank: ``[R, H]``.

    ``topk`` ids are local (-1 and weight 0 for experts elsewhere). ``expert_counts`` int32
    ``[E_local]`` on the device counts the (token, local expert) pairs per expert;
    ``expert_counts_host`` is an optional host copy (a tuple of ints) when the dispatcher
    already had to sync. ``handle`` is the dispatcher's own state for ``combine``.
    """

    format: ClassVar[Format] = Format.EP_NORMAL
    hidden: QuantizedActivations  # [R, H]
    topk: TopK  # [R, K], local ids
    expert_counts: torch.Tensor  # int32 [E_local]
    expert_counts_host: Optional[tuple[int, ...]] = None
    handle: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True, init=False)
class EPMaskedDispatch(DispatchOutput):
    """DeepEP low-latency layout: ``[E_local, C, H]`` slab, ``masked_m`` valid rows per expert.

    Rows at and beyond ``masked_m[e]`` hold garbage and must not be read. ``topk`` is the
    sender's original routing (global ids), kept for ``combine``.
    """

    format: ClassVar[Format] = Format.EP_MASKED
    hidden: QuantizedActivations  # [E_local, C, H]
    masked_m: torch.Tensor  # int32 [E_local]
    topk: TopK  # [T, K] of this rank's own tokens, global ids
    handle: Any = field(default=None, compare=False, repr=False)

    def __init__(self, hidden: QuantizedActivations, masked_m: torch.Tensor, topk: TopK, handle: Any = None) -> None:
        # the fields above, written once into __dict__, as QuantizedActivations does: one is made per
        # low-latency (decode) dispatch; the generated frozen __init__ cost 2.5x (docs/decisions.md, entry 61)
        if _dynamo_tracing():  # (see _set_fields)
            _set_fields(self, hidden=hidden, masked_m=masked_m, topk=topk, handle=handle)
        else:
            self.__dict__.update(hidden=hidden, masked_m=masked_m, topk=topk, handle=handle)


_new = object.__new__


def masked_dispatch_unchecked(data: torch.Tensor, dtype: WireDtype, scale: Optional[torch.Tensor], ue8m0: bool,
                              masked_m: torch.Tensor, topk: TopK, handle: Any) -> EPMaskedDispatch:
    """``EPMaskedDispatch(QuantizedActivations(data, dtype, scale, None, ue8m0), masked_m, topk, handle)``
    without ``QuantizedActivations``' checks, for a dispatcher whose results are valid by construction: the
    caller guarantees ``dtype`` is bf16 with ``scale=None`` or FP8 / INT8 with a scale (no NVFP4: no global
    scale here). The same objects, equal to the checked ones, at about the cost of one (both ``__dict__``s
    filled directly; one is made per low-latency dispatch, after its launch: docs/decisions.md entry 64).
    While dynamo traces, the public constructors build them."""
    if _dynamo_tracing():
        return EPMaskedDispatch(QuantizedActivations(data, dtype, scale, None, ue8m0), masked_m, topk, handle)
    hidden = _new(QuantizedActivations)
    f = hidden.__dict__
    f["data"], f["dtype"], f["scale"], f["global_scale"], f["ue8m0"] = data, dtype, scale, None, ue8m0
    out = _new(EPMaskedDispatch)
    f = out.__dict__
    f["hidden"], f["masked_m"], f["topk"], f["handle"] = hidden, masked_m, topk, handle
    return out


# --------------------------------------------------------------------------- combine inputs


@dataclass(frozen=True)
class CombineInput:
    """Base of what the experts hand back to the dispatcher's ``combine``.

    ``weighted`` says whether the top-k weights are already applied (the contract per format).
    """

    format: ClassVar[Format]
    weighted: ClassVar[bool]


@dataclass(frozen=True)
class StandardCombine(CombineInput):
    format: ClassVar[Format] = Format.STANDARD
    weighted: ClassVar[bool] = True
    hidden: torch.Tensor  # [T, H], weighted, summed over local experts


@dataclass(frozen=True)
class EPNormalCombine(CombineInput):
    format: ClassVar[Format] = Format.EP_NORMAL
    weighted: ClassVar[bool] = True
    hidden: torch.Tensor  # [R, H], weighted, summed over local experts
    handle: Any = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class EPMaskedCombine(CombineInput):
    format: ClassVar[Format] = Format.EP_MASKED
    weighted: ClassVar[bool] = False
    hidden: torch.Tensor  # [E_local, C, H], unweighted
    topk: TopK  # the sender's routing, as in EPMaskedDispatch
    handle: Any = field(default=None, compare=False, repr=False)


DISPATCH_TYPES: dict[Format, type[DispatchOutput]] = {
    Format.STANDARD: StandardDispatch,
    Format.EP_NORMAL: EPNormalDispatch,
    Format.EP_MASKED: EPMaskedDispatch,
}
COMBINE_TYPES: dict[Format, type[CombineInput]] = {
    Format.STANDARD: StandardCombine,
    Format.EP_NORMAL: EPNormalCombine,
    Format.EP_MASKED: EPMaskedCombine,
}
