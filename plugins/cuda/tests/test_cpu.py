"""CI without a GPU: plugin declarations and probes, and the Triton kernels in the interpreter."""

from __future__ import annotations

import os
from functools import partial

import pytest
import torch

from moe_core.backends import Code
from moe_core.reference.oracle import moe_float64, relative_error

cuda = torch.cuda.is_available()


def test_entry_point_and_specs():
    from moe_core.plugins import PluginManager

    pm = PluginManager()
    rec = {r.name: r for r in pm.records}
    assert rec["cuda"].status.ok
    names = {s.name for s in pm.specs if s.plugin == "cuda"}
    assert names == {"triton", "grouped_mm", "deepep", "cutedsl", "cutlass"}
    for s in pm.specs:
        if s.plugin == "cuda":
            r = pm.availability(s)  # probes never raise
            if not cuda:
                assert r.code in (Code.NO_DEVICE, Code.NOT_INSTALLED), r


def test_cutedsl_unsupported_arch_on_hopper(monkeypatch):
    from moe_plugin_cuda import probes

    monkeypatch.setattr(probes, "_cuda_capability", lambda: ((9, 0), None))
    r = probes.probe_cutedsl()
    assert r.code is Code.UNSUPPORTED_ARCH and "triton" in r.hint


def test_moe_core_tune_finds_the_cuda_tuner(capsys):
    """``moe-core tune`` lists the tuners plugins register (entry-point group ``moe_core.tuners``) and
    runs one with the arguments after ``--``."""
    from moe_core.cli import main

    assert main(["tune"]) == 0
    assert "cuda" in capsys.readouterr().out
    assert main(["tune", "cuda", "--", "--help"]) == 0
    assert "--presets" in capsys.readouterr().out
    assert main(["tune", "no-such-tuner"]) == 2
    assert "installed: cuda" in capsys.readouterr().err
    if not cuda:
        assert main(["tune", "cuda"]) == 1
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_moe_core_doctor_reports_the_cuda_vendor_packages(capsys):
    """The cuda backends declare the vendor packages they need (BackendSpec.packages), so
    ``moe-core doctor`` reports each one's version, or that it is absent, without importing it."""
    import json

    from moe_core.cli import main

    main(["doctor", "--json"])
    packages = json.loads(capsys.readouterr().out)["environment"]["packages"]
    assert {"triton", "deep_ep", "flashinfer", "cutlass_library", "deep_gemm"} <= set(packages)
    assert all(v is None or isinstance(v, str) and v for v in packages.values())  # a version, or absent


def test_deepep_not_installed_hint():
    from moe_plugin_cuda import probes

    r = probes.probe_deepep()
    assert r.code is Code.NOT_INSTALLED and "DeepEP" in r.hint


