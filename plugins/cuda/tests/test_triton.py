"""The ``triton`` experts: the kernels in Triton's interpreter without a GPU (fp16/fp32), and through
MoELayer against the reference on the GPU (``gpu`` marker)."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch
from cuda_layer_cases import (
    TOL,
    check_compiled,
    check_graph_replay,
    check_matches_reference,
    cuda_device,
    fixed_config,
    layer_config,
    layers,
    needs_gpu,
    random_topk,
    random_weights,
)

from moe_core import MoEConfig, plan
from moe_core.contracts import EPMaskedDispatch, TopK
from moe_core.layer import MoELayer
from moe_core.quant import quantize_activations
from moe_core.reference.oracle import moe_float64, relative_error
from moe_core.runtime import BackendContext

cuda = torch.cuda.is_available()

# CI must run the interpreter tests, never skip them: a clean CI environment once lacked numpy (the
# interpreter imports it) and every test below was skipped without anyone noticing
if os.environ.get("CI"):
    import triton
else:
    triton = pytest.importorskip("triton")


def _case(T, E, K, H, inter, dtype):
    x = torch.randn(T, H, dtype=dtype)
    w13 = (torch.randn(E, 2 * inter, H) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter) / inter ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int() if T else torch.zeros(0, K, dtype=torch.int32)
    if T:
        ids[torch.rand(T, K) < 0.2] = -1
    return x, w13, w2, torch.rand(T, K), ids


def _cfg(bn1=16, two_acc=0, bm=16, b_tma=0, a_tma=0):
    return {"gemm1": dict(BLOCK_M=bm, BLOCK_N=bn1, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2, TWO_ACC=two_acc,
                          B_TMA=b_tma, A_TMA=a_tma),
            "gemm2": dict(BLOCK_M=bm, BLOCK_N=32, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2, B_TMA=b_tma,
                          A_TMA=a_tma)}


# GEMM1 variants: one accumulator over interleaved w13 (the backend's default), the same with weight
# tiles through TMA descriptors, the two-accumulator fallback over interleaved and over checkpoint rows
# (the cutlass backend's small-T path; there TMA can load the gate and up tiles too); "a_tma": GEMM1
# writes h in the sorted rows' order and GEMM2 reads it through TMA (a slab: both GEMMs' A through TMA)
LAYOUTS = {"one_acc": (True, 0, 0, 0), "one_acc_b_tma": (True, 0, 1, 0), "two_acc_interleaved": (True, 1, 0, 0),
           "two_acc_checkpoint": (False, 1, 0, 0), "two_acc_checkpoint_b_tma": (False, 1, 1, 0),
           "one_acc_a_tma": (True, 0, 1, 1), "two_acc_checkpoint_a_tma": (False, 1, 0, 1)}


@pytest.mark.skipif(cuda, reason="interpreter path (the GPU tests cover the device)")
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("T,E,K,H,inter,dtype,act,bn1", [
    (0, 4, 2, 32, 32, torch.float32, "silu", 16), (1, 8, 3, 64, 32, torch.float16, "silu", 32),
    (5, 4, 2, 48, 40, torch.float32, "silu", 16), (37, 6, 2, 96, 37, torch.float32, "gelu", 32)])
def test_fused_experts_interpreter(layout, T, E, K, H, inter, dtype, act, bn1):
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    interleaved, two_acc, b_tma, a_tma = LAYOUTS[layout]
    x, w13, w2, w, ids = _case(T, E, K, H, inter, dtype)
    ref = moe_float64(x, w, ids, w13, w2, activation=act, routed_scaling_factor=1.5)
    run = partial(triton_ops.fused_experts, x, None, interleave_gate_up(w13) if interleaved else w13, w2, None, None,
                  w, ids, fp8_block=False, activation=act, routed_scaling_factor=1.5, out_dtype=dtype,
                  cfg=_cfg(bn1, two_acc, b_tma=b_tma, a_tma=a_tma), w13_interleaved=interleaved)
    if (b_tma or a_tma) and T and inter * w2.element_size() % 16:  # rows of 37 x 4 bytes: TMA cannot address them
        with pytest.raises(ValueError, match="16 bytes"):
            run()
        return
    out = run()
    assert out.shape == (T, H)
    assert relative_error(out, ref) < (1e-2 if dtype is torch.float16 else 1e-4)


@pytest.mark.skipif(cuda, reason="interpreter path (the GPU tests cover the device)")
@pytest.mark.parametrize("layout", ["one_acc", "two_acc_checkpoint_b_tma", "one_acc_a_tma"])
@pytest.mark.parametrize("T", [0, 1, 37, 130])
def test_fused_experts_half_tiles_interpreter(layout, T):
    """TAIL_TILES: buckets padded to BLOCK_M/2, an expert's last half block run as a BLOCK_M/2-row
    tile. With 6 experts and up to 260 slots, experts end in full and in half blocks (and -1 ids
    skip slots); both GEMMs must read exactly their expert's rows."""
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    interleaved, two_acc, b_tma, a_tma = LAYOUTS[layout]
    x, w13, w2, w, ids = _case(T, 6, 2, 64, 40, torch.float32)
    cfg = _cfg(16, two_acc, bm=32, b_tma=b_tma, a_tma=a_tma)
    cfg = {k: {**c, "TAIL_TILES": 1} for k, c in cfg.items()}
    out = triton_ops.fused_experts(x, None, interleave_gate_up(w13) if interleaved else w13, w2, None, None, w, ids,
                                   fp8_block=False, activation="silu", routed_scaling_factor=1.5, out_dtype=torch.float32,
                                   cfg=cfg,
                                   w13_interleaved=interleaved)
    ref = moe_float64(x, w, ids, w13, w2, activation="silu", routed_scaling_factor=1.5)
    assert out.shape == (T, 64) and relative_error(out, ref) < 1e-4
    if T:
        half = {"gemm1": cfg["gemm1"], "gemm2": {**cfg["gemm2"], "TAIL_TILES": 0}}
        with pytest.raises(AssertionError, match="TAIL_TILES"):
            triton_ops.fused_experts(x, None, w13, w2, None, None, w, ids, fp8_block=False, activation="silu",
                                     routed_scaling_factor=1.0, out_dtype=torch.float32, cfg=half)


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("layout", ["one_acc", "one_acc_b_tma", "two_acc_interleaved", "two_acc_checkpoint_b_tma",
                                    "one_acc_a_tma"])
