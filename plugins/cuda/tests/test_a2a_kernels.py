"""torch_a2a's fused exact-normal kernels (decision 63) against the torch functions they replace, byte for byte:
the layout (rows, counts message), pack + unpack (wire codes, scales, ids made local, weights, counts) and
combine's reduce. On the CPU the kernels run in Triton's interpreter (conftest); on a GPU, compiled."""

from __future__ import annotations

import pytest
import torch

from moe_core.contracts import WireDtype
from moe_core.distributed import torch_a2a as ta
from moe_core.testing.data import make_hidden

a2a = pytest.importorskip("moe_plugin_cuda.triton.a2a")
triton = pytest.importorskip("triton")
tl = triton.language

DEV = "cuda" if torch.cuda.is_available() else "cpu"
WIRES = (WireDtype.BF16, WireDtype.FP8, WireDtype.INT8)


def _ids(t: int, k: int, e: int, gen: torch.Generator, bad: bool = False) -> torch.Tensor:
    """Distinct experts per token, some -1, and (``bad``) a few ids outside [-1, E)."""
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) if t else torch.empty(0, k, dtype=torch.int64)
    ids[torch.rand(t, k, generator=gen) < 0.15] = -1
    if bad and t:
        ids[0, 0] = e + 3
        ids[-1, -1] = -5
    return ids.to(DEV)


# (several layout blocks of a2a.LAYOUT_BLOCK tokens: 256 exactly two, 300 and 517 a partial last one)
CASES = [(0, 4, 2, 8), (1, 4, 2, 8), (37, 4, 2, 8), (300, 8, 2, 128), (5, 3, 3, 4), (129, 6, 4, 16), (64, 2, 1, 8),
         (256, 2, 2, 8), (517, 4, 4, 8)]


@pytest.mark.parametrize("t,k,world,el", CASES)
@pytest.mark.parametrize("bad", [False, True])
def test_layout_matches_torch(t, k, world, el, bad):
    gen = torch.Generator().manual_seed(t * 7 + k + world)
    ids = _ids(t, k, world * el, gen, bad)
    row, msg = a2a.layout(ids, world, el)
    row_ref, msg_ref = ta._normal_layout(ids, world, el)
    assert row.shape == (t, world) and torch.equal(row, row_ref)
    assert torch.equal(msg[0, :, :3 + el], msg_ref[0]) and not msg[0, :, -1].any()  # (+ the direct exchange's flag)


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("t,h,k,world,el,dtype", [(0, 256, 4, 2, 8, torch.bfloat16), (1, 256, 4, 2, 8, torch.bfloat16),
                                                  (23, 200, 4, 2, 8, torch.bfloat16), (17, 129, 3, 3, 4, torch.float32),
                                                  (40, 384, 8, 4, 4, torch.bfloat16)])
