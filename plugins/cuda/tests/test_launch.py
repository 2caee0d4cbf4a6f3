"""The decode host path: ``triton.launch`` (compiled kernels called directly after the first launch per
specialization) and ``workspace`` (one allocation carved into a forward's scratch tensors).

CPU: the workspace's carving, and ``launch`` staying on ``kernel[grid]`` under Triton's interpreter. GPU
(``gpu`` marker): direct launches give the bytes ``kernel[grid]`` launches give, whatever the inputs'
alignment, strides and T, and a differently specialized argument never reuses a compiled variant."""

from __future__ import annotations

import os

import pytest
import torch
from moe_plugin_cuda.workspace import ALIGN, Layout, Layouts, layout

cuda = torch.cuda.is_available()
if os.environ.get("CI"):
    import triton
else:
    triton = pytest.importorskip("triton")


# ------------------------------------------------------------------ workspace (CPU)

PARTS = [(torch.int32, (37,)), (torch.int32, (1,)), (torch.float8_e4m3fn, (3, 100)), (torch.float32, (3, 1)),
         (torch.bfloat16, (0, 64)), (torch.bfloat16, (5, 7)), (torch.float32, (2, 3, 4))]


def test_layout_parts_are_aligned_disjoint_and_sized():
    lay = Layout(PARTS)
    spans = lay.spans
    for (dtype, shape), (start, end) in zip(PARTS, spans, strict=True):
        assert start % ALIGN == 0
        assert end - start == torch.Size(shape).numel() * dtype.itemsize
    for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False):
        assert e0 <= s1  # in order, never overlapping
    assert lay.nbytes % ALIGN == 0 and lay.nbytes >= spans[-1][1]


def test_carved_views_never_overlap_and_keep_their_values():
    lay = Layout(PARTS)
    views = lay.carve(torch.device("cpu"))
    assert [(v.dtype, tuple(v.shape)) for v in views] == [(d, s) for d, s in PARTS]
    base = views[0].untyped_storage().data_ptr()
    assert all(v.untyped_storage().data_ptr() == base for v in views)  # one allocation
    # (the allocator aligns the buffer: 64 bytes on the CPU, 512 on CUDA; the parts sit ALIGN bytes apart)
    assert all(v.is_contiguous() and (v.data_ptr() - base) % ALIGN == 0 for v in views if v.numel())
    vals = []
    for v in views:  # fill each with its own random bytes, then read all back
        b = torch.randint(0, 256, (v.numel() * v.element_size(),), dtype=torch.uint8)
        if v.numel():
            v.view(-1).view(torch.uint8).copy_(b)
        vals.append(b)
    for v, b in zip(views, vals, strict=True):
        if v.numel():
            assert torch.equal(v.reshape(-1).view(torch.uint8), b)
    # the byte ranges the views cover are disjoint
    ranges = sorted((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()) for v in views if v.numel())
    assert all(e0 <= s1 for (_, e0), (s1, _) in zip(ranges, ranges[1:], strict=False))


def test_each_carve_is_a_new_buffer():
    lay = Layout(PARTS)
    a, b = lay.carve(torch.device("cpu")), lay.carve(torch.device("cpu"))
    assert a[0].untyped_storage().data_ptr() != b[0].untyped_storage().data_ptr()


def test_layouts_reused_per_key_and_bounded():
    cache = Layouts(max_entries=3)
    calls = []

    def parts(T):
        def make():
            calls.append(T)
            return [(torch.int32, (T,)), (torch.bfloat16, (T, 8))]
        return make
    l1 = cache.get(("T", 1), parts(1))
    assert cache.get(("T", 1), parts(1)) is l1 and calls == [1]  # reused across calls at the same T
    l5 = cache.get(("T", 5), parts(5))
    assert l5 is not l1 and l5.spans[1][1] - l5.spans[1][0] == 5 * 8 * 2
    cache.get(("T", 7), parts(7))
    assert len(cache) == 3
    cache.get(("T", 9), parts(9))  # full: emptied, then this one
    assert len(cache) == 1 and calls == [1, 5, 7, 9]
    assert layout(None, ("T", 1), parts(1)) is not l1  # no cache: a layout for this call only


def test_layout_refuses_negative_shapes():
    with pytest.raises(ValueError, match="non-negative"):
        Layout([(torch.int32, (-1,))])


# ------------------------------------------------------------------ launch


tl = pytest.importorskip("triton.language")


