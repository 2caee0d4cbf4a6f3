"""Fused Triton kernels of ``torch_a2a`` (docs/decisions.md 63, 66), registered with the core by the plugin
(``plugin.py``) and imported at the first dispatch on a CUDA device.

The torch path (``moe_core.distributed.torch_a2a``) spends ~70 host operations a dispatch (~1.1 ms of host
time on the lent GPUs' host) for ~0.2 ms of GPU work. Here an exact normal dispatch is four kernels and two
collectives:

1. ``layout`` (two launches of one program per 128 tokens): per (token, rank) the 1-based row in the send buffer
   (0: not sent), and the counts message ``[W, 3 + E_local]`` of ``_normal_layout`` (ids below -1, ids from E up,
   rows per rank, (token, expert) pairs per expert) plus a last word (the direct exchange's overflow flag): the
   first counts each block's tokens per rank, the second scans each block with the earlier blocks' counts as base
   and adds the pairs per expert (atomic adds);
2. ``pack`` (one program per token, before the count exchange): the token's wire row quantized as the core
   quantizer does (FP8: the 128-channel group scales; INT8: one per token; IEEE division as decision 57 asks, and
   the scalar divisions by 448 / 127 as torch does them on the device: times the fp32 reciprocal on CUDA, a
   division elsewhere), written with its side block ``[scales | K ids (int32) | K weights (fp32)]`` into every
   send row of the token: one byte row per (token, rank), so ONE all-to-all moves data and side block;
3. ``unpack`` (one program per received row): the wire data to a contiguous ``[R, H]`` (the experts read
   it contiguous), the scales to ``[R, n_scale]``, the ids made local (-1 where the expert is elsewhere,
   with weight 0) and, in program 0, the per-local-expert counts from the received counts message.

Combine's ``reduce``: per token the sum of its returned rows (fp32, ranks in order, as ``_reduce_pairs_loop``).
``layout_fixed`` (two launches, as ``layout``) and ``pack_fixed`` (one program per slot): the fixed-capacity modes'
send slots, in-band counts included. Masked mode's receive side ``expand_masked`` (three launches: the slab rows
of each received pair, then the rows into the slab) and combine's weighted sums ``reduce_masked``.

The direct-write exchanges (``exchange_fixed``, ``exchange_masked_back``, ``exchange_normal``, ``exchange_counts``,
decision 66): receive rows in torch symmetric memory, which the same pack / reduce kernels write straight into
through a table of every rank's address of them (``_aligned``), between two barriers; graph-capturable once
allocated. ``exchange_masked`` (decision 71): masked dispatch whose own slots go straight into the slab (no
transfer, no expansion after it), a counts exchange (``self_layout``) ahead of the pack.

Launched through ``launch.launch`` (the compiled launcher, without ``JITFunction.run``'s per-call binding): the
arguments that change per call are few (the token count), so its value-keyed cache hits.

A send row is ``[data (H * element bytes, padded to 16) | side block (4 * (n_scale + 2K) bytes)]``, padded
to 16 bytes; it is private to ``pack`` and ``unpack``. Everything here is checked byte for byte against the
torch functions in ``tests/test_a2a_kernels.py`` (Triton's interpreter on the CPU, every rank's buffers in one
process for the direct writes) and on NCCL.
"""

from __future__ import annotations

import socket
import warnings

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from moe_core.plugin_api import TorchA2AKernels, WireDtype, quant
from moe_plugin_cuda.triton.launch import cdiv, launch, pow2

_WIRE_CODE = {WireDtype.BF16: 0, WireDtype.FP8: 1, WireDtype.INT8: 2}
_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (v + M) - M rounds an fp32 |v| < 2**22 to nearest, ties to even


# fp32 1 / qmax as CUDA's torch computes a Python-scalar divisor's reciprocal (a kernel's float argument is fp32)
_INV_QMAX = {WireDtype.BF16: 0.0, WireDtype.FP8: float(torch.tensor(1.0, dtype=torch.float32) / quant.FP8_MAX),
             WireDtype.INT8: float(torch.tensor(1.0, dtype=torch.float32) / 127)}


