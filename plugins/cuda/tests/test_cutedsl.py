"""End to end on CPU: the ``cutedsl`` experts with the emulated FlashInfer on a faked SM100, against the
core reference experts (EP_MASKED, nvfp4), through the planner, the conformance kit, and ``torch_a2a``
masked dispatch on a gloo world of 2.

Tolerance: the FlashInfer pipeline rounds GEMM1's output to bf16 (its ``c_dtype``) and SiLU(gate) * up
to bf16 before requantizing it to NVFP4; the reference keeps both in fp32. With one e2m1 mantissa bit,
those roundings move some intermediate values across a rounding boundary (a step of up to 1/3 of the
value), so against the reference the error is 2.8e-2 on average and up to 4.9e-2 at 13-150 rows, and up
to 1.2e-1 for 1-3 rows (hundreds of draws measured), above the 3e-2 of the other 4-bit schemes. The
tests therefore check: (1) no further from the exact float64 computation than 1.5x the reference (the
kit's rule; measured at most 1.14x), which also stands in for "within 5e-2 of the reference" when a
few rows miss that; (2) every row but a rare one within 5e-3 of the same math with the kernel's two
bf16 roundings (typically 1e-5).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch
import torch.nn.functional as F

from moe_core import quant
from moe_core.config import MoEConfig
from moe_core.contracts import EPMaskedCombine, EPMaskedDispatch, Format, QuantizedActivations, WireDtype
from moe_core.planner import DtypeStep, Plan, PlanError, plan
from moe_core.reference.oracle import moe_float64
from moe_core.testing.data import make_float_weights, make_topk, rel_error

E, K, H, I = 8, 4, 256, 128  # E_local = 4 on rank 1 of 2
TOL_REF, TOL_KERNEL_MATH = 5e-2, 5e-3


@pytest.fixture(autouse=True)
def _one_thread():
    """Small shapes: intra-op threads cost more than they save on a loaded 2-core CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_config(cap: int, **kw) -> MoEConfig:
    return MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=I, quant="nvfp4", ep_size=2,
                     ep_rank=1, max_tokens_per_rank=max(cap, 1), device="cuda", **kw)


def build(manager, cfg: MoEConfig, experts: str, wire: WireDtype, ckpt: dict):
    """A layer binding ``experts`` in EP_MASKED without a communicating dispatcher (``apply`` is called
    directly with the test's slab, as the conformance kit does)."""
    from moe_core.layer import MoELayer

    p = Plan(cfg, manager.spec("standard"), manager.spec(experts), Format.EP_MASKED, wire,
             (DtypeStep("test", wire, "synthetic EP_MASKED plan"),))
    layer = MoELayer(cfg, plan=p, manager=manager, device="cpu")
    layer.load_weights(**ckpt)
    layer.process_weights()
    return layer


def checkpoint(seed: int) -> dict:
    w13, w2 = make_float_weights(E, H, I, torch.Generator().manual_seed(seed))
    return quant.quantize_weights(w13, w2, "nvfp4", a13_amax=4.0, a2_amax=4.0)


