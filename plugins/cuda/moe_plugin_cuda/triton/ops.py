"""Python launchers of the Triton fused-MoE kernels (see ``triton.kernels`` for the algorithm).

Everything here is shape-driven: grids come from upper bounds known from the shapes alone, so
no launcher reads a device value on the host and the whole pipeline can be captured in a CUDA
graph.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from triton.runtime import driver as triton_driver
from triton.tools.tensor_descriptor import TensorDescriptor

from moe_plugin_cuda.triton import decode, kernels, replay
from moe_plugin_cuda.triton import launch as launch_mod
from moe_plugin_cuda.triton.launch import cdiv, launch, pow2
from moe_plugin_cuda.triton.replay import Programs
from moe_plugin_cuda.workspace import Layouts, layout

FP8 = torch.float8_e4m3fn


SMALL_ALIGN_MAX = 1024  # slots up to which one program does the whole alignment (one launch)
# chunk counts every place program re-reads (64 KB, from L2): bounds the programs for large E
PLACE_MAX_COUNTS = 16384
PLACE_MAX_PROGRAMS = 256


def _int32_ids(ids: torch.Tensor) -> torch.Tensor:
    flat = ids.reshape(-1)
    return flat if flat.dtype == torch.int32 else flat.to(torch.int32)


def _bucket(flat: torch.Tensor, num_experts: int, block_m: int, out: torch.Tensor, *, expert_ids=None,
            post_pad=None, counts=None, starts=None, tile_starts=None, max_blocks: int = 1, cursor=None,
            quant=None) -> None:
    """Launch the alignment kernels: ``align_block_size``'s outputs, or (``counts`` given) ``expert_rows``'.
    ``cursor``: the one-program kernel's ``[expert_lanes(E)]`` int32 scratch (allocated here if None).
    ``quant``: (x [T, H], codes [T, H] e4m3, scales [T, H/128] fp32) to quantize as ``quantize_fp8_groups`` does,
    in the one-program kernel's launch (more programs beside it): up to ``SMALL_ALIGN_MAX`` slots only (the caller
    quantizes beyond)."""
    numel = flat.numel()
    dev = flat.device
    row_map = counts is not None
    tails = tile_starts is not None
    dummy = out
    e_pow2 = expert_lanes(num_experts)
    ptrs = tuple(t if t is not None else dummy for t in (expert_ids, post_pad, counts, starts, tile_starts))
    if numel <= SMALL_ALIGN_MAX:
        if cursor is None:
            cursor = torch.empty(e_pow2, dtype=torch.int32, device=dev)
        x, q, s = quant if quant is not None else (out, out, out)
        H = x.shape[1] if quant is not None else 0
        groups = min(8, pow2(cdiv(H, 128))) if quant is not None else 1
        chunks = cdiv(cdiv(H, 128), groups)
        launch(kernels._align_small_kernel, (1 + x.shape[0] * chunks if quant is not None else 1,), flat, numel, cursor,
               out, *ptrs, max_blocks, x, q, s, H, x.stride(0), q.stride(0), s.stride(0), chunks, E=num_experts,
               E_POW2=e_pow2, BLOCK_M=block_m, NUMEL_POW2=max(16, pow2(numel)),
               BLOCKS_TILE=64 if e_pow2 <= 256 else 16, ROW_MAP=row_map, TAILS=tails, QUANT=quant is not None,
               GROUPS=groups)
        return
    if quant is not None:
        raise ValueError(f"quant: the tokens are quantized in the one-program alignment only (up to "
                         f"{SMALL_ALIGN_MAX} slots), got {numel} slots")
    # one place program per chunk: as many as fill a GPU, as few as keep the counts matrix small;
    # chunks of at most 4096 slots (16 a thread at 8 warps: no spills), more programs beyond that
    progs = max(1, min(PLACE_MAX_PROGRAMS, PLACE_MAX_COUNTS // e_pow2))
    chunk = min(4096, max(256, pow2(cdiv(numel, progs))))
    n_chunks = cdiv(numel, chunk)
    chunk_counts = torch.empty((n_chunks, e_pow2), dtype=torch.int32, device=dev)
    cursor = torch.empty((n_chunks, e_pow2), dtype=torch.int32, device=dev)
    warps = 8 if chunk >= 2048 else 4
    launch(kernels._align_count_kernel, (n_chunks,), flat, numel, chunk_counts, E=num_experts, E_POW2=e_pow2,
           CHUNK=chunk, num_warps=warps)
    blocks_per_prog = cdiv(max_blocks, n_chunks)
    launch(
        kernels._align_place_kernel, (n_chunks,), flat, numel, chunk_counts, n_chunks, cursor, out, *ptrs, max_blocks,
        blocks_per_prog, E=num_experts, E_POW2=e_pow2, BLOCK_M=block_m, CHUNK=chunk, ROWS=max(2, min(pow2(n_chunks), 8192 // e_pow2)),
        BLOCKS_TILE=max(2, min(pow2(blocks_per_prog), 64 if e_pow2 <= 256 else 16)),
        E_SUB=max(2, pow2(cdiv(e_pow2, n_chunks))), ROW_MAP=row_map, TAILS=tails, num_warps=8)


def expert_lanes(num_experts: int) -> int:
    """The alignment kernels' ``E_POW2``: per-expert lanes, and the entries of the one-program kernel's
    cursor scratch (``_bucket``'s ``cursor``)."""
    return max(16, pow2(num_experts))


def align_sizes(numel: int, num_experts: int, block_m: int) -> tuple[int, int]:
    """(max_blocks, rows of sorted_ids) of ``align_block_size`` for ``numel`` slots: a bound for any routing."""
    # at most min(numel, E) buckets are non-empty, each padded by < block_m; with tails an expert has
    # cdiv(count, block_m) M-blocks all the same, over fewer rows
    max_blocks = max(1, cdiv(numel + min(numel, num_experts) * (block_m - 1), block_m))
    return max_blocks, max_blocks * block_m


class Alignment(NamedTuple):
    """``align_block_size``'s result: the GEMMs' row layout for one routing."""

    sorted_ids: torch.Tensor  # [max_blocks * block_m] int32: slot of each row (sentinel numel: padding)
    expert_ids: torch.Tensor  # [max_blocks] int32: expert of each M-block, -1 past the last
    post_pad: torch.Tensor  # [1] int32: rows used (entries of sorted_ids past it are undefined)
    max_blocks: int  # the GEMM grids' M-blocks (a bound for any routing: no host sync)
    tile_starts: Optional[torch.Tensor] = None  # tails only: each M-block's first row (+1: half tile)


def align_block_size(ids: torch.Tensor, num_experts: int, block_m: int, tails: bool = False,
                     buffers: Optional[tuple] = None, quant: Optional[tuple] = None) -> Alignment:
    """Bucket the flattened slots of ``ids`` ([T, K] int32) by expert, padded to ``block_m``
    (``tails``: to ``block_m / 2``, for the GEMM kernels' half tiles, see ``_moe_gemm_kernel``).

    Entries of ``sorted_ids`` at or beyond ``post_pad`` are undefined; padding entries hold
    ``numel`` (the sentinel). Ids outside ``[0, E)`` (-1) get no slot. Up to ``SMALL_ALIGN_MAX``
    slots it is one launch, above that two (count, place). ``buffers``: (sorted_ids, expert_ids, post_pad,
    tile_starts or None, the one-program kernel's cursor or None) to write, e.g. a workspace's, else allocated
    here. ``quant``: (x, codes, scales), tokens quantized in the same launch (``_bucket``; one program only).
    """
    if tails and block_m % 32:
        raise ValueError(f"half tiles need BLOCK_M a multiple of 32 (halves of >= 16 rows), got {block_m}")
    flat = _int32_ids(ids)
    numel = flat.numel()
    dev = flat.device
    max_blocks, max_len = align_sizes(numel, num_experts, block_m)
    cursor = None
    if buffers is not None:  # (sorted_ids, expert_ids, post_pad, tile_starts or None, cursor or None): a workspace's
        sorted_ids, expert_ids, post_pad, tile_starts, cursor = buffers
        assert sorted_ids.numel() == max_len and expert_ids.numel() == max_blocks and tails == (tile_starts is not None)
    else:
        sorted_ids = torch.empty(max_len, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
        post_pad = torch.empty(1, dtype=torch.int32, device=dev)
        tile_starts = torch.empty(max_blocks, dtype=torch.int32, device=dev) if tails else None
    _bucket(flat, num_experts, block_m, sorted_ids, expert_ids=expert_ids, post_pad=post_pad,
            tile_starts=tile_starts, max_blocks=max_blocks, cursor=cursor, quant=quant)
    return Alignment(sorted_ids, expert_ids, post_pad, max_blocks, tile_starts)


def expert_rows(topk_ids: torch.Tensor, num_experts: int, row_align: int = 1):
    """The (token, slot) pairs grouped by expert, the grouped-GEMM pipeline's row layout: (rows per
    expert [E], each expert's first row [E], the row of every slot [T*K], the rows to allocate), the
    tensors int32. Each expert's rows start on a multiple of ``row_align`` (1: packed); the order of
    the slots within an expert is unspecified (any is fine: GEMM rows are independent). Ids outside
    [0, E) get no row (their entry is -1). The row count is a bound for any routing: ``T*K``, or
    with padding ``T*K + min(T*K, E) * (row_align - 1)`` rounded up to ``row_align`` (at most
    min(T*K, E) experts are non-empty). Same kernels as ``align_block_size``: one launch up to
    ``SMALL_ALIGN_MAX`` slots, two beyond; no host sync (graph-safe)."""
    flat = _int32_ids(topk_ids)
    numel, dev = flat.numel(), flat.device
    rows = numel if row_align == 1 else cdiv(numel + min(numel, num_experts) * (row_align - 1), row_align) * row_align
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    starts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    row_of_slot = torch.empty(numel, dtype=torch.int32, device=dev)
    _bucket(flat, num_experts, row_align, row_of_slot, counts=counts, starts=starts)
    return counts, starts, row_of_slot, rows


def quantize_fp8_groups(x: torch.Tensor, out: Optional[tuple[torch.Tensor, torch.Tensor]] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """[M, H] -> (e4m3 [M, H], fp32 scales [M, ceil(H/128)]), per token and 128-channel group (into ``out``:
    contiguous tensors of those shapes, if given)."""
    M, H = x.shape
    g = cdiv(H, 128)
    if out is None:
        q = torch.empty((M, H), dtype=FP8, device=x.device)
        s = torch.empty((M, g), dtype=torch.float32, device=x.device)
    else:
        q, s = out
    if M:
        groups = min(8, pow2(g))
        launch(kernels._quant_fp8_group_kernel, (M, cdiv(g, groups)), x, q, s, H, x.stride(0), q.stride(0),
               s.stride(0), GROUPS=groups)
    return q, s


def _gemm(a, a_scale, b, b_scale, c, c_scale, topk_w, align, masked_m, *, N, Kdim, num_valid, a_row_div,
          inter=0, up_row=0, capacity, num_m_blocks, out_scale=1.0, gate=0, row_mul=1, act=0, mul_weight,
          fp8, quant_out, masked, cfg, row_order=False, descriptors=None):
    """One launch of ``_moe_gemm_kernel``; ``row_order``: C at the sorted rows (for an ``A_TMA`` GEMM2);
    ``descriptors``: a cache of the weights' TMA descriptors (see ``_b_descriptor``)."""
    dummy = c
    grid = (num_m_blocks * cdiv(N, cfg["BLOCK_N"]),)
    tails = bool(cfg.get("TAIL_TILES", 0))
    if align is None:
        sorted_ids = expert_ids = tile_starts = dummy
        if tails:
            raise ValueError("TAIL_TILES needs an alignment (STANDARD / EP_NORMAL), not the masked slab")
    else:
        sorted_ids, expert_ids, tile_starts = align.sorted_ids, align.expert_ids, align.tile_starts
        if tails != (tile_starts is not None):
            raise ValueError(f"TAIL_TILES={int(tails)} but the alignment was made {'with' if not tails else 'without'}"
                             " half tiles: both GEMMs share one alignment")
        tile_starts = tile_starts if tails else dummy
    b_tma = bool(cfg.get("B_TMA", 0))
    if b_tma and gate == 2 and row_mul != 1:
        raise ValueError("B_TMA with two GEMM1 accumulators needs the checkpoint w13 layout (gate rows contiguous)")
    b_desc = _b_descriptor(b, cfg, descriptors) if b_tma else None
    a_tma = bool(cfg.get("A_TMA", 0))
    a_desc = a_desc_half = None
    if a_tma:
        a_desc = _a_descriptor(a, cfg["BLOCK_M"], cfg["BLOCK_K"])
        # the half-tile branch is compiled even without TAILS (never run then): its descriptor must fit it
        a_desc_half = _a_descriptor(a, max(1, cfg["BLOCK_M"] // 2), cfg["BLOCK_K"])
    sa, sb, sc = a.stride(), b.stride(), c.stride()  # (one call each: host time)
    sas = a_scale.stride() if a_scale is not None else (0, 0)
    sbs = b_scale.stride() if b_scale is not None else (0, 0, 0)
    scs = c_scale.stride() if c_scale is not None else (0, 0)
    launch(kernels._moe_gemm_kernel, grid,
        a, a_desc, a_desc_half, a_scale if a_scale is not None else dummy, b, b_desc, b_scale if b_scale is not None else dummy,
        c, c_scale if c_scale is not None else dummy, topk_w if topk_w is not None else dummy,
        sorted_ids, expert_ids, tile_starts, masked_m if masked_m is not None else dummy,
        N, b.shape[1], Kdim, num_valid, a_row_div, inter, up_row, capacity, num_m_blocks, float(out_scale),
        sa[0], sa[1], sb[0], sb[1], sb[2], sc[0], sc[1], sas[0], sas[1], sbs[0], sbs[1], sbs[2], scs[0], scs[1],
        GATE=gate, ROW_MUL=row_mul, ACT=act, MUL_WEIGHT=mul_weight, FP8=fp8, QUANT_OUT=quant_out, MASKED=masked,
        B_TMA=b_tma, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
        EVEN_K=Kdim % cfg["BLOCK_K"] == 0, TAILS=tails, ROW_ORDER=row_order and not masked, A_TMA=a_tma,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )


def _a_descriptor(a: torch.Tensor, block_m: int, block_k: int):
    """Host-side TMA descriptor over contiguous A rows [rows, K] (``A_TMA``)."""
    if a.stride(1) != 1 or a.stride(0) * a.element_size() % 16:
        raise ValueError(f"A_TMA needs rows of a multiple of 16 bytes, contiguous (TMA), got {tuple(a.shape)} "
                         f"strides {a.stride()} x {a.element_size()} bytes")
    return TensorDescriptor.from_tensor(a, [block_m, block_k])


def _b_descriptor(b: torch.Tensor, cfg: dict, cache: Optional[dict] = None):
    """Host-side TMA descriptor over the weights viewed as [E*N, K] (Hopper+; configs ask for it
    with ``B_TMA: 1``). A CUDA graph keeps it by value. ``cache`` (a dict the caller owns, e.g. a backend
    that clears it when its weights change) keeps it across calls: it depends only on the address,
    shape, dtype and tile, which are its key."""
    key = (b.data_ptr(), b.shape, b.stride(), b.dtype, cfg["BLOCK_N"], cfg["BLOCK_K"])
    if cache is not None and key in cache:
        return cache[key]
    E, n, k = b.shape
    if b.stride(2) != 1 or b.stride(1) != k or b.stride(0) != n * k:
        raise ValueError(f"B_TMA needs contiguous weights [E, N, K], got {tuple(b.shape)} strides {b.stride()}")
    if k * b.element_size() % 16:
        raise ValueError(f"B_TMA needs rows of a multiple of 16 bytes (TMA), got K={k} x {b.element_size()} bytes")
    desc = TensorDescriptor.from_tensor(b.view(E * n, k), [cfg["BLOCK_N"], cfg["BLOCK_K"]])
    if cache is not None:
        cache[key] = desc
    return desc


ACT_IDS = {"silu": 0, "gelu": 1}


def _check_fp8_cfg(cfg1: dict, cfg2: dict) -> None:
    for c in (cfg1, cfg2):
        if 128 % c["BLOCK_K"]:
            raise ValueError(f"FP8 block GEMMs need BLOCK_K dividing 128, got {c['BLOCK_K']}")


def gemm1_mode(cfg1: dict, w13_interleaved: bool) -> tuple[int, int, bool]:
    """(GATE, ROW_MUL, fused FP8 quant possible) of GEMM1: one accumulator over interleaved rows
    unless the config asks for the two-accumulator fallback (``TWO_ACC``) or w13 is in the
    checkpoint layout. The epilogue can quantize to FP8 only when a program owns exactly one
    128-column output group: BLOCK_N == 256 with one accumulator, 128 with two."""
    if w13_interleaved and not cfg1.get("TWO_ACC", 0):
        return 1, 1, cfg1["BLOCK_N"] == 256
    return 2, (2 if w13_interleaved else 1), cfg1["BLOCK_N"] == 128


def gemm1_parts(h_rows: int, inter: int, fp8: bool, fused_quant: bool, out_dtype: torch.dtype) -> list:
    """``gemm1``'s outputs as workspace parts ``(dtype, shape)``: h, then its scales (FP8 epilogue), or h in
    fp32 and its quantized copy (FP8 without the epilogue's quantization)."""
    g = cdiv(inter, 128)
    if fused_quant:
        return [(FP8, (h_rows, inter)), (torch.float32, (h_rows, g))]
    if fp8:
        return [(torch.float32, (h_rows, inter)), (FP8, (h_rows, inter)), (torch.float32, (h_rows, g))]
    return [(out_dtype, (h_rows, inter))]


def gemm1(a, a_scale, w13, w13_scale, *, align, masked_m, num_rows, a_row_div, capacity, num_m_blocks,
          activation, fp8, w13_interleaved, out_dtype, cfg1, row_order=False, descriptors=None, out=None):
    """Gated GEMM1 for ``num_rows`` slots: ``(h [num_rows, I], h_scale)``, or with ``row_order`` h at
    the alignment's sorted rows (``[len(sorted_ids), I]``, padding rows zero, rows past the routing's
    last M-block unwritten). FP8: ``h`` is e4m3 with per-(row, 128-column) scales (quantized in the
    epilogue or, for other tile widths, by ``quantize_fp8_groups``); otherwise ``h`` is ``out_dtype``
    and ``h_scale`` None. ``out``: the tensors of ``gemm1_parts`` (a workspace's), else allocated here."""
    E, n1, H = w13.shape
    inter = n1 // 2
    gate, row_mul, can_fuse = gemm1_mode(cfg1, w13_interleaved)
    fused_quant = fp8 and can_fuse
    # FP8 without the fused epilogue: h stays fp32 until it is quantized, as the scheme defines it (a
    # bf16 copy first would round twice and flip e4m3 values: the conformance kit caught 4.9% at T=1)
    h_rows = align.sorted_ids.numel() if row_order else num_rows
    if out is None:
        out = [torch.empty(shape, dtype=dt, device=a.device)
               for dt, shape in gemm1_parts(h_rows, inter, fp8, fused_quant, out_dtype)[:2 if fused_quant else 1]]
    h = out[0]
    h_scale = out[1] if fused_quant else None
    _gemm(a, a_scale, w13, w13_scale, h, h_scale, None, align, masked_m,
          N=n1 if gate == 1 else inter, Kdim=H, num_valid=num_rows, a_row_div=a_row_div, inter=inter,
          up_row=1 if w13_interleaved else inter, capacity=capacity, num_m_blocks=num_m_blocks,
          gate=gate, row_mul=row_mul, act=ACT_IDS[activation], mul_weight=False, fp8=fp8, quant_out=fused_quant,
          masked=masked_m is not None, cfg=cfg1, row_order=row_order, descriptors=descriptors)
    if fp8 and not fused_quant:  # rows never computed hold garbage here; their quantized copies are never read
        h, h_scale = quantize_fp8_groups(h, tuple(out[1:]) if len(out) == 3 else None)
    return h, h_scale


def gemm2(h, h_scale, w2, w2_scale, y, topk_w, *, align, masked_m, num_rows, capacity, num_m_blocks,
          out_scale, fp8, cfg2, descriptors=None):
    """Down GEMM into ``y`` [num_rows, H], times the slot's top-k weight when ``topk_w`` is given."""
    _gemm(h, h_scale, w2, w2_scale, y, None, topk_w, align, masked_m, N=w2.shape[1], Kdim=w2.shape[2],
          num_valid=num_rows, a_row_div=1, capacity=capacity, num_m_blocks=num_m_blocks, out_scale=out_scale,
          mul_weight=topk_w is not None, fp8=fp8, quant_out=False, masked=masked_m is not None, cfg=cfg2,
          descriptors=descriptors)
    return y


def fused_experts(
    hidden: torch.Tensor, a_scale: Optional[torch.Tensor], w13: torch.Tensor, w2: torch.Tensor,
    w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, *, fp8_block: bool, activation: str, routed_scaling_factor: float,
    out_dtype: torch.dtype, cfg: dict, w13_interleaved: bool = False, out: Optional[torch.Tensor] = None,
    descriptors: Optional[dict] = None, layouts: Optional[Layouts] = None, programs: Optional[Programs] = None,
) -> torch.Tensor:
    """Weighted MoE over token lists (STANDARD / EP_NORMAL): ``[T, H] -> [T, H]``.

    ``fp8_block``: ``w13`` and ``w2`` are e4m3 with block 128x128 scales ``w13_scale``/``w2_scale`` (always in
    the checkpoint layout) and ``hidden`` is in the compute dtype or e4m3 with ``a_scale`` [T, H/128]; else
    everything is in the compute dtype.
    ``w13_interleaved``: w13 rows are gate/up interleaved (``weights.interleave_gate_up``), else
    the checkpoint's [gate | up]. ``topk_ids`` are local ids, -1 skipped. ``descriptors``: a cache of the
    weights' TMA descriptors the caller owns (``_b_descriptor``). The scratch tensors (alignment,
    quantized tokens, h, the per-slot outputs) are views of one allocation (``workspace``); ``layouts``:
    the caller's cache of their offsets. ``programs``: the caller's cache of recorded calls (``replay``): a call
    whose key was recorded issues the same launches again with its own pointers.
    """
    args = (hidden, a_scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, fp8_block, activation,
            routed_scaling_factor, out_dtype, cfg, w13_interleaved)
    # (replayable: a one-program alignment, no temporaries; larger calls never pay for a key or a recording)
    shape = hidden.shape
    state = (launch_mod.direct_state() if programs is not None and replay.enabled
             and 0 < shape[0] * topk_ids.shape[1] <= SMALL_ALIGN_MAX else None)
    if state is None:
        return _fused_experts(*args, out, descriptors, layouts)[0]
    # everything the pipeline reads from its arguments but their data (docs/decisions.md, "A decode forward
    # replays its launches" and "The decode host path: ..."): the activations' and routing's shapes, strides, dtypes
    # and alignment; the weights by identity and whole address (a program keeps them alive, so an id is not reused
    # while it is kept; a weight given another shape in place at the same address is a weight change: the owner's
    # process_weights empties the cache); the pointers in the order of the program's tensors (the workspace's last)
    hp, wp, ip = hidden.data_ptr(), topk_weights.data_ptr(), topk_ids.data_ptr()
    p13, p2 = w13.data_ptr(), w2.data_ptr()
    ps13 = ps2 = pa = po = 0
    scales = None
    if w13_scale is not None or w2_scale is not None:
        ps13 = 0 if w13_scale is None else w13_scale.data_ptr()
        ps2 = 0 if w2_scale is None else w2_scale.data_ptr()
        scales = (id(w13_scale), ps13, id(w2_scale), ps2)
    extra = None  # (the layer's calls pass neither)
    if a_scale is not None or out is not None:
        pa = 0 if a_scale is None else a_scale.data_ptr()
        po = 0 if out is None else out.data_ptr()
        extra = tuple(None if t is None else (t.shape, t.stride(), t.dtype, p & 15)
                      for t, p in ((a_scale, pa), (out, po)))
    key = (state, id(cfg), shape, hidden.stride(), hidden.dtype, hidden.device, hp & 15,
           topk_weights.shape, topk_weights.stride(), topk_weights.dtype, wp & 15,
           topk_ids.shape, topk_ids.stride(), topk_ids.dtype, ip & 15, id(w13), p13, id(w2), p2, scales, extra,
           fp8_block, activation, routed_scaling_factor, out_dtype, w13_interleaved)
    program = programs.get(key)
    if program is not None:
        ptrs = [hp, pa, p13, p2, ps13, ps2, wp, ip, po, 0]
        nbytes, out_shape, device, merged, offset = program.info
        if out is None and merged:  # decode: the output and its small scratch in one allocation (after the output)
            full = torch.empty(merged, dtype=out_dtype, device=device)
            out = full.as_strided(out_shape, (out_shape[1], 1))
            ptrs[8] = full.data_ptr()
            ptrs[9] = ptrs[8] + offset
        else:
            if out is None:
                out = torch.empty(out_shape, dtype=out_dtype, device=device)
                ptrs[8] = out.data_ptr()
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)  # (alive until its launches are issued)
            ptrs[9] = buf.data_ptr()
        if (ptrs[8] | ptrs[9]) & 15:  # not as recorded (the caching allocator's blocks are 512-byte aligned)
            return _fused_experts(*args, out, descriptors, layouts)[0]
        try:
            program.run(ptrs, triton_driver.active.get_current_stream(state[0]))
        except TypeError:  # a launcher that takes no integer pointer (the check before its launch): never again
            programs.put(key, None)
            return _fused_experts(*args, out, descriptors, layouts)[0]
        launch_mod.stats["replayed"] += program.launches
        return out
    if key in programs:  # recorded, not replayable
        return _fused_experts(*args, out, descriptors, layouts)[0]
    with replay.recording() as (recorded, views):
        result, scratch = _fused_experts(*args, out, descriptors, layouts)
    tensors = (hidden, a_scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids)
    spans = [replay.span(t) for t in tensors] + [replay.span(result), scratch]
    program = None
    if not views.computed and (spans[8][0] | spans[9][0]) & 15 == 0:
        nbytes = spans[9][1] - spans[9][0]
        # (the decode kernels' scratch is a few rows of fp32: it may live as long as the output does)
        offset = -(-result.numel() * out_dtype.itemsize // 256) * 256  # (where the scratch starts)
        merged = -(-(offset + nbytes) // out_dtype.itemsize) if "decode" in cfg and out is None else 0
        program = replay.build(recorded, spans, fixed=(2, 3, 4, 5),
                               info=(nbytes, result.shape, result.device, merged, offset),
                               keep=(cfg, w13, w2, w13_scale, w2_scale))
    programs.put(key, program)
    return result


def _fused_experts(hidden, a_scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids, fp8_block, activation,
                   routed_scaling_factor, out_dtype, cfg, w13_interleaved, out, descriptors, layouts
                   ) -> tuple[torch.Tensor, Optional[tuple[int, int]]]:
    """``fused_experts``'s pipeline: (the output, the workspace's byte range or None). A decode config
    (``tuning_configs.decode_config``) runs ``decode.decode_experts`` instead."""
    if "decode" in cfg:
        return decode.decode_experts(hidden, a_scale, w13, w2, w13_scale, w2_scale, topk_weights, topk_ids,
                                     fp8_block=fp8_block, activation=activation,
                                     routed_scaling_factor=routed_scaling_factor, out_dtype=out_dtype, cfg=cfg,
                                     w13_interleaved=w13_interleaved, out=out, layouts=layouts)
    T, H = hidden.shape
    E = w13.shape[0]
    top_k = topk_ids.shape[1]
    if out is None:
        out = torch.empty((T, H), dtype=out_dtype, device=hidden.device)
    if T == 0:
        return out, None
    # GEMM1 gathers token rows: A_TMA (contiguous A rows) is only GEMM2's here (a slab has them in both)
    cfg1, cfg2 = {**cfg["gemm1"], "A_TMA": 0}, cfg["gemm2"]
    bm, tails = cfg1["BLOCK_M"], bool(cfg1.get("TAIL_TILES", 0))
    assert (cfg2["BLOCK_M"], bool(cfg2.get("TAIL_TILES", 0))) == (bm, tails), \
        "both GEMMs share the alignment's BLOCK_M and TAIL_TILES"
    quant_in = fp8_block and hidden.dtype != FP8
    if fp8_block:
        _check_fp8_cfg(cfg1, cfg2)
    ids = topk_ids.contiguous()
    numel = T * top_k
    row_order = bool(cfg2.get("A_TMA", 0))
    fused_quant = fp8_block and gemm1_mode(cfg1, w13_interleaved)[2]
    inter = w13.shape[1] // 2
    key = (T, top_k, E, H, inter, bm, tails, quant_in, fp8_block, fused_quant, row_order, out_dtype, hidden.device)
    n_blocks, max_len = align_sizes(numel, E, bm)

    small = numel <= SMALL_ALIGN_MAX  # the one-program alignment's cursor (the two-launch one allocates its own)

    def parts():  # (only the parts this call uses: each view costs host time)
        return [(torch.int32, (max_len,)), (torch.int32, (n_blocks,)), (torch.int32, (1,)), (out_dtype, (numel, H)),
                *([(torch.int32, (n_blocks,))] if tails else []),
                *([(torch.int32, (expert_lanes(E),))] if small else []),
                *([(FP8, (T, H)), (torch.float32, (T, cdiv(H, 128)))] if quant_in else []),
                *gemm1_parts(max_len if row_order else numel, inter, fp8_block, fused_quant, out_dtype)]
    lay = layout(layouts, key, parts)
    sorted_ids, expert_ids, post_pad, y, *rest = lay.carve(hidden.device)
    base = sorted_ids.untyped_storage().data_ptr()
    tile_starts = rest.pop(0) if tails else None
    cursor = rest.pop(0) if small else None
    quant = None
    if quant_in:  # the tokens' FP8 codes: in the alignment's launch when it is one program (decode), else their own
        quant = (hidden, rest.pop(0), rest.pop(0))
        if not small:
            quantize_fp8_groups(hidden, quant[1:])
        hidden, a_scale = quant[1:]
    align = align_block_size(ids, E, bm, tails, (sorted_ids, expert_ids, post_pad, tile_starts, cursor),
                             quant if small else None)
    # A_TMA: GEMM1 writes h in the sorted rows' order, GEMM2 streams it through TMA (no row gather)
    h1, h1_scale = gemm1(hidden, a_scale, w13, w13_scale, align=align, masked_m=None, num_rows=numel,
                         a_row_div=top_k, capacity=0, num_m_blocks=n_blocks, activation=activation, fp8=fp8_block,
                         w13_interleaved=w13_interleaved, out_dtype=out_dtype, cfg1=cfg1,
                         row_order=row_order, descriptors=descriptors, out=rest)  # (rest: gemm1_parts)
    gemm2(h1, h1_scale, w2, w2_scale, y, topk_weights.reshape(-1).contiguous(), align=align, masked_m=None,
          num_rows=numel, capacity=0, num_m_blocks=n_blocks, out_scale=1.0, fp8=fp8_block, cfg2=cfg2,
          descriptors=descriptors)
    block_h = min(1024, pow2(H))
    launch(kernels._moe_reduce_kernel, (T, cdiv(H, block_h)), y, ids, out, H, float(routed_scaling_factor), E,
           ids, ids, TOP_K=top_k, BLOCK_H=block_h, MAPPED=False)
    return out, (base, base + lay.nbytes)


def masked_experts(
    hidden: torch.Tensor, a_scale: Optional[torch.Tensor], masked_m: torch.Tensor, w13: torch.Tensor,
    w2: torch.Tensor, w13_scale: Optional[torch.Tensor], w2_scale: Optional[torch.Tensor], *,
    fp8_block: bool, activation: str, routed_scaling_factor: float, out_dtype: torch.dtype, cfg: dict,
    w13_interleaved: bool = False,
) -> torch.Tensor:
    """Unweighted (but scaled by ``routed_scaling_factor``) experts on a DeepEP low-latency slab:
    ``[E, C, H] -> [E, C, H]``; rows at and past ``masked_m[e]`` are not computed (left undefined,
    as the slab's own rows are)."""
    E, C, H = hidden.shape
    out = torch.empty((E, C, H), dtype=out_dtype, device=hidden.device)
    if E * C == 0:
        return out
    # half tiles (TAIL_TILES) belong to the token lists' alignment; a slab is C rows per expert
    cfg1, cfg2 = ({**cfg[k], "TAIL_TILES": 0} for k in ("gemm1", "gemm2"))
    bm = cfg1["BLOCK_M"]
    a = hidden.reshape(E * C, H)
    if fp8_block:
        _check_fp8_cfg(cfg1, cfg2)
        if hidden.dtype != FP8:
            a, a_scale = quantize_fp8_groups(a)
        else:
            a_scale = a_scale.reshape(E * C, -1).contiguous()  # DeepEP hands a column-major view
    n_blocks = E * cdiv(C, bm)
    mm = masked_m.to(torch.int32).contiguous()
    h1, h1_scale = gemm1(a, a_scale, w13, w13_scale, align=None, masked_m=mm, num_rows=E * C, a_row_div=1,
                         capacity=C, num_m_blocks=n_blocks, activation=activation, fp8=fp8_block,
                         w13_interleaved=w13_interleaved, out_dtype=out_dtype, cfg1=cfg1)
    gemm2(h1, h1_scale, w2, w2_scale, out.view(E * C, H), None, align=None, masked_m=mm, num_rows=E * C,
          capacity=C, num_m_blocks=n_blocks, out_scale=routed_scaling_factor, fp8=fp8_block, cfg2=cfg2)
    return out
