"""Pure-PyTorch emulation of the torch_npu ops moe-plugin-npu calls (TEST SUPPORT ONLY).

Follows ``vendor-apis.md`` section 6 (API) and section 8 (recipe). Where the documentation is
silent, the choice is marked INFERRED and explained. All accumulation is in float32.

Rows an op leaves undefined on the hardware (grouped-matmul rows past the last group, expanded
rows of dropped routing slots) are filled with NaN here, so a caller that reads them fails.
"""

from __future__ import annotations

import importlib.machinery
import types
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

ACL_FORMAT_ND = 2
ACL_FORMAT_FRACTAL_NZ = 29
GMM_MAX_GROUPS = 1024


# --------------------------------------------------------------------------- quantization helpers


def q_per_row(x: torch.Tensor, qmax: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``s = amax|x| / qmax`` per row; ``q = round_half_even(x / s).clamp(+-qmax)`` (int8 values).

    INFERRED: an all-zero row (s = 0) gives q = 0 (the docs do not say; any q dequantizes to 0).
    """
    xf = x.float()
    s = xf.abs().amax(dim=-1)
    safe = torch.where(s > 0, s, torch.ones_like(s)) / qmax
    q = torch.round(xf / safe.unsqueeze(-1)).clamp(-qmax, qmax)
    q = torch.where((s > 0).unsqueeze(-1), q, torch.zeros_like(q))
    return q.to(torch.int8), torch.where(s > 0, s / qmax, torch.zeros_like(s))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int4 values (one per int8, last dim % 8 == 0) -> int32, 8 per word, low nibble first (INFERRED order)."""
    if q.shape[-1] % 8:
        raise ValueError(f"int4 packing needs the last dim to be a multiple of 8, got {q.shape[-1]}")
    nib = (q.to(torch.int32) & 0xF).unflatten(-1, (-1, 8))
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return _pack_words(nib, shifts)


def _pack_words(nib: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    words = torch.zeros(nib.shape[:-1], dtype=torch.int32, device=nib.device)
    for j in range(8):
        words |= nib[..., j] << shifts[j]
    return words


def unpack_int4(w: torch.Tensor) -> torch.Tensor:
    """Inverse of ``pack_int4``: int32 ``[..., n/8]`` -> int8 values in [-8, 7] ``[..., n]``."""
    if w.dtype != torch.int32:
        raise TypeError(f"packed int4 must be int32, got {w.dtype}")
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=w.device)
    nib = (w.unsqueeze(-1) >> shifts) & 0xF
    nib = torch.where(nib >= 8, nib - 16, nib)
    return nib.flatten(-2).to(torch.int8)


# --------------------------------------------------------------------------- ops


def npu_format_cast(t: torch.Tensor, acl_format: int) -> torch.Tensor:
    """NZ (29) / ND (2) are storage layouts of the NPU; on CPU the cast is a no-op."""
    if acl_format not in (ACL_FORMAT_ND, ACL_FORMAT_FRACTAL_NZ):
        raise ValueError(f"unsupported acl format {acl_format}")
    return t


def npu_dynamic_quant(x: torch.Tensor, *, smooth_scales: Optional[torch.Tensor] = None,
                      group_index: Optional[torch.Tensor] = None, dst_type: Optional[torch.dtype] = None):
    """``scale = rowmax|x*s| / 127``; ``y = round(x*s / scale)`` int8. With ``dst_type=torch.quint4x2``:
    qmax 7, 8 values packed per int32 (low nibble first, INFERRED). Returns ``(y, scale fp32 x.shape[:-1])``."""
    if group_index is not None:
        raise NotImplementedError("group_index is not emulated")
    xs = x.float() if smooth_scales is None else x.float() * smooth_scales.float()
    if dst_type is None or dst_type == torch.int8:
        return q_per_row(xs, 127)
    if dst_type == torch.quint4x2:
        q, s = q_per_row(xs, 7)
        return pack_int4(q), s
    raise ValueError(f"unsupported dst_type {dst_type}")


def npu_swiglu(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``silu(A) * B`` with ``(A, B)`` the two halves of ``x`` along ``dim``."""
    a, b = x.float().chunk(2, dim=dim)
    return (F.silu(a) * b).to(x.dtype)


def _group_bounds(group_list: torch.Tensor, group_list_type: int, num_groups: int) -> list[tuple[int, int]]:
    gl = group_list.tolist()
    if len(gl) != num_groups:
        raise ValueError(f"group_list has {len(gl)} entries for {num_groups} weight groups")
    if group_list_type == 1:
        ends, acc = [], 0
        for c in gl:
            if c < 0:
                raise ValueError("group_list counts must be >= 0")
            acc += c
            ends.append(acc)
    elif group_list_type == 0:
        ends = gl
        if any(b < a for a, b in zip([0] + ends[:-1], ends, strict=True)):
            raise ValueError("group_list (cumsum) must be non-decreasing")
    else:
        raise NotImplementedError(f"group_list_type={group_list_type} is not emulated")
    starts = [0] + ends[:-1]
    return list(zip(starts, ends, strict=True))


def npu_grouped_matmul(x: Sequence[torch.Tensor], weight: Sequence[torch.Tensor], *, bias=None, scale=None,
                       offset=None, antiquant_scale=None, antiquant_offset=None, per_token_scale=None,
                       group_list: Optional[torch.Tensor] = None, activation_input=None,
                       activation_quant_scale=None, activation_quant_offset=None, split_item: int = 0,
                       group_type: Optional[int] = None, group_list_type: int = 0, act_type: int = 0,
                       output_dtype: Optional[torch.dtype] = None, tuning_config=None) -> list[torch.Tensor]:
    """MoE form only: ``x=[A [M, K]]``, ``weight=[W [E, K, N]]`` (right operand), ``group_type=0``,
    ``split_item`` 2 or 3, ``group_list`` int64 ``[E]`` (type 0 cumsum, 1 counts).

    - float: ``y[a:b] = A[a:b] @ W[e]`` in ``A``'s dtype;
    - int8 x int8: ``y = (A @ W[e]) * scale[e][n] * per_token_scale[m]`` in ``output_dtype``;
    - int4 (int32-packed A ``[M, K/8]`` and W ``[E, K, N/8]``): as int8 after unpacking.

    Rows past the last group are not written (NaN here).
    """
    if len(x) != 1 or len(weight) != 1:
        raise NotImplementedError("only the single-tensor MoE form is emulated")
    if group_type != 0 or split_item not in (2, 3):
        raise NotImplementedError(f"group_type={group_type}, split_item={split_item} not emulated (MoE form: 0, 2|3)")
    if any(v is not None for v in (bias, offset, antiquant_scale, antiquant_offset, activation_input,
                                   activation_quant_scale, activation_quant_offset)) or act_type != 0:
        raise NotImplementedError("bias/offset/antiquant/activation fusion are not emulated")
    a, w = x[0], weight[0]
    if group_list is None or group_list.dtype != torch.int64 or group_list.dim() != 1:
        raise TypeError("group_list must be a 1-D int64 tensor")
    if w.dim() != 3:
        raise ValueError(f"weight must be [E, K, N], got {tuple(w.shape)}")
    num_groups = w.shape[0]
    if num_groups > GMM_MAX_GROUPS:
        raise ValueError(f"at most {GMM_MAX_GROUPS} groups")
    quantized = a.dtype in (torch.int8, torch.int32)
    if a.dtype == torch.int32:  # int4 packed
        a_val, w_val = unpack_int4(a), unpack_int4(w)
    else:
        a_val, w_val = a, w
    if a_val.shape[-1] != w_val.shape[1]:
        raise ValueError(f"x is [M, {a_val.shape[-1]}] but weight is [E, {w_val.shape[1]}, N]")
    if quantized:
        if w_val.dtype != torch.int8:
            raise TypeError("quantized x needs int8/int4 weights")
        if scale is None or per_token_scale is None:
            raise ValueError("quantized grouped matmul needs scale and per_token_scale")
        out_dtype = output_dtype or torch.bfloat16
        if out_dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"per-token quantized output must be bf16 or fp16, got {out_dtype}")
        sc, pts = scale[0].float(), per_token_scale[0].float()
        if sc.shape != (num_groups, w_val.shape[2]) or pts.shape != (a_val.shape[0],):
            raise ValueError(f"scale must be [E, N] and per_token_scale [M]; got {tuple(sc.shape)}, {tuple(pts.shape)}")
    else:
        if a.dtype != w.dtype:
            raise TypeError(f"x is {a.dtype}, weight is {w.dtype}")
        out_dtype = output_dtype or a.dtype
    m, n = a_val.shape[0], w_val.shape[2]
    y = torch.full((m, n), float("nan"), dtype=out_dtype, device=a.device)
    for e, (lo, hi) in enumerate(_group_bounds(group_list, group_list_type, num_groups)):
        if hi > m:
            raise ValueError(f"group {e} ends at row {hi} > M = {m}")
        if hi == lo:
            continue
        acc = a_val[lo:hi].float() @ w_val[e].float()  # exact for int8 products below 2**24
        if quantized:
            acc = acc * sc[e] * pts[lo:hi, None]
        y[lo:hi] = acc.to(out_dtype)
    return [y]


def _expert_range(active_expert_range: Sequence[int], expert_num: int) -> tuple[int, int]:
    if active_expert_range:
        lo, hi = int(active_expert_range[0]), int(active_expert_range[1])
    else:
        lo, hi = 0, expert_num
    if not 0 <= lo < hi:
        raise ValueError(f"bad active_expert_range {list(active_expert_range)}")
    return lo, hi


def npu_moe_init_routing_v2(x: torch.Tensor, expert_idx: torch.Tensor, *, scale: Optional[torch.Tensor] = None,
                            offset=None, active_num: int = -1, expert_capacity: int = -1, expert_num: int = -1,
                            drop_pad_mode: int = 0, expert_tokens_num_type: int = 0,
                            expert_tokens_num_flag: bool = False, quant_mode: int = -1,
                            active_expert_range: Sequence[int] = (), row_idx_type: int = 0):
    """Expand ``x [N, H]`` to one row per (token, k) slot, sorted by expert (stable).

    Returns ``(expanded_x [N*K, H], expanded_row_idx [N*K] int32, expert_tokens int64, expanded_scale [N*K])``.

    - Slot ``f = n*K + k`` (row-major: v2 takes no ``row_idx``; INFERRED from the section 8 recipe
      ``stable argsort of expert_idx.flatten()``); ``expanded_x[i] = x[n]`` of the i-th sorted slot.
    - ``expanded_row_idx[f] = i`` (source slot -> expanded row), what ``npu_moe_finalize_routing``
      reads as ``expanded_src_to_dst_row`` (SGLang passes it straight through). Slots whose expert is
      outside ``active_expert_range`` are dropped: ``-1`` (INFERRED), and rows past the kept ones
      are undefined (NaN / 0 for int8).
    - ``expert_tokens_num_type`` 0: cumsum, 1: counts, over the active range.
    - ``quant_mode`` 1: dynamic per-row int8 of the expanded rows (``expanded_scale`` = the scales);
      -1 with ``scale [N]``: ``expanded_scale`` = ``scale`` expanded like ``x`` (INFERRED).
    """
    if drop_pad_mode != 0 or expert_capacity != -1:
        raise NotImplementedError("only drop_pad_mode=0 (dropless) is emulated")
    if row_idx_type != 0:
        raise NotImplementedError("only row_idx_type=0 is emulated")
    if expert_tokens_num_type not in (0, 1):
        raise NotImplementedError("expert_tokens_num_type 2 (key-value) is not emulated")
    if offset is not None:
        raise NotImplementedError("offset is not emulated")
    if expert_idx.dtype != torch.int32 or expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0]:
        raise TypeError("expert_idx must be int32 [N, K] matching x [N, H]")
    n, k = expert_idx.shape
    lo, hi = _expert_range(active_expert_range, expert_num)
    flat = expert_idx.reshape(-1).long()
    kept = (flat >= lo) & (flat < hi)
    key = torch.where(kept, flat, torch.full_like(flat, hi))  # dropped slots sort last
    order = torch.argsort(key, stable=True)
    num_kept = int(kept.sum())
    total = n * k if active_num < 0 else min(active_num, n * k)
    src_token = order // k
    if quant_mode == 1:
        q, s = q_per_row(x.float(), 127)
        data, row_scale = q, s
    elif quant_mode == -1:
        data, row_scale = x, (None if scale is None else scale.float().reshape(-1))
    else:
        raise NotImplementedError(f"quant_mode={quant_mode} is not emulated")
    fill = float("nan") if data.dtype.is_floating_point else 0
    expanded_x = torch.full((total,) + tuple(x.shape[1:]), fill, dtype=data.dtype, device=x.device)
    expanded_x[:num_kept] = data[src_token[:num_kept]]
    expanded_row_idx = torch.full((n * k,), -1, dtype=torch.int32, device=x.device)
    expanded_row_idx[order[:num_kept]] = torch.arange(num_kept, dtype=torch.int32, device=x.device)
    counts = torch.bincount(flat[kept] - lo, minlength=hi - lo).to(torch.int64)
    tokens = counts if expert_tokens_num_type == 1 else torch.cumsum(counts, 0)
    expanded_scale = None
    if row_scale is not None:
        expanded_scale = torch.full((total,), float("nan"), dtype=torch.float32, device=x.device)
        expanded_scale[:num_kept] = row_scale[src_token[:num_kept]]
    return expanded_x, expanded_row_idx, (tokens if expert_tokens_num_flag else None), expanded_scale


def npu_moe_finalize_routing(expanded_permuted_rows: torch.Tensor, skip1: Optional[torch.Tensor],
                             skip2: Optional[torch.Tensor], bias: Optional[torch.Tensor], scales: torch.Tensor,
                             expanded_src_to_dst_row: torch.Tensor, export_for_source_row: Optional[torch.Tensor],
                             drop_pad_mode: int = 0) -> torch.Tensor:
    """``out[i] = skip1 + skip2 + sum_k scales[i,k] * (rows[src2dst[slot(i,k)]] + bias[expert[i,k]])``.

    ``slot(i, k) = i + k*N`` for ``drop_pad_mode`` 0/1 (the documented formula) and ``i*K + k`` for
    2/3 (row-major; INFERRED: SGLang pairs ``init_routing_v2`` with ``drop_pad_mode=2``). Slots with
    ``src2dst = -1`` (dropped by ``init_routing_v2``) contribute nothing (INFERRED).
    """
    n, k = scales.shape
    src2dst = expanded_src_to_dst_row.long()
    if src2dst.numel() != n * k:
        raise ValueError(f"expanded_src_to_dst_row has {src2dst.numel()} entries, expected N*K = {n * k}")
    if drop_pad_mode in (0, 1):
        idx = src2dst.view(k, n).t()  # [N, K]
    elif drop_pad_mode in (2, 3):
        idx = src2dst.view(n, k)
    else:
        raise ValueError(f"bad drop_pad_mode {drop_pad_mode}")
    valid = idx >= 0
    rows = expanded_permuted_rows.float()
    gathered = rows[idx.clamp(min=0)]  # [N, K, H]
    if bias is not None:
        gathered = gathered + bias.float()[export_for_source_row.long().clamp(min=0)]
    w = torch.where(valid, scales.float(), torch.zeros_like(scales, dtype=torch.float32))
    gathered = torch.where(valid.unsqueeze(-1), gathered, torch.zeros_like(gathered))  # undefined rows: not read
    out = (gathered * w.unsqueeze(-1)).sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.float()
    return out.to(expanded_permuted_rows.dtype)


# --------------------------------------------------------------------------- module


class _NpuDeviceModule(types.ModuleType):
    """``torch_npu.npu``: the device queries the probes make; set by ``install``."""

    def __init__(self, soc: str, count: int) -> None:
        super().__init__("torch_npu.npu")
        self.soc, self.count = soc, count

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def get_device_name(self, device=None) -> str:
        if self.count < 1:
            raise RuntimeError("no NPU")
        return self.soc


def make_module(soc: str = "Ascend910_9392", device_count: int = 1) -> types.ModuleType:
    mod = types.ModuleType("torch_npu")
    mod.__spec__ = importlib.machinery.ModuleSpec("torch_npu", loader=None)
    mod.__version__ = "2.14.0+emulated"
    mod.EMULATED = True
    mod.npu = _NpuDeviceModule(soc, device_count)
    for fn in (npu_format_cast, npu_dynamic_quant, npu_swiglu, npu_grouped_matmul, npu_moe_init_routing_v2,
               npu_moe_finalize_routing):
        setattr(mod, fn.__name__, fn)
    return mod
