"""What the GPU tests of several components share: a layer on the GPU next to the core reference layer,
random routing, per-scheme tolerances, and the checks every experts backend must pass on the device
(against the reference, in a CUDA graph, under torch.compile). Run on the device:
``python -m pytest plugins/cuda -m gpu``; without CUDA these tests skip (``needs_gpu``)."""

from __future__ import annotations

import pytest
import torch

from moe_core import MoEConfig
from moe_core.contracts import TopK
from moe_core.layer import MoELayer
from moe_core.quant import quantize_weights
from moe_core.reference.oracle import relative_error


def needs_gpu(test):
    """The ``gpu`` marker, and skipped without a CUDA device."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))


TOL = {"unquantized": 1e-2, "fp8_block": 3e-2, "fp8_per_token": 3e-2}


def layer_config(backend, quant, E=16, K=4, H=256, inter=None, act="silu", dtype=torch.bfloat16, **kw):
    if inter is None:  # cutlass needs whole 128x128 scale blocks
        inter = 256 if backend == "cutlass" else 192
    return MoEConfig(num_experts=E, top_k=K, hidden_size=H, intermediate_size=inter, activation=act, quant=quant,
                     params_dtype=dtype, device="cuda", experts=backend, routed_scaling_factor=1.7, **kw)


def random_weights(cfg, gen):
    E, H, inter = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
    w13 = torch.randn(E, 2 * inter, H, generator=gen, device="cuda") / H ** 0.5
    w2 = torch.randn(E, H, inter, generator=gen, device="cuda") / inter ** 0.5
    if cfg.quant == "unquantized":
        return {"w13": w13.to(cfg.params_dtype), "w2": w2.to(cfg.params_dtype)}
    return quantize_weights(w13, w2, cfg.quant)


def cuda_device():
    return torch.device("cuda", torch.cuda.current_device())


def layers(backend, quant, **kw):
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    cfg = layer_config(backend, quant, **kw)
    ref_cfg = cfg.replace(experts="reference", cuda_graph=False)
    w = random_weights(cfg, gen)
    layer, ref = MoELayer(cfg, device=cuda_device()), MoELayer(ref_cfg, device=cuda_device())
    for lay in (layer, ref):
        lay.load_weights(**w)
        lay.process_weights()
    assert layer.plan.experts.name == backend
    return cfg, layer, ref


def random_topk(T, cfg, minus_one=True):
    logits = torch.randn(T, cfg.num_experts, device="cuda")
    w, ids = torch.softmax(logits, -1).topk(cfg.top_k, -1)
    ids = ids.to(torch.int32)
    if minus_one and T:
        drop = torch.rand(T, cfg.top_k, device="cuda") < 0.15
        ids = torch.where(drop, -1, ids)
    return TopK(w.contiguous(), ids.contiguous())


def fixed_config(bm, bn, two_acc, b_tma, fp8):
    """A fixed Triton launch config (``backend_options["triton"]["config"]``) for every T."""
    warps = 8 if bm >= 64 else 4
    bk = 128 if fp8 else 64  # 3 stages of these tiles fit the 227 KB of shared memory
    return {"gemm1": dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=4, num_warps=warps, num_stages=3, TWO_ACC=two_acc,
                          B_TMA=b_tma),
            "gemm2": dict(BLOCK_M=bm, BLOCK_N=64, BLOCK_K=128 if fp8 else 64, GROUP_M=4, num_warps=warps,
                          num_stages=3, B_TMA=b_tma)}


def need_cutlass():
    from moe_plugin_cuda.probes import probe_cutlass

    if not probe_cutlass().ok:
        pytest.skip(probe_cutlass().message)


def need_deepgemm():
    from moe_plugin_cuda.deepgemm import lib as deepgemm_lib

    need_cutlass()
    if deepgemm_lib.missing():
        pytest.skip(deepgemm_lib.missing())


def check_matches_reference(backend, quant, T):
    """Through MoELayer against the reference layer, -1 ids included; the same output on repeat."""
    cfg, layer, ref = layers(backend, quant)
    x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
    topk = random_topk(T, cfg)
    out = layer(x, topk)
    expected = ref(x, topk)
    assert out.shape == (T, cfg.hidden_size) and out.dtype == cfg.params_dtype
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) < TOL[quant]
    assert torch.equal(layer(x, topk), out)  # same output on repeat


def check_graph_replay(backend, quant, options):
    """Captured in a CUDA graph, replayed on new inputs in the captured buffers, against the reference."""
    cfg, layer, ref = layers(backend, quant, cuda_graph=True, **options)
    assert layer.plan.graph_safe
    T = 96
    x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
    replay_on_new_inputs(layer, x, random_topk(T, cfg), ref, TOL[quant])


def capture_forward(layer, x, topk):
    """(graph, its output): one forward of ``layer`` on ``x`` / ``topk`` captured in a CUDA graph after a warm-up
    call on a side stream (what allocates and compiles runs outside the capture)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x, topk)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = layer(x, topk)
    return g, out


def refill_inputs(layer, x, topk):
    """New O(1) tokens and routing written into a captured graph's ``x`` and ``topk`` (in place)."""
    x.copy_(torch.randn_like(x))
    new = random_topk(x.shape[0], layer.config)
    topk.weights.copy_(new.weights)
    topk.ids.copy_(new.ids)


