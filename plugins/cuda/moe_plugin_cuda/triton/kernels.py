"""Triton kernels of the fused-MoE pipeline (imported lazily: only when the backend is built).

Pipeline for STANDARD / EP_NORMAL (T tokens, top-k K, E local experts):

1. ``align``: bucket the T*K (token, expert) slots by expert, pad each bucket to a multiple of
   BLOCK_M, write ``sorted_ids`` (slot index, sentinel ``T*K`` for padding), one expert id per
   M-block and the padded total. Slots with id -1 (or an id >= E) get no bucket at all: they are
   skipped by both GEMMs and masked out by the reduction. No host sync: the GEMM grids are sized
   from an upper bound and blocks past the padded total return at once. Small T*K: one program
   does histogram, scan and scatter (one launch). Larger: two launches over chunks of the slots,
   a per-chunk histogram, then one program per chunk that re-reads the small [chunks, E] counts
   (from L2), rebuilds the bucket starts and its chunk's cursors, scatters its slots and writes
   its share of the M-block experts and padding sentinels: no serial single-program step. The same
   kernels with ``ROW_MAP`` give the CUTLASS/DeepGEMM layout (``triton_ops.expert_rows``): the row
   of each slot instead of the slot of each row. With half tiles (``TAIL_TILES``) buckets are
   padded to BLOCK_M/2 and each M-block also gets its first row, the GEMMs running an expert's
   last BLOCK_M/2 rows as a tile of that height.
2. ``gemm`` (gated): ``act(a @ gate.T) * (a @ up.T)`` per slot, so the [T*K, 2I] intermediate
   never exists. Default (``GATE == 1``): ``w13`` rows are interleaved by ``process_weights``
   (row 2j = gate j, row 2j+1 = up j), one accumulator covers BLOCK_N/2 (gate, up) pairs and the
   epilogue splits them; this keeps one fp32 tile live, so BLOCK_M=128 fits in registers.
   Fallback (``GATE == 2``): two accumulators (gate, up) over either layout. FP8 block-scaled
   variant with the per-token-group activation scales; the weight scales stay in the checkpoint
   layout (the kernel maps each B row back to its checkpoint row). When a program owns exactly
   128 output columns the epilogue quantizes them straight to FP8 + scale.
3. ``gemm`` (down): ``h @ w2[e].T`` times the slot's top-k weight, one row per slot.
4. ``reduce``: ``out[t] = scale * sum_k [id(t,k) valid] * y[t*K + k]``.

EP_MASKED uses the same GEMM kernel in ``MASKED`` mode: rows ``e*C + m`` for ``m < masked_m[e]``,
no routing weight (the dispatcher's combine weights).
"""

from __future__ import annotations

import struct

import triton
import triton.language as tl

FP8_MAX = 448.0
# fp32 1 / 448 as torch on CUDA computes a Python-scalar divisor's reciprocal: the core quantizer's group scale
# ``max(amax, 1e-4) / 448`` is ``max(amax, 1e-4) * INV_FP8_MAX`` on the device (docs/decisions.md, "The FP8 group
# scale is the device's core quantizer's")
INV_FP8_MAX = tl.constexpr(struct.unpack("f", struct.pack("f", 1.0 / FP8_MAX))[0])
GROUP = 128  # FP8 activation group and weight block edge


# --------------------------------------------------------------------------- alignment


@triton.jit
def _gated_activation(gate, up, ACT: tl.constexpr):
    """ACT 0: silu(gate) * up; 1: exact gelu(gate) * up (every kernel's gate/up epilogue)."""
    if ACT == 0:
        return gate * tl.sigmoid(gate) * up
    else:
        return 0.5 * gate * (1.0 + tl.math.erf(gate * 0.7071067811865476)) * up


