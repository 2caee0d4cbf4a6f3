"""Pure-PyTorch emulation of the AITER ops moe-plugin-rocm calls (TEST SUPPORT ONLY).

Follows ``shared/reference/vendor-apis.md`` section 5 (API) and section 8 (recipe), and the
AITER sources (``aiter/fused_moe.py``, ``aiter/ops/shuffle.py``):

- ``shuffle_weight(x, layout=(16, 16))``: the exact view/permute of AITER, sets ``is_shuffled``.
- ``fused_moe(...)``: ``expert_mask`` maps global ids to local experts through ``cumsum - 1``
  (masked-off experts contribute zero); only the first ``num_local_tokens`` rows are computed
  (the other output rows are never written: NaN here); weights are read as preshuffled only
  when ``w1.is_shuffled`` is set (otherwise the plain layout, like AITER's preshuffle-off path,
  which is exactly how a lost flag garbles the output); FP8 quant types quantize the activations
  before each GEMM in the weights' FP8 flavour, which must be the architecture's (fnuz on gfx942,
  OCP fn on gfx950); all accumulation in fp32.
"""

from __future__ import annotations

import enum
import types
from typing import Optional

import torch
import torch.nn.functional as F

ARCH_FP8 = {"gfx942": torch.float8_e4m3fnuz, "gfx950": torch.float8_e4m3fn}


class ActivationType(enum.IntEnum):
    No = -1
    Silu = 0
    Gelu = 1
    Swiglu = 2


class QuantType(enum.IntEnum):
    No = 0
    per_Tensor = 1
    per_Token = 2
    per_1x32 = 3
    per_1x128 = 4
    per_128x128 = 5


# ----------------------------------------------------------------------------- shuffle