def replay_on_new_inputs(layer, x, topk, expected, tol, fp8_scheme=None):
    """One forward of ``layer`` captured in a CUDA graph (after a warm-up on a side stream), then replayed twice
    on new tokens and routing written into the captured ``x`` and ``topk``: each replay against
    ``expected(x, topk)`` within ``tol``; with ``fp8_scheme`` (``(x, topk)`` -> ``fp8_scheme_reference``'s pair),
    within ``tol`` of that, allowing its flip slack (at T = 1 one h value at an e4m3 rounding midpoint, rounded the
    other way, measured 0.035-0.039 against float64: over 0.03 with no fault)."""
    g, out = capture_forward(layer, x, topk)
    for _ in range(2):
        refill_inputs(layer, x, topk)
        g.replay()
        torch.cuda.synchronize()
        if fp8_scheme is not None:
            ok, err = within_fp8_scheme(out, fp8_scheme(x, topk), tol)
            assert ok, err
        else:
            assert relative_error(out, expected(x, topk)) < tol


def check_compiled(backend, quant, options):
    """Under torch.compile (a fresh dynamo cache), against the reference."""
    # a fresh dynamo cache: MoELayer.forward is one code object, and after the recompile limit
    # (8 in torch 2.11) dynamo runs it eagerly without a word, so later cases compiled nothing
    torch._dynamo.reset()
    cfg, layer, ref = layers(backend, quant, **options)
    compiled = torch.compile(layer)
    for T in (5, 64):
        x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
        topk = random_topk(T, cfg)
        assert relative_error(compiled(x, topk), ref(x, topk)) < TOL[quant]


_E4M3_GRID = None


def _e4m3_grid() -> torch.Tensor:
    """The finite e4m3fn values, sorted (float64)."""
    global _E4M3_GRID
    if _E4M3_GRID is None:
        v = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).double()
        _E4M3_GRID = torch.unique(v[torch.isfinite(v)])
    return _E4M3_GRID


def _quantize_fp32(v: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(float64 values, float64 group scales) of ``v`` quantized per 128 columns by the core quantizer on
    ``device``: its scale ``max(amax, 1e-4) / 448`` is a multiplication by the fp32 reciprocal on CUDA and a
    division on the CPU (torch's scalar division), and a scale one ulp away moves every code of its group that
    sits at an e4m3 rounding tie (bf16 tokens have many where the scale is exact): a reference quantizing on
    the CPU was up to 4% from a kernel quantizing as the core does on the GPU."""
    from moe_core.quant import quantize_fp8_per_token_group

    q, s = quantize_fp8_per_token_group(v.float().to(device))
    s = s.double().cpu()
    return (q.double().cpu() * s.repeat_interleave(128, -1)[..., :v.shape[-1]]), s


def fp8_scheme_reference(x, weights, ids, w13, w2, routed_scaling_factor, rel=1e-5):
    """(float64 output of the FP8 block scheme, flip slack). The token is quantized by the core quantizer on
    ``x``'s device (the kernels' codes exactly, scale included: ``_quantize_fp32``; a float64 round trip differs
    where bf16 values divided by an fp32 scale meet e4m3 rounding ties); h, computed in float64 here and in fp32
    by a kernel, is quantized per 128-column group (the same scale rule), and where a value lies within ``rel``
    of an e4m3 rounding midpoint the kernel may take the neighbouring code. The slack is the sum, over every such element, of the output's change when that element
    alone takes its other code: what the kernel may differ by on top of the tolerance (0 in most calls). A stale
    buffer or a wrong scale is off by far more."""
    from moe_core.reference.oracle import moe_float64

    grid = _e4m3_grid()
    ambiguous = []  # (call, element, the other code's value)
    calls = [0]
    device = x.device

    def find(v, where, e):
        calls[0] += 1
        q, scales = _quantize_fp32(v, device)
        if where != "a2":
            return q
        for gi, g in enumerate(v.double().split(128, -1)):
            s = scales[..., gi].squeeze()
            c = (g / s).clamp(-448.0, 448.0).flatten()
            mag = c.abs()
            hi_i = torch.searchsorted(grid, mag).clamp(max=grid.numel() - 1)
            lo, hi = grid[(hi_i - 1).clamp(min=0)], grid[hi_i]
            near = ((mag - (lo + hi) / 2).abs() <= rel * mag.clamp(min=1e-30)) & (hi > lo)
            for i in torch.nonzero(near).flatten().tolist():
                code = abs(float(q.flatten()[gi * 128 + i]) / float(s))
                other = float(lo[i]) if abs(code - float(hi[i])) < abs(code - float(lo[i])) else float(hi[i])
                ambiguous.append((calls[0], gi * 128 + i, other * float(s) * (1.0 if float(c[i]) >= 0 else -1.0)))
        return q

    args = (x.cpu(), weights.cpu(), ids.cpu(), w13.cpu(), w2.cpu())
    ref = moe_float64(*args, routed_scaling_factor=routed_scaling_factor, quantize_activation=find)
    slack = 0.0
    for call, i, value in ambiguous:
        seen = [0]

        def flip(v, where, e, call=call, i=i, value=value, seen=seen):
            seen[0] += 1
            out = _quantize_fp32(v, device)[0]
            if seen[0] == call:
                out.view(-1)[i] = value
            return out

        slack += (moe_float64(*args, routed_scaling_factor=routed_scaling_factor, quantize_activation=flip)
                  - ref).norm().item()
    return ref.to(x.device), slack


def within_fp8_scheme(out, reference, tol) -> tuple[bool, float]:
    """(``out`` within ``tol`` of the scheme's float64 reference, allowing its flip slack; the relative error):
    ``||out - ref|| <= tol * ||ref|| + slack`` (``reference``: ``fp8_scheme_reference``'s pair)."""
    ref, slack = reference
    err = (out.double() - ref.double()).norm().item()
    return err <= tol * ref.double().norm().item() + slack, relative_error(out, ref)