def test_pack_unpack_match_torch(wire, t, h, k, world, el, dtype):
    gen = torch.Generator().manual_seed(t + h + k)
    x = make_hidden(t, h, dtype, gen).to(DEV)
    if t:  # an all-zero row (the quantizers' scale floor) and one large outlier
        x[0] = 0
        x[-1, h // 2] = 300.0
    ids = _ids(t, k, world * el, gen)
    weights = torch.rand(t, k, generator=gen).to(DEV)
    row, msg = a2a.layout(ids, world, el)
    n_send = int((row > 0).sum())
    send = a2a.pack(x, ids, weights, row, wire)
    assert send.shape[0] >= n_send
    send = send[:n_send]

    # the torch path's rows, in send-buffer order
    q, scale, meta = ta._normal_wire_rows(x, ids, weights, wire)
    src = ta._sources(row, world * t, None)[1:n_send + 1]
    for rank in range(world):  # unpack the send buffer as if every row came to ``rank``
        data, sc, lids, w, counts = a2a.unpack(send, msg[0], wire, x.dtype, h, k, rank, el)
        assert torch.equal(ta._bytes(data), ta._gather_rows(ta._bytes(q), src)), "wire data"
        sc_ref, lids_ref, w_ref = ta._normal_received(meta.index_select(0, src), ta._scale_words(wire, h), k,
                                                      ta._local_table(rank, el, world * el, x.device))
        if sc_ref is None:
            assert sc is None
        else:
            assert torch.equal(sc.view(torch.int32), sc_ref.view(torch.int32)), "scales"
        assert lids.dtype == lids_ref.dtype and torch.equal(lids, lids_ref), "local ids"
        assert torch.equal(w.view(torch.int32), w_ref.contiguous().view(torch.int32)), "weights"
        assert torch.equal(counts, msg[0, :, 3:3 + el].sum(0, dtype=torch.int32)), "per-expert counts"


@pytest.mark.parametrize("t,h,world,dtype", [(0, 64, 2, torch.bfloat16), (1, 64, 2, torch.bfloat16),
                                             (33, 200, 2, torch.bfloat16), (9, 100, 4, torch.float32),
                                             (12, 96, 3, torch.float16)])
def test_reduce_matches_torch(t, h, world, dtype):
    gen = torch.Generator().manual_seed(t + h)
    ids = _ids(t, 4, world * 4, gen)
    row, _ = a2a.layout(ids, world, 4)
    n = int((row > 0).sum())
    back = make_hidden(n, h, dtype, gen).to(DEV)
    out = a2a.reduce(back, row, torch.bfloat16)
    table = torch.cat([back.new_zeros(1, h), back])
    ref = ta._reduce_pairs_loop(table, row, None).to(torch.bfloat16)
    assert torch.equal(out.view(torch.int16), ref.view(torch.int16))


@triton.jit
def _e4m3_probe(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, a2a._e4m3_bits(tl.load(x_ptr + offs)))


def test_e4m3_rounding_matches_torch():
    """Every e4m3fn value, the midpoints between neighbours (ties to even) and one fp32 step either side."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pos = codes[torch.isfinite(codes) & (codes >= 0)].unique().sort().values  # 0 .. 448
    mids = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([pos, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(1e9)),
                      torch.rand(2000) * 448, torch.rand(2000) / 64])
    x = torch.cat([near, -near]).clamp(-448, 448)
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, x.new_zeros(n - x.numel())]).to(DEV)
    out = torch.empty(n, dtype=torch.uint8, device=DEV)
    _e4m3_probe[(1,)](x, out, N=n)
    assert torch.equal(out, x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("t,h,k,world,el,cap,dtype", [(0, 256, 4, 2, 8, 5, torch.bfloat16),
                                                      (1, 256, 4, 2, 8, 3, torch.bfloat16),
                                                      (23, 200, 4, 2, 8, 23, torch.bfloat16),
                                                      (17, 129, 3, 3, 4, 20, torch.float32)])
def test_pack_fixed_matches_torch(wire, t, h, k, world, el, cap, dtype):
    """The fixed-capacity send rows (worst-case normal and masked mode), padding slots and in-band counts included."""
    gen = torch.Generator().manual_seed(t + h + cap)
    x = make_hidden(t, h, dtype, gen).to(DEV)
    ids = _ids(t, k, world * el, gen)
    weights = torch.rand(t, k, generator=gen).to(DEV)
    slot, bad = ta._masked_layout(ids, world, el, cap, world * el, False)
    src = ta._sources(slot, cap * world, t)[1:]
    send = a2a.pack_fixed(x, ids, weights, src, t + 2, bad + 3, wire)
    data, meta = a2a.split_fixed(send, wire, x.dtype, h, k)

    m = ta._scale_words(wire, h) + 2 * k + 2
    q, _, meta_ref = ta._wire_rows(x, ids, weights, wire, m, t + 2, bad + 3)
    data_ref = ta._bytes(q)
    data_ref = ta._gather_rows(data_ref, src.clamp(max=t - 1)) if t else data_ref.new_zeros(cap * world, data_ref.shape[1])
    assert torch.equal(data, data_ref), "wire data"
    assert torch.equal(meta, meta_ref.index_select(0, src)), "side blocks"


@pytest.mark.parametrize("t,k,world,el,cap", [(0, 4, 2, 8, 5), (1, 4, 2, 8, 1), (37, 4, 2, 8, 40), (300, 8, 2, 128, 300),
                                             (5, 3, 3, 4, 7), (129, 6, 4, 16, 130), (260, 4, 3, 8, 300),
                                             (12, 4, 2, 8, 9)])
@pytest.mark.parametrize("bad", [False, True])
def test_layout_fixed_matches_torch(t, k, world, el, cap, bad):
    """Slots, source tokens (padding T) and bad-id count of the fixed-capacity modes; over capacity (the last case)
    the rank sends no tokens and still counts its ids."""
    gen = torch.Generator().manual_seed(t * 5 + k + cap)
    ids = _ids(t, k, world * el, gen, bad)
    overflow = t > cap
    slot, src, nbad = a2a.layout_fixed(ids, world, el, cap, overflow)
    slot_ref, bad_ref = ta._masked_layout(ids, world, el, cap, world * el, overflow)
    src_ref = ta._sources(slot_ref, cap * world, 0 if overflow else t)[1:]
    assert slot.shape == slot_ref.shape and torch.equal(slot, slot_ref)
    assert torch.equal(src, src_ref)
    assert nbad.dtype == bad_ref.dtype and nbad.shape == bad_ref.shape and torch.equal(nbad, bad_ref)


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("counts,h,k,el,cap,dtype", [((0, 3), 256, 4, 8, 5, torch.bfloat16),
                                                     ((1, 0, 2), 129, 3, 4, 3, torch.float32),
                                                     ((23, 17), 200, 4, 8, 23, torch.bfloat16)])
def test_pack_fixed_into_peers_is_the_all_to_all(wire, counts, h, k, el, cap, dtype):
    """The direct-write exchange's kernel (decision 66), every rank's buffer in this one process: after every rank
    wrote its slots through the table of base addresses, rank r's rows are what ``all_to_all_single`` of the ranks'
    ``pack_fixed`` rows gives it (chunk s: rank s's slots r * C ...), byte for byte, padding slots included."""
    world = len(counts)
    gen = torch.Generator().manual_seed(sum(counts) + h + cap)
    _, _, b = a2a._row_layout(wire, h, dtype.itemsize, k, in_band=True)
    recv = [torch.full((world * cap, b), 0xAB, dtype=torch.uint8, device=DEV) for _ in range(world)]
    peers = torch.tensor([r.data_ptr() for r in recv], dtype=torch.int64, device=DEV)
    sent = []
    for rank, t in enumerate(counts):
        x = make_hidden(t, h, dtype, gen).to(DEV)
        ids = _ids(t, k, world * el, gen)
        weights = torch.rand(t, k, generator=gen).to(DEV)
        _, src, bad = a2a.layout_fixed(ids, world, el, cap, False)
        sent.append(a2a.pack_fixed(x, ids, weights, src, t, bad, wire))
        a2a.pack_fixed_into(x, ids, weights, src, t, bad, wire, peers, rank)
    for r in range(world):
        expected = torch.cat([sent[s][r * cap:(r + 1) * cap] for s in range(world)])
        _, dp, _ = a2a._row_layout(wire, h, dtype.itemsize, k, in_band=True)
        data_bytes, _, _ = a2a._row_layout(wire, h, dtype.itemsize, k, in_band=True)
        side = 4 * (ta._scale_words(wire, h) + 2 * k + 2)
        for part in (slice(0, data_bytes), slice(dp, dp + side)):  # (the padding bytes between are never written)
            assert torch.equal(recv[r][:, part], expected[:, part]), f"rank {r} bytes {part}"


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("t,h,k,world,el,cap,rank,dtype", [(0, 256, 4, 2, 8, 5, 0, torch.bfloat16),
                                                           (1, 256, 4, 2, 8, 3, 1, torch.bfloat16),
                                                           (37, 200, 4, 2, 8, 40, 0, torch.bfloat16),
                                                           (17, 129, 3, 3, 4, 20, 2, torch.float32),
                                                           (70, 256, 8, 1, 16, 70, 0, torch.bfloat16)])
def test_expand_masked_matches_torch(wire, t, h, k, world, el, cap, rank, dtype):
    """Masked mode's receive side (decision 66) against ``_masked_received`` + ``expand_pairs``: the slab's valid
    rows and scales, masked_m, every pair's slab row, validity and weight, from rows as the fused exchange leaves
    them (a view with the send row's stride; padding slots, -1 and out-of-range ids among them)."""
    gen = torch.Generator().manual_seed(t + h + cap + rank)
    x = make_hidden(t, h, dtype, gen).to(DEV)
    ids = _ids(t, k, world * el, gen, bad=t > 2)
    weights = torch.rand(t, k, generator=gen).to(DEV)
    _, src, bad = a2a.layout_fixed(ids, world, el, cap, False)
    rows = a2a.pack_fixed(x, ids, weights, src, t, bad, wire)  # as if every slot came to this rank
    data, meta = a2a.split_fixed(rows, wire, x.dtype, h, k)
    ns = ta._scale_words(wire, h)
    wdt = dtype if wire is WireDtype.BF16 else (torch.float8_e4m3fn if wire is WireDtype.FP8 else torch.int8)
    slab, slab_scale, masked_m, index, valid, w = a2a.expand_masked(data, meta, ns, k, rank, el, wdt)

    scale_ref, w_ref, _, _, mine, index_ref, m_ref, write_index = ta._masked_received(meta, ns, k, rank, el)
    cw = cap * world
    assert torch.equal(masked_m, m_ref) and torch.equal(index, index_ref) and torch.equal(valid, mine)
    assert torch.equal(w.view(torch.int32), w_ref.contiguous().view(torch.int32))
    ref = torch.empty(el * cw + cw, data.shape[1], dtype=torch.uint8, device=DEV)
    ref.index_put_((write_index,), data.contiguous().unsqueeze(1))  # (expand_pairs, eager: no inductor in the test)
    here = (torch.arange(cw, device=DEV) < masked_m.unsqueeze(1))  # [EL, CW]: the valid slab rows
    assert slab.shape == (el, cw, h) and slab.dtype == wdt
    assert torch.equal(slab.view(torch.uint8).view(el, cw, -1)[here], ref[:el * cw].view(el, cw, -1)[here])
    if ns:
        ref_scale = torch.empty(el * cw + cw, ns, dtype=torch.float32, device=DEV)
        ref_scale.index_put_((write_index,), scale_ref.unsqueeze(1))
        assert torch.equal(slab_scale[here].view(torch.int32), ref_scale[:el * cw].view(el, cw, ns)[here].view(torch.int32))
    else:
        assert slab_scale is None


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("counts,h,k,el,cap,dtype", [((0, 3), 256, 4, 8, 5, torch.bfloat16),
                                                     ((1, 0, 2), 129, 3, 4, 3, torch.float32),
                                                     ((23, 17), 200, 4, 8, 23, torch.bfloat16),
                                                     ((9, 11, 6), 256, 8, 4, 12, torch.bfloat16)])
def test_pack_masked_into_then_expand_is_the_all_to_all(wire, counts, h, k, el, cap, dtype):
    """Masked mode's direct exchange with each rank's own slots written straight into its slab (decision 71), every
    rank's buffers in this one process: after ``self_layout``, the counts rows, ``pack_masked_into`` and
    ``expand_masked`` of the other ranks' slots only, each rank's slab (valid rows, scales), masked_m, pair rows,
    validity and weights are what ``expand_masked`` makes of the all-to-all of ``pack_fixed``'s rows, byte for
    byte (T = 0 ranks, -1 and out-of-range ids, padding slots, odd sizes, W = 3)."""
    world = len(counts)
    gen = torch.Generator().manual_seed(sum(counts) * 7 + h + cap + k)
    wdt = dtype if wire is WireDtype.BF16 else (torch.float8_e4m3fn if wire is WireDtype.FP8 else torch.int8)
    ns = ta._scale_words(wire, h)
    data_bytes, _, b = a2a._row_layout(wire, h, dtype.itemsize, k, in_band=True)
    cw = world * cap
    recv = [torch.full((cw, b), 0xAB, dtype=torch.uint8, device=DEV) for _ in range(world)]
    peers = torch.tensor([r.data_ptr() for r in recv], dtype=torch.int64, device=DEV)
    inputs, sent, msgs = [], [], []
    for rank, t in enumerate(counts):
        x = make_hidden(t, h, dtype, gen).to(DEV)
        ids = _ids(t, k, world * el, gen, bad=t > 2)
        weights = torch.rand(t, k, generator=gen).to(DEV)
        _, src, bad = a2a.layout_fixed(ids, world, el, cap, False)
        index, msg = a2a.self_layout(ids, t, world, el, cap, rank)
        valid_ids = ids[(ids >= 0) & (ids < world * el)]
        assert torch.equal(msg.view(-1).cpu(), torch.bincount(valid_ids.cpu(), minlength=world * el))
        inputs.append((x, ids, weights, src, bad, index))
        sent.append(a2a.pack_fixed(x, ids, weights, src, t, bad, wire))
        msgs.append(msg)
    slabs = []
    for rank, (x, ids, weights, src, bad, index) in enumerate(inputs):
        received = torch.stack([msgs[s][rank] for s in range(world)])  # what the counts rows hold
        slab = torch.full((el * cw, data_bytes), 0xCD, dtype=torch.uint8, device=DEV)
        slab_scale = torch.full((el * cw, ns), float("nan"), device=DEV) if ns else None
        a2a.pack_masked_into(x, ids, weights, src, counts[rank], bad, wire, peers, rank, index, received, slab,
                             slab_scale)
        slabs.append((slab, slab_scale))
    for r in range(world):
        data, meta = a2a.split_fixed(recv[r], wire, dtype, h, k)
        got = a2a.expand_masked(data, meta, ns, k, r, el, wdt, *slabs[r], done=(r * cap, cap))
        expected = torch.cat([sent[s][r * cap:(r + 1) * cap] for s in range(world)])
        ref = a2a.expand_masked(*a2a.split_fixed(expected, wire, dtype, h, k), ns, k, r, el, wdt)
        slab, slab_scale, masked_m, index, valid, w = got
        assert torch.equal(masked_m, ref[2]) and torch.equal(index, ref[3]) and torch.equal(valid, ref[4])
        assert torch.equal(w.view(torch.int32), ref[5].view(torch.int32))
        here = torch.arange(cw, device=DEV) < masked_m.unsqueeze(1)  # [EL, CW]: the valid slab rows
        assert slab.shape == (el, cw, h) and slab.dtype == wdt
        assert torch.equal(slab.view(torch.uint8).view(el, cw, -1)[here], ref[0].view(torch.uint8).view(el, cw, -1)[here])
        if ns:
            assert torch.equal(slab_scale[here].view(torch.int32), ref[1][here].view(torch.int32))
        # the in-band counts and ids of every received row (own slots included) are the all-to-all's
        assert torch.equal(meta[:, ns:], a2a.split_fixed(expected, wire, dtype, h, k)[1][:, ns:])


@pytest.mark.parametrize("t,h,k,world,el,cap,rank,dtype", [(0, 64, 4, 2, 8, 5, 0, torch.bfloat16),
                                                           (1, 100, 4, 2, 8, 3, 1, torch.bfloat16),
                                                           (37, 200, 4, 2, 8, 40, 0, torch.bfloat16),
                                                           (17, 129, 3, 3, 4, 20, 2, torch.float32)])
@pytest.mark.parametrize("direct", [False, True])
def test_reduce_masked_matches_torch(t, h, k, world, el, cap, rank, dtype, direct):
    """Masked combine's rows on the experts' rank (decision 66) against ``_masked_pairs`` + ``_reduce_pairs_loop``
    (the CUDA torch path), byte for byte on every slot with a pair here; ``direct``: written through a table of base
    addresses into every rank's rows, where ``all_to_all_single`` would put them."""
    gen = torch.Generator().manual_seed(t + h + cap + rank)
    ids = _ids(t, k, world * el, gen)
    weights = torch.rand(t, k, generator=gen).to(DEV)
    x = make_hidden(t, 16, torch.bfloat16, gen).to(DEV)
    _, src, bad = a2a.layout_fixed(ids, world, el, cap, False)
    rows = a2a.pack_fixed(x, ids, weights, src, t, bad, WireDtype.BF16)  # as if every slot came to this rank
    data, meta = a2a.split_fixed(rows, WireDtype.BF16, x.dtype, 16, k)
    _, _, _, index, valid, w = a2a.expand_masked(data, meta, 0, k, rank, el, torch.bfloat16)
    cw = cap * world
    y = make_hidden(el * cw, h, dtype, gen).view(el, cw, h).to(DEV)
    idx, pair_w = ta._masked_pairs(index, valid, w, el * cw - 1)
    ref = ta._reduce_pairs_loop(y.view(el * cw, h), idx, pair_w)
    used = valid.any(1)
    if direct:  # every rank's rows in this process; only this rank writes here
        back = [torch.zeros(cw, h, dtype=dtype, device=DEV) for _ in range(world)]
        peers = torch.tensor([b.data_ptr() for b in back], dtype=torch.int64, device=DEV)
        a2a._reduce_masked(y, index, valid, w, None, peers, rank, cap)
        out = torch.zeros(cw, h, dtype=dtype, device=DEV)
        for r in range(world):  # rank r got this rank's rows of its slots r * C ... as its rows rank * C ...
            out[r * cap:(r + 1) * cap] = back[r][rank * cap:(rank + 1) * cap]
    else:
        out = a2a.reduce_masked(y, index, valid, w)
    word = torch.int16 if dtype.itemsize == 2 else torch.int32
    assert torch.equal(out[used].view(word), ref[used].view(word))


@pytest.mark.parametrize("world,m", [(1, 4), (2, 11), (3, 131)])
def test_put_counts_is_the_all_to_all(world, m):
    """Exact normal mode's counts messages written into every rank's rows through the table of base addresses
    (decision 66): rank r's rows are what ``all_to_all_single`` of the messages gives it."""
    msgs = [torch.randint(0, 1 << 40, (world, m), dtype=torch.int64).to(DEV) for _ in range(world)]
    rows = [torch.full((world, m), -1, dtype=torch.int64, device=DEV) for _ in range(world)]
    peers = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=DEV)
    for rank in range(world):
        a2a._put_counts_kernel[(world,)](msgs[rank], peers, m, rank, MP=triton.next_power_of_2(m))
    for r in range(world):
        assert torch.equal(rows[r], torch.stack([msgs[s][r] for s in range(world)]))


@pytest.mark.parametrize("wire", WIRES, ids=str)
@pytest.mark.parametrize("counts,h,k,el,cap,dtype", [((0, 5), 256, 4, 8, 6, torch.bfloat16),
                                                     ((7, 1, 4), 129, 3, 4, 7, torch.float32),
                                                     ((23, 17), 200, 4, 8, 23, torch.bfloat16),
                                                     ((23, 17), 200, 4, 8, 9, torch.bfloat16)])
def test_pack_into_peers_then_unpack_is_the_all_to_all(wire, counts, h, k, el, cap, dtype):
    """Exact normal mode's direct exchange (decision 66), every rank's rows in this one process: after every rank
    wrote its rows into the others' chunks of ``cap`` rows, ``unpack`` of rank r's chunks gives what it gives for
    the rows ``all_to_all_single`` of the ranks' ``pack`` rows delivers, byte for byte; a rank that sends some rank
    more than ``cap`` rows says so in its counts message (the last case: every rank refuses then)."""
    world = len(counts)
    gen = torch.Generator().manual_seed(sum(counts) + h + cap)
    _, _, b = a2a._row_layout(wire, h, dtype.itemsize, k)
    rows = [torch.full((world * cap, b), 0xAB, dtype=torch.uint8, device=DEV) for _ in range(world)]
    peers = torch.tensor([r.data_ptr() for r in rows], dtype=torch.int64, device=DEV)
    msgs, sent = [], []
    for rank, t in enumerate(counts):
        x = make_hidden(t, h, dtype, gen).to(DEV)
        ids = _ids(t, k, world * el, gen)
        weights = torch.rand(t, k, generator=gen).to(DEV)
        row, msg = a2a.layout(ids, world, el)
        a2a.pack_into(x, ids, weights, row, msg, wire, peers, rank, cap)
        per_rank = msg[0, :, 2].tolist()
        assert msg[0, :, -1].tolist() == [int(max(per_rank) > cap)] * world, "overflow flag"
        send = a2a.pack(x, ids, weights, row, wire)
        start = [sum(per_rank[:r]) for r in range(world)]
        sent.append([send[start[r]:start[r] + per_rank[r]] for r in range(world)])
        msgs.append(msg)
    if any(int(m[0, 0, -1]) for m in msgs):
        return  # overflowed: the dispatch is refused on every rank (the core reads the flags), nothing to compare
    for r in range(world):
        recv_msg = torch.stack([msgs[s][0, r] for s in range(world)])
        n = int(recv_msg[:, 2].sum())
        got = a2a.unpack(rows[r], recv_msg, wire, dtype, h, k, r, el, rows=n, chunk=cap)
        ref = a2a.unpack(torch.cat([sent[s][r] for s in range(world)]), recv_msg, wire, dtype, h, k, r, el)
        # at the chunks' size, before the host knows n (the core's early unpack, decision 70): the same first n rows
        early = a2a.unpack(rows[r], recv_msg, wire, dtype, h, k, r, el, rows=world * cap, chunk=cap)
        for a, e, b_ in zip(got, early, ref, strict=True):
            assert (a is None and b_ is None) or torch.equal(a.view(torch.uint8), b_.view(torch.uint8))
            assert e is None or torch.equal((e if e.dim() == 1 else e[:n]).view(torch.uint8), b_.view(torch.uint8))


def test_peer_addresses_apply_the_tensors_offset_in_its_allocation():
    """A rendezvous handle's ``buffer_ptrs`` are the ranks' allocation bases (a pool may put several tensors in one
    allocation): every rank's address of the tensor is its base plus this rank's offset (decision 66)."""
    import types

    buf = torch.empty(64, dtype=torch.uint8)
    for offset in (0, 16, 48):
        bases = [1 << 40, buf.data_ptr() - offset, 3 << 40]
        handle = types.SimpleNamespace(buffer_ptrs=bases, rank=1, buffer_size=128)
        assert a2a.peer_addresses(buf, handle) == [b + offset for b in bases]
    with pytest.raises(RuntimeError, match="not in this rank's buffer"):
        a2a.peer_addresses(buf, types.SimpleNamespace(buffer_ptrs=[0, buf.data_ptr() + 1, 0], rank=1, buffer_size=8))


def test_direct_ok_only_for_reachable_cuda_devices_of_one_host(monkeypatch):
    """The direct exchanges' condition (decision 66): a CPU device never; on CUDA, one host and distinct devices that
    reach each other, from one gather of every rank's (host, device), cached per group."""
    import types

    assert a2a.direct_ok(None, torch.device("cpu")) is False
    group = types.SimpleNamespace(group_name="g-test")
    gathered = [("node-a", 0), ("node-a", 1)]

    def all_gather_object(out, obj, group=None):
        out[:] = gathered

    monkeypatch.setattr(a2a.dist, "get_world_size", lambda group=None: len(gathered))
    monkeypatch.setattr(a2a.dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(a2a.torch.cuda, "can_device_access_peer", lambda a, b: True)
    for where, ok in (([("node-a", 0), ("node-a", 1)], True), ([("node-a", 0), ("node-b", 1)], False),
                      ([("node-a", 0), ("node-a", 0)], False)):
        gathered = where
        monkeypatch.setattr(a2a, "_DIRECT_OK", {})
        assert a2a.direct_ok(group, torch.device("cuda", 0)) is ok, where
    monkeypatch.setattr(a2a.torch.cuda, "can_device_access_peer", lambda a, b: False)
    gathered = [("node-a", 0), ("node-a", 1)]
    monkeypatch.setattr(a2a, "_DIRECT_OK", {})
    assert a2a.direct_ok(group, torch.device("cuda", 0)) is False