def slab(cap: int, wire: WireDtype, masked: torch.Tensor, gen: torch.Generator, dtype=torch.bfloat16) -> EPMaskedDispatch:
    """A masked slab as a dispatcher delivers it, with garbage (NaN) in every row at and beyond masked_m."""
    x = torch.randn(E // 2, cap, H, generator=gen).to(dtype)
    qa = quant.quantize_activations(x, wire)
    garbage = torch.arange(cap).view(1, -1) >= masked.view(-1, 1)
    data = qa.data.clone()
    if wire is WireDtype.BF16:
        data[garbage] = float("nan")
        qa = QuantizedActivations(data)
    else:
        data[garbage] = 0x77
        scale = qa.scale.clone()
        scale.view(torch.uint8)[garbage] = 0x7F  # e4m3 NaN
        qa = QuantizedActivations(data, wire, scale, qa.global_scale)
    return EPMaskedDispatch(qa, masked, make_topk(3, K, E, gen), handle=("test-handle", cap))


def kernel_math(ckpt: dict, d: EPMaskedDispatch, rsf: float, dtype=torch.bfloat16) -> torch.Tensor:
    """The pipeline's math in plain torch (float32, dequantized weights): NVFP4 input, GEMM1 rounded to
    ``dtype``, SiLU(gate) * up rounded to ``dtype``, NVFP4 requantization with a2_global_scale, GEMM2."""
    w13, w2 = quant.dequantize_weights(ckpt, "nvfp4")
    first = E // 2  # rank 1's experts
    qa = d.hidden
    out = torch.zeros(qa.shape, dtype=torch.float32)
    for e, m in enumerate(d.masked_m.tolist()):
        if qa.dtype is WireDtype.BF16:
            gs = ckpt["a13_global_scale"][first + e]
            x = quant.dequantize_nvfp4(*quant.quantize_nvfp4(qa.data[e, :m].float(), gs), gs)
        else:
            x = quant.dequantize_nvfp4(qa.data[e, :m], qa.scale[e, :m], qa.global_scale)
        gu = (x @ w13[first + e].t()).to(dtype).float()
        h = (F.silu(gu[:, :I]) * gu[:, I:]).to(dtype).float()
        gs2 = ckpt["a2_global_scale"][first + e]
        hq = quant.dequantize_nvfp4(*quant.quantize_nvfp4(h, gs2), gs2)
        out[e, :m] = hq @ w2[first + e].t() * rsf
    return out.to(dtype)


def exact(ckpt: dict, d: EPMaskedDispatch, valid: torch.Tensor, rsf: float) -> torch.Tensor:
    w13, w2 = quant.dequantize_weights(ckpt, "nvfp4")
    x = d.hidden.dequantize(torch.float32)[valid]
    ids = valid.nonzero()[:, :1].to(torch.int32)  # each valid row goes through its local expert, weight 1
    return moe_float64(x, torch.ones(ids.shape), ids, w13[E // 2:], w2[E // 2:], routed_scaling_factor=rsf)


def masked_counts(cap: int, gen: torch.Generator, pattern: str) -> torch.Tensor:
    if pattern == "empty":  # T = 0: nothing arrived on this rank
        return torch.zeros(E // 2, dtype=torch.int32)
    m = torch.randint(0, cap + 1, (E // 2,), generator=gen, dtype=torch.int32)
    m[0], m[-1] = 0, cap  # an expert with no rows (flashinfer #1856 territory) and a full one
    return m


@pytest.mark.parametrize("cap,wire,pattern,rsf,dtype", [
    (1, WireDtype.BF16, "random", 1.0, torch.bfloat16),  # T = 1
    (8, WireDtype.BF16, "empty", 1.0, torch.bfloat16),  # T = 0 (masked_m all zero)
    (37, WireDtype.BF16, "random", 2.5, torch.bfloat16),  # odd capacity, routed_scaling_factor
    (150, WireDtype.BF16, "random", 1.0, torch.bfloat16),  # two 128-row scale tiles
    (37, WireDtype.NVFP4, "random", 1.0, torch.bfloat16),  # the dispatcher already quantized
    (150, WireDtype.NVFP4, "random", 2.5, torch.bfloat16),
    (37, WireDtype.BF16, "random", 1.0, torch.float16),
])
def test_cutedsl_matches_reference(cutedsl_manager, flashinfer_emu, cap, wire, pattern, rsf, dtype):
    seed = random.randrange(1 << 30)
    gen = torch.Generator().manual_seed(seed)
    ckpt = checkpoint(seed)
    cfg = make_config(cap, routed_scaling_factor=rsf, params_dtype=dtype)
    layer = build(cutedsl_manager, cfg, "cutedsl", wire, ckpt)
    ref = build(cutedsl_manager, cfg, "reference", wire, ckpt)
    d = slab(cap, wire, masked_counts(cap, gen, pattern), gen, dtype)
    flashinfer_emu.calls.clear()
    out = layer.experts.apply(layer, d)
    assert isinstance(out, EPMaskedCombine) and out.handle is d.handle and out.topk is d.topk
    assert out.hidden.shape == (E // 2, cap, H) and out.hidden.dtype == dtype
    first = ["scaled_fp4_grouped_quantize"] if wire is WireDtype.BF16 else []
    assert flashinfer_emu.calls == first + ["grouped_gemm_nt_masked", "silu_and_mul_scaled_nvfp4_experts_quantize",
                                            "grouped_gemm_nt_masked"]
    valid = torch.arange(cap).view(1, -1) < d.masked_m.view(-1, 1)
    got = out.hidden[valid]
    assert bool(torch.isfinite(got).all()), f"seed={seed}: garbage rows leaked into valid rows"
    expected = ref.experts.apply(ref, d).hidden[valid]
    if pattern == "empty":
        assert got.numel() == 0
        return
    where = f"seed={seed} cap={cap} wire={wire} rsf={rsf} dtype={dtype}"
    truth = exact(ckpt, d, valid, rsf)
    vs_exact, ref_vs_exact = rel_error(got, truth), rel_error(expected, truth)
    assert rel_error(got, expected) <= TOL_REF or vs_exact <= 1.5 * ref_vs_exact, where
    assert vs_exact <= 1.5 * ref_vs_exact, where
    bad, rows = rows_off(got, kernel_math(ckpt, d, rsf, dtype)[valid], TOL_KERNEL_MATH)
    assert bad <= max(1, rows // 20), f"{where}: {bad} of {rows} rows differ from the kernel's math"


def rows_off(got: torch.Tensor, want: torch.Tensor, tol: float) -> tuple[int, int]:
    """How many rows differ from ``want`` by more than ``tol`` (relative, per row), and how many rows.
    Per row because fp32 accumulation order may flip one NVFP4 requantization (a step of up to 1/3) in a
    rare row: measured 1e-5 typical, one row in ~80 draws moved the whole-slab error to 6e-3."""
    err = (got.double() - want.double()).norm(dim=-1) / want.double().norm(dim=-1).clamp_min(1e-30)
    return int((err > tol).sum()), got.shape[0]


def test_garbage_beyond_masked_m_does_not_matter(cutedsl_manager):
    seed = random.randrange(1 << 30)
    ckpt = checkpoint(seed)
    layer = build(cutedsl_manager, make_config(37), "cutedsl", WireDtype.BF16, ckpt)
    gen = torch.Generator().manual_seed(seed)
    d = slab(37, WireDtype.BF16, masked_counts(37, gen, "random"), gen)
    valid = torch.arange(37).view(1, -1) < d.masked_m.view(-1, 1)
    other = d.hidden.data.clone()
    other[~valid] = torch.randn(int((~valid).sum()), H).mul(1e4).to(torch.bfloat16)  # huge finite garbage
    d2 = EPMaskedDispatch(QuantizedActivations(other), d.masked_m, d.topk)
    a = layer.experts.apply(layer, d).hidden[valid]
    b = layer.experts.apply(layer, d2).hidden[valid]
    assert torch.equal(a, b)
    assert torch.equal(a, layer.experts.apply(layer, d).hidden[valid])  # deterministic


def test_process_weights_idempotent_and_reload(cutedsl_manager):
    ckpt = checkpoint(random.randrange(1 << 30))
    layer = build(cutedsl_manager, make_config(16), "cutedsl", WireDtype.BF16, ckpt)
    assert layer.w13_scale.shape == (E // 2, 2, 4, 32, 4, 4)  # swizzled: [E, 2I/128, H/16/4, 32, 4, 4]
    assert layer.w2_scale.shape == (E // 2, 2, 2, 32, 4, 4)  # [E, H/128, I/16/4, 32, 4, 4]
    gen = torch.Generator().manual_seed(1)
    d = slab(16, WireDtype.BF16, torch.tensor([16, 3, 0, 9], dtype=torch.int32), gen)
    valid = torch.arange(16).view(1, -1) < d.masked_m.view(-1, 1)
    first = layer.experts.apply(layer, d).hidden[valid]
    swizzled = layer.w13_scale.detach().clone()
    layer.process_weights()  # a second call changes nothing
    assert torch.equal(layer.w13_scale.view(torch.uint8), swizzled.view(torch.uint8))
    assert torch.equal(layer.experts.apply(layer, d).hidden[valid], first)
    layer.load_weights(**ckpt)  # a reload restores the checkpoint layout ...
    assert layer.w13_scale.shape == (E // 2, 2 * I, H // 16)
    layer.process_weights()  # ... and converting it again gives the same result
    assert torch.equal(layer.experts.apply(layer, d).hidden[valid], first)


def test_bad_inputs_are_refused(cutedsl_manager):
    layer = build(cutedsl_manager, make_config(8), "cutedsl", WireDtype.BF16, checkpoint(0))
    gen = torch.Generator().manual_seed(0)
    d = slab(8, WireDtype.BF16, torch.tensor([8, 1, 0, 2], dtype=torch.int32), gen)
    with pytest.raises(ValueError, match="E_local"):
        layer.experts.apply(layer, EPMaskedDispatch(QuantizedActivations(d.hidden.data[:3]), d.masked_m[:3], d.topk))
    with pytest.raises(ValueError, match="masked_m"):
        layer.experts.apply(layer, EPMaskedDispatch(d.hidden, d.masked_m.long(), d.topk))
    fp8 = quant.quantize_activations(d.hidden.data.nan_to_num(), WireDtype.FP8)
    with pytest.raises(TypeError, match="bf16 or nvfp4"):
        layer.experts.apply(layer, EPMaskedDispatch(fp8, d.masked_m, d.topk))


# --------------------------------------------------------------------------- planning


def test_planner_picks_cutedsl_with_torch_a2a(cutedsl_manager):
    p = plan(make_config(16, cuda_graph=True), manager=cutedsl_manager)
    assert (p.dispatcher_name, p.experts.name, p.format) == ("torch_a2a", "cutedsl", Format.EP_MASKED)
    assert p.dispatch_dtype is WireDtype.BF16  # torch_a2a carries no NVFP4: cutedsl quantizes the slab itself
    assert p.graph_safe
    with pytest.raises(PlanError) as err:
        plan(make_config(16, experts="cutedsl", params_dtype=torch.float32), manager=cutedsl_manager)
    assert any("bf16/fp16" in r.message for rej in err.value.rejected for r in rej.reasons)


def test_hopper_rejects_cutedsl_with_a_hint(monkeypatch):
    import flashinfer_emulation

    from moe_core.plugins import PluginManager

    flashinfer_emulation.install(monkeypatch, arch=(9, 0))
    with pytest.raises(PlanError) as err:
        plan(make_config(16, experts="cutedsl"), manager=PluginManager())
    reasons = [r for rej in err.value.rejected for r in rej.reasons if r.code == "UNSUPPORTED_ARCH"]
    assert reasons and "SM90" in reasons[0].message and "triton" in reasons[0].hint


# --------------------------------------------------------------------------- the kit, and a real EP world


def test_conformance_kit_on_cutedsl(cutedsl_manager):
    from moe_core.testing import run_kit

    report = run_kit("cuda.cutedsl", manager=cutedsl_manager, device="cpu", device_kind="cuda")
    print(report.text())
    assert report.ok, report.text()
    passed = [r.case_id for r in report.results if r.status == "passed"]
    assert sum(c.startswith("experts-ep_masked-nvfp4") for c in passed) >= 13, passed


@pytest.mark.multiproc
@pytest.mark.timeout(180)
def test_torch_a2a_masked_world2_matches_reference():
    from flashinfer_ep_worker import run_world

    seed = random.randrange(1 << 30)
    case = dict(E=E, K=K, H=H, I=I, max_tokens=16, rsf=2.5, tokens=[[0, 5], [1, 0], [13, 16]])
    results = run_world(2, case, seed, timeout=150)
    for rank, r in enumerate(results):
        where = f"seed={seed} rank={rank}: {r}"
        assert (r["dispatcher"], r["experts"], r["format"], r["dtype"]) == ("torch_a2a", "cutedsl", "ep_masked",
                                                                            "bf16"), where
        assert r["graph_safe"] and r["empty_rows_zero"], where
        # The kit's rule per pass: within TOL_REF of the reference, or no further from the exact float64
        # than 1.5x the reference. A pass of 1-3 tokens exceeds 5e-2 vs the reference in ~6% of draws (304
        # passes measured: up to 8.3e-2; 13-16 tokens: up to 4.9e-2) while its distance to exact stays within
        # 1.14x the reference's.
        for vs_ref, vs_exact, ref_vs_exact in r["errors"]:
            assert vs_ref <= TOL_REF or vs_exact <= 1.5 * ref_vs_exact, where
        assert "grouped_gemm_nt_masked" in r["calls"], where


# ------------------------------------------------------------------ on a Blackwell GPU


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.version.hip is None and \
        torch.cuda.get_device_capability() in ((10, 0), (10, 3))


@pytest.mark.gpu
@pytest.mark.skipif(not _blackwell(), reason="needs an SM100/SM103 GPU")
@pytest.mark.skipif(importlib.util.find_spec("flashinfer") is None, reason="pip install 'moe-plugin-cuda[flashinfer]'")
def test_conformance_kit_on_blackwell():
    from moe_core.testing import run_kit

    report = run_kit("cuda.cutedsl")
    print(report.text())
    assert report.ok, report.text()
    assert any(r.case_id == "graph-ep_masked" and r.status == "passed" for r in report.results), report.text()