def test_masked_experts_interpreter(layout):
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    E, C, H, inter = 4, 10, 48, 40
    x = torch.randn(E, C, H)
    w13, w2 = torch.randn(E, 2 * inter, H) / 7, torch.randn(E, H, inter) / 6
    mm = torch.tensor([0, 10, 3, 7], dtype=torch.int32)
    interleaved, two_acc, b_tma, a_tma = LAYOUTS[layout]
    out = triton_ops.masked_experts(x, None, mm, interleave_gate_up(w13) if interleaved else w13, w2, None, None,
                                    fp8_block=False, activation="silu", routed_scaling_factor=2.0, out_dtype=torch.float32,
                                    cfg=_cfg(32, two_acc, b_tma=b_tma, a_tma=a_tma), w13_interleaved=interleaved)
    for e in range(E):
        m = int(mm[e])
        if m:
            ids = torch.full((m, 1), e, dtype=torch.int32)
            ref = moe_float64(x[e, :m], torch.ones(m, 1), ids, w13, w2, routed_scaling_factor=2.0)
            assert relative_error(out[e, :m], ref) < 1e-4


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("M,H", [(0, 256), (1, 1000), (37, 200), (9, 1152)])
def test_activation_quant_scales_interpreter(M, H):
    """Indexing and masking of the Triton FP8 group quantizer (several groups per program, a
    partial last group, groups past the row's end): its scales are the core's. (The codes are
    fp8 casts, unreliable in the interpreter: the GPU test compares them.)"""
    from moe_plugin_cuda.triton import ops as triton_ops

    from moe_core.quant import quantize_fp8_per_token_group

    x = torch.randn(M, H) * (1 + 4 * torch.rand(M, 1))
    _, s = triton_ops.quantize_fp8_groups(x)
    assert s.shape == (M, -(-H // 128))
    assert torch.allclose(s, quantize_fp8_per_token_group(x)[1], rtol=1e-6, atol=0)


def _block_scaled(E, n, k):
    """fp32 stand-ins of an FP8 block-scaled weight: values and one scale per 128x128 block."""
    w = torch.randn(E, n, k) / k ** 0.5
    s = torch.rand(E, -(-n // 128), -(-k // 128)) + 0.5
    full = w * s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    return w, s, full


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("gate,bn", [(1, 256), (1, 64), (2, 128), (2, 32)])
def test_gemm1_fp8_scales_and_epilogue_quant_interpreter(gate, bn):
    """The FP8 GEMM1 path with fp32 stand-ins (the interpreter's fp8 casts are unreliable): the
    checkpoint-layout weight scales must follow interleaved rows, per-token-group activation
    scales apply per 128-column K group, and with 128 output columns per program the epilogue's
    per-(row, group) quantization must reproduce the activated output (up to fp8 rounding,
    which this fp32 stand-in skips)."""
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    T, E, K, H, inter = 29, 3, 2, 384, 200  # I not a multiple of 128: up rows straddle scale blocks
    w13, s13, w13_full = _block_scaled(E, 2 * inter, H)
    a = torch.randn(T, H)
    a_s = torch.rand(T, H // 128) + 0.5
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    ids[torch.rand(T, K) < 0.2] = -1
    cfg = dict(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, TWO_ACC=int(gate == 2))
    align = triton_ops.align_block_size(ids, E, 16)
    mode, row_mul, fused_quant = triton_ops.gemm1_mode(cfg, True)
    n_out = bn // 2 if mode == 1 else bn
    assert mode == gate and fused_quant == (n_out == 128)
    h = torch.zeros(T * K, inter)
    h_s = torch.zeros(T * K, -(-inter // 128))
    triton_ops._gemm(a, a_s, interleave_gate_up(w13), s13, h, h_s if fused_quant else None, None,
                     align, None, N=2 * inter if mode == 1 else inter, Kdim=H,
                     num_valid=T * K, a_row_div=K, inter=inter, up_row=1, capacity=0, num_m_blocks=align.max_blocks,
                     gate=mode, row_mul=row_mul, act=0, mul_weight=False, fp8=True, quant_out=fused_quant,
                     masked=False, cfg=cfg)
    a_full = a * a_s.repeat_interleave(128, 1)
    valid = (ids.reshape(-1) >= 0).nonzero().flatten()
    for slot in valid.tolist():
        e, t = int(ids.reshape(-1)[slot]), slot // K
        gu = w13_full[e].double() @ a_full[t].double()
        want = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
        got = h[slot].double()
        if fused_quant:
            scale = h_s[slot].repeat_interleave(128)[:inter].double()
            assert relative_error(h_s[slot], want.abs().unflatten(0, (-1, 128)).amax(1) / 448 if inter % 128 == 0
                                  else torch.stack([c.abs().max() for c in want.split(128)]) / 448) < 1e-5
            assert got.abs().max() <= 448.0
            got = got * scale
        assert relative_error(got, want) < 1e-5


@pytest.mark.skipif(cuda, reason="interpreter path")
def test_gemm2_fp8_scales_interpreter():
    from moe_plugin_cuda.triton import ops as triton_ops

    T, E, K, H, inter = 21, 3, 2, 200, 256
    w2, s2, w2_full = _block_scaled(E, H, inter)
    h = torch.randn(T * K, inter)
    h_s = torch.rand(T * K, inter // 128) + 0.5
    ids = torch.randint(-1, E, (T, K), dtype=torch.int32)
    w = torch.rand(T * K)
    align = triton_ops.align_block_size(ids, E, 16)
    y = torch.zeros(T * K, H)
    triton_ops.gemm2(h, h_s, w2, s2, y, w, align=align, masked_m=None,
                     num_rows=T * K, capacity=0, num_m_blocks=align.max_blocks, out_scale=1.0, fp8=True,
                     cfg2=dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, GROUP_M=1, num_warps=4, num_stages=2))
    h_full = h * h_s.repeat_interleave(128, 1)
    for slot in (ids.reshape(-1) >= 0).nonzero().flatten().tolist():
        e = int(ids.reshape(-1)[slot])
        want = (w2_full[e].double() @ h_full[slot].double()) * float(w[slot])
        assert relative_error(y[slot], want) < 1e-5


@pytest.mark.skipif(cuda, reason="interpreter path")
def test_weight_descriptors_cached_across_calls_interpreter():
    """B_TMA weight descriptors come from the caller's cache after the first call (one per weight tensor and
    tile), with the same output as descriptors built per call."""
    from moe_plugin_cuda.triton import ops as triton_ops

    x, w13, w2, tw, ids = _case(9, 4, 2, 64, 48, torch.float32)
    cfg = _cfg(bn1=32, b_tma=1)
    kw = dict(fp8_block=False, activation="silu", routed_scaling_factor=1.0, out_dtype=torch.float32, cfg=cfg)
    cache: dict = {}
    first = triton_ops.fused_experts(x, None, w13, w2, None, None, tw, ids, descriptors=cache, **kw)
    built = dict(cache)
    assert len(built) == 2  # w13's and w2's
    again = triton_ops.fused_experts(x, None, w13, w2, None, None, tw, ids, descriptors=cache, **kw)
    assert cache == built and all(cache[k] is built[k] for k in built)
    uncached = triton_ops.fused_experts(x, None, w13, w2, None, None, tw, ids, **kw)
    assert torch.equal(first, uncached) and torch.equal(again, uncached)


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("numel_tokens,E,bm", [
    (1, 8, 16), (100, 256, 16), (204, 37, 64), (700, 256, 64),  # up to SMALL_ALIGN_MAX: one program
    (205, 37, 16), (1000, 8, 16), (1000, 37, 128), (1000, 128, 64), (1000, 256, 128), (3000, 37, 16),
    (8000, 8, 128), (8000, 37, 16), (8000, 128, 128), (8000, 256, 64)])
@pytest.mark.parametrize("tails", [False, True])
def test_align_block_size(numel_tokens, E, bm, tails, check_alignment):
    """Up to SMALL_ALIGN_MAX (1024) slots the one-program kernel; beyond, count + place over chunks
    (1025 .. 40000 slots: 5 to 157 place programs, each writing its share of the M-block experts and
    sentinels, with more programs than experts and more experts than programs), with and without
    half tiles: the ``check_alignment`` fixture."""
    from moe_plugin_cuda.triton import ops as triton_ops

    if tails and bm < 32:
        with pytest.raises(ValueError, match="half tiles"):
            triton_ops.align_block_size(torch.zeros(1, 1, dtype=torch.int32), E, bm, tails)
        return
    ids = torch.randint(-1, E, (numel_tokens, 5), dtype=torch.int32)
    if numel_tokens > 100:
        ids[ids == 3] = 2  # an empty expert
    check_alignment(ids, E, bm, tails, triton_ops.align_block_size(ids, E, bm, tails))


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("row_align", [1, 128])
@pytest.mark.parametrize("T,K,E", [(0, 4, 8), (1, 8, 16), (77, 3, 5), (333, 3, 37), (1111, 4, 37), (2501, 8, 256),
                                   (5001, 1, 8)])
def test_expert_rows_layout(T, K, E, row_align):
    """``triton_ops.expert_rows`` (one program up to 1024 slots, count + place beyond): per-expert
    counts, first rows on multiples of ``row_align`` without overlap; each valid slot (ids -1 and >= E
    are not) a distinct row inside its expert's [start, start + count), skipped slots -1; a row bound
    that holds every expert's padded rows for any routing."""
    from moe_plugin_cuda.triton import ops as triton_ops

    ids = torch.randint(-1, E + 1, (T, K), dtype=torch.int32)
    if T > 2:
        ids[ids == 2] = 3  # expert 2: empty
    counts, start, row_of_slot, rows = triton_ops.expert_rows(ids, E, row_align)
    assert {counts.dtype, start.dtype, row_of_slot.dtype} == {torch.int32} and row_of_slot.shape == (T * K,)
    flat = ids.flatten().long()
    valid = (flat >= 0) & (flat < E)
    ref_counts = torch.bincount(flat[valid], minlength=E)
    padded = (ref_counts + row_align - 1) // row_align * row_align
    assert torch.equal(counts.long(), ref_counts) and torch.equal(start.long(), torch.cumsum(padded, 0) - padded)
    r, e = row_of_slot[valid].long(), flat[valid]
    assert r.unique().numel() == r.numel()  # one row per slot
    assert bool(((r >= start[e]) & (r < start[e] + counts[e])).all())
    assert bool((row_of_slot[~valid] == -1).all())
    assert rows % row_align == 0 and rows >= int((start.long() + padded).max())
    assert rows == (T * K if row_align == 1 else -(-(T * K + min(T * K, E) * (row_align - 1)) // row_align) * row_align)


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("fmt", ["standard", "ep_masked"])
def test_apply_is_one_custom_op_under_torch_compile_interpreter(fmt):
    """Under torch.compile(fullgraph=True) the triton experts' apply is one opaque custom op (no graph
    break, inductor never re-compiles our kernels); it computes what the eager call does. aot_eager:
    dynamo + the op's fake (shape) function, without a C++ build on this CPU."""
    from moe_plugin_cuda.triton.experts import TritonExperts
    from moe_plugin_cuda.weights import interleave_gate_up

    from moe_core.contracts import EPMaskedDispatch, Format, QuantizedActivations, StandardDispatch, WireDtype
    from moe_core.plugins import PluginManager
    from moe_core.runtime import BackendContext

    E, K, H, inter = 4, 2, 48, 40
    spec = next(s for s in PluginManager().specs if s.plugin == "cuda" and s.name == "triton")
    cfg = MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=inter, params_dtype=torch.float32,
                    routed_scaling_factor=1.5, backend_options={"triton": {"config": _cfg(32)}})
    form = Format.STANDARD if fmt == "standard" else Format.EP_MASKED
    experts = TritonExperts(BackendContext(cfg, spec, form, WireDtype.BF16))
    x, w13, w2, w, ids = _case(5, E, K, H, inter, torch.float32)
    layer = torch.nn.Module()
    layer.w13, layer.w2 = torch.nn.Parameter(interleave_gate_up(w13)), torch.nn.Parameter(w2)
    if fmt == "standard":
        d = StandardDispatch(QuantizedActivations(x, WireDtype.BF16), TopK(w, ids))
        ref = moe_float64(x, w, ids, w13, w2, routed_scaling_factor=1.5)
    else:
        slab = torch.randn(E, 6, H)
        mm = torch.tensor([6, 0, 2, 5], dtype=torch.int32)
        d = EPMaskedDispatch(QuantizedActivations(slab, WireDtype.BF16), mm, TopK(w, ids), handle=None)
    compiled = torch.compile(lambda disp: experts.apply(layer, disp).hidden, fullgraph=True, backend="aot_eager")
    out, eager = compiled(d), experts.apply(layer, d).hidden
    if fmt == "standard":
        assert out.shape == (5, H) and relative_error(out, ref) < 1e-4
        assert torch.equal(out, eager)
    else:
        for e in range(E):
            m = int(mm[e])
            assert torch.equal(out[e, :m], eager[e, :m])
            if m:
                r = moe_float64(slab[e, :m], torch.ones(m, 1), torch.full((m, 1), e, dtype=torch.int32), w13, w2,
                                routed_scaling_factor=1.5)
                assert relative_error(out[e, :m], r) < 1e-4


# ------------------------------------------------------------------ on the GPU


TRITON_QUANTS = ["unquantized", "fp8_block"]


@needs_gpu
@pytest.mark.parametrize("quant", TRITON_QUANTS)
@pytest.mark.parametrize("T", [0, 1, 7, 133, 1031])
def test_matches_reference(quant, T):
    check_matches_reference("triton", quant, T)


@needs_gpu
@pytest.mark.parametrize("act", ["silu", "gelu"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_dtypes_and_gelu(act, dtype):
    cfg, layer, ref = layers("triton", "unquantized", act=act, dtype=dtype, E=8, K=2, H=200, inter=136)
    x = torch.randn(77, cfg.hidden_size, device="cuda").to(dtype)
    topk = random_topk(77, cfg)
    assert relative_error(layer(x, topk), ref(x, topk)) < 1e-2


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_triton_large_expert_count(quant):
    # 256 experts, top-8 (DeepSeek-like routing), many alignment chunks
    cfg, layer, ref = layers("triton", quant, E=256, K=8, H=512, inter=256)
    x = torch.randn(3000, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
    topk = random_topk(3000, cfg)
    assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]


# GEMM1 variants (BLOCK_M, BLOCK_N, TWO_ACC, B_TMA): one accumulator over interleaved rows (BLOCK_N/2 outputs;
# 256 = one 128-column group, so FP8 quantizes in the epilogue; 128 = a separate quantization kernel), the
# two-accumulator fallback (BLOCK_N outputs; 128 fuses the FP8 quantization, 64 does not), and weight
# tiles through TMA descriptors in both GEMMs (B_TMA)
GEMM1_VARIANTS = [(16, 256, 0, 0), (16, 128, 0, 0), (16, 128, 1, 0), (16, 64, 1, 0), (64, 256, 0, 0), (128, 128, 0, 0),
                  (16, 128, 0, 1), (64, 256, 0, 1), (128, 128, 0, 1)]


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
@pytest.mark.parametrize("bm,bn,two_acc,b_tma", GEMM1_VARIANTS)
def test_triton_masked(quant, bm, bn, two_acc, b_tma):
    cfg = layer_config("triton", quant, max_tokens_per_rank=64, backend_options={"triton": {
        "config": fixed_config(bm, bn, two_acc, b_tma, quant == "fp8_block")}})
    gen = torch.Generator(device="cuda").manual_seed(3)
    w = random_weights(cfg, gen)
    layer, ref = MoELayer(cfg, device=cuda_device()), MoELayer(cfg.replace(experts="reference"), device=cuda_device())
    for lay in (layer, ref):
        lay.load_weights(**w)
        lay.process_weights()
    E, C, H = cfg.num_local_experts, 40, cfg.hidden_size
    slab = torch.randn(E, C, H, device="cuda").to(cfg.params_dtype)
    # the slab arrives in the scheme's wire dtype (FP8 for fp8_block), as a dispatcher sends it
    qa = quantize_activations(slab, "fp8" if quant == "fp8_block" else "bf16")
    masked_m = torch.randint(0, C + 1, (E,), device="cuda", dtype=torch.int32)
    masked_m[0], masked_m[1] = 0, C
    topk = random_topk(5, cfg)
    d = EPMaskedDispatch(qa, masked_m, topk)
    out = layer.experts.apply(layer, d).hidden
    exp = ref.experts.apply(ref, d).hidden
    valid = torch.arange(C, device="cuda")[None, :] < masked_m[:, None]
    assert relative_error(out[valid], exp[valid]) < TOL[quant]


@needs_gpu
# I=320: up rows straddle the 128-row FP8 scale blocks and the last output group is partial
@pytest.mark.parametrize("quant,inter", [("unquantized", 320), ("fp8_block", 384), ("fp8_block", 320)])
@pytest.mark.parametrize("bm,bn,two_acc,b_tma", GEMM1_VARIANTS)
def test_triton_gemm1_variants(quant, inter, bm, bn, two_acc, b_tma):
    """Each GEMM1 kernel variant through the whole layer against the reference (T=700: many
    blocks per expert, -1 ids), including the FP8 epilogue quantization and BLOCK_M=128 tiles."""
    cfg, layer, ref = layers("triton", quant, E=16, K=4, H=384, inter=inter,
                              backend_options={"triton": {"config": fixed_config(bm, bn, two_acc, b_tma,
                                                                           quant == "fp8_block")}})
    x = torch.randn(700, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
    topk = random_topk(700, cfg)
    assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]


def _half_tiles(bm, bn, two_acc, b_tma, fp8):
    return {k: {**c, "TAIL_TILES": 1} for k, c in fixed_config(bm, bn, two_acc, b_tma, fp8).items()}


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
@pytest.mark.parametrize("bm,bn,two_acc,b_tma", [(128, 256, 0, 1), (64, 256, 0, 1), (128, 128, 1, 0), (32, 128, 0, 0)])
def test_triton_half_tiles(quant, bm, bn, two_acc, b_tma):
    """TAIL_TILES (an expert's last BLOCK_M/2 rows as a half tile) through the whole layer against the
    reference: T=1 (one half tile per expert), T=700 and 1031 (E=16, K=4: 140-260 rows per expert, so
    experts end in full and in half tiles), -1 ids; and the EP_MASKED slab on the same config (no
    alignment there: the option is ignored)."""
    fp8 = quant == "fp8_block"
    cfg, layer, ref = layers("triton", quant, E=16, K=4, H=384, inter=320,
                              backend_options={"triton": {"config": _half_tiles(bm, bn, two_acc, b_tma, fp8)}})
    for T in (1, 700, 1031):
        x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
        topk = random_topk(T, cfg)
        assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    E, C, H, inter = 4, 64, 384, 320
    w = random_weights(layer_config("triton", quant, E=E, H=H, inter=inter), torch.Generator(device="cuda").manual_seed(3))
    x = torch.randn(E, C, H, device="cuda").to(torch.bfloat16)
    mm = torch.tensor([0, 64, 3, 33], dtype=torch.int32, device="cuda")
    run = partial(triton_ops.masked_experts, x, None, mm, interleave_gate_up(w["w13"]), w["w2"], w.get("w13_scale"),
                  w.get("w2_scale"), fp8_block=fp8, activation="silu", routed_scaling_factor=1.7,
                  out_dtype=torch.bfloat16, w13_interleaved=True)
    got, want = run(cfg=_half_tiles(bm, bn, two_acc, b_tma, fp8)), run(cfg=fixed_config(bm, bn, two_acc, b_tma, fp8))
    for e in range(E):
        assert torch.equal(got[e, :int(mm[e])], want[e, :int(mm[e])])


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
@pytest.mark.parametrize("bm,bn,two_acc,tails", [(128, 256, 0, 1), (64, 256, 0, 0), (128, 128, 1, 1), (16, 128, 0, 0)])
def test_triton_a_tma(quant, bm, bn, two_acc, tails):
    """A_TMA: GEMM1 writes h in the sorted rows' order and GEMM2 streams it through TMA (a slab: both
    GEMMs' A through TMA). Same tiles, same K order as the gathering kernels: bit for bit their
    output, at T=1, 700 and 1031 (E=16, K=4: experts ending in full and half tiles, -1 ids) and on the
    slab; and through the layer against the reference."""
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    fp8 = quant == "fp8_block"
    base = fixed_config(bm, bn, two_acc, 0 if two_acc else 1, fp8)  # (two accumulators: interleaved w13, no B_TMA)
    if tails:
        base = {k: {**c, "TAIL_TILES": 1} for k, c in base.items()}
    a_tma = {k: {**c, "A_TMA": 1} for k, c in base.items()}
    cfg = layer_config("triton", quant, E=16, K=4, H=384, inter=320)
    w = random_weights(cfg, torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31))
    w13 = interleave_gate_up(w["w13"])
    for T in (1, 700, 1031):
        x = torch.randn(T, cfg.hidden_size, device="cuda").to(torch.bfloat16)
        topk = random_topk(T, cfg)
        run = partial(triton_ops.fused_experts, x, None, w13, w["w2"], w.get("w13_scale"), w.get("w2_scale"),
                      topk.weights, topk.ids, fp8_block=fp8, activation="silu", routed_scaling_factor=1.7,
                      out_dtype=torch.bfloat16, w13_interleaved=True)
        assert torch.equal(run(cfg=a_tma), run(cfg=base)), T
    C = 64
    slab = torch.randn(16, C, cfg.hidden_size, device="cuda").to(torch.bfloat16)
    mm = torch.randint(0, C + 1, (16,), dtype=torch.int32, device="cuda")
    mm[0], mm[1] = 0, C
    run = partial(triton_ops.masked_experts, slab, None, mm, w13, w["w2"], w.get("w13_scale"), w.get("w2_scale"),
                  fp8_block=fp8, activation="silu", routed_scaling_factor=1.7, out_dtype=torch.bfloat16,
                  w13_interleaved=True)
    got, want = run(cfg=a_tma), run(cfg=base)
    for e in range(16):
        assert torch.equal(got[e, :int(mm[e])], want[e, :int(mm[e])])
    _, layer, ref = layers("triton", quant, E=16, K=4, H=384, inter=320,
                            backend_options={"triton": {"config": a_tma}})
    x = torch.randn(1031, 384, device="cuda").to(torch.bfloat16)
    topk = random_topk(1031, cfg)
    assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_triton_gemm1_two_acc_option(quant):
    """backend option gemm1_two_acc: the fallback kernel on every config (tuned or heuristic)."""
    cfg, layer, ref = layers("triton", quant, E=16, K=4, H=384, inter=320,
                              backend_options={"triton": {"gemm1_two_acc": True}})
    for T in (3, 900):
        x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
        topk = random_topk(T, cfg)
        assert relative_error(layer(x, topk), ref(x, topk)) < TOL[quant]
        assert layer.experts.launch_config(T, x.device)["gemm1"]["TWO_ACC"] == 1


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_triton_process_weights_once(quant):
    """w13 is interleaved once: a second process_weights, and a reload + process_weights, leave
    the output unchanged (the kit checks the same; this also checks the layout itself)."""
    from moe_plugin_cuda.weights import interleave_gate_up

    cfg = layer_config("triton", quant)
    w = random_weights(cfg, torch.Generator(device="cuda").manual_seed(5))
    layer, ref = MoELayer(cfg, device=cuda_device()), MoELayer(cfg.replace(experts="reference"), device=cuda_device())
    for lay in (layer, ref):
        lay.load_weights(**w)
        lay.process_weights()
    assert torch.equal(layer.w13, interleave_gate_up(w["w13"]))
    x = torch.randn(64, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
    topk = random_topk(64, cfg)
    first = layer(x, topk)
    assert relative_error(first, ref(x, topk)) < TOL[quant]
    layer.experts.process_weights(layer)
    assert torch.equal(layer(x, topk), first)
    layer.load_weights(**w)
    layer.process_weights()
    assert torch.equal(layer.w13, interleave_gate_up(w["w13"]))
    assert torch.equal(layer(x, topk), first)


@needs_gpu
@pytest.mark.parametrize("numel_tokens,E,bm", [(1, 8, 16), (100, 256, 16), (128, 256, 64), (129, 128, 16),
                                               (3000, 37, 16), (5000, 256, 64), (4096, 8, 64), (16384, 128, 128)])
@pytest.mark.parametrize("tails", [False, True])
def test_triton_align_on_device(numel_tokens, E, bm, tails, check_alignment):
    """Both alignment paths on the GPU (one program up to 1024 slots, with atomics after a
    barrier; count + place beyond), with and without half tiles: the ``check_alignment`` fixture."""
    from moe_plugin_cuda.triton import ops as triton_ops

    if tails and bm < 32:
        pytest.skip("half tiles need BLOCK_M >= 32")
    ids = torch.randint(-1, E, (numel_tokens, 8), dtype=torch.int32, device="cuda")
    check_alignment(ids, E, bm, tails, triton_ops.align_block_size(ids, E, bm, tails))


@needs_gpu
@pytest.mark.parametrize("T,K,E", [(1, 8, 256), (333, 8, 37), (16384, 8, 128), (32768, 8, 256), (32768, 2, 8)])
@pytest.mark.parametrize("row_align", [1, 128])
def test_expert_rows_on_device(T, K, E, row_align):
    """The grouped GEMMs' row layout on the GPU, up to T*K = 262144 slots: per-expert counts, first
    rows on multiples of ``row_align``, each valid slot a distinct row of its expert, skipped slots -1."""
    from moe_plugin_cuda.triton import ops as triton_ops

    ids = torch.randint(-1, E, (T, K), dtype=torch.int32, device="cuda")
    counts, start, row_of_slot, rows = triton_ops.expert_rows(ids, E, row_align)
    flat = ids.flatten().long()
    valid = flat >= 0
    padded = (counts.long() + row_align - 1) // row_align * row_align
    assert torch.equal(counts.long(), torch.bincount(flat[valid], minlength=E))
    assert torch.equal(start.long(), torch.cumsum(padded, 0) - padded) and rows >= int(padded.sum())
    r, e = row_of_slot[valid].long(), flat[valid]
    assert r.unique().numel() == r.numel() and bool(((r >= start[e]) & (r < start[e] + counts[e])).all())
    assert bool((row_of_slot[~valid] == -1).all())


@needs_gpu
@pytest.mark.parametrize("M,H", [(0, 256), (1, 7168), (37, 1000), (300, 128), (5, 200)])
def test_triton_activation_quant_matches_core(M, H):
    """The Triton per-token-group FP8 quantizer (several groups per program, a partial last group)
    gives the core's scales and codes exactly."""
    from moe_plugin_cuda.triton import ops as triton_ops

    from moe_core.quant import quantize_fp8_per_token_group

    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16) * (1 + 4 * torch.rand(M, 1, device="cuda"))
    q, s = triton_ops.quantize_fp8_groups(x)
    q_ref, s_ref = quantize_fp8_per_token_group(x)
    assert torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


# plus configs with TMA weight loads (tuned tables pick B_TMA at large T; its descriptors are built on the
# host per call and must replay / compile like the rest) and with half tiles
VARIANTS = [(q, v) for q in TRITON_QUANTS for v in (None, "b_tma", "half_tiles")]


def _variant_options(quant, variant):
    if variant == "b_tma":
        return {"backend_options": {"triton": {"config": fixed_config(64, 256, 0, 1, quant == "fp8_block")}}}
    if variant == "half_tiles":
        return {"backend_options": {"triton": {"config": _half_tiles(64, 256, 0, 1, quant == "fp8_block")}}}
    return {}


@needs_gpu
@pytest.mark.parametrize("quant,variant", VARIANTS)
def test_cuda_graph_capture_replay(quant, variant):
    check_graph_replay("triton", quant, _variant_options(quant, variant))


@needs_gpu
@pytest.mark.parametrize("quant,variant", VARIANTS)
def test_torch_compile(quant, variant):
    check_compiled("triton", quant, _variant_options(quant, variant))


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_torch_compile_fullgraph_triton(quant):
    """fullgraph=True: the triton experts are one custom op under compile, not a graph break."""
    torch._dynamo.reset()  # see test_torch_compile
    cfg, layer, ref = layers("triton", quant)
    compiled = torch.compile(layer, fullgraph=True)
    for T in (1, 37):
        x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
        topk = random_topk(T, cfg)
        assert relative_error(compiled(x, topk), ref(x, topk)) < TOL[quant]


@needs_gpu
def test_backend_context_options_fixed_config():
    # a fixed launch config from backend_options is used for every T
    cfg = layer_config("triton", "unquantized", backend_options={"triton": {"config": {
        "gemm1": dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3),
        "gemm2": dict(BLOCK_M=32, BLOCK_N=128, BLOCK_K=64, GROUP_M=4, num_warps=4, num_stages=3)}}})
    p = plan(cfg)
    from moe_plugin_cuda.triton.experts import TritonExperts

    e = TritonExperts(BackendContext(cfg, p.experts, p.format, p.dispatch_dtype))
    assert e.launch_config(1000, torch.device("cuda"))["gemm1"]["BLOCK_M"] == 32


@needs_gpu
def test_conformance_kit_on_the_gpu():
    """The conformance kit, as a vendor runs it, on this GPU (every scheme the backend declares)."""
    from moe_core.testing import run_kit

    report = run_kit("cuda.triton")
    print(report.text())
    assert report.ok, report.text()
    assert sum(r.status == "passed" for r in report.results) > 20