def test_deepep_checks():
    from moe_plugin_cuda import probes

    from moe_core import MoEConfig

    cfg = MoEConfig(num_experts=18, top_k=2, hidden_size=1000, intermediate_size=64, ep_size=3, cuda_graph=True,
                    device="cuda")
    codes = [r.code for r in probes.check_deepep(cfg, None)]
    assert Code.UNSUPPORTED_PARALLEL in codes and codes.count(Code.UNSUPPORTED_SHAPE) >= 2


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
    from moe_plugin_cuda import triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    interleaved, two_acc, b_tma, a_tma = LAYOUTS[layout]
    x, w13, w2, w, ids = _case(T, E, K, H, inter, dtype)
    ref = moe_float64(x, w, ids, w13, w2, activation=act, routed_scaling_factor=1.5)
    run = partial(triton_ops.fused_experts, x, None, interleave_gate_up(w13) if interleaved else w13, w2, None, None,
                  w, ids, activation=act, routed_scaling_factor=1.5, out_dtype=dtype,
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
    from moe_plugin_cuda import triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    interleaved, two_acc, b_tma, a_tma = LAYOUTS[layout]
    x, w13, w2, w, ids = _case(T, 6, 2, 64, 40, torch.float32)
    cfg = _cfg(16, two_acc, bm=32, b_tma=b_tma, a_tma=a_tma)
    cfg = {k: {**c, "TAIL_TILES": 1} for k, c in cfg.items()}
    out = triton_ops.fused_experts(x, None, interleave_gate_up(w13) if interleaved else w13, w2, None, None, w, ids,
                                   activation="silu", routed_scaling_factor=1.5, out_dtype=torch.float32, cfg=cfg,
                                   w13_interleaved=interleaved)
    ref = moe_float64(x, w, ids, w13, w2, activation="silu", routed_scaling_factor=1.5)
    assert out.shape == (T, 64) and relative_error(out, ref) < 1e-4
    if T:
        half = {"gemm1": cfg["gemm1"], "gemm2": {**cfg["gemm2"], "TAIL_TILES": 0}}
        with pytest.raises(AssertionError, match="TAIL_TILES"):
            triton_ops.fused_experts(x, None, w13, w2, None, None, w, ids, activation="silu", routed_scaling_factor=1.0,
                                     out_dtype=torch.float32, cfg=half)


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("layout", ["one_acc", "one_acc_b_tma", "two_acc_interleaved", "two_acc_checkpoint_b_tma",
                                    "one_acc_a_tma"])
def test_masked_experts_interpreter(layout):
    from moe_plugin_cuda import triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    E, C, H, inter = 4, 10, 48, 40
    x = torch.randn(E, C, H)
    w13, w2 = torch.randn(E, 2 * inter, H) / 7, torch.randn(E, H, inter) / 6
    mm = torch.tensor([0, 10, 3, 7], dtype=torch.int32)
    interleaved, two_acc, b_tma, a_tma = LAYOUTS[layout]
    out = triton_ops.masked_experts(x, None, mm, interleave_gate_up(w13) if interleaved else w13, w2, None, None,
                                    activation="silu", routed_scaling_factor=2.0, out_dtype=torch.float32,
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
    from moe_plugin_cuda import triton_ops

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
    from moe_plugin_cuda import triton_ops
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
    from moe_plugin_cuda import triton_ops

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
    from moe_plugin_cuda import triton_ops

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
    from moe_plugin_cuda import triton_ops

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


def test_interleave_gate_up_layout():
    from moe_plugin_cuda.weights import deinterleave_gate_up, interleave_gate_up, interleave_gate_up_

    E, inter, H = 3, 5, 4
    w13 = torch.randn(E, 2 * inter, H)
    il = interleave_gate_up(w13)
    for j in range(inter):
        assert torch.equal(il[:, 2 * j], w13[:, j]) and torch.equal(il[:, 2 * j + 1], w13[:, inter + j])
    assert torch.equal(deinterleave_gate_up(il), w13)
    in_place = w13.clone()
    assert interleave_gate_up_(in_place) is in_place and torch.equal(in_place, il)


def test_process_weights_interleaves_once():
    """Idempotent: a second call, or a re-wrapped Parameter over the same storage, is not
    interleaved again; a reload (in-place copy, as MoELayer.load_weights does) is."""
    import types

    from moe_plugin_cuda.triton_experts import TritonExperts
    from moe_plugin_cuda.weights import InterleavedW13, interleave_gate_up

    E, inter, H = 2, 6, 8
    ckpt = torch.randn(E, 2 * inter, H)
    layer = torch.nn.Module()
    layer.w13 = torch.nn.Parameter(ckpt.clone(), requires_grad=False)
    layer.w2 = torch.nn.Parameter(torch.randn(E, H, inter), requires_grad=False)
    backend = types.SimpleNamespace(w13_layout=InterleavedW13())  # process_weights only uses this
    process = TritonExperts.process_weights
    want = interleave_gate_up(ckpt)
    process(backend, layer)
    assert torch.equal(layer.w13, want)
    process(backend, layer)
    assert torch.equal(layer.w13, want)
    layer.w13 = torch.nn.Parameter(layer.w13.data, requires_grad=False)  # re-wrapped
    process(backend, layer)
    assert torch.equal(layer.w13, want)
    with torch.no_grad():
        layer.w13.copy_(ckpt)  # reload
    process(backend, layer)
    assert torch.equal(layer.w13, want)
    layer.w13 = torch.nn.Parameter(ckpt.clone(), requires_grad=False)  # a new checkpoint tensor
    process(backend, layer)
    assert torch.equal(layer.w13, want)


@pytest.mark.parametrize("fp8", [False, True])
def test_tuner_candidates_and_heuristic_fit_hopper(fp8):
    """Every tuner candidate and every heuristic config fits an H100 SM (227 KB shared memory,
    <= 128 accumulator registers per thread) and respects the kernels' rules (shared BLOCK_M,
    FP8 BLOCK_K dividing 128, even GEMM1 BLOCK_N)."""
    from moe_plugin_cuda import tune, tuning_configs

    def fits(c, gemm1):
        two = gemm1 and bool(c.get("TWO_ACC"))
        assert tune.smem_bytes(c, fp8, two) <= tune.SMEM_BYTES, c
        assert tune.acc_registers(c, fp8, two) <= 128, c
        assert not fp8 or 128 % c["BLOCK_K"] == 0, c
        assert not gemm1 or c["BLOCK_N"] % 2 == 0, c

    for bm in (16, 32, 64, 128):
        c1s, c2s = tune.candidates(bm, fp8, tma=True)
        assert any(c.get("TWO_ACC") for c in c1s) and not all(c.get("TWO_ACC") for c in c1s)
        assert not any(c.get("TWO_ACC") and c.get("B_TMA") for c in c1s)
        assert any(c.get("B_TMA") for c in c1s) and any(c.get("B_TMA") for c in c2s)
        assert not any(c.get("B_TMA") for c in sum(tune.candidates(bm, fp8, tma=False), []))
        for c in c1s + c2s:
            assert c["BLOCK_M"] == bm
        for c in c1s:
            fits(c, True)
        for c in c2s:
            fits(c, False)
        if fp8:  # the cutlass backend's Triton path: two accumulators on the checkpoint layout, TMA allowed
            k1s, k2s = tune.candidates(bm, fp8, tma=True, checkpoint=True)
            assert all(c.get("TWO_ACC") for c in k1s) and any(c.get("B_TMA") for c in k1s)
            assert len(k1s) == len({tuple(sorted(c.items())) for c in k1s}), "duplicate candidates"
            assert k2s == c2s
            for c in k1s:
                assert c["BLOCK_M"] == bm
                fits(c, True)
    seen_bm = set()
    for E, K, inter, H in [(8, 2, 14336, 4096), (128, 8, 768, 2048), (256, 8, 2048, 7168), (128, 8, 1536, 4096)]:
        for M in (1, 16, 64, 256, 1024, 4096, 16384):
            cfg = tuning_configs.heuristic(M, E, K, inter, H, fp8)
            assert cfg["gemm1"]["BLOCK_M"] == cfg["gemm2"]["BLOCK_M"]
            fits(cfg["gemm1"], True)
            fits(cfg["gemm2"], False)
            seen_bm.add(cfg["gemm1"]["BLOCK_M"])
    assert 128 in seen_bm and 16 in seen_bm  # large M gets BLOCK_M=128 again


def test_heuristic_fits_fp32_tiles():
    """fp32 tiles take twice bf16's shared memory: the heuristic shrinks BLOCK_K/stages to fit
    (an fp32 layer on the H100 ran out of shared memory before this)."""
    from moe_plugin_cuda import tuning_configs

    for M in (1, 77, 1024, 16384):
        cfg = tuning_configs.heuristic(M, 8, 2, 136, 200, False, elem_bytes=4)
        for c in cfg.values():
            assert c["num_stages"] * (c["BLOCK_M"] + c["BLOCK_N"]) * c["BLOCK_K"] * 4 <= tuning_configs.SMEM_BYTES, c


def test_tuned_config_files_carry_the_kernel_version(tmp_path):
    """Configs of another kernel version are never read; files of this version are."""
    import json

    from moe_plugin_cuda import tuning_configs

    name = tuning_configs.config_file_name(8, 64, 128, "Some GPU", "bf16")
    assert f"kernel=v{tuning_configs.KERNEL_VERSION}" in name
    c = dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3)
    old = name.replace(f",kernel=v{tuning_configs.KERNEL_VERSION}", "")
    (tmp_path / old).write_text(json.dumps({"100": {"gemm1": c, "gemm2": c}}))
    _, src = tuning_configs.get_config(100, 8, 2, 64, 128, "bf16", "Some GPU", str(tmp_path))
    assert src == "heuristic"
    tuning_configs.save_table(tmp_path / name, {100: {"gemm1": {**c, "TWO_ACC": 1}, "gemm2": c}})
    cfg, src = tuning_configs.get_config(90, 8, 2, 64, 128, "bf16", "Some GPU", str(tmp_path))
    assert src == name and cfg["gemm1"]["TWO_ACC"] == 1 and cfg["gemm2"]["TWO_ACC"] == 0
    assert cfg["gemm1"]["BLOCK_M"] == 32


def test_shipped_tables_follow_the_kernels_rules():
    """Every shipped table measured every T the benchmark runs (the lookup takes the nearest entry: a
    table starting at T=1024 ran its T=1024 path at T=1); every entry: both GEMMs share BLOCK_M and
    TAIL_TILES (one alignment), half tiles only where BLOCK_M >= 32, A_TMA on GEMM2 only (GEMM1 gathers
    token rows), and the lookup reads TAIL_TILES and A_TMA back (0 where an entry has none)."""
    import json

    from moe_plugin_cuda import tuning_configs

    files = sorted(tuning_configs.CONFIG_DIR.glob("*.json"))
    assert files
    for f in files:
        table = json.loads(f.read_text())
        assert {1, 16, 64, 256, 1024, 4096, 16384} <= set(map(int, table)), f.name
        for m, entry in table.items():
            if "gemm1" not in entry:
                continue
            g1, g2 = entry["gemm1"], entry["gemm2"]
            assert g1["BLOCK_M"] == g2["BLOCK_M"], (f.name, m)
            assert g1.get("TAIL_TILES", 0) == g2.get("TAIL_TILES", 0), (f.name, m)
            assert not g1.get("TAIL_TILES", 0) or g1["BLOCK_M"] >= 32, (f.name, m)
            assert not g1.get("A_TMA", 0), (f.name, m)
    name = next(f.name for f in files if f.name.endswith(f"kernel={tuning_configs.TRITON_TABLE}.json"))
    E, inter, H = (int(name.split(f"{k}=")[1].split(",")[0]) for k in ("E", "N", "H"))
    dtype, device = name.split("dtype=")[1].split(",")[0], name.split("device_name=")[1].split(",")[0]
    entry, _ = tuning_configs.lookup(4096, E, inter, H, dtype, device)
    assert entry["gemm1"]["TAIL_TILES"] in (0, 1) and entry["gemm2"]["A_TMA"] in (0, 1)


def test_as_two_acc_keeps_output_width():
    from moe_plugin_cuda import tuning_configs

    for fp8 in (False, True):
        for M in (1, 4096):
            cfg = tuning_configs.heuristic(M, 128, 8, 768, 2048, fp8)
            two = tuning_configs.as_two_acc(cfg)
            assert two["gemm1"]["TWO_ACC"] == 1 and two["gemm2"] == cfg["gemm2"]
            assert two["gemm1"]["BLOCK_N"] * 2 == cfg["gemm1"]["BLOCK_N"]  # same output columns per program
            assert tuning_configs.as_two_acc(two) == two


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("fmt", ["standard", "ep_masked"])
def test_apply_is_one_custom_op_under_torch_compile_interpreter(fmt):
    """Under torch.compile(fullgraph=True) the triton experts' apply is one opaque custom op (no graph
    break, inductor never re-compiles our kernels); it computes what the eager call does. aot_eager:
    dynamo + the op's fake (shape) function, without a C++ build on this CPU."""
    from moe_plugin_cuda.triton_experts import TritonExperts
    from moe_plugin_cuda.weights import interleave_gate_up

    from moe_core import MoEConfig
    from moe_core.contracts import EPMaskedDispatch, Format, QuantizedActivations, StandardDispatch, TopK, WireDtype
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


def test_vs_bar_scores_the_planners_pick_against_the_issue_bar(tmp_path, capsys):
    """benchmarks/cuda/vs_bar.py counts a cell slower than SGLang's figure, a T >= 4096 cell under the floor
    bar and a missing cell, reads only the planner's pick, and exits 1 unless every run meets both bars."""
    import importlib.util
    import json
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(
        "vs_bar", Path(__file__).parents[3] / "benchmarks" / "cuda" / "vs_bar.py")
    vs_bar = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(vs_bar)

    def bench(slower=None, under_floor=None, drop=None):
        results, plan = [], {}
        for (preset, quant), bars in vs_bar.SGLANG_US.items():
            plan[f"{preset}/{quant}"] = "cutlass"
            for T, bar in zip(vs_bar.TOKENS, bars, strict=True):
                cell = (preset, quant, T)
                us = bar * (1.05 if cell == slower else 0.9)
                frac = vs_bar.FLOOR_BAR[quant] * (0.9 if cell == under_floor else 1.1)
                if cell != drop:
                    results.append({"preset": preset, "quant": quant, "T": T, "backend": "cutlass",
                                    "best_us": us, "frac_floor": frac})
                # a faster backend the planner did not pick must not count
                results.append({"preset": preset, "quant": quant, "T": T, "backend": "triton",
                                "best_us": 0.5 * bar, "frac_floor": 1.0})
        return {"meta": {"auto_plan": plan}, "results": results}

    runs = {"ok": bench(), "slow": bench(slower=("qwen3-30b-a3b", "unquantized", 4096)),
            "floor": bench(under_floor=("qwen3-235b-a22b", "fp8_block", 4096)),
            "small_t": bench(under_floor=("qwen3-235b-a22b", "fp8_block", 1024)),  # no floor bar below 4096
            "gap": bench(drop=("deepseek-v3", "fp8_block", 1))}
    paths = {}
    for name, b in runs.items():
        paths[name] = tmp_path / f"{name}.json"
        paths[name].write_text(json.dumps(b))
    assert vs_bar.main([str(paths["ok"]), str(paths["small_t"])]) == 0
    assert vs_bar.score(vs_bar.picked_cells(runs["slow"]))[:2] == (34, 14)
    assert vs_bar.score(vs_bar.picked_cells(runs["floor"]))[:2] == (35, 13)
    assert vs_bar.score(vs_bar.picked_cells(runs["gap"]))[2] == ["deepseek-v3 fp8_block T=1"]
    for bad in ("slow", "floor", "gap"):
        assert vs_bar.main([str(paths["ok"]), str(paths[bad])]) == 1
    out = capsys.readouterr().out
    assert "| qwen3-30b-a3b bf16 |" in out and "**" in out