@triton.jit
def _rank_hits(ids_ptr, tok, ok, ranks, K: tl.constexpr, E: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr,
               WP: tl.constexpr):
    """int32 ``[BT, WP]``: 1 where token ``tok`` has an expert (id in [0, E)) on rank ``ranks``, else 0."""
    hit = tl.zeros([BT, WP], dtype=tl.int32)
    for k in tl.static_range(K):
        ids = tl.load(ids_ptr + tok.to(tl.int64) * K + k, mask=ok, other=-1)
        dest = tl.where((ids >= 0) & (ids < E), ids // EL, -1).to(tl.int32)
        hit = tl.maximum(hit, (dest[:, None] == ranks[None, :]).to(tl.int32))
    return hit


@triton.jit
def _layout_count_kernel(ids_ptr, part_ptr, msg_ptr, T, K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr,
                         WP: tl.constexpr, EL: tl.constexpr, ELP: tl.constexpr, BT: tl.constexpr):
    """Layout, step 1 of 2 (one program per ``BT`` tokens): the block's tokens per rank and its ids below -1 and
    from E up into ``part[b] = [per rank ..., below, above]`` (int32); program 0 zeroes the per-expert counts of
    the message, which step 2 adds to."""
    E: tl.constexpr = W * EL
    b = tl.program_id(0)
    ranks = tl.arange(0, WP)
    kk = tl.arange(0, KP)
    tok = b * BT + tl.arange(0, BT)
    ok = tok < T
    block = tl.load(ids_ptr + tok[:, None].to(tl.int64) * K + kk[None, :], mask=ok[:, None] & (kk < K)[None, :],
                    other=-1)
    hit = _rank_hits(ids_ptr, tok, ok, ranks, K, E, EL, BT, WP)
    out = part_ptr + b.to(tl.int64) * (W + 2)
    tl.store(out + ranks, tl.sum(hit, axis=0), mask=ranks < W)
    tl.store(out + W, tl.sum(tl.sum((block < -1).to(tl.int32), axis=1), axis=0))
    tl.store(out + W + 1, tl.sum(tl.sum((block >= E).to(tl.int32), axis=1), axis=0))
    if b == 0:  # (word 3 + EL: the direct exchange's overflow flag, set by its pack)
        j = tl.arange(0, ELP)
        tl.store(msg_ptr + ranks[:, None].to(tl.int64) * (4 + EL) + 3 + j[None, :], tl.zeros([WP, ELP], dtype=tl.int64),
                 mask=(ranks < W)[:, None] & (j < EL + 1)[None, :])


@triton.jit
def _layout_rows_kernel(ids_ptr, part_ptr, row_ptr, msg_ptr, T, NB, K: tl.constexpr, KP: tl.constexpr,
                        W: tl.constexpr, WP: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr, NBB: tl.constexpr):
    """Layout, step 2 of 2 (one program per ``BT`` tokens): row of (token, rank) = rows of the lower ranks + the
    rank's rows in the earlier blocks + its running count in this block (from 1; 0: not sent), from step 1's
    per-block counts; the block's (token, expert) pairs added per expert (atomic adds: ``tl.histogram``
    miscounted with 256 experts on H200, Triton 3.6); program 0 writes the rest of the counts message (row r:
    [ids below -1, ids from E up, rows for r, ...])."""
    E: tl.constexpr = W * EL
    b = tl.program_id(0)
    ranks = tl.arange(0, WP)
    rmask = ranks < W
    totals = tl.zeros([WP], dtype=tl.int32)
    before = tl.zeros([WP], dtype=tl.int32)
    below = tl.zeros([NBB], dtype=tl.int32)
    above = tl.zeros([NBB], dtype=tl.int32)
    for start in range(0, NB, NBB):
        blocks = start + tl.arange(0, NBB)
        bmask = blocks < NB
        p = tl.load(part_ptr + blocks[:, None].to(tl.int64) * (W + 2) + ranks[None, :],
                    mask=bmask[:, None] & rmask[None, :], other=0)
        totals += tl.sum(p, axis=0)
        before += tl.sum(tl.where((blocks < b)[:, None], p, 0), axis=0)
        below += tl.load(part_ptr + blocks.to(tl.int64) * (W + 2) + W, mask=bmask, other=0)
        above += tl.load(part_ptr + blocks.to(tl.int64) * (W + 2) + W + 1, mask=bmask, other=0)
    carry = tl.cumsum(totals, axis=0) - totals + before
    tok = b * BT + tl.arange(0, BT)
    ok = tok < T
    hit = _rank_hits(ids_ptr, tok, ok, ranks, K, E, EL, BT, WP)
    row = carry[None, :] + tl.cumsum(hit, axis=0)
    tl.store(row_ptr + ranks[None, :].to(tl.int64) * T + tok[:, None], tl.where(hit > 0, row, 0).to(tl.int64),
             mask=ok[:, None] & rmask[None, :])
    kk = tl.arange(0, KP)
    block = tl.load(ids_ptr + tok[:, None].to(tl.int64) * K + kk[None, :], mask=ok[:, None] & (kk < K)[None, :],
                    other=-1)
    expert = (block >= 0) & (block < E)
    e = tl.where(expert, block, 0)
    tl.atomic_add(msg_ptr + (e // EL) * (4 + EL) + 3 + e % EL, tl.full([BT, KP], 1, tl.int64), mask=expert,
                  sem="relaxed")
    if b == 0:
        mrow = ranks.to(tl.int64) * (4 + EL)
        tl.store(msg_ptr + mrow, (tl.sum(below, axis=0) + tl.zeros([WP], dtype=tl.int32)).to(tl.int64), mask=rmask)
        tl.store(msg_ptr + mrow + 1, (tl.sum(above, axis=0) + tl.zeros([WP], dtype=tl.int32)).to(tl.int64),
                 mask=rmask)
        tl.store(msg_ptr + mrow + 2, totals.to(tl.int64), mask=rmask)


@triton.jit
def _layout_fixed_count_kernel(ids_ptr, part_ptr, src_ptr, T, T_IDS, C, K: tl.constexpr, KP: tl.constexpr,
                               W: tl.constexpr, WP: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr):
    """The fixed-capacity modes' send side (``_masked_layout`` + ``_sources``), step 1 of 2 (one program per ``BT``
    tokens and slots): the padding source ``T`` into the block's slots, and ``part[b] = [the block's tokens per
    rank ..., its ids outside [-1, E) over ``T_IDS`` tokens]`` (an overflowing rank sends none: ``T`` = 0, and
    still counts its ids)."""
    E: tl.constexpr = W * EL
    b = tl.program_id(0)
    ranks = tl.arange(0, WP)
    kk = tl.arange(0, KP)
    s = b * BT + tl.arange(0, BT)
    tl.store(src_ptr + s, tl.zeros([BT], dtype=tl.int64) + T, mask=s < W * C)
    tok = b * BT + tl.arange(0, BT)
    block = tl.load(ids_ptr + tok[:, None].to(tl.int64) * K + kk[None, :],
                    mask=(tok < T_IDS)[:, None] & (kk < K)[None, :], other=-1)
    hit = _rank_hits(ids_ptr, tok, tok < T, ranks, K, E, EL, BT, WP)
    out = part_ptr + b.to(tl.int64) * (W + 1)
    tl.store(out + ranks, tl.sum(hit, axis=0), mask=ranks < W)
    tl.store(out + W, tl.sum(tl.sum(((block < -1) | (block >= E)).to(tl.int32), axis=1), axis=0))


@triton.jit
def _layout_fixed_rows_kernel(ids_ptr, part_ptr, slot_ptr, src_ptr, bad_ptr, T, C, NB, K: tl.constexpr,
                              W: tl.constexpr, WP: tl.constexpr, EL: tl.constexpr, BT: tl.constexpr,
                              NBB: tl.constexpr):
    """Step 2 of 2: slot of (token, rank) (rank r's slots r*C + 1 ..., after its tokens of the earlier blocks; 0:
    not sent), the source token of each used slot; program 0 sums the bad-id counts."""
    E: tl.constexpr = W * EL
    b = tl.program_id(0)
    ranks = tl.arange(0, WP)
    rmask = ranks < W
    before = tl.zeros([WP], dtype=tl.int32)
    bad = tl.zeros([NBB], dtype=tl.int32)
    for start in range(0, NB, NBB):
        blocks = start + tl.arange(0, NBB)
        p = tl.load(part_ptr + blocks[:, None].to(tl.int64) * (W + 1) + ranks[None, :],
                    mask=(blocks < b)[:, None] & rmask[None, :], other=0)
        before += tl.sum(p, axis=0)
        bad += tl.load(part_ptr + blocks.to(tl.int64) * (W + 1) + W, mask=blocks < NB, other=0)
    if b == 0:
        tl.store(bad_ptr, tl.sum(bad, axis=0))
    tok = b * BT + tl.arange(0, BT)
    ok = tok < T
    hit = _rank_hits(ids_ptr, tok, ok, ranks, K, E, EL, BT, WP)
    row = (ranks * C + before)[None, :] + tl.cumsum(hit, axis=0)
    mine = ok[:, None] & rmask[None, :]
    tl.store(slot_ptr + ranks[None, :].to(tl.int64) * T + tok[:, None], tl.where(hit > 0, row, 0).to(tl.int64),
             mask=mine)
    tl.store(src_ptr + (row - 1).to(tl.int64), tok[:, None].to(tl.int64) + tl.zeros([BT, WP], dtype=tl.int64),
             mask=mine & (hit > 0))


@triton.jit
def _e4m3_bits(q):
    """fp32 ``q`` (``|q| <= 448``) -> its e4m3fn code as uint8, rounded to nearest, ties to even (as torch's
    ``.to(float8_e4m3fn)``). Integer arithmetic rather than ``.to(tl.float8e4nv)``: the same on the GPU, and
    Triton's interpreter rounds that cast wrongly where the mantissa carries into the exponent."""
    bits = q.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(q)
    # normal (|q| >= 2**-6): keep 3 of the 23 mantissa bits, rounding the 20 dropped ones to nearest even
    ab = a.to(tl.int32, bitcast=True)
    r = (ab + 0x7FFFF + ((ab >> 20) & 1)) & ~0xFFFFF
    normal = (((r >> 23) - 120) << 3) | ((r >> 20) & 7)
    # subnormal: a multiple of 2**-9 (code = the multiple; 8 is the smallest normal, code 8 too)
    sub = ((a * 512.0 + _MAGIC) - _MAGIC).to(tl.int32)
    return (tl.where(a >= 0.015625, normal, sub) | sign).to(tl.uint8)


@triton.jit
def _fp8_groups(v, inv_qmax, QMAX: tl.constexpr, FLOOR: tl.constexpr, RECIPROCAL: tl.constexpr):
    """fp32 ``v [groups, GROUP]`` -> (its e4m3 codes, uint8, and one fp32 scale per group), as the core quantizer."""
    scale = tl.maximum(tl.max(tl.abs(v), axis=1), FLOOR)
    scale = scale * inv_qmax if RECIPROCAL else tl.math.div_rn(scale, QMAX)
    return _e4m3_bits(tl.minimum(tl.maximum(tl.math.div_rn(v, scale[:, None]), -QMAX), QMAX)), scale


@triton.jit
def _int8_scale(x_row, HL, H, inv_qmax, BH: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr,
                RECIPROCAL: tl.constexpr):
    """A token's one fp32 INT8 scale (its first ``HL`` of ``H`` channels)."""
    amax = tl.zeros([BH], dtype=tl.float32)
    for start in range(0, H, BH):
        offs = start + tl.arange(0, BH)
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + offs, mask=offs < HL, other=0.0).to(tl.float32)))
    scale = tl.maximum(tl.max(amax), FLOOR)
    return scale * inv_qmax if RECIPROCAL else tl.math.div_rn(scale, QMAX)


@triton.jit
def _int8_codes(v, scale, QMAX: tl.constexpr):
    q = (tl.math.div_rn(v, scale) + _MAGIC) - _MAGIC  # torch.round: to nearest, ties to even
    return tl.minimum(tl.maximum(q, -QMAX), QMAX).to(tl.int8)


@triton.jit
def _store_token(x_row, HL, send_ptr, base, sent, valid, H, DP, inv_qmax, WP: tl.constexpr, WIRE: tl.constexpr,
                 NS: tl.constexpr, GROUP: tl.constexpr, GB: tl.constexpr, BH: tl.constexpr, QMAX: tl.constexpr,
                 FLOOR: tl.constexpr, RECIPROCAL: tl.constexpr):
    """One token's wire data (its first ``HL`` channels, zeros past them) into the send rows at byte offsets
    ``base [WP]`` where ``sent``, and its scales into their side blocks (byte ``DP``): 0 where not ``valid``
    (padding rows)."""
    side = send_ptr + base + DP
    if WIRE == 0:  # the activations' own dtype: copied
        for start in range(0, H, BH):
            offs = start + tl.arange(0, BH)
            v = tl.load(x_row + offs, mask=offs < HL, other=0.0)
            out = (send_ptr + base[:, None]).to(tl.pointer_type(v.dtype))
            tl.store(out + offs[None, :], v[None, :], mask=sent[:, None] & (offs < H)[None, :])
    elif WIRE == 1:  # FP8 e4m3, one fp32 scale per GROUP channels
        for start in range(0, H, GB * GROUP):
            g = start // GROUP + tl.arange(0, GB)
            offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            v = tl.load(x_row + offs, mask=offs < HL, other=0.0).to(tl.float32)
            q, scale = _fp8_groups(v, inv_qmax, QMAX, FLOOR, RECIPROCAL)
            tl.store(send_ptr + base[:, None, None] + offs[None, :, :], q[None, :, :],
                     mask=sent[:, None, None] & (offs < H)[None, :, :])
            tl.store((side[:, None]).to(tl.pointer_type(tl.float32)) + g[None, :],
                     tl.where(valid[:, None], scale[None, :], 0.0), mask=sent[:, None] & (g < NS)[None, :])
    else:  # INT8, one fp32 scale per token
        scale = _int8_scale(x_row, HL, H, inv_qmax, BH, QMAX, FLOOR, RECIPROCAL)
        for start in range(0, H, BH):
            offs = start + tl.arange(0, BH)
            v = tl.load(x_row + offs, mask=offs < HL, other=0.0).to(tl.float32)
            q = _int8_codes(v, scale, QMAX)
            tl.store((send_ptr + base[:, None]).to(tl.pointer_type(tl.int8)) + offs[None, :], q[None, :],
                     mask=sent[:, None] & (offs < H)[None, :])
        tl.store(side.to(tl.pointer_type(tl.float32)), tl.where(valid, scale, 0.0), mask=sent)