@triton.jit
def _axpy_kernel(x_ptr, y_ptr, out_ptr, n, stride_x, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs * stride_x, mask=m, other=0.0)
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    tl.store(out_ptr + offs, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=m)


def _kept(kernel) -> int:
    """The launcher's kept compiled variants of ``kernel``."""
    from moe_plugin_cuda.triton import launch as L

    return sum(kern is kernel for kern, _ in L._compiled.values())


def _axpy(kernel, launch_fn, x, y, alpha):
    n = y.numel()
    out = torch.empty_like(y)
    launch_fn(kernel, (triton.cdiv(max(n, 1), 64),), x, y, out, n, x.stride(0), alpha, BLOCK=64)
    return out


@pytest.mark.skipif(cuda, reason="interpreter path")
def test_launch_goes_through_the_interpreter():
    from moe_plugin_cuda.triton import launch as L

    kernel = _axpy_kernel
    direct = L.stats["direct"]
    for n in (1, 5, 64):
        x, y = torch.randn(n), torch.randn(n)
        out = _axpy(kernel, L.launch, x, y, 0.5)
        torch.testing.assert_close(out, 0.5 * x.double().float() + y, rtol=1e-6, atol=1e-6)
    assert L.stats["direct"] == direct  # nothing kept, nothing launched directly
    assert not _kept(kernel)


needs_gpu = pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")


def _triton_launch(kernel, grid, *args, **kwargs):
    kernel[grid](*args, **kwargs)


@pytest.mark.gpu
@needs_gpu
def test_direct_launch_matches_and_keys_on_alignment_and_ints():
    from moe_plugin_cuda.triton import launch as L

    kernel = _axpy_kernel
    dev = torch.device("cuda")
    base = torch.randn(4096 + 8, device=dev)
    y0 = torch.randn(4096 + 8, device=dev)
    cases = []  # (x view, y view): aligned, 4-byte offset (not 16-byte aligned), strided; n = 1, 16, odd
    for n in (1, 16, 37, 1000, 4096):
        cases += [(base[:n], y0[:n]), (base[1:n + 1], y0[:n]), (base[:2 * n:2] if 2 * n <= base.numel() else base[:n],
                                                                  y0[3:n + 3])]
    before = dict(L.stats)
    for _ in range(3):  # first round compiles / keeps, the next ones launch directly
        for x, y in cases:
            got = _axpy(kernel, L.launch, x, y, 1.5)
            want = _axpy(kernel, _triton_launch, x, y, 1.5)
            assert torch.equal(got, want)
    assert L.stats["direct"] > before["direct"]
    assert _kept(kernel) >= 2 * 5  # aligned and unaligned x, each n (1, 16 and 37 are different Triton variants)


@pytest.mark.gpu
@needs_gpu
def test_a_differently_specialized_argument_is_a_miss():
    """Each argument Triton specializes on, changed alone, goes through ``kernel[grid]`` again (a new variant
    kept), never to the variant kept for the other value; an unchanged call goes direct."""
    from moe_plugin_cuda.triton import launch as L

    kernel = _axpy_kernel
    L.clear()
    dev = torch.device("cuda")
    base, y0 = torch.randn(4096, device=dev), torch.randn(4096, device=dev)

    def step(x, y, alpha=1.5, expect="triton"):
        before = dict(L.stats)
        got = _axpy(kernel, L.launch, x, y, alpha)
        assert torch.equal(got, _axpy(kernel, _triton_launch, x, y, alpha))
        assert L.stats[expect] == before[expect] + 1, expect

    step(base[:37], y0[:37])  # first call: through kernel[grid], kept
    step(base[:37], y0[:37], expect="direct")
    step(base[1:38], y0[:37])  # x 4 bytes off 16-byte alignment
    step(base[1:38], y0[:37], expect="direct")
    step(base[:37], y0[4:41], expect="direct")  # y 16 bytes further: the same alignment, the kept variant
    step(base[:16], y0[:16])  # n % 16 == 0
    step(base[:1], y0[:1])  # n == 1
    step(base[:1], y0[:1], expect="direct")
    step(base[:2 * 37:2], y0[:37])  # stride 2 (an int argument: 1 -> 2)
    step(base[:37].double(), y0[:37].double())  # another dtype
    step(base[:37], y0[:37], alpha=2)  # an int where a float was
    step(base[:37], y0[:37], expect="direct")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
