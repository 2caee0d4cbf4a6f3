"""``torch_a2a``'s layout functions give the same bits compiled (as on CUDA) and eager (as on CPU/NPU).

Each stage's index math and the wire quantization run inductor-compiled on CUDA (decision 16), so
every function is called both ways on random O(1) inputs, with -1 and out-of-range ids, over a
sequence of token counts in one process (T = 0, 1, odd sizes: dynamo recompiles or goes
dynamic between them, as in an engine), and compared exactly: integers and the quantized wire
bits must not move. On CPU the compiled runs use inductor's C++ backend: hidden sizes there are
multiples of 128, because inductor 2.13 on CPU miscompiled a per-group scale broadcast over a
partial last group at T = 1 (found writing this test; the CUDA run covers H = 200).
"""

from __future__ import annotations

import warnings

import pytest
import torch

from moe_core.contracts import WireDtype
from moe_core.distributed import torch_a2a as a2a

TOKENS = (7, 0, 1, 33, 2, 7)  # first call static, then dynamic; 0 and 1 are specialized by dynamo
NUM_LOCAL, TOP_K, CAPACITY = 5, 4, 40


def _routing(t: int, world: int, gen: torch.Generator, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    e = world * NUM_LOCAL
    ids = torch.rand(t, e, generator=gen).topk(TOP_K, dim=1).indices.int()
    if t:
        ids[0, -1] = -1  # an unused slot
    weights = torch.rand(t, TOP_K, generator=gen) + 0.1
    return ids.to(device), weights.to(device)


def _equal(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(_equal(u, v) for u, v in zip(a, b, strict=True))
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:  # compare the bits (fp8; NaN from the padding rows' -1 words)
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        a, b = a.contiguous().view(bits), b.contiguous().view(bits)
    return torch.equal(a, b)


def _same_quantized(want, got, wire: WireDtype) -> bool:
    """The wire data and scales of a compiled quantization: the same bits as the core quantizer's.
    (Triton's plain fp32 ``/`` is approximate; torch_a2a compiles with inductor's IEEE division, without
    which one INT8/FP8 code in a few thousand moved by one step on H100/H200: decision 57.)"""
    return _equal(want, got)


def _check_all(device: str, hidden: int, x_dtype: torch.dtype, wire: WireDtype, world: int) -> None:
    """One layer's calls (one wire dtype, one x dtype) over ``TOKENS``, from a fresh dynamo."""
    torch._dynamo.reset()
    a2a._compiled.cache_clear()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a fallback to eager would test nothing
        for t in TOKENS:
            _check_tokens(t, device, hidden, x_dtype, wire, world, gen)


def _check_tokens(t, device, hidden, x_dtype, wire, world, gen) -> None:
    """Every layout function at ``t`` tokens, compiled as torch_a2a compiles it (static shapes
    for masked mode's fixed-shape stages): same bits as eager (the wire codes: see above)."""
    ids, weights = _routing(t, world, gen, device)
    x = torch.randn(t, hidden, generator=gen).to(device=device, dtype=x_dtype)
    n_scale = a2a._scale_words(wire, hidden)
    meta_words = n_scale + 2 * TOP_K + 2
    bad = torch.tensor(3 * (t % 2), dtype=torch.int32, device=device)
    args = (x, ids, weights, wire, meta_words, t, bad)
    want = a2a._wire_rows(*args)
    got = a2a._compiled(a2a._wire_rows)(*args)
    assert _same_quantized(want[:2], got[:2], wire) and _equal(want[2], got[2]), \
        f"_wire_rows T={t} H={hidden} {wire} {x_dtype}"

    nargs = (x, ids, weights, wire)
    want_n, got_n = a2a._normal_wire_rows(*nargs), a2a._compiled(a2a._normal_wire_rows)(*nargs)
    assert _same_quantized(want_n[:2], got_n[:2], wire) and _equal(want_n[2], got_n[2]), \
        f"_normal_wire_rows T={t} H={hidden} {wire} {x_dtype}"

    # the side block as a receiver sees it: rows of several senders, padding rows included
    meta = want[2][torch.randint(0, t + 1, (world * CAPACITY,), generator=gen).to(device)]
    # exact normal mode (eager everywhere) maps ids through a table: the same as the worst-case mode's math
    scale, ids, weights = a2a._split_meta(meta, n_scale, TOP_K)
    table = a2a._local_table(1, NUM_LOCAL, world * NUM_LOCAL, torch.device(device))
    assert _equal(a2a._normal_received(meta, n_scale, TOP_K, table),
                  (scale, *a2a._local_ids(ids, weights, 1, NUM_LOCAL))), f"_normal_received T={t}"
    assert _equal(a2a._worst_case_received(meta, n_scale, TOP_K, 1, NUM_LOCAL),
                  a2a._compiled(a2a._worst_case_received, False)(meta, n_scale, TOP_K, 1, NUM_LOCAL)), \
        f"_worst_case_received T={t} {wire}"
    received = a2a._masked_received(meta, n_scale, TOP_K, 1, NUM_LOCAL)
    assert _equal(received, a2a._compiled(a2a._masked_received, False)(meta, n_scale, TOP_K, 1, NUM_LOCAL)), \
        f"_masked_received T={t} {wire}"
    _, _, _, _, mine, slab_index, _, _ = received
    pair_w = torch.rand(world * CAPACITY, TOP_K, generator=gen).to(device)
    pargs = (slab_index, mine, pair_w, NUM_LOCAL * world * CAPACITY - 1)
    assert _equal(a2a._masked_pairs(*pargs), a2a._compiled(a2a._masked_pairs, False)(*pargs))


@pytest.mark.parametrize("wire", [WireDtype.BF16, WireDtype.FP8, WireDtype.INT8])
def test_compiled_layout_matches_eager_cpu(wire):
    _check_all("cpu", 256, torch.bfloat16, wire, world=4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("hidden,x_dtype,wire,world", [
    (7168, torch.bfloat16, WireDtype.BF16, 2), (7168, torch.bfloat16, WireDtype.FP8, 2),
    (7168, torch.bfloat16, WireDtype.INT8, 2), (200, torch.bfloat16, WireDtype.FP8, 4),
    (136, torch.float16, WireDtype.INT8, 4), (200, torch.float32, WireDtype.FP8, 3)])
def test_compiled_layout_matches_eager_cuda(hidden, x_dtype, wire, world):
    _check_all("cuda", hidden, x_dtype, wire, world)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wire", [WireDtype.FP8, WireDtype.INT8])
def test_compiled_wire_codes_are_the_core_quantizers_cuda(wire):
    """DeepSeek-V3's hidden size at 4096 tokens (29M codes): with Triton's approximate division some
    codes moved by one step, which failed the NCCL layout test's exact-data check at random (decision 57)."""
    torch._dynamo.reset()
    a2a._compiled.cache_clear()
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    ids, weights = _routing(4096, 2, gen, "cuda")
    x = torch.randn(4096, 7168, generator=gen).to("cuda", torch.bfloat16)
    want = a2a._normal_wire_rows(x, ids, weights, wire)
    got = a2a._compiled(a2a._normal_wire_rows)(x, ids, weights, wire)
    moved = int((want[0].view(torch.uint8) != got[0].view(torch.uint8)).sum())
    assert moved == 0 and _equal(want, got), f"{moved} of {x.numel()} codes differ"


def test_compiled_with_ieee_division(monkeypatch):
    """Every compiled helper asks inductor for IEEE-rounded fp32 division (decision 57), under the name
    this torch gives the switch: the wire codes must equal the core quantizer's on CUDA too."""
    import torch._inductor.config as inductor_config

    seen = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: seen.append(kw.get("options")) or fn)
    a2a._compiled.cache_clear()
    a2a._compiled(lambda x: x)
    a2a._compiled.cache_clear()
    (options,) = seen
    assert options and all(v is True and k in inductor_config.get_config_copy() for k, v in options.items()), options
    assert set(options) & {"eager_numerics.division_rounding", "emulate_divison_rounding"}, options


def test_recompile_limit_falls_back_to_eager():
    """Past dynamo's recompile limit a compiled helper warns once and runs eagerly (no exception)."""
    torch._dynamo.reset()
    a2a._compiled.cache_clear()

    def twice(x: torch.Tensor) -> torch.Tensor:  # a fresh function: its own cache entry
        return x * 2

    fn = a2a._compiled(twice)
    with torch._dynamo.config.patch(recompile_limit=1):
        assert torch.equal(fn(torch.ones(3)), torch.full((3,), 2.0))
        with pytest.warns(RuntimeWarning, match="runs eagerly"):
            out = fn(torch.ones(3, dtype=torch.float64))  # another dtype: a recompile past the limit
        assert torch.equal(out, torch.full((3,), 2.0, dtype=torch.float64))
        assert torch.equal(fn(torch.ones(2, dtype=torch.int32)), torch.full((2,), 2, dtype=torch.int32))