@triton.jit
def _store_token_pairs(x_row, HL, slab_ptr, scale_ptr, rows, here, H, DB, inv_qmax, K: tl.constexpr,
                       KP: tl.constexpr, WIRE: tl.constexpr, NS: tl.constexpr, GROUP: tl.constexpr, GB: tl.constexpr,
                       BH: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr, RECIPROCAL: tl.constexpr):
    """One token's wire data (quantized as ``_store_token``) into the slab rows ``rows [KP]`` (``DB`` bytes each,
    from byte 0 of ``slab_ptr``) of its pairs ``here``, and its scales into the same rows of ``scale_ptr`` (fp32
    ``[rows, NS]``): each block quantized once and stored once per pair (a [K, block] tile of addresses spills)."""
    kk = tl.arange(0, KP)
    if WIRE == 0:
        for start in range(0, H, BH):
            offs = start + tl.arange(0, BH)
            v = tl.load(x_row + offs, mask=offs < HL, other=0.0)
            for k in tl.static_range(K):
                row = tl.sum(tl.where(kk == k, rows, 0), axis=0)
                ok = tl.sum(tl.where(kk == k, here.to(tl.int32), 0), axis=0) + offs * 0 > 0
                tl.store((slab_ptr + row * DB).to(tl.pointer_type(v.dtype)) + offs, v, mask=ok & (offs < H))
    elif WIRE == 1:
        for start in range(0, H, GB * GROUP):
            g = start // GROUP + tl.arange(0, GB)
            offs = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
            v = tl.load(x_row + offs, mask=offs < HL, other=0.0).to(tl.float32)
            q, scale = _fp8_groups(v, inv_qmax, QMAX, FLOOR, RECIPROCAL)
            for k in tl.static_range(K):
                row = tl.sum(tl.where(kk == k, rows, 0), axis=0)
                ok = tl.sum(tl.where(kk == k, here.to(tl.int32), 0), axis=0) + g * 0 > 0
                tl.store(slab_ptr + row * DB + offs, q, mask=ok[:, None] & (offs < H))
                tl.store(scale_ptr + row * NS + g, scale, mask=ok & (g < NS))
    else:
        scale = _int8_scale(x_row, HL, H, inv_qmax, BH, QMAX, FLOOR, RECIPROCAL)
        for start in range(0, H, BH):
            offs = start + tl.arange(0, BH)
            v = tl.load(x_row + offs, mask=offs < HL, other=0.0).to(tl.float32)
            q = _int8_codes(v, scale, QMAX)
            for k in tl.static_range(K):
                row = tl.sum(tl.where(kk == k, rows, 0), axis=0)
                ok = tl.sum(tl.where(kk == k, here.to(tl.int32), 0), axis=0) + offs * 0 > 0
                tl.store((slab_ptr + row * DB).to(tl.pointer_type(tl.int8)) + offs, q, mask=ok & (offs < H))
        tl.store(scale_ptr + rows, tl.zeros([KP], dtype=tl.float32) + scale, mask=here)


@triton.jit
def _aligned(anchor, address, dtype: tl.constexpr):
    """``address`` (an int64 loaded from memory: a peer's rows) as a ``dtype`` pointer the compiler knows 16-byte
    aligned (``_symmetric_rows`` checks that they are): an offset from ``anchor`` (a pointer argument, which Triton
    specializes as aligned), hinted a multiple of 16. A loaded address cast straight to a pointer has no known
    alignment: the stores through it took 1 or 2 bytes each (the SASS for sm_90; decision 71)."""
    base = anchor.to(tl.pointer_type(tl.uint8))
    offset = tl.multiple_of(address - base.to(tl.int64), 16)
    return (base + offset).to(tl.pointer_type(dtype))


@triton.jit
def _pack_kernel(x_ptr, x_stride, ids_ptr, w_ptr, row_ptr, row_s0, row_s1, send_ptr, peers_ptr, msg_ptr, H, B, DP,
                 inv_qmax, C, RANK, K: tl.constexpr, KP: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
                 EL: tl.constexpr, WIRE: tl.constexpr, NS: tl.constexpr, GROUP: tl.constexpr, GB: tl.constexpr,
                 BH: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr, RECIPROCAL: tl.constexpr,
                 DIRECT: tl.constexpr):
    """Exact normal mode: one program per token, writing every send row of it (``row``: 1-based, 0 none).
    ``DIRECT``: the send rows for rank r go straight into rank r's receive rows (base address ``peers[r]``), this
    rank's chunk of ``C`` rows at ``RANK * C``, in order (after the rows for lower ranks, from the counts message
    ``msg`` ``[W, 4 + EL]``); rows past ``C`` are not written, and program 0 sets the message's last word (1: this
    rank sends some rank more than ``C`` rows, and every rank then moves the rows again by the collective)."""
    t = tl.program_id(0).to(tl.int64)
    ranks = tl.arange(0, WP)
    dst = tl.load(row_ptr + t * row_s0 + ranks.to(tl.int64) * row_s1, mask=ranks < W, other=0)  # 1-based, 0: none
    sent = dst > 0
    if DIRECT:
        rows = tl.load(msg_ptr + ranks * (4 + EL) + 2, mask=ranks < W, other=0)
        j = dst - 1 - (tl.cumsum(rows, axis=0) - rows)  # the row's place in this rank's chunk at rank r
        sent = sent & (j < C)
        if t == 0:
            over = (tl.max(rows, axis=0) > C).to(tl.int64)
            tl.store(msg_ptr + ranks * (4 + EL) + 3 + EL, over + tl.zeros([WP], dtype=tl.int64), mask=ranks < W)
        # every rank's rows as byte offsets from rank 0's (one flat address space: CUDA's, the interpreter's)
        first = tl.load(peers_ptr)
        base = tl.multiple_of(tl.load(peers_ptr + ranks, mask=ranks < W, other=0) - first + (RANK * C + j) * B, 16)
        send_ptr = _aligned(send_ptr, first, tl.uint8)
    else:
        base = (dst - 1) * B  # byte offset of each send row
    _store_token(x_ptr + t * x_stride, H, send_ptr, base, sent, sent, H, DP, inv_qmax, WP, WIRE, NS, GROUP, GB, BH,
                 QMAX, FLOOR, RECIPROCAL)
    side = send_ptr + base + DP
    kk = tl.arange(0, KP)
    ids = tl.load(ids_ptr + t * K + kk, mask=kk < K, other=0).to(tl.int32)
    wts = tl.load(w_ptr + t * K + kk, mask=kk < K, other=0.0).to(tl.float32)
    kmask = sent[:, None] & (kk < K)[None, :]
    tl.store((side[:, None] + 4 * NS).to(tl.pointer_type(tl.int32)) + kk[None, :], ids[None, :], mask=kmask)
    tl.store((side[:, None] + 4 * (NS + K)).to(tl.pointer_type(tl.float32)) + kk[None, :], wts[None, :], mask=kmask)


