"""Each emulated vendor op against a straightforward computation from its documentation
(vendor-apis.md sections 6-8), so the end-to-end tests rest on emulations that are right."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from npu_emulation import deep_ep_ascend as dee
from npu_emulation import torch_npu_ops as ops


def test_dynamic_quant_int8_rounds_half_to_even_per_row():
    x = torch.tensor([[127.0, 2.5, 3.5, -2.5, -0.5], [0.0, 0.0, 0.0, 0.0, 0.0]])
    y, s = ops.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (2,)
    assert y[0].tolist() == [127, 2, 4, -2, 0] and s[0].item() == 1.0
    assert y[1].tolist() == [0] * 5 and s[1].item() == 0.0
    x = torch.randn(7, 64) * 3
    y, s = ops.npu_dynamic_quant(x)
    assert torch.allclose(s, x.abs().amax(1) / 127)
    assert torch.equal(y, torch.round(x / s[:, None]).to(torch.int8))


def test_dynamic_quant_int4_packs_eight_per_int32_low_nibble_first():
    x = torch.tensor([[7.0, -7.0, 1.0, -1.0, 0.0, 2.5, 3.0, -3.5]])
    y, s = ops.npu_dynamic_quant(x, dst_type=torch.quint4x2)
    assert y.dtype == torch.int32 and y.shape == (1, 1) and s.item() == 1.0
    expected = [7, -7, 1, -1, 0, 2, 3, -4]  # 2.5 -> 2 and -3.5 -> -4 (half to even)
    word = sum((v & 0xF) << (4 * i) for i, v in enumerate(expected))
    assert (y.item() & 0xFFFFFFFF) == word
    assert ops.unpack_int4(y).tolist() == [expected]


def test_swiglu():
    x = torch.randn(5, 12)
    assert torch.allclose(ops.npu_swiglu(x), F.silu(x[:, :6]) * x[:, 6:], atol=1e-6)


def _gmm(x, w, gl, glt, **kw):
    return ops.npu_grouped_matmul([x], [w], group_list=gl, group_list_type=glt, split_item=2, group_type=0, **kw)[0]


def test_grouped_matmul_float_counts_and_cumsum():
    x, w = torch.randn(10, 16), torch.randn(3, 16, 8)  # weight is the right operand [E, K, N]
    counts = torch.tensor([4, 0, 5], dtype=torch.int64)  # 9 rows: row 9 is not written
    y = _gmm(x, w, counts, 1)
    expected = torch.cat([x[0:4] @ w[0], x[4:9] @ w[2]])
    assert torch.allclose(y[:9], expected, atol=1e-5) and torch.isnan(y[9]).all()
    assert torch.equal(_gmm(x, w, torch.cumsum(counts, 0), 0)[:9], y[:9])
    with pytest.raises(TypeError):
        _gmm(x, w, counts.int(), 1)


@pytest.mark.parametrize("int4", [False, True])
def test_grouped_matmul_per_token_quantized(int4):
    qmax = 7 if int4 else 127
    xq = torch.randint(-qmax, qmax + 1, (6, 16), dtype=torch.int8)
    wq = torch.randint(-qmax, qmax + 1, (2, 16, 8), dtype=torch.int8)
    scale, pts = torch.rand(2, 8) + 0.5, torch.rand(6) + 0.5
    counts = torch.tensor([2, 4], dtype=torch.int64)
    xa, wa = (ops.pack_int4(xq), ops.pack_int4(wq)) if int4 else (xq, wq)
    y = _gmm(xa, wa, counts, 1, scale=[scale], per_token_scale=[pts], output_dtype=torch.bfloat16)
    ref = torch.cat([(xq[:2].double() @ wq[0].double()) * scale[0].double() * pts[:2, None].double(),
                     (xq[2:].double() @ wq[1].double()) * scale[1].double() * pts[2:, None].double()])
    assert y.dtype == torch.bfloat16
    assert torch.allclose(y.double(), ref, rtol=1e-2, atol=1e-2)


def test_init_routing_v2_and_finalize_routing_worked_example():
    x = torch.arange(3 * 4, dtype=torch.float32).view(3, 4)
    ids = torch.tensor([[1, 0], [2, -1], [0, 1]], dtype=torch.int32)
    ex, row_idx, counts, sc = ops.npu_moe_init_routing_v2(
        x, ids, scale=torch.tensor([10.0, 20.0, 30.0]), active_num=6, expert_num=2, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, 2])
    # slots f = n*K + k: (0,e1) (0,e0) (1,e2 out of range) (1,-1) (2,e0) (2,e1); stable sort by expert
    assert torch.equal(ex[:4], x[[0, 2, 0, 2]]) and torch.isnan(ex[4:]).all()
    assert row_idx.tolist() == [2, 0, -1, -1, 1, 3] and counts.tolist() == [2, 2]
    assert sc[:4].tolist() == [10.0, 30.0, 10.0, 30.0]
    q, qs = ops.npu_moe_init_routing_v2(x, ids, active_num=6, expert_num=2, quant_mode=1,
                                        active_expert_range=[0, 2])[0::3]
    ref_q, ref_s = ops.npu_dynamic_quant(x[[0, 2, 0, 2]])
    assert torch.equal(q[:4], ref_q) and torch.equal(qs[:4], ref_s)

    rows = torch.randn(6, 4)
    scales = torch.rand(3, 2)
    skip = torch.randn(3, 4)
    out = ops.npu_moe_finalize_routing(rows, skip, None, None, scales, row_idx, ids, drop_pad_mode=2)
    ref = skip.clone()
    for n in range(3):
        for k in range(2):
            dst = int(row_idx[n * 2 + k])
            if dst >= 0:
                ref[n] += scales[n, k] * rows[dst]
    assert torch.allclose(out, ref, atol=1e-6)
    # documented drop_pad_mode 0 formula: slot(i, k) = i + k*N
    src2dst = torch.tensor([0, 1, 2, 3, 4, 5], dtype=torch.int32)
    out0 = ops.npu_moe_finalize_routing(rows, None, None, None, scales, src2dst, ids, drop_pad_mode=0)
    ref0 = torch.stack([sum(scales[i, k] * rows[i + k * 3] for k in range(2)) for i in range(3)])
    assert torch.allclose(out0, ref0, atol=1e-6)


def test_format_cast_is_a_noop():
    w = torch.randn(2, 3)
    assert ops.npu_format_cast(w, 29) is w


# --------------------------------------------------------------------------- DeepEP-Ascend (one rank)


E, K, H = 4, 2, 8


def _routing(t):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(t)]).long()
    ids[0, 1] = -1
    return ids, torch.rand(t, K)


def test_deep_ep_normal_dispatch_combine_and_int8_env(monkeypatch):
    buf = dee.Buffer(dee.SoloGroup())
    x = torch.randn(5, H).bfloat16()
    ids, w = _routing(5)
    per_rank, _, per_expert, in_rank, _ = buf.get_dispatch_layout(ids, E)
    assert per_rank.tolist() == [5] and per_expert.tolist() == torch.bincount(ids[ids >= 0], minlength=E).tolist()
    monkeypatch.delenv(dee.INT8_ENV, raising=False)
    rx, ridx, rw, counts, handle, _ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                   num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w)
    assert torch.equal(rx, x) and torch.equal(ridx, ids) and counts == per_expert.tolist()
    y, _, _ = buf.combine(rx * 2, handle)  # unweighted: each token once per rank
    assert torch.allclose(y.float(), (x * 2).float())
    monkeypatch.setenv(dee.INT8_ENV, "1")
    (q, s), *_ = buf.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                              num_tokens_per_expert=per_expert, topk_idx=ids, topk_weights=w)
    ref_q, ref_s = ops.npu_dynamic_quant(x)
    assert torch.equal(q, ref_q) and torch.equal(s, ref_s) and buf.env_seen == [None, "1"]


@pytest.mark.parametrize("use_fp8", [False, True])
def test_deep_ep_low_latency_dispatch_combine(use_fp8):
    num_max = 6
    buf = dee.Buffer(dee.SoloGroup(), 0, dee.Buffer.get_low_latency_rdma_size_hint(num_max, H, 1, E),
                     low_latency_mode=True)
    x = torch.randn(5, H).bfloat16()
    ids, w = _routing(5)
    recv, counts, handle, _, _ = buf.low_latency_dispatch(x, ids, num_max, E, use_fp8=use_fp8)
    assert counts.dtype == torch.int64 and counts.tolist() == torch.bincount(ids[ids >= 0], minlength=E).tolist()
    data = recv[0] if use_fp8 else recv
    n = int(counts.sum())
    rows = data[:n].float() * (recv[1][:n, None] if use_fp8 else 1)
    start = 0
    for e, c in enumerate(counts.tolist()):  # packed by expert: each row is a token routed to e
        tokens = (ids == e).any(dim=1).nonzero().flatten()
        ref = (ops.npu_dynamic_quant(x[tokens])[0].float() * ops.npu_dynamic_quant(x[tokens])[1][:, None]
               if use_fp8 else x[tokens].float())
        assert torch.allclose(rows[start:start + c].sort(dim=0).values, ref.sort(dim=0).values)
        start += c
    y = torch.randn(data.shape[0], H).bfloat16()
    out, _, _ = buf.low_latency_combine(y, ids, w, handle)
    ref = torch.zeros(5, H)
    info = handle[0]
    for p in range(n):
        t, e = int(info[p, 1]), int(info[p, 2])
        ref[t] += w[t][ids[t] == e].sum() * y[p].float()
    assert torch.allclose(out.float(), ref, atol=3e-2)
    small = dee.Buffer(dee.SoloGroup(), 0, dee.Buffer.get_low_latency_rdma_size_hint(num_max, H // 2, 1, E),
                       low_latency_mode=True)
    with pytest.raises(RuntimeError, match="RDMA bytes"):  # a buffer sized for a smaller layer
        small.low_latency_dispatch(x, ids, num_max, E)


def test_fused_deep_moe_matches_documented_pipeline():
    hid, inter, num_max, t = 512, 1024, 4, 3
    buf = dee.Buffer(dee.SoloGroup(), 0, dee.Buffer.get_low_latency_rdma_size_hint(num_max, hid, 1, E),
                     low_latency_mode=True)
    w13 = torch.randint(-127, 128, (E, 2 * inter, hid), dtype=torch.int8)  # checkpoint [E, 2I, H]
    w2 = torch.randint(-127, 128, (E, hid, inter), dtype=torch.int8)
    s13, s2 = torch.rand(E, 2 * inter) / 3000, torch.rand(E, hid) / 3000
    perm = w13.transpose(1, 2).reshape(E, hid, 2, inter // 64, 64).transpose(2, 3).reshape(E, hid, 2 * inter)
    perm_s = s13.reshape(E, 2, inter // 64, 64).transpose(1, 2).reshape(E, 2 * inter)
    x = torch.randn(t, hid).bfloat16()
    ids, w = _routing(t)
    out, recv = buf.fused_deep_moe(x, ids, w, perm, perm_s, w2, s2, num_max, E)
    ref = torch.zeros(t, hid, dtype=torch.float64)
    for i in range(t):
        xq, xs = ops.npu_dynamic_quant(x[i:i + 1])
        for k in range(K):
            e = int(ids[i, k])
            if e < 0:
                continue
            a = (xq.double() @ w13[e].double().t()) * s13[e].double() * xs.double()
            h = F.silu(a[:, :inter]) * a[:, inter:]
            hq, hs = ops.npu_dynamic_quant(h.float())
            y = (hq.double() @ w2[e].double().t()) * s2[e].double() * hs.double()
            ref[i] += w[i, k] * y[0]
    assert out.dtype == torch.bfloat16 and recv.tolist() == torch.bincount(ids[ids >= 0], minlength=E).tolist()
    assert ((out.double() - ref).norm() / ref.norm()).item() < 1e-2
    with pytest.raises(ValueError, match="limits"):
        buf.fused_deep_moe(x[:, :256].contiguous(), ids, w, perm[:, :256], perm_s, w2[:, :256], s2[:, :256],
                           num_max, E)