def _shuffle_view(shape: torch.Size, elem_size: int, layout=(16, 16)) -> tuple[int, ...]:
    IN, IK = layout
    BK = IK * 2
    K = 16 // elem_size
    BN = IN
    if shape[-2] % BN or shape[-1] % BK:
        raise AssertionError(f"shuffle_weight needs rows % {BN} == 0 and columns % {BK} == 0, got {tuple(shape)}")
    return (-1, shape[-2] // BN, BN, shape[-1] // BK, BK // K, K)


def shuffle_weight(x: torch.Tensor, layout=(16, 16), use_int4: bool = False) -> torch.Tensor:
    """AITER's ``shuffle_weight`` (non-int4 path): view, permute (0, 1, 3, 4, 2, 5), flag."""
    if use_int4:
        raise NotImplementedError("emulation covers the non-int4 layout only")
    x_type = x.dtype
    x_ = x.view(_shuffle_view(x.shape, x.element_size(), layout))
    x_ = x_.permute(0, 1, 3, 4, 2, 5).contiguous()
    x_ = x_.view(*x.shape).view(x_type)
    x_.is_shuffled = True
    return x_


def unshuffle_weight(x: torch.Tensor, layout=(16, 16)) -> torch.Tensor:
    """Inverse of ``shuffle_weight`` (what the preshuffled kernels read back)."""
    v = _shuffle_view(x.shape, x.element_size(), layout)
    # the shuffled tensor, viewed in permuted order (-1, N/16, K/32, 32/P, 16, P)
    x_ = x.contiguous().view(v[0], v[1], v[3], v[4], v[2], v[5])
    return x_.permute(0, 1, 4, 2, 3, 5).contiguous().view(x.shape)


# ----------------------------------------------------------------------------- quantization


def _fp8_quant(x: torch.Tensor, fp8: torch.dtype, group: Optional[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic quantization of fp32 ``x [M, N]``: per token (``group=None``) or per 1 x group.
    ``s = amax / fp8max`` with zero scales set to 1; clamp before the cast (torch makes overflow NaN)."""
    fmax = torch.finfo(fp8).max
    M, N = x.shape
    g = N if group is None else group
    xg = x.view(M, N // g, g)
    s = xg.abs().amax(dim=-1, keepdim=True) / fmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    q = (xg / s).clamp(-fmax, fmax).to(fp8)
    return q.view(M, N), s.view(M, N // g)


def _fp8_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    M, N = q.shape
    g = N // s.shape[-1]
    return (q.float().view(M, N // g, g) * s.float().view(M, -1, 1)).view(M, N)


def _dequant_weight_blocks(w: torch.Tensor, scale: torch.Tensor, block: int = 128) -> torch.Tensor:
    """``w [E, N, K]`` fp8 with ``scale [E, ceil(N/128), ceil(K/128)]`` -> fp32."""
    E, N, K = w.shape
    s = scale.float().repeat_interleave(block, dim=1)[:, :N].repeat_interleave(block, dim=2)[:, :, :K]
    return w.float() * s


# ----------------------------------------------------------------------------- fused_moe


def fused_moe(
    hidden_states: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    topk_weight: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_mask: Optional[torch.Tensor] = None,
    activation=ActivationType.Silu,
    quant_type=QuantType.No,
    doweight_stage1: bool = False,
    w1_scale: Optional[torch.Tensor] = None,
    w2_scale: Optional[torch.Tensor] = None,
    a1_scale: Optional[torch.Tensor] = None,
    a2_scale: Optional[torch.Tensor] = None,
    block_size_M=None,
    num_local_tokens: Optional[torch.Tensor] = None,
    moe_sorting_dispatch_policy=0,
    dtype: Optional[torch.dtype] = None,
    hidden_pad=0,
    intermediate_pad=0,
    bias1=None,
    bias2=None,
    *,
    _arch: str,
) -> torch.Tensor:
    activation = ActivationType(activation)
    quant_type = QuantType(quant_type)
    if quant_type is QuantType.per_128x128:  # AITER's quant_remap
        quant_type = QuantType.per_1x128
    M, topk = topk_ids.shape
    E, two_inter, H = w1.shape
    inter = w2.shape[2]
    if two_inter != 2 * inter or w2.shape[:2] != (E, H):
        raise AssertionError(f"Invalid MoE weight: {w1.shape=} {w2.shape=}")
    if topk_ids.dtype != torch.int32 or topk_weight.dtype != torch.float32:
        raise AssertionError("fused_moe takes int32 topk_ids and fp32 topk_weight")
    if hidden_states.shape[0] != M or hidden_states.shape[1] != H:
        raise AssertionError(f"hidden_states {tuple(hidden_states.shape)} does not match ids [{M}, K] and H={H}")
    dtype = hidden_states.dtype if dtype is None else dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise AssertionError(f"Fused_moe unsupported out dtype: {dtype}")
    if activation not in (ActivationType.Silu, ActivationType.Gelu):
        raise NotImplementedError(f"emulation: activation {activation}")

    n = M if num_local_tokens is None else int(num_local_tokens.reshape(-1)[0])
    if not 0 <= n <= M:
        raise AssertionError(f"num_local_tokens={n} outside [0, {M}]")
    out = torch.full((M, H), float("nan"), dtype=dtype, device=hidden_states.device)  # rows >= n: never written

    # -- moe_sorting: global ids -> local experts through the mask
    ids = topk_ids[:n].long()
    global_e = E if expert_mask is None else expert_mask.numel()
    if n and (ids.min() < 0 or ids.max() >= global_e):
        raise AssertionError(f"topk_ids outside [0, {global_e}) (AITER cannot take -1 ids)")
    if expert_mask is None:
        local, valid = ids, torch.ones_like(ids, dtype=torch.bool)
    else:
        if expert_mask.dtype != torch.int32:
            raise AssertionError("expert_mask must be int32")
        mask = expert_mask.long()
        if int(mask.sum()) != E:
            raise AssertionError(f"expert_mask marks {int(mask.sum())} local experts, w1 has {E}")
        local = (torch.cumsum(mask, 0) - 1)[ids]
        valid = mask[ids] == 1

    # -- weights, in the layout the flag says
    if getattr(w1, "is_shuffled", False):
        w1, w2 = unshuffle_weight(w1), unshuffle_weight(w2)
    fp8 = ARCH_FP8[_arch]
    if quant_type is QuantType.No:
        if w1.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise AssertionError(f"QuantType.No with {w1.dtype} weights")
        W1, W2 = w1.float(), w2.float()
        group = "none"
    elif quant_type in (QuantType.per_Token, QuantType.per_1x128):
        if w1.dtype != fp8 or w2.dtype != fp8:
            raise AssertionError(f"{_arch} computes FP8 as {fp8}; got weights {w1.dtype}/{w2.dtype}")
        if quant_type is QuantType.per_Token:
            if w1_scale is None or w1_scale.shape != (E, two_inter, 1) or w2_scale.shape != (E, H, 1):
                raise AssertionError("per_Token needs w1_scale [E, 2I, 1] and w2_scale [E, H, 1]")
            W1, W2 = w1.float() * w1_scale.float(), w2.float() * w2_scale.float()
            group = None
        else:
            want1 = (E, -(-two_inter // 128), -(-H // 128))
            want2 = (E, -(-H // 128), -(-inter // 128))
            if w1_scale is None or tuple(w1_scale.shape) != want1 or tuple(w2_scale.shape) != want2:
                raise AssertionError(f"per_1x128 needs w1_scale {want1} and w2_scale {want2}")
            W1, W2 = _dequant_weight_blocks(w1, w1_scale), _dequant_weight_blocks(w2, w2_scale)
            group = 128
    else:
        raise NotImplementedError(f"emulation: quant type {quant_type}")

    # -- stage 1 input: quantized dynamically unless given in the FP8 flavour with its a1_scale
    x = hidden_states[:n]
    if group == "none":
        a = x.float()
    elif x.dtype == fp8:
        if a1_scale is None:
            raise AssertionError("a1_scale must be provided for quantized input for fused_moe")
        a = _fp8_dequant(x, a1_scale[:n])
    elif x.dtype in (torch.float8_e4m3fn, torch.float8_e4m3fnuz):
        raise AssertionError(f"{_arch} takes FP8 activations as {fp8}, got {x.dtype}")
    else:
        a = _fp8_dequant(*_fp8_quant(x.float(), fp8, group))

    act = F.silu if activation is ActivationType.Silu else F.gelu
    acc = torch.zeros(n, H, dtype=torch.float32, device=x.device)
    for e in range(E):
        sel = valid & (local == e)
        rows, slots = sel.nonzero(as_tuple=True)
        if rows.numel() == 0:
            continue
        gu = a[rows] @ W1[e].t()
        h = act(gu[:, :inter]) * gu[:, inter:]
        w = topk_weight[:n][rows, slots].float()[:, None]
        if doweight_stage1:
            h = h * w
        if group != "none":  # stage-2 input is quantized again
            h = _fp8_dequant(*_fp8_quant(h, fp8, group))
        y = h @ W2[e].t()
        if not doweight_stage1:
            y = y * w
        acc.index_add_(0, rows, y)
    out[:n] = acc.to(dtype)
    return out


def torch_moe_reference(x, w1, w2, weights, ids, activation=ActivationType.Silu, act_quant=None) -> torch.Tensor:
    """Straightforward fp32 loop from the documentation (token by token, slot by slot).

    ``act_quant(v) -> v'`` (fp32 ``[N]`` to its quantize-dequantize round trip) is applied to the
    input of each GEMM, as the FP8 recipe does."""
    inter = w2.shape[2]
    act = F.silu if ActivationType(activation) is ActivationType.Silu else F.gelu
    q = act_quant or (lambda v: v)
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        xt = q(x[t].float())
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            gate = w1[e, :inter].float() @ xt
            up = w1[e, inter:].float() @ xt
            out[t] += float(weights[t, k]) * (w2[e].float() @ q(act(gate) * up))
    return out


def make_modules(arch: str) -> dict[str, types.ModuleType]:
    """Fake ``aiter`` package modules for ``sys.modules``, emulating ``arch``."""
    import functools

    root = types.ModuleType("aiter")
    root.__path__ = []  # a package
    root.ActivationType = ActivationType
    root.QuantType = QuantType
    root.EMULATED_ARCH = arch
    fm = types.ModuleType("aiter.fused_moe")
    fm.fused_moe = functools.partial(fused_moe, _arch=arch)
    ops = types.ModuleType("aiter.ops")
    ops.__path__ = []
    shuffle = types.ModuleType("aiter.ops.shuffle")
    shuffle.shuffle_weight = shuffle_weight
    root.fused_moe = fm
    root.ops = ops
    ops.shuffle = shuffle
    return {"aiter": root, "aiter.fused_moe": fm, "aiter.ops": ops, "aiter.ops.shuffle": shuffle}