@triton.jit
def _align_count_kernel(ids_ptr, numel, chunk_counts_ptr, E: tl.constexpr, E_POW2: tl.constexpr,
                        CHUNK: tl.constexpr):
    """Per-chunk expert histogram: chunk_counts[c, e] (deterministic, no atomics)."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    inb = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inb, other=-1)
    valid = inb & (ids >= 0) & (ids < E)
    hist = tl.histogram(tl.where(valid, ids, 0), E_POW2)
    # invalid slots were counted in bin 0: take them out again
    n_invalid = tl.sum((~valid).to(tl.int32), axis=0)
    bins = tl.arange(0, E_POW2)
    hist = hist - tl.where(bins == 0, n_invalid, 0)
    tl.store(chunk_counts_ptr + c * E_POW2 + bins, hist)


@triton.jit
def _pick(vec, idx, bins):
    """``vec[idx]`` for a short index vector (register tensors cannot be indexed: a one-hot sum)."""
    return tl.sum(tl.where(bins[None, :] == idx[:, None], vec[None, :], 0), axis=1)


@triton.jit
def _block_experts(counts, padded, starts, bins, expert_ids_ptr, tile_starts_ptr, b_lo, b_hi, BLOCK_M: tl.constexpr,
                   BLOCKS_TILE: tl.constexpr, TAILS: tl.constexpr):
    """Expert of M-blocks [b_lo, b_hi) (-1 past the last): expert e owns cdiv(counts[e], BLOCK_M)
    consecutive blocks. TAILS (buckets padded to BLOCK_M/2): also each block's first row, plus 1
    where the block is a half tile (its expert's last BLOCK_M/2 padded rows)."""
    n = tl.cdiv(counts, BLOCK_M)
    tcum = tl.cumsum(n, axis=0)
    total = tl.sum(n, axis=0)
    for b0 in range(b_lo, b_hi, BLOCKS_TILE):
        blk = b0 + tl.arange(0, BLOCKS_TILE)
        e = tl.sum((tcum[None, :] <= blk[:, None]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.where(blk < total, e, -1), mask=blk < b_hi)
        if TAILS:
            local = (blk - _pick(tcum - n, e, bins)) * BLOCK_M
            half = _pick(padded, e, bins) - local <= BLOCK_M // 2
            tl.store(tile_starts_ptr + blk, _pick(starts, e, bins) + local + half.to(tl.int32), mask=blk < b_hi)


@triton.jit
def _pad_sentinels(sorted_ptr, lo, hi, numel, BLOCK_M: tl.constexpr):
    """``sorted[lo[i]:hi[i]] = numel``: a bucket's padding (fewer than BLOCK_M slots past its last slot)."""
    pos = lo[:, None] + tl.arange(0, BLOCK_M)[None, :]
    tl.store(sorted_ptr + pos, numel, mask=pos < hi[:, None])


@triton.jit
def _write_slots(out_ptr, offs, pos, inb, valid, ROW_MAP: tl.constexpr):
    """Slot ``offs`` goes to bucket position ``pos``: ``sorted[pos] = slot``, or with ROW_MAP
    ``row_of_slot[slot] = pos`` (-1 for skipped slots, so no entry is left undefined)."""
    if ROW_MAP:
        tl.store(out_ptr + offs, tl.where(valid, pos, -1), mask=inb)
    else:
        tl.store(out_ptr + pos, offs, mask=valid)


@triton.jit
def _align_small_kernel(ids_ptr, numel, cursor_ptr, out_ptr, expert_ids_ptr, post_pad_ptr, counts_out_ptr,
                        starts_out_ptr, tile_starts_ptr, max_blocks, x_ptr, q_ptr, s_ptr, H, stride_x, stride_q,
                        stride_s, quant_chunks, E: tl.constexpr, E_POW2: tl.constexpr,
                        BLOCK_M: tl.constexpr, NUMEL_POW2: tl.constexpr, BLOCKS_TILE: tl.constexpr,
                        ROW_MAP: tl.constexpr, TAILS: tl.constexpr, QUANT: tl.constexpr, GROUPS: tl.constexpr):
    """The whole alignment in one program (small T*K): histogram, bucket layout, scatter. ROW_MAP
    (``expert_rows``): each slot's row, and per expert its count and first row, instead of the
    sorted slots, M-block experts and padded total. TAILS: buckets padded to BLOCK_M/2, and each
    M-block's first row (``_block_experts``). QUANT: programs 1.. quantize the tokens ``x`` [T, H] to FP8 as
    ``_quant_fp8_group_kernel`` does (``quant_chunks`` programs of GROUPS groups a row), in the same launch."""
    if QUANT:
        pid = tl.program_id(0)
        if pid > 0:
            _quant_row_groups(x_ptr, q_ptr, s_ptr, (pid - 1) // quant_chunks, (pid - 1) % quant_chunks, H, stride_x,
                              stride_q, stride_s, GROUPS)
            return
    offs = tl.arange(0, NUMEL_POW2)
    inb = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inb, other=-1)
    valid = inb & (ids >= 0) & (ids < E)
    safe = tl.where(valid, ids, 0)
    hist = tl.histogram(safe, E_POW2)
    bins = tl.arange(0, E_POW2)
    counts = hist - tl.where(bins == 0, tl.sum((~valid).to(tl.int32), axis=0), 0)
    PAD_M: tl.constexpr = BLOCK_M // 2 if TAILS else BLOCK_M
    padded = tl.cdiv(counts, PAD_M) * PAD_M
    cum = tl.cumsum(padded, axis=0)
    starts = cum - padded
    if ROW_MAP:
        tl.store(counts_out_ptr + bins, counts, mask=bins < E)
        tl.store(starts_out_ptr + bins, starts, mask=bins < E)
    else:
        tl.store(post_pad_ptr, tl.sum(padded, axis=0))
        _pad_sentinels(out_ptr, starts + counts, cum, numel, PAD_M)
        _block_experts(counts, padded, starts, bins, expert_ids_ptr, tile_starts_ptr, 0, max_blocks, BLOCK_M,
                       BLOCKS_TILE, TAILS)
    tl.store(cursor_ptr + bins, starts)
    tl.debug_barrier()  # the cursors are visible to every thread of the program before the atomics
    pos = tl.atomic_add(cursor_ptr + safe, 1, mask=valid, sem="relaxed")
    _write_slots(out_ptr, offs, pos, inb, valid, ROW_MAP)


@triton.jit
def _align_place_kernel(ids_ptr, numel, chunk_counts_ptr, n_chunks, cursor_ptr, out_ptr, expert_ids_ptr,
                        post_pad_ptr, counts_out_ptr, starts_out_ptr, tile_starts_ptr, max_blocks, blocks_per_prog,
                        E: tl.constexpr, E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
                        ROWS: tl.constexpr, BLOCKS_TILE: tl.constexpr, E_SUB: tl.constexpr, ROW_MAP: tl.constexpr,
                        TAILS: tl.constexpr):
    """One program per chunk, after ``_align_count_kernel``. Each program rebuilds the bucket layout
    from the chunk counts (small, in L2: cheaper than a serial scan launch between the two), scatters
    its chunk's slots from cursors of its own (bucket start + the expert's slots in earlier chunks)
    and writes its share of the rest: M-blocks [c*blocks_per_prog, ...) and the padding of experts
    [c*E_SUB, ...); program 0 the padded total. ROW_MAP, TAILS: as in ``_align_small_kernel``."""
    c = tl.program_id(0)
    offs = c * CHUNK + tl.arange(0, CHUNK)
    inb = offs < numel
    ids = tl.load(ids_ptr + offs, mask=inb, other=-1)
    valid = inb & (ids >= 0) & (ids < E)
    bins = tl.arange(0, E_POW2)
    counts = tl.zeros((E_POW2,), dtype=tl.int32)
    before = tl.zeros((E_POW2,), dtype=tl.int32)  # each expert's slots in the chunks before this one
    for r0 in range(0, n_chunks, ROWS):
        crow = r0 + tl.arange(0, ROWS)
        cc = tl.load(chunk_counts_ptr + crow[:, None] * E_POW2 + bins[None, :], mask=crow[:, None] < n_chunks,
                     other=0)
        counts += tl.sum(cc, axis=0)
        before += tl.sum(tl.where(crow[:, None] < c, cc, 0), axis=0)
    PAD_M: tl.constexpr = BLOCK_M // 2 if TAILS else BLOCK_M
    padded = tl.cdiv(counts, PAD_M) * PAD_M
    cum = tl.cumsum(padded, axis=0)
    starts = cum - padded
    # cursors private to the program: its atomics only order slots of one chunk (any order within an
    # expert is fine: each row of a GEMM tile is computed independently)
    cur = cursor_ptr + c * E_POW2
    tl.store(cur + bins, starts + before)
    tl.debug_barrier()  # the cursors are visible to every thread of the program before the atomics
    pos = tl.atomic_add(cur + tl.where(valid, ids, 0), 1, mask=valid, sem="relaxed")
    _write_slots(out_ptr, offs, pos, inb, valid, ROW_MAP)
    if ROW_MAP:
        first = bins + c * E_POW2 < E  # program 0 only
        tl.store(counts_out_ptr + bins, counts, mask=first)
        tl.store(starts_out_ptr + bins, starts, mask=first)
    else:
        tl.store(post_pad_ptr, tl.sum(padded, axis=0), mask=c == 0)
        b_lo = c * blocks_per_prog
        _block_experts(counts, padded, starts, bins, expert_ids_ptr, tile_starts_ptr, b_lo,
                       tl.minimum(b_lo + blocks_per_prog, max_blocks), BLOCK_M, BLOCKS_TILE, TAILS)
        sub = c * E_SUB + tl.arange(0, E_SUB)  # past E_POW2: picks 0, an empty range
        _pad_sentinels(out_ptr, _pick(starts + counts, sub, bins), _pick(cum, sub, bins), numel, PAD_M)


# --------------------------------------------------------------------------- grouped GEMM


@triton.jit
def _group_scale(amax):
    """The FP8 scale of groups with maximum ``amax``, as the core quantizer computes it on CUDA (times the fp32
    reciprocal of 448: not Triton's ``/``, which is approximate, ``div.full.f32``, nor an IEEE division, which
    is what torch does on the CPU): one scale off by an ulp moves every code of its group at an e4m3 rounding tie
    (bf16 tokens have many when the scale is exact), a few percent of a one-token output."""
    return tl.maximum(amax, 1e-4) * INV_FP8_MAX


@triton.jit
def _quant_groups(x):
    """Rows of one 128-column group each, fp32 ``[R, 128]`` (zeros where masked) -> (codes, scales ``[R]``):
    scale = ``_group_scale(amax)``, codes = clamp(x / scale) with IEEE division (Triton's ``/`` is
    approximate): the same codes as the core quantizer on the device, in every kernel that quantizes."""
    s = _group_scale(tl.max(tl.abs(x), axis=1))
    return tl.clamp(tl.math.div_rn(x, tl.broadcast_to(s[:, None], x.shape)), -448.0, 448.0), s


# row counts change with T: not specialized on them (one compiled kernel per config, not several)
@triton.jit(do_not_specialize=["num_valid", "a_row_div", "inter", "up_row", "capacity", "num_m_blocks"])
def _moe_gemm_kernel(
    a_ptr, a_desc, a_desc_half, a_scale_ptr, b_ptr, b_desc, b_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr,
    sorted_ptr, expert_ids_ptr, tile_starts_ptr, masked_m_ptr,
    N, b_rows, K, num_valid, a_row_div, inter, up_row, capacity, num_m_blocks, out_scale,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_csm, stride_csk,
    GATE: tl.constexpr, ROW_MUL: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    FP8: tl.constexpr, QUANT_OUT: tl.constexpr, MASKED: tl.constexpr, B_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, TAILS: tl.constexpr, ROW_ORDER: tl.constexpr, A_TMA: tl.constexpr,
):
    """C = A[rows] @ B[e].T per M-block of one expert. ``N`` is the number of B rows the grid spans.

    GATE == 0: plain GEMM. GATE == 1: B rows interleaved (2j gate, 2j+1 up), output column j of
    ``inter`` = act(gate j) * up j, BLOCK_N/2 output columns per program. GATE == 2: gate row
    j*ROW_MUL and up row j*ROW_MUL + up_row (checkpoint: 1, I; interleaved: 2, 1), two accumulators.
    FP8 weight scales are in the checkpoint layout: gate j in scale row j // 128, up j in (inter + j) // 128.
    B_TMA: B tiles come through ``b_desc``, a TMA descriptor over B viewed as [E*b_rows, K] (GATE 2:
    checkpoint rows only, ROW_MUL 1, the up tile ``up_row`` rows further); out-of-range K reads as
    zero, rows past this expert's gate or up rows only feed masked-off output columns.
    EVEN_K: K is a multiple of BLOCK_K, so the loads need no K mask.
    TAILS: buckets are padded to BLOCK_M/2 and an expert's last BLOCK_M/2 padded rows, if that is
    all that is left of it, run as a tile of BLOCK_M/2 rows (``tile_starts``: each M-block's first
    row, plus 1 for such a half tile). With about 2 full tiles per expert, a whole tile for a few
    rows past them was ~20% of the tensor-core work (qwen3-30b at T=4096: 256 +- 15 rows per expert).
    ROW_ORDER (token lists): C is stored at the sorted rows (one per row of ``sorted_ids``, padding rows
    as zeros) instead of the slots' rows, so GEMM2 reads its A rows contiguously. A_TMA: A rows are
    contiguous (a ROW_ORDER GEMM1's output, or the masked slab) and come through ``a_desc``
    (``a_desc_half`` for half tiles), unmasked: rows past the tile's valid ones only feed output rows
    that are not stored. (Triton 3.6's warp specialization of the K loop, tried on top: no faster on
    the H100, and it fails to compile on this kernel's early returns.)
    """
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # grouped ordering: GROUP_M consecutive M-blocks share the B tiles they stream (L2 reuse)
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_m_blocks - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m

    if MASKED:
        m_blocks_per_e = tl.cdiv(capacity, BLOCK_M)
        expert = pid_m // m_blocks_per_e
        local = (pid_m % m_blocks_per_e) * BLOCK_M
        rows_left = tl.load(masked_m_ptr + expert) - local
        if rows_left <= 0:
            return
        row0 = expert * capacity + local
    else:
        expert = tl.load(expert_ids_ptr + pid_m)
        if expert < 0:  # past the last M-block of this routing
            return
        rows_left = 0
        row0 = pid_m * BLOCK_M
    half = False  # a BLOCK_M/2-row tile (TAILS only)
    if TAILS:
        start = tl.load(tile_starts_ptr + pid_m)
        half = start % 2 == 1
        row0 = start - start % 2
    if half:
        _gemm_tile(
            a_ptr, a_desc_half, a_scale_ptr, b_ptr, b_desc, b_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr, sorted_ptr,
            expert, row0, rows_left, pid_n, N, b_rows, K, num_valid, a_row_div, inter, up_row, out_scale,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_csm, stride_csk,
            GATE, ROW_MUL, ACT, MUL_WEIGHT, FP8, QUANT_OUT, MASKED, B_TMA, BLOCK_M // 2, BLOCK_N, BLOCK_K, EVEN_K,
            ROW_ORDER, A_TMA)
    else:
        _gemm_tile(
            a_ptr, a_desc, a_scale_ptr, b_ptr, b_desc, b_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr, sorted_ptr,
            expert, row0, rows_left, pid_n, N, b_rows, K, num_valid, a_row_div, inter, up_row, out_scale,
            stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
            stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_csm, stride_csk,
            GATE, ROW_MUL, ACT, MUL_WEIGHT, FP8, QUANT_OUT, MASKED, B_TMA, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
            ROW_ORDER, A_TMA)


@triton.jit
def _gemm_tile(
    a_ptr, a_desc, a_scale_ptr, b_ptr, b_desc, b_scale_ptr, c_ptr, c_scale_ptr, topk_w_ptr, sorted_ptr,
    expert, row0, rows_left, pid_n, N, b_rows, K, num_valid, a_row_div, inter, up_row, out_scale,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn,
    stride_asm, stride_ask, stride_bse, stride_bsn, stride_bsk, stride_csm, stride_csk,
    GATE: tl.constexpr, ROW_MUL: tl.constexpr, ACT: tl.constexpr, MUL_WEIGHT: tl.constexpr,
    FP8: tl.constexpr, QUANT_OUT: tl.constexpr, MASKED: tl.constexpr, B_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    ROW_ORDER: tl.constexpr, A_TMA: tl.constexpr,
):
    """One BLOCK_M x BLOCK_N output tile of ``_moe_gemm_kernel`` (see there) for ``expert``: rows
    ``row0 ...`` of the sorted slots, or MASKED, slab rows ``row0 ...`` of which ``rows_left`` hold tokens."""
    arange_m = tl.arange(0, BLOCK_M)
    if MASKED:
        rows = row0 + arange_m
        row_mask = arange_m < rows_left
        a_rows = rows
    else:
        rows = tl.load(sorted_ptr + row0 + arange_m)
        row_mask = rows < num_valid
        if A_TMA:
            a_rows = row0 + arange_m
        else:
            a_rows = rows // a_row_div
    expert = expert.to(tl.int64)
    rows = rows.to(tl.int64)
    a_rows = a_rows.to(tl.int64)
    if ROW_ORDER:
        c_rows = (row0 + arange_m).to(tl.int64)
    else:
        c_rows = rows

    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_base = b_ptr + expert * stride_be
    if GATE == 2:
        b_ptrs = b_base + offs_k[:, None] * stride_bk + (offs_n * ROW_MUL)[None, :] * stride_bn
        u_ptrs = b_ptrs + up_row * stride_bn
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        b_ptrs = b_base + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    if FP8:
        as_ptrs = a_scale_ptr + a_rows * stride_asm
        if GATE == 1:
            s_rows = (offs_n % 2) * inter + offs_n // 2  # checkpoint row of each interleaved row
        else:
            s_rows = offs_n
        bs_ptrs = b_scale_ptr + expert * stride_bse + (s_rows // 128) * stride_bsn
        if GATE == 2:
            us_ptrs = b_scale_ptr + expert * stride_bse + ((inter + offs_n) // 128) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:  # a K mask only for the last, partial K step
            k_mask = tl.full((BLOCK_K,), 1, tl.int1)
        else:
            k_mask = offs_k < K - k * BLOCK_K
        if A_TMA:
            a = a_desc.load([row0.to(tl.int32), k * BLOCK_K])
        else:
            a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if B_TMA:
            b = b_desc.load([(expert * b_rows).to(tl.int32) + pid_n * BLOCK_N, k * BLOCK_K]).T
        else:
            b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if FP8:
            kg = (k * BLOCK_K) // 128
            a_s = tl.load(as_ptrs + kg * stride_ask, mask=row_mask, other=0.0)
            b_s = tl.load(bs_ptrs + kg * stride_bsk, mask=n_mask, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        if GATE == 2:
            if B_TMA:
                u = b_desc.load([(expert * b_rows).to(tl.int32) + up_row + pid_n * BLOCK_N, k * BLOCK_K]).T
            else:
                u = tl.load(u_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
            if FP8:
                u_s = tl.load(us_ptrs + kg * stride_bsk, mask=n_mask, other=0.0)
                acc_u += tl.dot(a, u) * a_s[:, None] * u_s[None, :]
            else:
                acc_u = tl.dot(a, u, acc_u)
            u_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if GATE == 1:
        # (gate, up) pairs sit in adjacent columns: split them, BLOCK_N/2 output columns
        gate, up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N // 2, 2)))
        offs_o = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        o_mask = offs_o < inter
    elif GATE == 2:
        gate = acc
        up = acc_u
        offs_o = offs_n
        o_mask = n_mask
    else:
        offs_o = offs_n
        o_mask = n_mask
    if GATE != 0:
        acc = _gated_activation(gate, up, ACT)
    if MUL_WEIGHT:
        w = tl.load(topk_w_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * w[:, None]
    acc = acc * out_scale

    c_ptrs = c_ptr + c_rows[:, None] * stride_cm + offs_o[None, :] * stride_cn
    if ROW_ORDER:  # padding rows too (zeros: their A rows were masked), so an A_TMA GEMM2 reads no garbage
        store_rows = tl.full((BLOCK_M,), 1, tl.int1)
    else:
        store_rows = row_mask
    c_mask = store_rows[:, None] & o_mask[None, :]
    if QUANT_OUT:
        # this program owns exactly one 128-column output group of each row (checked by the
        # launcher): quantize it to FP8 with a per-(row, group) scale, as the activation quantizer does
        q, scale = _quant_groups(tl.where(c_mask, acc, 0.0))
        tl.store(c_ptrs, q.to(c_ptr.dtype.element_ty), mask=c_mask)
        tl.store(c_scale_ptr + c_rows * stride_csm + pid_n * stride_csk, scale, mask=store_rows)
    else:
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)


# --------------------------------------------------------------------------- reduction


@triton.jit
def _moe_reduce_kernel(y_ptr, ids_ptr, out_ptr, H, scale, E, row_map_ptr, topk_w_ptr, TOP_K: tl.constexpr,
                       BLOCK_H: tl.constexpr, MAPPED: tl.constexpr):
    """out[t] = scale * sum_k [0 <= id(t,k) < E] * y[row(t,k)]; invalid slots were never written.

    row(t,k) = t*TOP_K + k, or with MAPPED the slot's row in expert-sorted ``y`` (``row_map``), each
    times its top-k weight (the GEMM did not apply it)."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = offs < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + k) + tl.zeros((BLOCK_H,), dtype=tl.int32)  # broadcast the id
        ok = (e >= 0) & (e < E)
        if MAPPED:
            row = tl.load(row_map_ptr + t * TOP_K + k).to(tl.int64)
            w = tl.load(topk_w_ptr + t * TOP_K + k).to(tl.float32)
        else:
            row = t * TOP_K + k
            w = 1.0
        y = tl.load(y_ptr + row * H + offs, mask=hmask & ok, other=0.0)
        acc += tl.where(ok, y.to(tl.float32) * w, 0.0)
    tl.store(out_ptr + t * H + offs, (acc * scale).to(out_ptr.dtype.element_ty), mask=hmask)


# --------------------------------------------------------------------------- FP8 activation quant


@triton.jit
def _quant_fp8_group_kernel(x_ptr, q_ptr, s_ptr, H, stride_x, stride_q, stride_s, GROUPS: tl.constexpr):
    """Per (row, 128-column group): scale = ``_group_scale(amax)``; q = fp8(clamp(x / scale)).
    GROUPS groups of one row per program (one group per program was 140 us, ~4x HBM time, for
    DeepSeek-V3's 4096 x 7168 input on the H100)."""
    _quant_row_groups(x_ptr, q_ptr, s_ptr, tl.program_id(0), tl.program_id(1), H, stride_x, stride_q, stride_s, GROUPS)


@triton.jit
def _quant_row_groups(x_ptr, q_ptr, s_ptr, row, chunk, H, stride_x, stride_q, stride_s, GROUPS: tl.constexpr):
    """Row ``row``'s groups ``chunk*GROUPS ...`` of ``_quant_fp8_group_kernel`` (also run by the alignment kernel)."""
    row = row.to(tl.int64)
    grp = chunk * GROUPS + tl.arange(0, GROUPS)
    offs = grp[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = offs < H  # also masks the groups past the last one
    x = tl.load(x_ptr + row * stride_x + offs, mask=m, other=0.0).to(tl.float32)
    q, s = _quant_groups(x)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row * stride_s + grp, s, mask=grp * 128 < H)


@triton.jit
def _quantize_into_rows_kernel(x_ptr, x_scale_ptr, q_ptr, s_ptr, ids_ptr, row_map_ptr, E, H, stride_x, stride_xs,
                               stride_q, stride_s, stride_sg, TOP_K: tl.constexpr, GROUPS: tl.constexpr,
                               QUANTIZE: tl.constexpr, SCALES: tl.constexpr):
    """Token t's GROUPS groups, quantized as ``_quant_fp8_group_kernel`` does (QUANTIZE) or its codes
    (and with SCALES its scales) as they came, stored in row ``row_map[t*TOP_K + k]`` for each slot k whose
    id is in [0, E) (scale of row r, group j at ``s + r*stride_s + j*stride_sg``)."""
    t = tl.program_id(0).to(tl.int64)
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = grp[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = offs < H
    gm = grp * 128 < H
    if QUANTIZE:
        q, s = _quant_groups(tl.load(x_ptr + t * stride_x + offs, mask=m, other=0.0).to(tl.float32))
        q = q.to(q_ptr.dtype.element_ty)
    else:
        q = tl.load(x_ptr + t * stride_x + offs, mask=m)
        if SCALES:
            s = tl.load(x_scale_ptr + t * stride_xs + grp, mask=gm)
    for k in tl.static_range(TOP_K):
        e = tl.load(ids_ptr + t * TOP_K + k)
        if (e >= 0) & (e < E):
            row = tl.load(row_map_ptr + t * TOP_K + k).to(tl.int64)
            tl.store(q_ptr + row * stride_q + offs, q, mask=m)
            if SCALES:
                tl.store(s_ptr + row * stride_s + grp * stride_sg, s, mask=gm)


@triton.jit
def _silu_mul_quant_kernel(d_ptr, q_ptr, s_ptr, rows_used_ptr, inter, stride_d, stride_q, stride_s, stride_sg,
                           GROUPS: tl.constexpr, BOUNDED: tl.constexpr):
    """h = silu(gate) * up from GEMM1's output row [gate (inter) | up (inter)], quantized per (row,
    128-column group) exactly like ``_quant_fp8_group_kernel``. BOUNDED: rows at and past
    ``rows_used[0]`` (allocated for the worst routing, unused by this one) are skipped."""
    row = tl.program_id(0).to(tl.int64)
    if BOUNDED:
        if row >= tl.load(rows_used_ptr):
            return
    grp = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = grp[:, None] * 128 + tl.arange(0, 128)[None, :]
    m = offs < inter
    gate = tl.load(d_ptr + row * stride_d + offs, mask=m, other=0.0).to(tl.float32)
    up = tl.load(d_ptr + row * stride_d + inter + offs, mask=m, other=0.0).to(tl.float32)
    q, s = _quant_groups(gate * tl.sigmoid(gate) * up)
    tl.store(q_ptr + row * stride_q + offs, q.to(q_ptr.dtype.element_ty), mask=m)
    tl.store(s_ptr + row * stride_s + grp * stride_sg, s, mask=grp * 128 < inter)


@triton.jit
def _silu_mul_kernel(d_ptr, h_ptr, rows_used_ptr, inter, stride_d, stride_h, BLOCK: tl.constexpr,
                     INTERLEAVED: tl.constexpr, BOUNDED: tl.constexpr):
    """h = silu(gate) * up from GEMM1's output row: [gate (inter) | up (inter)], or with INTERLEAVED
    gate/up pairs (column 2j gate, 2j+1 up: GEMM1 over ``weights.interleave_gate_up_``'s w13), read
    as one contiguous run of 2*BLOCK values and split (two stride-2 loads ran at ~2 TB/s on the H100).
    BOUNDED: rows at and past ``rows_used[0]`` are skipped (see ``_silu_mul_quant_kernel``)."""
    row = tl.program_id(0).to(tl.int64)
    if BOUNDED:
        if row >= tl.load(rows_used_ptr):
            return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < inter
    if INTERLEAVED:
        pair = tl.program_id(1) * 2 * BLOCK + tl.arange(0, 2 * BLOCK)
        gu = tl.load(d_ptr + row * stride_d + pair, mask=pair < 2 * inter, other=0.0).to(tl.float32)
        gate, up = tl.split(tl.reshape(gu, (BLOCK, 2)))
    else:
        gate = tl.load(d_ptr + row * stride_d + offs, mask=m, other=0.0).to(tl.float32)
        up = tl.load(d_ptr + row * stride_d + inter + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(h_ptr + row * stride_h + offs, (gate * tl.sigmoid(gate) * up).to(h_ptr.dtype.element_ty), mask=m)


# --------------------------------------------------------------------------- decode (GEMV) path


@triton.jit
def _as_codes(q, codes_dtype: tl.constexpr):
    """Quantized values rounded to the weights' dtype and back (e4m3 on the device: the scheme's codes; an fp32
    stand-in in the interpreter tests, whose fp8 casts are unreliable, keeps them)."""
    return q.to(codes_dtype).to(tl.float32)


@triton.jit
def _quant_groups_3d(x, codes_dtype: tl.constexpr):
    """``_quant_groups`` over the last axis of ``[1, G, 128]`` fp32 (G groups of one row): (codes x scale as fp32
    ``[1, G, 128]``, i.e. the dequantized values the scheme computes with)."""
    s = _group_scale(tl.max(tl.abs(x), axis=2))
    q = tl.clamp(tl.math.div_rn(x, tl.broadcast_to(s[:, :, None], x.shape)), -448.0, 448.0)
    return _as_codes(q, codes_dtype) * s[:, :, None]


@triton.jit
def _decode_gate_up_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, ids_ptr, h_ptr, H, inter, E,
                           stride_x, stride_xs, stride_xsk, stride_it, stride_ik, stride_we, stride_wn, stride_wse,
                           stride_wsn, stride_wsk, stride_h, TOP_K: tl.constexpr, ACT: tl.constexpr,
                           FP8: tl.constexpr, QUANT_X: tl.constexpr, INTERLEAVED: tl.constexpr,
                           BLOCK_I: tl.constexpr, GROUPS: tl.constexpr, EVEN_K: tl.constexpr, FOLD: tl.constexpr,
                           PDL: tl.constexpr):
    """Decode GEMM1 as GEMVs: program (slot, I-block) computes h[slot, I-block] = act(gate) * up of its slot's token
    against its expert's gate and up rows (each a contiguous row of H), in fp32; slots with an id outside [0, E)
    return at once (their h is never read). Each step reads GROUPS 128-column groups of BLOCK_I gate and up rows as
    [BLOCK_I, GROUPS, 128] tiles; the products accumulate elementwise in registers, reduced once after the loop.
    FP8: the token's groups quantized as ``_quant_groups`` does (QUANT_X; else its codes and scales as they came),
    products scaled per (row, group) by the token group's and the weight block's scales, as the tensor-core GEMM
    scales each K group. INTERLEAVED: w13 rows gate/up interleaved (2j, 2j+1), else the checkpoint's [gate | up];
    weight scales are in the checkpoint layout either way. FOLD (FP8, the program's gate rows and its up rows each
    within one 128-row scale block: BLOCK_I divides 128 and I): the weight scales multiply the token's group values
    once a step instead of every weight (one FMA per weight). PDL: let the down kernel launch once every program is
    past its loop."""
    slot = tl.program_id(0)
    t = slot // TOP_K
    e = tl.load(ids_ptr + t * stride_it + (slot % TOP_K) * stride_ik)
    if (e < 0) | (e >= E):
        return
    e = e.to(tl.int64)
    t = t.to(tl.int64)
    offs_i = tl.program_id(1) * BLOCK_I + tl.arange(0, BLOCK_I)
    i_mask = offs_i < inter
    if INTERLEAVED:
        g_rows = 2 * offs_i
        u_rows = g_rows + 1
    else:
        g_rows = offs_i
        u_rows = offs_i + inter
    grp = tl.arange(0, GROUPS)
    offs_k = grp[:, None] * 128 + tl.arange(0, 128)[None, :]  # [GROUPS, 128]: this step's columns
    w_base = w_ptr + e * stride_we
    g_ptrs = w_base + g_rows.to(tl.int64)[:, None, None] * stride_wn + offs_k[None, :, :]
    u_ptrs = w_base + u_rows.to(tl.int64)[:, None, None] * stride_wn + offs_k[None, :, :]
    x_ptrs = x_ptr + t * stride_x + offs_k[None, :, :]
    if FP8:
        if FOLD:  # one scale row for the gate rows, one for the up rows: [1, GROUPS]
            i0 = tl.program_id(1) * BLOCK_I
            gs_ptrs = w_scale_ptr + e * stride_wse + (i0 // 128) * stride_wsn + grp[None, :] * stride_wsk
            us_ptrs = w_scale_ptr + e * stride_wse + ((i0 + inter) // 128) * stride_wsn + grp[None, :] * stride_wsk
        else:
            gs_ptrs = w_scale_ptr + e * stride_wse + (offs_i // 128)[:, None] * stride_wsn + grp[None, :] * stride_wsk
            us_ptrs = (w_scale_ptr + e * stride_wse + ((offs_i + inter) // 128)[:, None] * stride_wsn
                       + grp[None, :] * stride_wsk)
        xs_ptrs = x_scale_ptr + t * stride_xs + grp[None, :] * stride_xsk
    acc_g = tl.zeros((BLOCK_I, GROUPS, 128), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_I, GROUPS, 128), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, GROUPS * 128)):
        if EVEN_K:
            k_mask = tl.full((GROUPS, 128), 1, tl.int1)
        else:
            k_mask = offs_k < H - k * GROUPS * 128
        x = tl.load(x_ptrs, mask=k_mask[None, :, :], other=0.0).to(tl.float32)  # [1, GROUPS, 128]
        w_mask = i_mask[:, None, None] & k_mask[None, :, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0).to(tl.float32)
        if FP8:
            g_ok = grp[None, :] < tl.cdiv(H, 128) - k * GROUPS  # [1, GROUPS]: groups inside H
            if QUANT_X:
                x = _quant_groups_3d(x, w_ptr.dtype.element_ty)
            else:
                x = x * tl.load(xs_ptrs + k * GROUPS * stride_xsk, mask=g_ok, other=0.0)[:, :, None]
            if FOLD:
                g_s = tl.load(gs_ptrs + k * GROUPS * stride_wsk, mask=g_ok, other=0.0)
                u_s = tl.load(us_ptrs + k * GROUPS * stride_wsk, mask=g_ok, other=0.0)
                acc_g += g * (x * g_s[:, :, None])
                acc_u += u * (x * u_s[:, :, None])
            else:
                s_mask = i_mask[:, None] & g_ok
                g_s = tl.load(gs_ptrs + k * GROUPS * stride_wsk, mask=s_mask, other=0.0)
                u_s = tl.load(us_ptrs + k * GROUPS * stride_wsk, mask=s_mask, other=0.0)
                acc_g += g * x * g_s[:, :, None]
                acc_u += u * x * u_s[:, :, None]
        else:
            acc_g += g * x
            acc_u += u * x
        x_ptrs += GROUPS * 128
        g_ptrs += GROUPS * 128
        u_ptrs += GROUPS * 128
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
    gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    h = _gated_activation(gate, up, ACT)
    tl.store(h_ptr + slot.to(tl.int64) * stride_h + offs_i, h, mask=i_mask)


@triton.jit
def _decode_down_kernel(h_ptr, w_ptr, w_scale_ptr, ids_ptr, topk_w_ptr, out_ptr, H, inter, E, scale,
                        stride_h, stride_it, stride_ik, stride_wt, stride_wk, stride_we, stride_wn, stride_wse,
                        stride_wsn, stride_wsk, stride_out, TOP_K: tl.constexpr, FP8: tl.constexpr,
                        BLOCK_H: tl.constexpr, GROUPS: tl.constexpr, FLAT: tl.constexpr, PDL: tl.constexpr):
    """Decode GEMM2 and the top-k sum: program (token, H-block) computes out[t, H-block] = scale * sum_k w(t,k) *
    (w2[id(t,k)] @ h[t*TOP_K + k])[H-block] over the slots with an id in [0, E), GROUPS 128-column groups of I a
    step, elementwise in [BLOCK_H, GROUPS, 128] fp32 registers reduced once at the end (deterministic, no atomics,
    no per-slot output). FLAT: one loop over (slot, I-step), so the software pipeline runs across slots (a skipped
    slot's steps load nothing), else a loop over I per valid slot. FP8: each 128-column group of h quantized as
    ``_quant_groups`` does (the scheme's quantization of GEMM1's output), scaled per (row, group) by the weight
    block's scale: BLOCK_H divides 128, so one scale row covers the program's rows and the scales multiply h's group
    values once a step instead of every weight (one FMA per weight). PDL: launched early behind the gate/up kernel,
    waits for it before reading h."""
    t = tl.program_id(0).to(tl.int64)
    s_row = (tl.program_id(1) * BLOCK_H) // 128  # the weight scale row of this program's rows
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    grp = tl.arange(0, GROUPS)
    offs_i = grp[:, None] * 128 + tl.arange(0, 128)[None, :]  # [GROUPS, 128]
    acc = tl.zeros((BLOCK_H, GROUPS, 128), dtype=tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    if FLAT:
        n_i = tl.cdiv(inter, GROUPS * 128)
        for j in range(0, TOP_K * n_i):
            k = j // n_i
            i = j - k * n_i
            e = tl.load(ids_ptr + t * stride_it + k * stride_ik)
            ok = (e >= 0) & (e < E)
            weight = tl.load(topk_w_ptr + t * stride_wt + k * stride_wk).to(tl.float32)
            acc = _decode_down_step(acc, h_ptr, w_ptr, w_scale_ptr, tl.where(ok, e, 0).to(tl.int64),
                                    tl.where(ok, inter, 0), weight, t * TOP_K + k, i, s_row, offs_h, h_mask, offs_i,
                                    grp, stride_h, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, FP8, GROUPS)
    else:
        for k in tl.static_range(TOP_K):
            e = tl.load(ids_ptr + t * stride_it + k * stride_ik)
            if (e >= 0) & (e < E):
                weight = tl.load(topk_w_ptr + t * stride_wt + k * stride_wk).to(tl.float32)
                for i in range(0, tl.cdiv(inter, GROUPS * 128)):
                    acc = _decode_down_step(acc, h_ptr, w_ptr, w_scale_ptr, e.to(tl.int64), inter, weight,
                                            t * TOP_K + k, i, s_row, offs_h, h_mask, offs_i, grp, stride_h, stride_we,
                                            stride_wn, stride_wse, stride_wsn, stride_wsk, FP8, GROUPS)
    out = tl.sum(tl.sum(acc, axis=2), axis=1) * scale
    tl.store(out_ptr + t * stride_out + offs_h, out.to(out_ptr.dtype.element_ty), mask=h_mask)


@triton.jit
def _decode_down_step(acc, h_ptr, w_ptr, w_scale_ptr, e, limit, weight, slot, i, s_row, offs_h, h_mask, offs_i, grp,
                      stride_h, stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, FP8: tl.constexpr,
                      GROUPS: tl.constexpr):
    """``_decode_down_kernel``'s step i of slot ``slot`` (expert ``e``): ``acc`` plus weight x w2[e, H-block, step's
    columns] x h[slot, step's columns], columns past ``limit`` (I, or 0 for a skipped slot: nothing loaded) masked."""
    cols = i * GROUPS * 128 + offs_i  # [GROUPS, 128]
    i_mask = cols < limit
    hv = tl.load(h_ptr + slot * stride_h + cols[None, :, :], mask=i_mask[None, :, :], other=0.0)  # [1, GROUPS, 128]
    wv = tl.load(w_ptr + e * stride_we + offs_h.to(tl.int64)[:, None, None] * stride_wn + cols[None, :, :],
                 mask=h_mask[:, None, None] & i_mask[None, :, :], other=0.0).to(tl.float32)
    if FP8:
        w_s = tl.load(w_scale_ptr + e * stride_wse + s_row * stride_wsn + (i * GROUPS + grp) * stride_wsk,
                      mask=(i * GROUPS + grp) * 128 < limit, other=0.0)  # [GROUPS]
        hv = _quant_groups_3d(hv, w_ptr.dtype.element_ty) * (w_s * weight)[None, :, None]
        return acc + wv * hv
    return acc + wv * (hv * weight)


# Decode kernels, form 2 (docs/decisions.md, "FP8 decode at HBM speed: columns over threads, rows in registers"):
# a step's tile is [rows, GROUPS, 128 // VEC, VEC] with VEC = one 16-byte load of a weight row, so Triton spreads the
# threads (and warps) over the step's columns and each thread keeps all the program's rows in registers. The token's
# (or h's) values of a step are then held once, not once per row a thread owns: the per-128-column quantization of
# FP8 (an IEEE division per value) is paid once per value and shared by every row, where form 1 paid it once per
# row a thread owned and ran ALU-bound (~0.8 TB/s for the down kernel). Products are summed over VEC in-thread each
# step into [rows, GROUPS, 128 // VEC] fp32, so the weight block scales apply per (row, group) after that sum.


@triton.jit
def _quant_groups_4d(x, codes_dtype: tl.constexpr):
    """``_quant_groups`` over each [128 // VEC, VEC] group of ``[1, G, 128 // VEC, VEC]`` fp32: the dequantized values
    (codes x scale) the scheme computes with."""
    s = _group_scale(tl.max(tl.max(tl.abs(x), axis=3), axis=2))
    q = tl.clamp(tl.math.div_rn(x, tl.broadcast_to(s[:, :, None, None], x.shape)), -448.0, 448.0)
    return _as_codes(q, codes_dtype) * s[:, :, None, None]


# L2 prefetch of the down kernel's weights from the gate/up programs (docs/decisions.md, "Decode: the down weights
# prefetched into L2 by the gate/up programs"): one Hopper bulk prefetch (``cp.async.bulk.prefetch.L2``, sm_90+) per
# contiguous chunk, issued by the program's thread 0 (a scalar in Triton is computed by every thread), with the
# 64-bit policy of ``createpolicy`` (evict_last: the chunk outlives the gate/up weights streaming past it) or none.
_PF_ASM = tl.constexpr("{ .reg .pred p; .reg .u32 t; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
           "@p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }")
_PF_ASM_KEEP = tl.constexpr("{ .reg .pred p; .reg .u32 t; .reg .b64 pol; mov.u32 t, %tid.x; setp.eq.u32 p, t, 0; "
                "createpolicy.fractional.L2::evict_last.b64 pol, 1.0; "
                "@p cp.async.bulk.prefetch.L2.global.L2::cache_hint [$1], $2, pol; mov.u32 $0, 0; }")


@triton.jit
def _prefetch_l2(addr, nbytes, KEEP: tl.constexpr):
    """Prefetch ``nbytes`` (a multiple of 16, > 0) at byte address ``addr`` (int64, 16-byte aligned) into L2."""
    if KEEP:
        tl.inline_asm_elementwise(_PF_ASM_KEEP, "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)
    else:
        tl.inline_asm_elementwise(_PF_ASM, "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _decode_gate_up_v2_kernel(x_ptr, x_scale_ptr, w_ptr, w_scale_ptr, ids_ptr, h_ptr, cnt_ptr, H, inter, E, n_cnt,
                              stride_x, stride_xs, stride_xsk, stride_it, stride_ik, stride_we, stride_wn,
                              stride_wse, stride_wsn, stride_wsk, stride_h, pf_ptr, pf_stride_e, pf_chunk, pf_limit,
                              pfs_ptr, pfs_stride_e, pfs_bytes, TOP_K: tl.constexpr, ACT: tl.constexpr,
                              FP8: tl.constexpr, QUANT_X: tl.constexpr, INTERLEAVED: tl.constexpr,
                              SLOTS: tl.constexpr, BLOCK_I: tl.constexpr, GROUPS: tl.constexpr, VEC: tl.constexpr,
                              EVEN_K: tl.constexpr, ZERO_CNT: tl.constexpr, PDL: tl.constexpr,
                              STAGES: tl.constexpr, L2PF: tl.constexpr = 0, W_EVICT: tl.constexpr = ""):
    """``_decode_gate_up_kernel``'s math in form 2: program (token x group of SLOTS slots, I-block) writes h[slot,
    I-block] = act(gate) * up in fp32 for each of its SLOTS slots (rows: SLOTS x BLOCK_I (slot, I-row) pairs, each
    with its own expert; rows of a slot whose id is outside [0, E) load and store nothing). Several slots a program
    share the token's values of a step and, in FP8, its per-128-column quantization (QUANT_X), whose IEEE divisions
    would otherwise dominate the ALU; dispatched codes are scaled as they came. The weight block scales multiply the
    step's per-(row, group) sums. ZERO_CNT: the programs (first slot group of token t, 0) zero token t's ``n_cnt``
    counters of the split down kernel (which runs after this one). STAGES > 1: Triton's software pipeline over the
    loop (its loads run STAGES - 1 steps ahead through shared memory, cp.async; a loop without a dot is pipelined
    only when the loop asks, ``tl.range(num_stages=)``). PDL: 1 lets the down kernel launch once every program is
    past its loop, 2 as soon as every program has started (it waits for this grid before reading h). L2PF (1, or 2:
    with an evict_last policy; never in the interpreter): before its loop, program (slots, I-block j) prefetches into
    L2 bytes [j * pf_chunk, min((j + 1) * pf_chunk, pf_limit)) of each of its slots' experts' down weights (byte
    offsets of ``pf_ptr`` + e * pf_stride_e), and the programs of I-block 0 the expert's first ``pfs_bytes`` of down
    block scales, so the down kernel reads them from L2 while these programs still stream gate/up from HBM.
    W_EVICT: the weight
    loads' eviction policy ("" or "evict_first": an L2 evict_first policy, so they do not push out prefetched
    lines)."""
    if PDL == 2:
        tl.extra.cuda.gdc_launch_dependents()
    GROUPS_PER_T: tl.constexpr = TOP_K // SLOTS
    t = tl.program_id(0) // GROUPS_PER_T
    k0 = (tl.program_id(0) % GROUPS_PER_T) * SLOTS
    if L2PF:
        start = tl.program_id(1).to(tl.int64) * pf_chunk
        n_pf = tl.minimum(pf_chunk, pf_limit - start)
        for s in tl.static_range(SLOTS):
            e_pf = tl.load(ids_ptr + t * stride_it + (k0 + s) * stride_ik).to(tl.int64)
            if (e_pf >= 0) & (e_pf < E):
                if n_pf > 0:
                    _prefetch_l2(pf_ptr.to(tl.int64, bitcast=True) + e_pf * pf_stride_e + start, n_pf.to(tl.int32),
                                 L2PF == 2)
                if (pfs_bytes > 0) & (tl.program_id(1) == 0):
                    _prefetch_l2(pfs_ptr.to(tl.int64, bitcast=True) + e_pf * pfs_stride_e, pfs_bytes, L2PF == 2)
    if ZERO_CNT:
        if (k0 == 0) & (tl.program_id(1) == 0):
            for c in range(0, n_cnt, 128):
                offs_c = c + tl.arange(0, 128)
                tl.store(cnt_ptr + t * n_cnt + offs_c, tl.zeros((128,), tl.int32), mask=offs_c < n_cnt)
    t = t.to(tl.int64)
    LANES: tl.constexpr = 128 // VEC
    rows = tl.arange(0, SLOTS * BLOCK_I)
    slot = t * TOP_K + k0 + rows // BLOCK_I  # [R]: each row's slot
    offs_i = tl.program_id(1) * BLOCK_I + rows % BLOCK_I  # [R]: its row of I
    e = tl.load(ids_ptr + t * stride_it + (k0 + rows // BLOCK_I) * stride_ik)
    ok = (e >= 0) & (e < E) & (offs_i < inter)
    e = tl.where(ok, e, 0).to(tl.int64)
    if INTERLEAVED:
        g_rows = 2 * offs_i
        u_rows = g_rows + 1
    else:
        g_rows = offs_i
        u_rows = offs_i + inter
    grp = tl.arange(0, GROUPS)
    offs_k = (grp[:, None, None] * 128 + tl.arange(0, LANES)[None, :, None] * VEC
              + tl.arange(0, VEC)[None, None, :])  # [GROUPS, LANES, VEC]: this step's columns
    w_rows = w_ptr + e * stride_we  # [R]
    g_ptrs = (w_rows + g_rows.to(tl.int64) * stride_wn)[:, None, None, None] + offs_k[None, :, :, :]
    u_ptrs = (w_rows + u_rows.to(tl.int64) * stride_wn)[:, None, None, None] + offs_k[None, :, :, :]
    x_ptrs = x_ptr + t * stride_x + offs_k[None, :, :, :]
    if FP8:  # each row's weight scale row (its expert's, its checkpoint row's block): [R, GROUPS]
        s_rows = w_scale_ptr + e * stride_wse
        gs_ptrs = (s_rows + (offs_i // 128) * stride_wsn)[:, None] + grp[None, :] * stride_wsk
        us_ptrs = (s_rows + ((offs_i + inter) // 128) * stride_wsn)[:, None] + grp[None, :] * stride_wsk
        xs_ptrs = x_scale_ptr + t * stride_xs + grp[None, :] * stride_xsk
    acc_g = tl.zeros((SLOTS * BLOCK_I, GROUPS, LANES), dtype=tl.float32)
    acc_u = tl.zeros((SLOTS * BLOCK_I, GROUPS, LANES), dtype=tl.float32)
    for k in tl.range(0, tl.cdiv(H, GROUPS * 128), num_stages=STAGES):
        if EVEN_K:
            k_mask = tl.full((GROUPS, LANES, VEC), 1, tl.int1)
        else:
            k_mask = offs_k < H - k * GROUPS * 128
        w_mask = ok[:, None, None, None] & k_mask[None, :, :, :]
        g = tl.load(g_ptrs, mask=w_mask, other=0.0, eviction_policy=W_EVICT)
        u = tl.load(u_ptrs, mask=w_mask, other=0.0, eviction_policy=W_EVICT)
        x = tl.load(x_ptrs, mask=k_mask[None, :, :, :], other=0.0).to(tl.float32)  # [1, GROUPS, LANES, VEC]
        if FP8:
            g_ok = grp[None, :] < tl.cdiv(H, 128) - k * GROUPS  # [1, GROUPS]: groups inside H
            if QUANT_X:
                x = _quant_groups_4d(x, w_ptr.dtype.element_ty)
            else:
                x = x * tl.load(xs_ptrs + k * GROUPS * stride_xsk, mask=g_ok, other=0.0)[:, :, None, None]
            s_mask = ok[:, None] & g_ok
            g_s = tl.load(gs_ptrs + k * GROUPS * stride_wsk, mask=s_mask, other=0.0)
            u_s = tl.load(us_ptrs + k * GROUPS * stride_wsk, mask=s_mask, other=0.0)
            acc_g += tl.sum(g.to(tl.float32) * x, axis=3) * g_s[:, :, None]
            acc_u += tl.sum(u.to(tl.float32) * x, axis=3) * u_s[:, :, None]
        else:
            acc_g += tl.sum(g.to(tl.float32) * x, axis=3)
            acc_u += tl.sum(u.to(tl.float32) * x, axis=3)
        x_ptrs += GROUPS * 128
        g_ptrs += GROUPS * 128
        u_ptrs += GROUPS * 128
    if PDL == 1:
        tl.extra.cuda.gdc_launch_dependents()
    gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)
    up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
    h = _gated_activation(gate, up, ACT)
    tl.store(h_ptr + slot * stride_h + offs_i, h, mask=ok)


@triton.jit
def _decode_down_v2_kernel(h_ptr, w_ptr, w_scale_ptr, ids_ptr, topk_w_ptr, out_ptr, part_ptr, cnt_ptr, H, inter, E,
                           scale, n_cnt, stride_h, stride_it, stride_ik, stride_wt, stride_wk, stride_we, stride_wn,
                           stride_wse, stride_wsn, stride_wsk, stride_out, stride_p, TOP_K: tl.constexpr,
                           FP8: tl.constexpr, BLOCK_H: tl.constexpr, GROUPS: tl.constexpr, VEC: tl.constexpr,
                           SPLIT: tl.constexpr, PDL: tl.constexpr, STAGES: tl.constexpr,
                           W_EVICT: tl.constexpr = ""):
    """``_decode_down_kernel``'s math in form 2. Without SPLIT: program (token, H-block) sums its token's slots in
    registers. SPLIT (K times the programs: each streams one slot's w2 block): program (slot, H-block) writes its
    top-k-weighted fp32 partial to ``part`` [T*K, H], then adds one to the token's H-block counter (zeroed by the
    gate/up kernel); the program that brings it to K sums the token's valid partials in slot order, times the
    routed scaling factor, into the output: deterministic (the sum's order is fixed, whichever program does it).
    FP8: h quantized per 128-column group each step; BLOCK_H divides 128, so one weight scale row a program.
    STAGES: as the gate/up kernel's (Triton's software pipeline over the loop, through shared memory). W_EVICT: the
    weight loads' eviction policy ("" or "evict_first")."""
    hb = tl.program_id(1)
    if SPLIT:
        slot = tl.program_id(0).to(tl.int64)
        t = slot // TOP_K
        k_first = slot % TOP_K
        n_slots = 1
    else:
        t = tl.program_id(0).to(tl.int64)
        k_first = 0
        n_slots = TOP_K
    LANES: tl.constexpr = 128 // VEC
    s_row = (hb * BLOCK_H) // 128
    offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < H
    grp = tl.arange(0, GROUPS)
    offs_i = (grp[:, None, None] * 128 + tl.arange(0, LANES)[None, :, None] * VEC
              + tl.arange(0, VEC)[None, None, :])  # [GROUPS, LANES, VEC]
    acc = tl.zeros((BLOCK_H, GROUPS, LANES), dtype=tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    n_i = tl.cdiv(inter, GROUPS * 128)
    for j in tl.range(0, n_slots * n_i, num_stages=STAGES):  # (slot, I-step) flat: the pipeline runs across slots
        k = k_first + j // n_i
        i = j % n_i
        e = tl.load(ids_ptr + t * stride_it + k * stride_ik)
        ok = (e >= 0) & (e < E)
        e = tl.where(ok, e, 0).to(tl.int64)
        limit = tl.where(ok, inter, 0)  # (a skipped slot loads nothing)
        weight = tl.load(topk_w_ptr + t * stride_wt + k * stride_wk).to(tl.float32)
        cols = i * GROUPS * 128 + offs_i
        i_mask = cols < limit
        hv = tl.load(h_ptr + (t * TOP_K + k) * stride_h + cols[None, :, :, :], mask=i_mask[None, :, :, :],
                     other=0.0)
        wv = tl.load(w_ptr + e * stride_we + offs_h.to(tl.int64)[:, None, None, None] * stride_wn
                     + cols[None, :, :, :], mask=h_mask[:, None, None, None] & i_mask[None, :, :, :], other=0.0,
                     eviction_policy=W_EVICT)
        if FP8:
            w_s = tl.load(w_scale_ptr + e * stride_wse + s_row * stride_wsn + (i * GROUPS + grp) * stride_wsk,
                          mask=(i * GROUPS + grp) * 128 < limit, other=0.0)  # [GROUPS]
            hv = _quant_groups_4d(hv, w_ptr.dtype.element_ty)
            acc += tl.sum(wv.to(tl.float32) * hv, axis=3) * (w_s * weight)[None, :, None]
        else:
            acc += tl.sum(wv.to(tl.float32) * hv, axis=3) * weight
    total = tl.sum(tl.sum(acc, axis=2), axis=1)
    if SPLIT:
        tl.store(part_ptr + slot * stride_p + offs_h, total, mask=h_mask)
        tl.debug_barrier()  # (every thread's partial stored before the counter moves)
        arrived = tl.atomic_add(cnt_ptr + t * n_cnt + hb, 1, sem="acq_rel", scope="gpu")
        if arrived == TOP_K - 1:  # the token's last slot for this H-block: reduce in slot order
            tl.store(cnt_ptr + t * n_cnt + hb, 0)  # (back to zero: a buffer zeroed once serves every launch)
            total = tl.zeros((BLOCK_H,), dtype=tl.float32)
            for k in tl.static_range(TOP_K):
                e = tl.load(ids_ptr + t * stride_it + k * stride_ik)
                if (e >= 0) & (e < E):
                    total += tl.load(part_ptr + (t * TOP_K + k) * stride_p + offs_h, mask=h_mask, other=0.0,
                                     cache_modifier=".cg")
            tl.store(out_ptr + t * stride_out + offs_h, (total * scale).to(out_ptr.dtype.element_ty), mask=h_mask)
    else:
        tl.store(out_ptr + t * stride_out + offs_h, (total * scale).to(out_ptr.dtype.element_ty), mask=h_mask)