@triton.jit
def _pack_fixed_kernel(x_ptr, x_stride, ids_ptr, w_ptr, src_ptr, bad_ptr, send_ptr, peers_ptr, T, T_IN, H, HL, B, DP,
                       inv_qmax, C, W, RANK, slab_ptr, scale_ptr, index_ptr, counts_ptr, DB, K: tl.constexpr,
                       KP: tl.constexpr, WIRE: tl.constexpr, NS: tl.constexpr, GROUP: tl.constexpr, GB: tl.constexpr,
                       BH: tl.constexpr, QMAX: tl.constexpr, FLOOR: tl.constexpr, RECIPROCAL: tl.constexpr,
                       DIRECT: tl.constexpr, SELF: tl.constexpr, EL: tl.constexpr):
    """The fixed-capacity modes: one program per send slot ``s`` (``src[s]``: its token, T for padding). A padding
    slot holds the last token's data (zeros without tokens), scales 0, ids -1, weights 0, as ``_wire_rows`` +
    ``_gather_rows`` make it; every slot ends with the in-band counts (sender's bad ids, its token count).
    ``DIRECT``: slot ``s`` = ``r * C + j`` goes straight to rank r's receive rows (base address ``peers[r]``) as
    row ``RANK * C + j``, where an all-to-all of the send rows would put it; else to ``send`` row ``s``.
    Program p takes slot ``(p % W) * C + p // W``: the ranks' slots interleaved, so that the programs running at any
    time write to every rank at once (in slot order they wrote one rank's rows after the other: this rank's over
    HBM, then the peers' over NVLink, one after the other; 265 us against exact normal's 177 us for the same rows
    at 4096 tokens, 2x H100, decision 71).
    ``SELF`` (masked mode's direct exchange, decision 71): this rank's own slots (``RANK * C ...``) skip the transfer
    and the expansion after it: their data (and scales) go straight into this rank's slab ``slab_ptr`` (rows of
    ``DB`` bytes; fp32 ``scale_ptr``) at the rows the receive side's ``_masked_index_kernel`` gives their pairs:
    ``index`` (``self_layout``'s slab row among this rank's own tokens) + the pairs of that expert from the lower
    ranks (``counts`` int64 ``[W, EL]``: row s, source s's pairs per expert here); only their side blocks go to
    the receive rows."""
    p = tl.program_id(0).to(tl.int64)
    s = (p % W) * C + p // W
    one = tl.arange(0, 1)
    t_src = tl.load(src_ptr + s + one)
    valid = t_src < T
    t_load = tl.minimum(t_src, T - 1)
    t_load = tl.maximum(t_load, 0)
    if DIRECT:
        send_ptr = _aligned(send_ptr, tl.load(peers_ptr + s // C), tl.uint8)
        base = (RANK * C + s % C) * B + one * 0
    else:
        base = s * B + one * 0
    sent = one == 0
    x_row = x_ptr + tl.sum(t_load) * x_stride
    kk = tl.arange(0, KP)
    if SELF and s // C == RANK:
        pick = (tl.sum(valid.to(tl.int32), axis=0) + kk * 0 > 0) & (kk < K)
        ids = tl.load(ids_ptr + tl.sum(t_load) * K + kk, mask=pick, other=-1)
        here = (ids >= RANK * EL) & (ids < (RANK + 1) * EL)
        le = tl.where(here, ids - RANK * EL, 0)
        lower = tl.zeros([KP], dtype=tl.int64)
        for r in range(0, RANK):
            lower += tl.load(counts_ptr + r * EL + le, mask=here, other=0)
        rows = tl.load(index_ptr + tl.sum(t_load) * K + kk, mask=here, other=0) + lower
        _store_token_pairs(x_row, HL, slab_ptr, scale_ptr, rows, here, H, DB, inv_qmax, K, KP, WIRE, NS, GROUP, GB,
                           BH, QMAX, FLOOR, RECIPROCAL)
    else:
        _store_token(x_row, HL, send_ptr, base, sent, valid, H, DP, inv_qmax, 1, WIRE, NS, GROUP, GB,
                     BH, QMAX, FLOOR, RECIPROCAL)
    side = send_ptr + base + DP
    pick = valid[:, None] & (kk < K)[None, :]
    ids = tl.load(ids_ptr + t_load[:, None] * K + kk[None, :], mask=pick, other=-1).to(tl.int32)
    wts = tl.load(w_ptr + t_load[:, None] * K + kk[None, :], mask=pick, other=0.0).to(tl.float32)
    kmask = (kk < K)[None, :] & sent[:, None]
    tl.store((side[:, None] + 4 * NS).to(tl.pointer_type(tl.int32)) + kk[None, :], ids, mask=kmask)
    tl.store((side[:, None] + 4 * (NS + K)).to(tl.pointer_type(tl.float32)) + kk[None, :], wts, mask=kmask)
    counts = side + 4 * (NS + 2 * K)
    tl.store(counts.to(tl.pointer_type(tl.int32)), tl.load(bad_ptr + one * 0).to(tl.int32))
    tl.store((counts + 4).to(tl.pointer_type(tl.int32)), (T_IN + one * 0).to(tl.int32))


@triton.jit
def _unpack_kernel(recv_ptr, msg_ptr, data_ptr, scale_ptr, lid_ptr, w_ptr, counts_ptr, B, DP, WORDS, first, C,
                   ROWS: tl.constexpr, NS: tl.constexpr, NSP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr,
                   W: tl.constexpr, WP: tl.constexpr, EL: tl.constexpr, ELP: tl.constexpr, BD: tl.constexpr,
                   CHUNKED: tl.constexpr):
    """One program per received row (``CHUNKED``: the rows of source s are rows ``s * C ...`` of ``recv``, as the
    direct exchange leaves them, and a program past the received rows, or past its source's chunk, writes nothing:
    the core may unpack at the chunks' size before it reads the counts; else one after the other)."""
    pid = tl.program_id(0)
    ranks = tl.arange(0, WP)
    if pid == 0:  # received (token, expert) pairs per local expert, from the counts message
        j = tl.arange(0, ELP)
        m = tl.load(msg_ptr + ranks[:, None] * (4 + EL) + 3 + j[None, :],
                    mask=(ranks < W)[:, None] & (j < EL)[None, :], other=0)
        tl.store(counts_ptr + j, tl.sum(m, axis=0).to(tl.int32), mask=j < EL)
    if ROWS:  # (no rows: one program, for the counts; a value-keyed row count would miss launch's cache)
        r = pid.to(tl.int64)
        if CHUNKED:
            rows = tl.load(msg_ptr + ranks * (4 + EL) + 2, mask=ranks < W, other=0)  # from each source
            source = tl.sum((tl.cumsum(rows, axis=0) <= r).to(tl.int64), axis=0)
            within = r - tl.sum(tl.where(ranks < source, rows, 0), axis=0)
            src = recv_ptr + (source * C + within) * B
            live = (source < W) & (within < C)
        else:
            src = recv_ptr + r * B
            live = r >= 0
        _unpack_row(src, r, data_ptr, scale_ptr, lid_ptr, w_ptr, DP, WORDS, first, live, NS, NSP, K, KP, EL, BD)


@triton.jit
def _unpack_row(src, r, data_ptr, scale_ptr, lid_ptr, w_ptr, DP, WORDS, first, live, NS: tl.constexpr,
                NSP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr, EL: tl.constexpr, BD: tl.constexpr):
    """Received row ``r`` (at ``src``): its data words, scales, local ids and weights, where ``live``."""
    if live:
        for start in range(0, WORDS, BD):
            offs = start + tl.arange(0, BD)
            v = tl.load(src.to(data_ptr.dtype) + offs, mask=offs < WORDS)  # data words (data_ptr's type)
            tl.store(data_ptr + r * WORDS + offs, v, mask=offs < WORDS)
        side = src + DP
        if NS > 0:
            s = tl.arange(0, NSP)
            tl.store(scale_ptr + r * NS + s, tl.load(side.to(tl.pointer_type(tl.float32)) + s, mask=s < NS),
                     mask=s < NS)
        kk = tl.arange(0, KP)
        ids = tl.load((side + 4 * NS).to(tl.pointer_type(tl.int32)) + kk, mask=kk < K, other=-1)
        wts = tl.load((side + 4 * (NS + K)).to(tl.pointer_type(tl.float32)) + kk, mask=kk < K, other=0.0)
        mine = (ids >= first) & (ids < first + EL)
        tl.store(lid_ptr + r * K + kk, tl.where(mine, ids - first, -1), mask=kk < K)
        tl.store(w_ptr + r * K + kk, tl.where(mine, wts, 0.0), mask=kk < K)


@triton.jit
def _masked_count_kernel(meta_ptr, meta_stride, part_ptr, CW, FIRST, NS: tl.constexpr, K: tl.constexpr,
                         EL: tl.constexpr, ELP: tl.constexpr, BS: tl.constexpr):
    """Masked receive, step 1 of 3 (one program per ``BS`` received slots): the block's pairs per local expert
    (``part[b]``, int32 ``[EL]``). A slot holds each expert at most once (distinct top-k ids)."""
    b = tl.program_id(0)
    s = b * BS + tl.arange(0, BS)
    j = tl.arange(0, ELP)
    hits = tl.zeros([ELP], dtype=tl.int32)
    for k in tl.static_range(K):
        ids = tl.load(meta_ptr + s.to(tl.int64) * meta_stride + NS + k, mask=s < CW, other=-1)
        le = tl.where((ids >= FIRST) & (ids < FIRST + EL), ids - FIRST, ELP)  # ELP: not here
        hits += tl.sum((le[:, None] == j[None, :]).to(tl.int32), axis=0)
    tl.store(part_ptr + b.to(tl.int64) * EL + j, hits, mask=j < EL)


@triton.jit
def _masked_index_kernel(meta_ptr, meta_stride, part_ptr, index_ptr, valid_ptr, w_ptr, m_ptr, N, CW, NB, FIRST,
                         NS: tl.constexpr, K: tl.constexpr, EL: tl.constexpr, ELP: tl.constexpr, BS: tl.constexpr,
                         NBB: tl.constexpr, SENDER: tl.constexpr, E: tl.constexpr):
    """Step 2 of 3: slab row of each of the ``N`` received (slot, k) pairs here: expert * CW + the pairs of that
    expert in the earlier slots (the earlier blocks' from step 1); ``EL * CW`` where not here (as
    ``_masked_received``); the sender's weights; program 0 writes ``masked_m``. ``SENDER`` (``self_layout``): the
    "slots" are this rank's own tokens (``meta``: their ids, ``[T, K]``), no validity or weights are written, and
    every id in ``[0, E)`` is added to its expert's count in ``w_ptr`` (int64 ``[E]``, zeroed before)."""
    b = tl.program_id(0)
    j = tl.arange(0, ELP)
    before = tl.zeros([ELP], dtype=tl.int32)
    totals = tl.zeros([ELP], dtype=tl.int32)
    for start in range(0, NB, NBB):
        blocks = start + tl.arange(0, NBB)
        p = tl.load(part_ptr + blocks[:, None].to(tl.int64) * EL + j[None, :],
                    mask=(blocks < NB)[:, None] & (j < EL)[None, :], other=0)
        totals += tl.sum(p, axis=0)
        before += tl.sum(tl.where((blocks < b)[:, None], p, 0), axis=0)
    if b == 0:
        tl.store(m_ptr + j, totals, mask=j < EL)
    s = b * BS + tl.arange(0, BS)
    ok = s < N
    row = meta_ptr + s.to(tl.int64) * meta_stride
    present = tl.zeros([BS, ELP], dtype=tl.int32)  # slot has a pair of expert j
    for k in tl.static_range(K):
        ids = tl.load(row + NS + k, mask=ok, other=-1)
        le = tl.where((ids >= FIRST) & (ids < FIRST + EL), ids - FIRST, ELP)
        present += (le[:, None] == j[None, :]).to(tl.int32)
    seen = tl.cumsum(present, axis=0) + before[None, :]  # pairs of each expert up to and with each slot
    for k in tl.static_range(K):
        ids = tl.load(row + NS + k, mask=ok, other=-1)
        mine = (ids >= FIRST) & (ids < FIRST + EL)
        le = tl.where(mine, ids - FIRST, ELP)
        count = tl.sum(tl.where(le[:, None] == j[None, :], seen, 0), axis=1)  # the pair's, from 1
        out = s.to(tl.int64) * K + k
        tl.store(index_ptr + out, tl.where(mine, le.to(tl.int64) * CW + count - 1, EL * CW), mask=ok)
        if SENDER:
            expert = ok & (ids >= 0) & (ids < E)
            tl.atomic_add(w_ptr + tl.where(expert, ids, 0), tl.full([BS], 1, tl.int64), mask=expert, sem="relaxed")
        else:
            tl.store(valid_ptr + out, mine.to(tl.int8), mask=ok)
            tl.store(w_ptr + out, tl.load((row + NS + K + k).to(tl.pointer_type(tl.float32)), mask=ok), mask=ok)


@triton.jit
def _masked_expand_kernel(data_ptr, data_stride, meta_ptr, meta_stride, index_ptr, valid_ptr, slab_ptr, scale_ptr,
                          WORDS, SKIP, SKIPPED, NS: tl.constexpr, NSP: tl.constexpr, K: tl.constexpr,
                          BD: tl.constexpr):
    """Step 3 of 3 (program (slot s, block of ``BD`` words)): the slot's words (row at byte ``s * data_stride``;
    ``WORDS`` words of ``slab_ptr``'s type) and, in block 0, its scales into the slab rows of its pairs here. One
    row in registers, stored once per pair (a [K, BD] tile of addresses spilled). The ``SKIPPED`` slots from
    ``SKIP`` on are left out (program p takes slot p below ``SKIP``, p + ``SKIPPED`` from there): the sender wrote
    those straight into the slab (``exchange_masked``)."""
    p = tl.program_id(0).to(tl.int64)
    s = p + (p >= SKIP).to(tl.int64) * SKIPPED
    offs = tl.program_id(1) * BD + tl.arange(0, BD)
    ok = offs < WORDS
    v = tl.load((data_ptr + s * data_stride).to(slab_ptr.dtype) + offs, mask=ok)
    g = tl.arange(0, NSP)
    for k in tl.static_range(K):
        here = tl.load(valid_ptr + s * K + k + offs * 0) != 0  # (a block: a scalar mask fails in the interpreter)
        dst = tl.load(index_ptr + s * K + k)
        tl.store(slab_ptr + dst * WORDS + offs, v, mask=ok & here)
        if NS > 0:
            if tl.program_id(1) == 0:
                sc = tl.load((meta_ptr + s * meta_stride).to(tl.pointer_type(tl.float32)) + g, mask=g < NS)
                tl.store(scale_ptr + dst * NS + g, sc, mask=(g < NS) & (tl.load(valid_ptr + s * K + k + g * 0) != 0))


@triton.jit
def _masked_reduce_kernel(y_ptr, index_ptr, valid_ptr, w_ptr, out_ptr, peers_ptr, H, C, W, RANK, K: tl.constexpr,
                          KP: tl.constexpr, BH: tl.constexpr, DIRECT: tl.constexpr):
    """Masked combine on the experts' rank (program (s, h-block)): received slot ``s``'s weighted sum of its K slab
    rows of ``y`` in fp32, in the order of k, rounded to ``y``'s dtype, as ``_masked_pairs`` + ``_reduce_pairs_loop``
    compute it (a pair not here adds its slot's first pair here times 0, which is what that adds: +-0 or NaN). A slot
    with no pair here (padding: its sender never reads it back) is skipped. ``DIRECT``: the row goes straight to
    the slot's sender (``peers[s // C]``, row ``RANK * C + s % C``); else to ``out`` row ``s``. Program p takes slot
    ``(p % W) * C + p // W``: the ranks' chunks interleaved, as ``_pack_fixed_kernel`` (decision 71)."""
    p = tl.program_id(0).to(tl.int64)
    s = (p % W) * C + p // W
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    kk = tl.arange(0, KP)
    valid = tl.load(valid_ptr + s * K + kk, mask=kk < K, other=0) != 0
    if tl.sum(valid.to(tl.int32), axis=0) > 0:
        index = tl.load(index_ptr + s * K + kk, mask=kk < K, other=0)
        first = tl.min(tl.where(valid, kk, KP), axis=0)
        v_first = tl.load(y_ptr + tl.sum(tl.where(kk == first, index, 0), axis=0) * H + offs, mask=ok,
                          other=0.0).to(tl.float32)
        acc = tl.zeros([BH], dtype=tl.float32)
        for k in tl.static_range(K):
            here = (tl.load(valid_ptr + s * K + k + offs * 0) != 0)  # (as a block: a scalar mask fails in the interpreter)
            w = tl.load(w_ptr + s * K + k)
            row = tl.load(index_ptr + s * K + k)
            v = tl.load(y_ptr + row * H + offs, mask=ok & here, other=0.0).to(tl.float32)
            term = tl.where(here, v * w, v_first * 0.0)
            acc = term if k == 0 else acc + term
        res = _round_to(acc, y_ptr.dtype.element_ty)
        if DIRECT:
            dst = _aligned(out_ptr, tl.load(peers_ptr + s // C), y_ptr.dtype.element_ty)
            tl.store(dst + (RANK * C + s % C) * H + offs, res, mask=ok)
        else:
            tl.store(out_ptr + s * H + offs, res, mask=ok)


@triton.jit
def _reduce_kernel(back_ptr, row_ptr, row_s0, row_s1, out_ptr, H, W: tl.constexpr, BH: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BH + tl.arange(0, BH)
    ok = offs < H
    acc = tl.zeros([BH], dtype=tl.float32)
    for r in tl.static_range(W):
        src = tl.load(row_ptr + t * row_s0 + r * row_s1)  # 1-based returned row, 0: not sent there (a zero row)
        v = tl.load(back_ptr + (src - 1) * H + offs, mask=ok & (offs * 0 + src > 0), other=0.0).to(tl.float32)
        acc = v if r == 0 else acc + v
    res = _round_to(acc, back_ptr.dtype.element_ty)  # as torch: in the rows' dtype, then the tokens'
    if out_ptr.dtype.element_ty != back_ptr.dtype.element_ty:
        res = _round_to(res.to(tl.float32), out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * H + offs, res, mask=ok)


@triton.jit
def _round_to(v, dtype: tl.constexpr):
    """fp32 ``v`` in ``dtype``, rounded to nearest even as torch's ``.to()``. bf16 by its bits: Triton's
    interpreter truncates an fp32 -> bf16 cast (the GPU rounds; the two now agree)."""
    if dtype == tl.bfloat16:
        bits = v.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float32:
        return v
    else:
        return v.to(dtype)


# --------------------------------------------------------------------------- the launches


def _reciprocal(device: torch.device) -> bool:
    """Whether torch divides a tensor by a Python scalar as a multiplication by its fp32 reciprocal on
    ``device`` (CUDA does; the CPU divides): the scale's ``amax / 448`` must round as the core quantizer's."""
    return device.type == "cuda"


def _row_layout(wire: WireDtype, hidden: int, element_size: int, top_k: int,
                in_band: bool = False) -> tuple[int, int, int]:
    """(data bytes, byte offset of the side block, row bytes) of a send row (``in_band``: the fixed-capacity
    modes' side block, which ends with the sender's bad-id and token counts)."""
    data = hidden * (element_size if wire is WireDtype.BF16 else 1)
    dp = -(-data // 16) * 16
    side = 4 * (_scale_words(wire, hidden) + 2 * top_k + (2 if in_band else 0))
    return data, dp, -(-(dp + side) // 16) * 16


def _scale_words(wire: WireDtype, hidden: int) -> int:
    if wire is WireDtype.FP8:
        return -(-hidden // quant.FP8_GROUP)
    return 1 if wire is WireDtype.INT8 else 0


# per-shape launch constants of the exact normal path, worked out once (its dispatch is bound by host time: every
# piece of Python on it counts, 2026-11-26); emptied when full
_SHAPES: dict[tuple, tuple] = {}
_SHAPES_MAX = 1024


def _shape_constants(key: tuple, make) -> tuple:
    c = _SHAPES.get(key)
    if c is None:
        if len(_SHAPES) >= _SHAPES_MAX:
            _SHAPES.clear()
        c = _SHAPES[key] = make()
    return c


def _layout_constants(t: int, k: int, world: int, num_local: int) -> tuple:
    nb = max(1, cdiv(t, LAYOUT_BLOCK))
    consts = dict(K=k, KP=pow2(k), W=world, WP=pow2(world), EL=num_local, BT=LAYOUT_BLOCK, num_warps=4)
    return nb, dict(consts, ELP=pow2(num_local + 1)), dict(consts, NBB=min(1024, pow2(nb)))


def layout(ids: torch.Tensor, world: int, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    t, k = ids.shape
    if not ids.is_contiguous():
        ids = ids.contiguous()
    dev = ids.device
    nb, count_consts, rows_consts = _shape_constants(("layout", t, k, world, num_local),
                                                     lambda: _layout_constants(t, k, world, num_local))
    row = torch.empty(world, t, dtype=torch.int64, device=dev)
    # the counts message of _normal_layout, plus a last word per row: 1 where the direct exchange overflowed
    msg = torch.empty(2, world, 4 + num_local, dtype=torch.int64, device=dev)
    part = torch.empty(nb, world + 2, dtype=torch.int32, device=dev)
    launch(_layout_count_kernel, (nb,), ids, part, msg, t, **count_consts)
    launch(_layout_rows_kernel, (nb,), ids, part, row, msg, t, nb, **rows_consts)
    return row.T, msg


def layout_fixed(ids: torch.Tensor, world: int, num_local: int, capacity: int,
                 overflow: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t_ids, k = ids.shape
    t = 0 if overflow else t_ids
    ids = ids.contiguous()
    slot = torch.empty(world, t, dtype=torch.int64, device=ids.device)
    src = torch.empty(world * capacity, dtype=torch.int64, device=ids.device)
    bad = torch.empty((), dtype=torch.int32, device=ids.device)
    nb = max(1, cdiv(max(t_ids, world * capacity), LAYOUT_BLOCK))
    part = torch.empty(nb, world + 1, dtype=torch.int32, device=ids.device)
    consts = dict(K=k, W=world, WP=pow2(world), EL=num_local, BT=LAYOUT_BLOCK, num_warps=4)
    launch(_layout_fixed_count_kernel, (nb,), ids, part, src, t, t_ids, capacity, KP=pow2(k), **consts)
    launch(_layout_fixed_rows_kernel, (nb,), ids, part, slot, src, bad, t, capacity, nb, NBB=min(1024, pow2(nb)),
           **consts)
    return slot.T, src, bad


# received slots per program of masked mode's receive (expand_masked)
MASKED_BLOCK = 32
# tokens per program of the layouts: 32 programs at 4096 tokens (one program for all took 89 us there on H200,
# 2026-11-26; decision 66)
LAYOUT_BLOCK = 128


def pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, row: torch.Tensor,
         wire: WireDtype) -> torch.Tensor:
    t, h = x.shape
    k = ids.shape[1]
    _, dp, b = _row_layout(wire, h, x.element_size(), k)
    # as many rows as could be sent (a token goes at most once to each rank, and to at most K ranks): sized
    # without the counts, so that it runs before the count exchange and its host read (decision 66)
    send = torch.empty(t * min(row.shape[1], k), b, dtype=torch.uint8, device=x.device)
    _pack(x, ids, weights, row, wire, send, None, None, 0, 1)
    return send


def pack_into(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, row: torch.Tensor, msg: torch.Tensor,
              wire: WireDtype, peers: torch.Tensor, rank: int, capacity: int) -> None:
    """``pack`` written straight into every rank's receive rows: ``peers`` (int64 ``[W]``) holds the base address of
    each rank's ``uint8 [W * capacity, B]`` rows; rank r gets this rank's rows for it, in order, as its rows
    ``rank * capacity ...`` (past ``capacity`` none, and ``msg[0]``'s last words say so)."""
    _pack(x, ids, weights, row, wire, None, peers, msg[0], rank, capacity)


def _pack_constants(wire: WireDtype, h: int, element_size: int, k: int, world: int, el: int, direct: bool,
                    device: torch.device) -> tuple:
    _, dp, b = _row_layout(wire, h, element_size, k)
    fp8 = wire is WireDtype.FP8
    return b, dp, dict(K=k, KP=pow2(k), W=world, WP=pow2(world), EL=el, WIRE=_WIRE_CODE[wire],
                       NS=_scale_words(wire, h), GROUP=quant.FP8_GROUP, GB=max(1, min(8, pow2(h) // quant.FP8_GROUP)),
                       BH=min(2048, pow2(h)), QMAX=quant.FP8_MAX if fp8 else 127.0,
                       FLOOR=quant.FP8_AMAX_FLOOR if fp8 else quant.INT_AMAX_FLOOR, RECIPROCAL=_reciprocal(device),
                       DIRECT=direct, num_warps=4)


def _pack(x, ids, weights, row, wire, send, peers, msg, rank: int, capacity: int) -> None:
    t, h = x.shape
    if t == 0:  # (nothing sent: the layout's zero overflow flags stand)
        return
    k = ids.shape[1]
    world = row.shape[1]
    direct = peers is not None
    el = msg.shape[1] - 4 if direct else 0
    b, dp, consts = _shape_constants(("pack", wire, h, x.dtype, k, world, el, direct, x.device),
                                     lambda: _pack_constants(wire, h, x.element_size(), k, world, el, direct, x.device))
    if x.stride(1) != 1:
        x = x.contiguous()
    if not ids.is_contiguous():
        ids = ids.contiguous()
    if not weights.is_contiguous():
        weights = weights.contiguous()
    out = peers if direct else send
    launch(_pack_kernel, (t,), x, x.stride(0), ids, weights, row, row.stride(0), row.stride(1), out, out,
           msg if direct else send, h, b, dp, _INV_QMAX[wire], capacity, rank, **consts)


def pack_fixed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, src: torch.Tensor, num_tokens: int,
               bad_ids: torch.Tensor, wire: WireDtype) -> torch.Tensor:
    _, dp, b = _row_layout(wire, x.shape[1], x.element_size(), ids.shape[1], in_band=True)
    send = torch.empty(src.shape[0], b, dtype=torch.uint8, device=x.device)
    _pack_fixed(x, ids, weights, src, num_tokens, bad_ids, wire, send, None, 0, 1)
    return send


def pack_fixed_into(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, src: torch.Tensor, num_tokens: int,
                    bad_ids: torch.Tensor, wire: WireDtype, peers: torch.Tensor, rank: int) -> None:
    """``pack_fixed`` written straight into every rank's receive rows: ``peers`` (int64 ``[W]``) holds the base
    address of each rank's ``uint8 [W * C, B]`` rows; rank r receives this rank's slots ``r * C ...`` as its rows
    ``rank * C ...``, as ``all_to_all_single`` of ``pack_fixed``'s rows would place them."""
    world = peers.shape[0]
    if src.shape[0] % world:
        raise ValueError(f"src has {src.shape[0]} slots, not a multiple of the {world} ranks in peers")
    _pack_fixed(x, ids, weights, src, num_tokens, bad_ids, wire, None, peers, rank, src.shape[0] // world)


def _pack_fixed(x, ids, weights, src, num_tokens, bad_ids, wire, send, peers, rank, capacity, own=None) -> None:
    """``own``: (slab uint8 [EL * W * C, D], slab scales fp32 or None, ``self_layout``'s index, counts int64 [W, EL]):
    this rank's own slots go straight into its slab (``_pack_fixed_kernel``'s ``SELF``)."""
    t, h = x.shape
    k = ids.shape[1]
    _, dp, b = _row_layout(wire, h, x.element_size(), k, in_band=True)
    if x.stride(1) != 1:
        x = x.contiguous()
    qmax = quant.FP8_MAX if wire is WireDtype.FP8 else 127.0
    floor = quant.FP8_AMAX_FLOOR if wire is WireDtype.FP8 else quant.INT_AMAX_FLOOR
    direct = peers is not None
    out = peers if direct else send
    slab, slab_scale, index, counts = own if own is not None else (out, None, out, out)
    if src.shape[0]:
        launch(_pack_fixed_kernel, (src.shape[0],), x, x.stride(0), ids.contiguous(), weights.contiguous(), src,
               bad_ids, out, out, t, num_tokens, h, h if t else 0, b, dp, _INV_QMAX[wire], capacity,
               src.shape[0] // capacity, rank, slab, slab if slab_scale is None else slab_scale, index, counts,
               slab.shape[1] if own is not None else 0, K=k, KP=pow2(k), WIRE=_WIRE_CODE[wire],
               NS=_scale_words(wire, h),
               GROUP=quant.FP8_GROUP, GB=max(1, min(8, pow2(h) // quant.FP8_GROUP)), BH=min(2048, pow2(h)),
               QMAX=qmax, FLOOR=floor, RECIPROCAL=_reciprocal(x.device), DIRECT=direct, SELF=own is not None,
               EL=1 if own is None else counts.shape[1], num_warps=4)


def self_layout(ids: torch.Tensor, num_tokens: int, world: int, num_local: int, capacity: int,
                rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked mode's direct exchange, before the rows move (decision 71): (int64 ``[T, K]``: the slab row of each of
    this rank's own (token, k) pairs on this rank, as ``_masked_index_kernel`` will give it, less the pairs of that
    expert from the lower ranks; ``EL * W * C`` where the expert is elsewhere; int64 ``[W, EL]``: this rank's pairs
    per expert, row r for rank r's experts: its counts message). Only the first ``num_tokens`` tokens are sent
    (0: an overflowing rank)."""
    k = ids.shape[1]
    ids = ids[:num_tokens].contiguous()
    cw = world * capacity
    index = torch.empty(num_tokens, k, dtype=torch.int64, device=ids.device)
    msg = torch.zeros(world, num_local, dtype=torch.int64, device=ids.device)
    nb = max(1, cdiv(num_tokens, MASKED_BLOCK))
    part = torch.empty(nb, num_local, dtype=torch.int32, device=ids.device)
    m = torch.empty(num_local, dtype=torch.int32, device=ids.device)
    consts = dict(NS=0, K=k, EL=num_local, ELP=pow2(num_local), BS=MASKED_BLOCK, num_warps=4)
    launch(_masked_count_kernel, (nb,), ids, k, part, num_tokens, rank * num_local, **consts)
    launch(_masked_index_kernel, (nb,), ids, k, part, index, index, msg, m, num_tokens, cw, nb, rank * num_local,
           NBB=min(256, pow2(nb)), SENDER=True, E=world * num_local, **consts)
    return index, msg


# --------------------------------------------------------------------------- the direct-write exchange (decision 66)
# Receive rows in torch symmetric memory (CUDA P2P over NVLink within a node), one allocation per (group, rows, row
# bytes, device) shared by every dispatcher of that shape: each exchange reads them before it returns (the core
# copies what it keeps), and the barrier that opens the next exchange waits for every rank's reads.
_SYMMETRIC: dict[tuple, tuple[torch.Tensor, object, torch.Tensor]] = {}


_DIRECT_OK: dict[str, bool] = {}


def direct_ok(group, device: torch.device) -> bool:
    """Whether the direct-write exchanges can serve ``group`` from ``device``: every rank a CUDA device of this
    host, each able to reach every other (P2P; CUDA symmetric memory maps the peers' memory). Every rank computes
    the same answer from the same gathered (host, device) list: one ``all_gather_object`` per group, at the first
    call (outside a CUDA graph capture, as the first exchange's allocation)."""
    if device.type != "cuda":
        return False
    group = group if group is not None else dist.group.WORLD
    if group.group_name not in _DIRECT_OK:
        where: list = [None] * dist.get_world_size(group)
        dist.all_gather_object(where, (socket.gethostname(), device.index), group=group)
        devices = [index for _, index in where]
        _DIRECT_OK[group.group_name] = (len({host for host, _ in where}) == 1 and len(set(devices)) == len(devices)
                                        and all(a == b or torch.cuda.can_device_access_peer(a, b)
                                                for a in devices for b in devices))
    return _DIRECT_OK[group.group_name]


def _symmetric_rows(group, rows: int, row_bytes: int, device: torch.device, use: str = "rows"):
    """(``uint8 [rows, row_bytes]`` receive rows in symmetric memory, its handle, int64 ``[W]`` the ranks' base
    addresses), allocated and rendezvoused (a collective) at the first call for this group, shape and ``use``."""
    group = group if group is not None else dist.group.WORLD
    key = (group.group_name, rows, row_bytes, device, use)
    if key not in _SYMMETRIC:
        import torch.distributed._symmetric_memory as symm_mem  # only processes that exchange this way load it

        if hasattr(symm_mem, "is_symm_mem_enabled_for_group") and not symm_mem.is_symm_mem_enabled_for_group(
                group.group_name):  # torch < 2.10 needs it; later ones deprecate it (a no-op there)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                symm_mem.enable_symm_mem_for_group(group.group_name)
        buf = symm_mem.empty(rows, row_bytes, dtype=torch.uint8, device=device)
        handle = symm_mem.rendezvous(buf, group)
        addresses = peer_addresses(buf, handle)
        if any(a % 16 for a in addresses):  # (the kernels write through them as 16-byte aligned: _aligned)
            raise RuntimeError(f"symmetric memory: rows at {[hex(a) for a in addresses]}, not all 16-byte aligned")
        _SYMMETRIC[key] = (buf, handle, torch.tensor(addresses, dtype=torch.int64, device=device))
    return _SYMMETRIC[key]


def peer_addresses(buf: torch.Tensor, handle) -> list[int]:
    """Every rank's address of ``buf`` (symmetric memory, ``handle`` its rendezvous), in this process. A handle's
    ``buffer_ptrs`` are the bases of the ranks' allocations, which ``symm_mem.empty`` carves from a pool (torch
    >= 2.10: ``TORCH_SYMMMEM_IMPLICIT_POOL``, several tensors to an allocation): the tensor sits at the same
    offset from each, its own from this rank's. (The first direct exchanges on 2x H100, 2026-11-26, used the bases
    as the tensors' addresses and crashed once several buffers existed; the probe's first buffer, at offset 0,
    worked.)"""
    bases = list(handle.buffer_ptrs)
    offset = buf.data_ptr() - bases[handle.rank]
    if not 0 <= offset < handle.buffer_size:
        raise RuntimeError(f"symmetric memory: the tensor at {buf.data_ptr():#x} is not in this rank's buffer "
                           f"[{bases[handle.rank]:#x}, +{handle.buffer_size})")
    return [base + offset for base in bases]


@triton.jit
def _put_counts_kernel(msg_ptr, peers_ptr, M, RANK, MP: tl.constexpr):
    """Program r: this rank's counts message row for rank r into rank r's rows, as row ``RANK``."""
    r = tl.program_id(0)
    dst = tl.load(peers_ptr + r).to(tl.pointer_type(tl.int64))
    offs = tl.arange(0, MP)
    tl.store(dst + RANK * M + offs, tl.load(msg_ptr + r * M + offs, mask=offs < M), mask=offs < M)


def exchange_counts(msg: torch.Tensor, group) -> None:
    """``all_to_all_single(msg[1], msg[0])`` of exact normal mode's counts messages (int64 ``[2, W, M]``) without a
    collective: every rank writes its row for rank r into rank r's rows in symmetric memory, between two barriers,
    and this rank's rows are copied to ``msg[1]``."""
    counts, handle, peers = _symmetric_rows(group, msg.shape[1], msg.shape[2] * 8, msg.device, use="counts")
    handle.barrier(channel=0)
    _put_counts(msg, peers, handle.rank)
    handle.barrier(channel=0)
    msg[1].copy_(counts.view(torch.int64))


def _put_counts(msg: torch.Tensor, peers: torch.Tensor, rank: int) -> None:
    world, m = msg.shape[1], msg.shape[2]
    launch(_put_counts_kernel, (world,), msg[0], peers, m, rank, MP=pow2(m), num_warps=1)


def exchange_normal(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, row: torch.Tensor, msg: torch.Tensor,
                    wire: WireDtype, group, capacity: int) -> torch.Tensor:
    """Exact normal mode's rows and counts messages moved before the host reads the counts (decision 66): every rank
    writes its rows for rank r straight into rank r's receive rows in symmetric memory (its chunk of ``capacity``
    rows) and its counts message row for r into r's counts rows, between two barriers as ``exchange_fixed``, and
    ``msg[1]`` gets this rank's (what ``all_to_all_single(msg[1], msg[0])`` gives); the last word of every row
    says whether its sender's rows overflowed a chunk. Returns this rank's ``uint8 [W * capacity, B]`` rows
    (source s's in rows ``s * capacity ...``; ``unpack`` with ``chunk=capacity`` reads them), reused by the next
    exchange of the same shape."""
    world = msg.shape[1]
    _, _, b = _row_layout(wire, x.shape[1], x.element_size(), ids.shape[1])
    buf, handle, peers = _symmetric_rows(group, world * capacity, b, x.device, use="normal")
    counts, counts_handle, counts_peers = _symmetric_rows(group, world, msg.shape[2] * 8, x.device, use="counts")
    handle.barrier(channel=0)  # (every rank past its last exchange: its reads of both buffers are done)
    pack_into(x, ids, weights, row, msg, wire, peers, handle.rank, capacity)
    _put_counts(msg, counts_peers, handle.rank)  # (after pack: it sets the overflow words)
    handle.barrier(channel=0)
    msg[1].copy_(counts.view(torch.int64))
    return buf


def exchange_fixed(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, src: torch.Tensor, num_tokens: int,
                   bad_ids: torch.Tensor, wire: WireDtype, group) -> torch.Tensor:
    """``all_to_all_single`` of ``pack_fixed``'s rows without a collective: every rank writes its slots straight
    into the owning rank's receive rows in symmetric memory, between two barriers (the first: every rank is done
    reading the previous exchange's rows; the second: every rank's rows have landed). Graph-capturable once the
    rows exist (the first call for a shape allocates them: a collective, outside a capture). Returns this rank's
    received rows ``uint8 [W * C, B]``, reused by the next exchange of the same shape."""
    _, _, b = _row_layout(wire, x.shape[1], x.element_size(), ids.shape[1], in_band=True)
    buf, handle, peers = _symmetric_rows(group, src.shape[0], b, x.device)
    handle.barrier(channel=0)
    pack_fixed_into(x, ids, weights, src, num_tokens, bad_ids, wire, peers, handle.rank)
    handle.barrier(channel=0)
    return buf


def pack_masked_into(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, src: torch.Tensor, num_tokens: int,
                     bad_ids: torch.Tensor, wire: WireDtype, peers: torch.Tensor, rank: int, index: torch.Tensor,
                     counts: torch.Tensor, slab: torch.Tensor, slab_scale: torch.Tensor | None) -> None:
    """``pack_fixed_into``, but this rank's own slots go straight into its ``slab`` (uint8 ``[EL * W * C, D]``) and
    ``slab_scale`` (fp32 ``[EL * W * C, n_scale]`` or None) at the rows the receive side gives their pairs
    (``index``: ``self_layout``'s; ``counts``: int64 ``[W, EL]``, row s: rank s's pairs per expert of this rank),
    only their side blocks into this rank's receive rows (``expand_masked`` with ``done=(rank * C, C)`` then
    completes the slab). Decision 71."""
    world = peers.shape[0]
    if src.shape[0] % world:
        raise ValueError(f"src has {src.shape[0]} slots, not a multiple of the {world} ranks in peers")
    _pack_fixed(x, ids, weights, src, num_tokens, bad_ids, wire, None, peers, rank, src.shape[0] // world,
                own=(slab, slab_scale, index, counts))


def exchange_masked(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, src: torch.Tensor, num_tokens: int,
                    bad_ids: torch.Tensor, wire: WireDtype, group, num_local: int, data_dtype: torch.dtype):
    """Masked mode's dispatch by direct writes (decision 71): ``exchange_fixed`` + ``expand_masked``'s results, but
    this rank's own slots never move: every rank first writes its pairs per expert (``self_layout``) into the
    owning rank's counts rows, then, after a barrier, its slots for the other ranks into their receive rows and its
    own ones straight into its slab (``pack_masked_into``), and after a second barrier only the received slots are
    expanded. Returns (received side blocks ``int32 [W*C, M]`` (reused by the next call), then what
    ``expand_masked`` returns)."""
    world, rank, t = dist.get_world_size(group), dist.get_rank(group), x.shape[0]
    cw = src.shape[0]
    c = cw // world
    h, k = x.shape[1], ids.shape[1]
    data_bytes, _, b = _row_layout(wire, h, x.element_size(), k, in_band=True)
    ns = _scale_words(wire, h)
    index, msg = self_layout(ids, t, world, num_local, c, rank)
    buf, handle, peers = _symmetric_rows(group, cw, b, x.device)
    counts, _, counts_peers = _symmetric_rows(group, world, num_local * 8, x.device, use="masked_counts")
    slab = torch.empty(num_local * cw, data_bytes, dtype=torch.uint8, device=x.device)
    slab_scale = torch.empty(num_local * cw, ns, dtype=torch.float32, device=x.device) if ns else None
    # Two barriers, not three: the counts rows are read only by the pack, before the last exchange's second barrier,
    # which every rank passed before this put; the rows are written after this call's first barrier, which every
    # rank reaches after its reads of the last exchange's (whichever exchange used them).
    launch(_put_counts_kernel, (world,), msg, counts_peers, num_local, rank, MP=pow2(num_local), num_warps=1)
    handle.barrier(channel=0)
    pack_masked_into(x, ids, weights, src, num_tokens, bad_ids, wire, peers, rank, index, counts.view(torch.int64),
                     slab, slab_scale)
    handle.barrier(channel=0)
    recv_data, recv_meta = split_fixed(buf, wire, x.dtype, h, k)
    return (recv_meta,) + expand_masked(recv_data, recv_meta, ns, k, rank, num_local, data_dtype, slab, slab_scale,
                                        done=(rank * c, c))


def split_fixed(recv: torch.Tensor, wire: WireDtype, dtype: torch.dtype, hidden: int,
                top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    data_bytes, dp, b = _row_layout(wire, hidden, dtype.itemsize, top_k, in_band=True)
    words = _scale_words(wire, hidden) + 2 * top_k + 2
    return recv[:, :data_bytes], recv[:, dp:dp + 4 * words].view(torch.int32)


def unpack(recv: torch.Tensor, msg: torch.Tensor, wire: WireDtype, dtype: torch.dtype, hidden: int, top_k: int,
           rank: int, num_local: int, rows: int | None = None, chunk: int = 0):
    r = recv.shape[0] if rows is None else rows
    dev = recv.device
    world = msg.shape[0]
    data_dtype, word_dtype, nbytes, word, dp, b, ns, consts = _shape_constants(
        ("unpack", wire, dtype, hidden, top_k, world, num_local, r > 0, chunk > 0),
        lambda: _unpack_constants(wire, dtype, hidden, top_k, world, num_local, r > 0, chunk > 0))
    if recv.shape[1] != b:
        raise ValueError(f"received rows of {recv.shape[1]} bytes, expected {b} (a send row of this layer)")
    data = torch.empty(r, hidden, dtype=data_dtype, device=dev)
    scale = torch.empty(r, ns, dtype=torch.float32, device=dev) if ns else None
    lids = torch.empty(r, top_k, dtype=torch.int32, device=dev)
    weights = torch.empty(r, top_k, dtype=torch.float32, device=dev)
    counts = torch.empty(num_local, dtype=torch.int32, device=dev)
    words = data.view(word_dtype)
    launch(_unpack_kernel, (max(r, 1),), recv, msg, words, scale if ns else weights, lids, weights, counts,
           b, dp, nbytes // word, rank * num_local, chunk, **consts)
    return data, scale, lids, weights, counts


def _unpack_constants(wire: WireDtype, dtype: torch.dtype, hidden: int, top_k: int, world: int, num_local: int,
                      rows: bool, chunked: bool) -> tuple:
    data_dtype = dtype if wire is WireDtype.BF16 else (torch.float8_e4m3fn if wire is WireDtype.FP8 else torch.int8)
    nbytes, dp, b = _row_layout(wire, hidden, dtype.itemsize, top_k)
    ns = _scale_words(wire, hidden)
    word = next(w for w in (4, 2, 1) if nbytes % w == 0)
    word_dtype = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    consts = dict(ROWS=rows, NS=ns, NSP=pow2(ns), K=top_k, KP=pow2(top_k), W=world, WP=pow2(world), EL=num_local,
                  ELP=pow2(num_local), BD=1024, CHUNKED=chunked, num_warps=4)
    return data_dtype, word_dtype, nbytes, word, dp, b, ns, consts


def expand_masked(recv_data: torch.Tensor, recv_meta: torch.Tensor, n_scale: int, top_k: int, rank: int,
                  num_local: int, data_dtype: torch.dtype, slab: torch.Tensor | None = None,
                  slab_scale: torch.Tensor | None = None, done: tuple[int, int] = (0, 0)):
    """``slab`` / ``slab_scale`` (uint8 ``[EL * W * C, D]`` / fp32 ``[EL * W * C, n_scale]``): the slab to fill
    (None: a new one); ``done`` (first slot, count): received slots whose pairs are in it already (the sender wrote
    them there, ``exchange_masked``), left out of the expansion."""
    cw, db = recv_data.shape
    dev = recv_data.device
    el, k = num_local, top_k
    first = rank * el
    slab = torch.empty(el * cw, db, dtype=torch.uint8, device=dev) if slab is None else slab
    scale = slab_scale if slab_scale is not None or not n_scale else torch.empty(el * cw, n_scale,
                                                                                 dtype=torch.float32, device=dev)
    index = torch.empty(cw, k, dtype=torch.int64, device=dev)
    valid = torch.empty(cw, k, dtype=torch.bool, device=dev)
    weights = torch.empty(cw, k, dtype=torch.float32, device=dev)
    masked_m = torch.empty(el, dtype=torch.int32, device=dev)
    if recv_meta.stride(1) != 1 or recv_data.stride(1) != 1:
        raise ValueError("expand_masked: the received rows' last dim must be contiguous")
    nb = max(1, cdiv(cw, MASKED_BLOCK))
    part = torch.empty(nb, el, dtype=torch.int32, device=dev)
    consts = dict(NS=n_scale, K=k, EL=el, ELP=pow2(el), BS=MASKED_BLOCK, num_warps=4)
    launch(_masked_count_kernel, (nb,), recv_meta, recv_meta.stride(0), part, cw, first, **consts)
    launch(_masked_index_kernel, (nb,), recv_meta, recv_meta.stride(0), part, index, valid.view(torch.int8), weights,
           masked_m, cw, cw, nb, first, NBB=min(256, pow2(nb)), SENDER=False, E=0, **consts)
    if cw > done[1]:
        word = next(w for w in (4, 2, 1) if db % w == 0 and recv_data.stride(0) % w == 0
                    and (recv_data.data_ptr() % w == 0))
        wdt = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
        launch(_masked_expand_kernel, (cw - done[1], cdiv(db // word, 1024)), recv_data, recv_data.stride(0),
               recv_meta, recv_meta.stride(0), index, valid.view(torch.int8), slab.view(wdt),
               scale if n_scale else weights, db // word, done[0], done[1], NS=n_scale, NSP=pow2(n_scale), K=k,
               BD=1024, num_warps=4)
    data = slab.view(el, cw, db).view(data_dtype)
    return data, None if scale is None else scale.view(el, cw, n_scale), masked_m, index, valid, weights


def reduce_masked(y: torch.Tensor, slab_index: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    el, cw, h = y.shape
    out = torch.empty(cw, h, dtype=y.dtype, device=y.device)
    _reduce_masked(y, slab_index, valid, weights, out, None, 0, 1)
    return out


def _reduce_masked(y, slab_index, valid, weights, out, peers, rank: int, capacity: int) -> None:
    el, cw, h = y.shape
    k = slab_index.shape[1]
    if not y.is_contiguous():
        y = y.contiguous()
    if cw:
        bh = min(1024, pow2(h))  # (4096: the [K] loads and fp32 sums of a wide block spilled, 1.3x slower on H100)
        direct = peers is not None
        launch(_masked_reduce_kernel, (cw, cdiv(h, bh)), y, slab_index.contiguous(),
               valid.contiguous().view(torch.int8), weights.contiguous(), peers if direct else out,
               peers if direct else out, h, capacity, cw // capacity, rank, K=k, KP=pow2(k), BH=bh, DIRECT=direct,
               num_warps=4)


def exchange_masked_back(y: torch.Tensor, slab_index: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor,
                         group) -> torch.Tensor:
    """``reduce_masked``'s rows returned to their senders as ``all_to_all_single`` would (rank r gets the rows of its
    slots here, ``r * C ...``, as its rows ``rank * C ...``), written straight into the senders' rows in symmetric
    memory between two barriers (as ``exchange_fixed``). Returns this rank's returned rows ``[W * C, H]`` in
    ``y``'s dtype, reused by the next call of the same shape."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    el, cw, h = y.shape
    buf, handle, peers = _symmetric_rows(group, cw, h * y.element_size(), y.device)
    handle.barrier(channel=0)
    _reduce_masked(y, slab_index, valid, weights, None, peers, rank, cw // world)
    handle.barrier(channel=0)
    return buf.view(y.dtype)


def reduce(back: torch.Tensor, row: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    t, world = row.shape
    h = back.shape[1]
    out = torch.empty(t, h, dtype=dtype, device=back.device)
    if t:
        bh = min(4096, pow2(h))
        launch(_reduce_kernel, (t, cdiv(h, bh)), back, row, row.stride(0), row.stride(1), out, h, W=world,
               BH=bh, num_warps=4)
    return out


KERNELS = TorchA2AKernels(layout=layout, pack=pack, unpack=unpack, reduce=reduce, layout_fixed=layout_fixed,
                          pack_fixed=pack_fixed, split_fixed=split_fixed, exchange_fixed=exchange_fixed,
                          expand_masked=expand_masked, reduce_masked=reduce_masked,
                          exchange_masked_back=exchange_masked_back, exchange_counts=exchange_counts,
                          exchange_masked=exchange_masked,
                          exchange_normal=exchange_normal, direct_ok=direct_ok)
