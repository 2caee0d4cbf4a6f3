"""MoE on grouped GEMMs (Hopper), FP8 block-scaled or bf16: the pipeline around ``cutlass.lib`` and ``deepgemm.lib``.

Token list (STANDARD / EP_NORMAL): group the (token, slot) pairs by expert -> each token's row
quantized once (FP8; bf16: copied) and written to the rows of its slots -> GEMM1 -> SiLU(gate) * up
(FP8: re-quantized) -> GEMM2 -> weighted sum of each token's slots. Masked slab (EP_MASKED): the
slab already holds each expert's rows contiguously, so GEMM1 -> activation -> GEMM2 run on it in
place of the grouping.

Everything is shape-driven: the grouping by expert (``triton_ops.expert_rows``, two Triton
launches) and the GEMMs' per-expert row counts and pointers stay on the device, so no call syncs
with the host and the pipeline can be captured in a CUDA graph. ``gemm`` is the grouped GEMM and
the layout it wants (``GroupedGemm``): ``CUTLASS`` (FP8; fp32 or bf16 GEMM1 output, rows packed),
``CUTLASS_BF16`` (CUTLASS's bf16 kernels: bf16 output, rows packed), ``DEEPGEMM`` (DeepGEMM's FP8
kernel: bf16 output, each expert's rows from a multiple of 128, activation scales MN-major),
``DEEPGEMM_BF16`` (DeepGEMM's bf16 kernel, same rows), or the torch emulation for CI without a GPU
(``REFERENCE``, in any of these layouts).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

from moe_plugin_cuda.triton import kernels
from moe_plugin_cuda.triton.launch import launch
from moe_plugin_cuda.triton.ops import FP8, cdiv, expert_rows, pow2, quantize_fp8_groups

GemmFn = Callable[..., None]
BLOCK = 128


_WORKSPACE: dict[tuple, int] = {}


def cutlass_gemm(a, a_scale, b, b_scale, d, m_sizes, row_start, variant: Optional[int] = None) -> None:
    """``d[rows of g] = (a * a_scale)[rows of g] @ (b[g] * b_scale[g]).T`` for every expert g, where
    the rows of g are ``row_start[g] .. row_start[g] + m_sizes[g]`` (device int tensors).

    FP8: a e4m3 [R, K], a_scale fp32 [R, K/128]; b e4m3 [G, N, K], b_scale fp32 [G, N/128, K/128];
    d bf16 or fp32 [R, N]. bf16: a, b and d bf16, ``a_scale`` and ``b_scale`` None. Rows of ``d``
    outside every group are not written. ``variant``: which of the library's kernels
    (``cutlass_lib.VARIANTS``; it must read a's dtype and write d's), default
    ``cutlass_lib.DEFAULT_VARIANTS`` (FP8: GEMM1's for an fp32 d, GEMM2's for bf16; bf16: GEMM1's).
    A "swiglu" variant (bf16, b's rows gate/up interleaved: ``weights.interleave_gate_up``) writes
    ``silu(gate) * up`` instead, ``d`` bf16 [R, N/2].
    """
    from moe_plugin_cuda.cutlass import lib as cutlass_lib

    operands = "bf16" if a.dtype == torch.bfloat16 else "fp8"
    outs = ("fp32",) if d.dtype == torch.float32 else ("bf16", "swiglu")
    bf16 = operands == "bf16"
    if (a_scale is None, b_scale is None) != (bf16, bf16) or b.dtype != a.dtype:
        raise ValueError(f"CUTLASS grouped GEMM: FP8 (e4m3) operands with scales or bf16 ones without, not "
                         f"{a.dtype} x {b.dtype} with{'out' if a_scale is None else ''} scales")
    if variant is None:
        variant = cutlass_lib.DEFAULT_VARIANTS[operands][0 if outs[0] == "fp32" or bf16 else 1]
    if not 0 <= variant < len(cutlass_lib.VARIANTS) or cutlass_lib.VARIANTS[variant][0] != operands \
            or cutlass_lib.VARIANTS[variant][3] not in outs:
        raise ValueError(f"no CUTLASS variant {variant} reading {a.dtype} and writing {d.dtype}: see "
                         "cutlass_lib.VARIANTS")
    G, N, Kd = b.shape
    swiglu = cutlass_lib.VARIANTS[variant][3] == "swiglu"
    d_cols = N // 2 if swiglu else N
    if d.shape[1] != d_cols or (swiglu and N % 16):  # (the SwiGLU epilogue stores 8 outputs at a time)
        raise ValueError(f"CUTLASS variant {variant} ({cutlass_lib.VARIANTS[variant][3]}) writes {d_cols} columns "
                         f"from a {N}-row weight{', N a multiple of 16' if swiglu else ''}, d has {d.shape[1]}")
    lib = cutlass_lib.library()
    dev = a.device
    start = row_start.to(torch.int64)
    experts = torch.arange(G, device=dev, dtype=torch.int64)
    nb, kb = cdiv(N, BLOCK), cdiv(Kd, BLOCK)
    problems = torch.stack([m_sizes.to(torch.int32), torch.full_like(m_sizes, N, dtype=torch.int32),
                            torch.full_like(m_sizes, Kd, dtype=torch.int32)], 1).contiguous()
    ptrs = torch.stack([
        a.data_ptr() + start * Kd * a.element_size(),
        b.data_ptr() + experts * N * Kd * b.element_size(),
        d.data_ptr() + start * d_cols * d.element_size(),
    ] + ([] if a_scale is None else [  # the bf16 kernels read no scales
        a_scale.data_ptr() + start * kb * 4,
        b_scale.data_ptr() + experts * nb * kb * 4,
    ])).contiguous()
    scale_ptrs = (None, None) if a_scale is None else (ptrs[3].data_ptr(), ptrs[4].data_ptr())
    key = (G, variant, dev.index)
    if key not in _WORKSPACE:  # host-side size query (depends on the SM count), once per shape
        _WORKSPACE[key] = int(lib.moe_cutlass_workspace_size(G, variant))
    ws = torch.empty(_WORKSPACE[key], dtype=torch.uint8, device=dev)
    rc = lib.moe_cutlass_grouped_gemm(
        G, problems.data_ptr(), None, ptrs[0].data_ptr(), ptrs[1].data_ptr(), ptrs[2].data_ptr(), *scale_ptrs,
        ws.data_ptr(), ws.numel(), torch.cuda.current_stream(dev).cuda_stream, variant, 0)
    if rc:
        raise RuntimeError(f"CUTLASS grouped GEMM failed ({rc}): {lib.moe_cutlass_last_error().decode()}")


def reference_gemm(a, a_scale, b, b_scale, d, m_sizes, row_start, variant: Optional[int] = None) -> None:
    """``cutlass_gemm`` (FP8, or bf16 with ``a_scale`` and ``b_scale`` None) in torch
    (float32 math on the dequantized operands; reads the row counts on the host, which the real ones
    never do; every variant computes the same, a "swiglu" one then ``silu(gate) * up`` of the fp32
    result): what CI runs the pipeline against."""
    from moe_core.plugin_api import quant
    from moe_plugin_cuda.cutlass import lib as cutlass_lib

    G, N, Kd = b.shape
    swiglu = variant is not None and cutlass_lib.VARIANTS[variant][3] == "swiglu"
    for g, (m, s) in enumerate(zip(m_sizes.tolist(), row_start.tolist(), strict=True)):
        if m and a_scale is None:
            y = a[s:s + m].float() @ b[g].float().T
        elif m:
            x = quant.dequantize_fp8_per_token_group(a[s:s + m], a_scale[s:s + m])
            w = b[g].float() * b_scale[g].float().repeat_interleave(BLOCK, 0)[:N].repeat_interleave(BLOCK, 1)[:, :Kd]
            y = x @ w.T
        if m:
            d[s:s + m] = (torch.nn.functional.silu(y[:, 0::2]) * y[:, 1::2] if swiglu else y).to(d.dtype)


def deepgemm_gemm(a, a_scale, b, b_scale, d, m_sizes, row_start, variant: Optional[int] = None) -> None:
    """``cutlass_gemm``'s contract on DeepGEMM's SM90 kernel (``deepgemm.lib``), with its layout:
    ``row_start`` multiples of 128 and rows up to the next expert's start writable, ``a_scale`` a
    ``[R, K/128]`` view of MN-major storage (``a_scale.t()`` contiguous), ``d`` bf16. A multicast
    variant that cannot run N columns (``deepgemm_lib.runnable``) runs as variant 0 (no multicast)."""
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    G, N, Kd = b.shape
    R = a.shape[0]
    variant = _deepgemm_variant(variant, N, deepgemm_lib.FP8_VARIANTS, deepgemm_lib.DEFAULT_FP8_VARIANTS)
    if d.dtype != torch.bfloat16 or a_scale.stride() != (1, R) or R % deepgemm_lib.ROW_ALIGN:
        raise ValueError("DeepGEMM's layout: bf16 d, MN-major a_scale, rows a multiple of 128")
    psum = _psum(m_sizes, row_start)
    _deepgemm_run("moe_dg_fp8_grouped_gemm", a.device, variant, a.data_ptr(), a_scale.data_ptr(), b.data_ptr(),
                  b_scale.data_ptr(), d.data_ptr(), psum.data_ptr(), R, N, Kd, G)


def deepgemm_bf16_gemm(a, a_scale, b, b_scale, d, m_sizes, row_start, variant: Optional[int] = None) -> None:
    """``d[rows of g] = a[rows of g] @ b[g].T`` (bf16 operands, fp32 accumulation, bf16 ``d``) on
    DeepGEMM's SM90 bf16 kernel, in ``deepgemm_gemm``'s row layout; ``a_scale`` and ``b_scale`` are
    None. ``variant`` indexes ``deepgemm_lib.BF16_VARIANTS``."""
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    G, N, Kd = b.shape
    R = a.shape[0]
    variant = _deepgemm_variant(variant, N, deepgemm_lib.BF16_VARIANTS, deepgemm_lib.DEFAULT_BF16_VARIANTS)
    if a_scale is not None or b_scale is not None or {a.dtype, b.dtype, d.dtype} != {torch.bfloat16} \
            or R % deepgemm_lib.ROW_ALIGN:
        raise ValueError("DeepGEMM's bf16 layout: bf16 a, b and d, no scales, rows a multiple of 128")
    psum = _psum(m_sizes, row_start)
    _deepgemm_run("moe_dg_bf16_grouped_gemm", a.device, variant, a.data_ptr(), b.data_ptr(), d.data_ptr(),
                  psum.data_ptr(), R, N, Kd, G)


def _deepgemm_variant(variant: Optional[int], n: int, variants: tuple, defaults: tuple[int, int]) -> int:
    """The kernel to launch: ``variant`` (default: GEMM1's default), or variant 0 where its multicast
    cannot run N = ``n`` columns."""
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    variant = defaults[0] if variant is None else variant
    if not 0 <= variant < len(variants):
        raise ValueError(f"no DeepGEMM variant {variant} among {len(variants)}: see deepgemm.lib")
    return variant if deepgemm_lib.runnable(variant, n, variants) else 0


def _deepgemm_run(entry: str, device: torch.device, *args) -> None:
    """Call the library's ``entry`` on the current stream; a nonzero return raises with its error text."""
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    lib = deepgemm_lib.library(torch.cuda.get_device_properties(device).multi_processor_count)
    rc = getattr(lib, entry)(*args, torch.cuda.current_stream(device).cuda_stream)
    if rc:
        raise RuntimeError(f"DeepGEMM {entry} failed ({rc}): {lib.moe_dg_last_error().decode()}")


def _psum(m_sizes: torch.Tensor, row_start: torch.Tensor) -> torch.Tensor:
    """DeepGEMM's psum layout: each expert's end row, padded to the kernel's group count."""
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    ends = (row_start + m_sizes).to(torch.int32)
    return torch.cat([ends, ends[-1:].expand(deepgemm_lib.MAX_EXPERTS - ends.numel())])


class GroupedGemm(NamedTuple):
    """A grouped GEMM (``cutlass_gemm``'s contract) and the layout it reads and writes."""
    run: GemmFn
    row_align: int = 1  # each expert's rows start on a multiple of this
    mn_major_scales: bool = False  # activation scales stored [K/128, R] (viewed as [R, K/128])
    gemm1_dtype: torch.dtype = torch.float32  # GEMM1's output, before SiLU x up and FP8


CUTLASS = GroupedGemm(cutlass_gemm)
CUTLASS_BF16 = GroupedGemm(cutlass_gemm, gemm1_dtype=torch.bfloat16)  # bf16 operands: bf16 GEMM1 output
REFERENCE = GroupedGemm(reference_gemm)
# bf16 GEMM1 output (the kernel writes bf16 only): h is rounded to bf16 before its FP8 requantization,
# as SGLang's DeepGEMM runner does
DEEPGEMM = GroupedGemm(deepgemm_gemm, 128, True, torch.bfloat16)
DEEPGEMM_BF16 = GroupedGemm(deepgemm_bf16_gemm, 128, False, torch.bfloat16)


def grouped_gemm(name: str, fp8: bool) -> GroupedGemm:
    """The grouped GEMM a table entry's ``path`` names ("cutlass" or "deepgemm"), for FP8 block or bf16."""
    return {("cutlass", True): CUTLASS, ("cutlass", False): CUTLASS_BF16,
            ("deepgemm", True): DEEPGEMM, ("deepgemm", False): DEEPGEMM_BF16}[name, fp8]


def _scales(rows: int, groups: int, mn_major: bool, device) -> torch.Tensor:
    """fp32 scales ``[rows, groups]``, stored row-major or MN-major (``.t()`` contiguous)."""
    if mn_major:
        return torch.empty((groups, rows), dtype=torch.float32, device=device).t()
    return torch.empty((rows, groups), dtype=torch.float32, device=device)


def silu_mul_quant(d1: torch.Tensor, code_dtype: torch.dtype = FP8, mn_major: bool = False,
                   rows_used: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GEMM1's ``[R, 2I]`` output (gate | up) -> (``silu(gate) * up`` as codes [R, I], fp32 scales
    [R, I/128]), per row and 128-column group (``code_dtype`` fp32 keeps the unrounded values: CI).
    ``rows_used`` ([1] int32 on the device): rows at and past it are left undefined."""
    R, two_i = d1.shape
    inter = two_i // 2
    g = cdiv(inter, BLOCK)
    q = torch.empty((R, inter), dtype=code_dtype, device=d1.device)
    s = _scales(R, g, mn_major, d1.device)
    if R:
        groups = min(8, pow2(g))
        launch(kernels._silu_mul_quant_kernel, (R, cdiv(g, groups)),
            d1, q, s, rows_used if rows_used is not None else d1, inter, d1.stride(0), q.stride(0), s.stride(0),
            s.stride(1), GROUPS=groups, BOUNDED=rows_used is not None)
    return q, s


def silu_mul(d1: torch.Tensor, out_dtype: torch.dtype, interleaved: bool = False,
             rows_used: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GEMM1's ``[R, 2I]`` output (gate | up, or gate/up pairs when ``interleaved``) -> ``silu(gate) * up``
    ``[R, I]`` in ``out_dtype`` (the bf16 pipeline's GEMM2 input); rows at and past ``rows_used``
    ([1] int32 on the device) are left undefined."""
    R, two_i = d1.shape
    inter = two_i // 2
    h = torch.empty((R, inter), dtype=out_dtype, device=d1.device)
    if R:
        block = min(1024, pow2(inter))
        launch(kernels._silu_mul_kernel, (R, cdiv(inter, block)),
            d1, h, rows_used if rows_used is not None else d1, inter, d1.stride(0), h.stride(0), BLOCK=block,
            INTERLEAVED=interleaved, BOUNDED=rows_used is not None)
    return h


def _gemm1_dtype(gemm: GroupedGemm, variant: Optional[int]) -> torch.dtype:
    """GEMM1's output dtype: with packed rows (CUTLASS's layout) the named kernel's D (the FP8 kernels
    write fp32 or bf16: a bf16 h is rounded before its FP8 requantization, as on DeepGEMM), otherwise
    ``gemm.gemm1_dtype``."""
    from moe_plugin_cuda.cutlass import lib as cutlass_lib

    if variant is None or gemm.row_align != 1:
        return gemm.gemm1_dtype
    return torch.float32 if cutlass_lib.VARIANTS[variant][3] == "fp32" else torch.bfloat16


def _fuses_swiglu(gemm: GroupedGemm, variant: Optional[int]) -> bool:
    """Whether GEMM1's kernel writes ``silu(gate) * up`` itself: a "swiglu" CUTLASS variant (packed rows)."""
    from moe_plugin_cuda.cutlass import lib as cutlass_lib

    return variant is not None and gemm.row_align == 1 and cutlass_lib.VARIANTS[variant][3] == "swiglu"


def _experts(a, a_scale, w13, w13_scale, w2, w2_scale, m_sizes, row_start, gemm: GroupedGemm, out_dtype, code_dtype, *,
             fp8_block: bool, variants: Optional[tuple[int, int]] = None, w13_interleaved: bool = False,
             sorted_rows: bool = False):
    """GEMM1 -> activation (+ FP8 requantization with ``fp8_block``) -> GEMM2 over rows grouped by expert:
    ``[R, H]`` -> ``[R, H]``. ``sorted_rows``: experts in order, each from ``row_start`` (``expert_rows``'
    layout, int32), so the activation pass stops after the last expert's last row instead of at R (the
    bound for any routing: 10% more rows at deepseek T=16384); rows past it, like the padding rows
    within experts, only feed GEMM2 output rows that no slot reads. A GEMM1 kernel with the SwiGLU
    epilogue (bf16, w13 interleaved) writes h itself: no activation pass."""
    R = a.shape[0]
    v1, v2 = variants or (None, None)
    if _fuses_swiglu(gemm, v1):
        if fp8_block or not w13_interleaved:
            raise ValueError(f"CUTLASS variant {v1} (SwiGLU epilogue) needs bf16 w13 with gate/up interleaved")
        h, h_scale = torch.empty((R, w13.shape[1] // 2), dtype=a.dtype, device=a.device), None
        gemm.run(a, None, w13, None, h, m_sizes, row_start, variant=v1)
    else:
        d1 = torch.empty((R, w13.shape[1]), dtype=_gemm1_dtype(gemm, v1), device=a.device)
        gemm.run(a, a_scale, w13, w13_scale, d1, m_sizes, row_start, variant=v1)
        used = row_start[-1:] + m_sizes[-1:] if sorted_rows else None
        if not fp8_block:
            h, h_scale = silu_mul(d1, a.dtype, w13_interleaved, used), None
        else:
            h, h_scale = silu_mul_quant(d1, code_dtype, gemm.mn_major_scales, used)
    d2 = torch.empty((R, w2.shape[1]), dtype=out_dtype, device=a.device)
    gemm.run(h, h_scale, w2, w2_scale, d2, m_sizes, row_start, variant=v2)
    return d2


def quantize_into_rows(hidden: torch.Tensor, a_scale: Optional[torch.Tensor], topk_ids: torch.Tensor,
                       row_of_slot: torch.Tensor, num_experts: int, code_dtype: torch.dtype = FP8,
                       rows: Optional[int] = None, mn_major: bool = False,
                       quantize: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Each token's row, quantized per 128-column group (or its codes and scales as they came, with
    ``a_scale``; or as it came, without ``quantize``), written to the row of each of its slots
    (``row_of_slot``; slots with ids outside [0, E) are skipped and their rows left unwritten):
    ``[T, H]`` -> (codes ``[rows, H]``, fp32 scales ``[rows, H/128]``, MN-major storage with
    ``mn_major``; None without ``quantize``), ``rows`` = T*K by default. One read of the token
    instead of a quantizer's pass and a gather of K copies."""
    T, H = hidden.shape
    top_k, g = topk_ids.shape[1], cdiv(H, BLOCK)
    rows = T * top_k if rows is None else rows
    codes = hidden.dtype if a_scale is not None or not quantize else code_dtype
    a = torch.empty((rows, H), dtype=codes, device=hidden.device)
    s = _scales(rows, g, mn_major, hidden.device) if quantize else None
    if T:
        src, dst = hidden, a
        if a_scale is not None and hidden.element_size() == 1:  # FP8 codes: copied as bytes
            src, dst = hidden.view(torch.uint8), a.view(torch.uint8)
        s_out = a if s is None else s  # (dummies where no scale is read or written)
        src_scale = s_out if a_scale is None else a_scale
        groups = min(8, pow2(g))
        launch(kernels._quantize_into_rows_kernel, (T, cdiv(g, groups)),
            src, src_scale, dst, s_out, topk_ids.to(torch.int32).contiguous(), row_of_slot, num_experts, H,
            src.stride(0), src_scale.stride(0), dst.stride(0), s_out.stride(0), s_out.stride(1), TOP_K=top_k,
            GROUPS=groups, QUANTIZE=quantize and a_scale is None, SCALES=quantize)
    return a, s


def fused_experts(hidden: torch.Tensor, a_scale: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
                  w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, *, fp8_block: bool, routed_scaling_factor: float, out_dtype: torch.dtype,
                  gemm: GroupedGemm = CUTLASS, code_dtype: torch.dtype = FP8,
                  variants: Optional[tuple[int, int]] = None, w13_interleaved: bool = False) -> torch.Tensor:
    """Weighted SiLU MoE over a token list: ``[T, H] -> [T, H]``; ``topk_ids`` local, -1 skipped.

    ``fp8_block``: ``hidden`` in the compute dtype, or FP8 codes with ``a_scale`` [T, H/128]; w13 [E, 2I, H]
    (checkpoint gate | up rows), w2 [E, H, I], e4m3 with 128x128 block scales. bf16 (not ``fp8_block``;
    ``w13_scale`` None, ``gemm`` ``CUTLASS_BF16`` or ``DEEPGEMM_BF16``): hidden and weights bf16, w13 in the
    checkpoint layout or gate/up interleaved (``w13_interleaved``). ``variants``: the kernels of GEMM1
    and GEMM2 (indices into ``cutlass_lib.VARIANTS``, ``deepgemm_lib.FP8_VARIANTS`` or
    ``deepgemm_lib.BF16_VARIANTS``).
    """
    T, H = hidden.shape
    E, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.empty((T, H), dtype=out_dtype, device=hidden.device)
    if T == 0:
        return out
    counts, row_start, row_of_slot, rows = expert_rows(topk_ids, E, gemm.row_align)
    a, a_s = quantize_into_rows(hidden, a_scale, topk_ids, row_of_slot, E, code_dtype, rows, gemm.mn_major_scales,
                                quantize=fp8_block)
    y = _experts(a, a_s, w13, w13_scale, w2, w2_scale, counts, row_start, gemm, out_dtype, code_dtype,
                 fp8_block=fp8_block, variants=variants, w13_interleaved=w13_interleaved, sorted_rows=True)
    block_h = min(1024, pow2(H))
    launch(kernels._moe_reduce_kernel, (T, cdiv(H, block_h)),
        y, topk_ids.to(torch.int32).contiguous(), out, H, float(routed_scaling_factor), E, row_of_slot,
        topk_weights.to(torch.float32).contiguous(), TOP_K=top_k, BLOCK_H=block_h, MAPPED=True)
    return out


def masked_experts(hidden: torch.Tensor, a_scale: Optional[torch.Tensor], masked_m: torch.Tensor,
                   w13: torch.Tensor, w2: torch.Tensor, w13_scale: torch.Tensor, w2_scale: torch.Tensor, *,
                   routed_scaling_factor: float, out_dtype: torch.dtype, gemm: GroupedGemm = CUTLASS,
                   code_dtype: torch.dtype = FP8, variants: Optional[tuple[int, int]] = None) -> torch.Tensor:
    """EP_MASKED slab ``[E, C, H]`` (rows ``< masked_m[e]`` valid) -> unweighted expert outputs
    ``[E, C, H]`` times ``routed_scaling_factor``; rows past ``masked_m`` are left undefined. Rows
    packed (``gemm.row_align`` 1, row-major scales): the CUTLASS kernels."""
    if gemm.row_align != 1 or gemm.mn_major_scales:
        raise ValueError("the masked slab runs a packed-row GEMM (CUTLASS)")
    E, C, H = hidden.shape
    flat = hidden.reshape(E * C, H).contiguous()
    if a_scale is None:
        flat, a_scale = quantize_fp8_groups(flat)
    else:
        a_scale = a_scale.reshape(E * C, -1)
    rows = masked_m.to(torch.int64)
    start = torch.arange(E, device=hidden.device, dtype=torch.int64) * C
    y = _experts(flat, a_scale.contiguous(), w13, w13_scale, w2, w2_scale, rows, start, gemm, out_dtype, code_dtype,
                 fp8_block=True, variants=variants)
    if routed_scaling_factor != 1.0:
        y.mul_(routed_scaling_factor)
    return y.view(E, C, H)