@pytest.mark.parametrize("a_tma", [0, 1])
def test_fused_experts_direct_launch_bit_identical(quant, a_tma, monkeypatch):
    """The whole fused pipeline, T = 0, 1, odd and 64, ids -1, hidden rows offset or strided: the direct
    launches (from the second call on) give exactly the bytes of ``kernel[grid]`` launches."""
    from moe_plugin_cuda.triton import launch as L
    from moe_plugin_cuda.triton import ops
    from moe_plugin_cuda.weights import interleave_gate_up
    from moe_plugin_cuda.workspace import Layouts

    dev = torch.device("cuda")
    E, K, H, inter = 8, 2, 256, 256
    fp8 = quant == "fp8_block"
    w13 = torch.randn(E, 2 * inter, H, device=dev) / H ** 0.5
    w2 = torch.randn(E, H, inter, device=dev) / inter ** 0.5
    if fp8:
        s13 = torch.rand(E, 2 * inter // 128, H // 128, device=dev) + 0.5
        s2 = torch.rand(E, H // 128, inter // 128, device=dev) + 0.5
        w13, w2 = (w13 * 100).to(torch.float8_e4m3fn), (w2 * 100).to(torch.float8_e4m3fn)
    else:
        s13 = s2 = None
        w13, w2 = interleave_gate_up(w13.bfloat16()), w2.bfloat16()
    cfg = {"gemm1": dict(BLOCK_M=16, BLOCK_N=128 if fp8 else 64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3,
                         TWO_ACC=1 if fp8 else 0),
           "gemm2": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=3, A_TMA=a_tma)}
    layouts = Layouts()

    def run(hidden, w, ids, launch_fn):
        monkeypatch.setattr(ops, "launch", launch_fn)
        return ops.fused_experts(hidden, None, w13, w2, s13, s2, w, ids, fp8_block=fp8, activation="silu",
                                 routed_scaling_factor=1.0, out_dtype=torch.bfloat16, cfg=cfg,
                                 w13_interleaved=not fp8, layouts=layouts)

    direct = L.stats["direct"]
    for T in (0, 1, 7, 64):
        wide = torch.randn(T, H + 8, device=dev).bfloat16()
        # contiguous; rows strided at a 16-byte offset; rows strided at a 2-byte offset (no 16-byte alignment)
        for hidden in (wide[:, :H].contiguous(), wide[:, 8:], wide[:, 1:H + 1]):
            ids = torch.stack([torch.randperm(E, device=dev)[:K] for _ in range(T)]).int() if T \
                else torch.zeros(0, K, dtype=torch.int32, device=dev)
            if T:
                ids[torch.rand(T, K, device=dev) < 0.25] = -1
            w = torch.rand(T, K, device=dev)
            for _ in range(2):
                got = run(hidden, w, ids, L.launch)
                want = run(hidden, w, ids, _triton_launch)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (T, hidden.stride())
    assert L.stats["direct"] > direct


# ------------------------------------------------------------------ the tokens' FP8 quantization in the alignment's launch


@pytest.mark.parametrize("device", [pytest.param("cpu", marks=pytest.mark.skipif(cuda, reason="interpreter path")),
                                    pytest.param("cuda", marks=[pytest.mark.gpu, needs_gpu])])
@pytest.mark.parametrize("T,H,E,K,bm,tails", [(1, 256, 8, 2, 16, False), (3, 200, 16, 4, 32, True),
                                              (17, 1100, 128, 8, 16, False), (64, 7168, 256, 8, 64, True)])
def test_align_quantizes_the_tokens_as_the_quantizer_does(T, H, E, K, bm, tails, device, check_alignment):
    """One launch (the one-program alignment plus a program per row chunk) gives the alignment of a separate
    launch and exactly the codes and scales of ``quantize_fp8_groups``; tokens strided, ids -1, H not a multiple
    of 128. (The interpreter without a GPU, the compiled kernels on one.)"""
    from moe_plugin_cuda.triton import ops

    dev = torch.device(device)
    wide = (torch.randn(T, H + 8, device=dev) * torch.rand(T, 1, device=dev) * 5).bfloat16()
    x = wide[:, 3:H + 3]
    ids = torch.randint(-1, E, (T, K), dtype=torch.int32, device=dev)
    q = torch.empty(T, H, dtype=torch.float8_e4m3fn, device=dev)
    s = torch.empty(T, -(-H // 128), dtype=torch.float32, device=dev)
    al = ops.align_block_size(ids, E, bm, tails, quant=(x, q, s))
    check_alignment(ids, E, bm, tails, al)
    q_ref, s_ref = ops.quantize_fp8_groups(x)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
