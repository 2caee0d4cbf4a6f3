"""The triton experts' decode kernels (``triton.decode``): in Triton's interpreter without a GPU (fp32/fp16, FP8
with fp32 stand-in codes), and through MoELayer on the GPU (``gpu`` marker) against a float64 computation, in CUDA
graphs and under torch.compile."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from cuda_layer_cases import (
    TOL,
    capture_forward,
    fp8_scheme_reference,
    layers,
    needs_gpu,
    random_topk,
    refill_inputs,
    replay_on_new_inputs,
    within_fp8_scheme,
)

from moe_core.reference.oracle import moe_float64, relative_error

cuda = torch.cuda.is_available()
if os.environ.get("CI"):  # CI must run the interpreter tests, never skip them (see test_triton.py)
    import triton  # noqa: F401
else:
    pytest.importorskip("triton")


def _cfg(block_i=16, groups=1, block_h=16, groups2=1, flat=1, form=1, split=0, slots=1):
    """A decode config: form 1 (``flat``: the down kernel's loop form) or form 2 (``split``: one down program per
    slot, partials reduced by the last; ``slots``: gate/up slots a program)."""
    if form == 2:
        return {"decode": dict(BLOCK_I=block_i, GROUPS=groups, FORM=2, SLOTS=slots, num_warps=4, num_stages=2),
                "down": dict(BLOCK_H=block_h, GROUPS=groups2, FORM=2, SPLIT=split, num_warps=4, num_stages=2),
                **({"L2PF": 1.0, "L2PF_KEEP": 1} if split else {})}  # (a prefetch: no-op in the interpreter)
    return {"decode": dict(BLOCK_I=block_i, GROUPS=groups, num_warps=4, num_stages=2),
            "down": dict(BLOCK_H=block_h, GROUPS=groups2, FLAT=flat, num_warps=4, num_stages=2)}


# (form, loop or split) of the interpreter cases: form 1 flat and per slot, form 2 in registers and split
FORMS = [(1, 1), (1, 0), (2, 0), (2, 1)]


def _ids(T, E, K):
    if T == 0:
        return torch.zeros(0, K, dtype=torch.int32)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int()
    ids[torch.rand(T, K) < 0.25] = -1
    ids[0, 0] = -1  # at least one skipped slot
    return ids


@pytest.mark.skipif(cuda, reason="interpreter path (the GPU tests cover the device)")
@pytest.mark.parametrize("interleaved,groups", [(True, 1), (False, 2)])
@pytest.mark.parametrize("form,flat", FORMS)
@pytest.mark.parametrize("T,E,K,H,inter,dtype,act", [
    (0, 4, 2, 32, 32, torch.float32, "silu"), (1, 8, 3, 64, 32, torch.float16, "silu"),
    (1, 5, 2, 70, 37, torch.float32, "gelu"), (3, 6, 4, 300, 140, torch.float32, "silu")])
def test_decode_experts_interpreter(interleaved, groups, form, flat, T, E, K, H, inter, dtype, act):
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    x = torch.randn(T, H).to(dtype)
    w13 = (torch.randn(E, 2 * inter, H) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter) / inter ** 0.5).to(dtype)
    w, ids = torch.rand(T, K), _ids(T, E, K)
    ref = moe_float64(x, w, ids, w13, w2, activation=act, routed_scaling_factor=1.5)
    out = triton_ops.fused_experts(x, None, interleave_gate_up(w13) if interleaved else w13, w2, None, None, w, ids,
                                   fp8_block=False, activation=act, routed_scaling_factor=1.5, out_dtype=dtype,
                                   cfg=_cfg(groups=groups, groups2=groups, flat=flat, form=form, split=flat,
                                            slots=2 if K % 2 == 0 and flat else 1), w13_interleaved=interleaved)
    assert out.shape == (T, H) and out.dtype == dtype
    assert relative_error(out, ref) < (1e-2 if dtype is torch.float16 else 1e-5)


def _block_scaled(E, n, k):
    w = torch.randn(E, n, k) / k ** 0.5
    s = torch.rand(E, -(-n // 128), -(-k // 128)) + 0.5
    full = w * s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]
    return w, s, full


def _groups(v, fn):
    """``fn`` of each 128-column group of the last dimension, spread back over its columns."""
    return torch.stack([fn(c) for c in v.split(128, -1)], -1).repeat_interleave(128, -1)[..., :v.shape[-1]]


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("interleaved,groups,inter", [(True, 1, 200), (False, 2, 256), (True, 4, 256)])
@pytest.mark.parametrize("form,flat", FORMS)
@pytest.mark.parametrize("given_codes", [False, True])
def test_decode_fp8_scales_interpreter(interleaved, groups, form, flat, inter, given_codes):
    """The FP8 decode math with fp32 stand-in codes (the interpreter's fp8 casts are unreliable; the GPU tests
    compare e4m3): the token and h are scaled per 128-column group by max|.| / 448 (so the kernels' codes of a
    group reach +-448), weight block scales follow interleaved rows back to their checkpoint rows, I and H not
    multiples of 128 (blocks straddle scale rows: per-row scales) or I = 256 (each block's gate and up rows in one
    scale row: the scales folded into the token's values), one or several groups a step (partial steps masked)."""
    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    T, E, K, H = 2, 6, 4, 300
    w13, s13, w13_full = _block_scaled(E, 2 * inter, H)
    w2, s2, w2_full = _block_scaled(E, H, inter)
    x = torch.randn(T, H)
    w, ids = torch.rand(T, K), _ids(T, E, K)
    x_scale = None
    x_full = x.double()
    if given_codes:  # dispatched codes and scales: used as they came
        x_scale = torch.rand(T, -(-H // 128)) + 0.5
        x_full = x.double() * x_scale.double().repeat_interleave(128, 1)[:, :H]
    out = triton_ops.fused_experts(x, x_scale, interleave_gate_up(w13) if interleaved else w13, w2, s13, s2, w, ids,
                                   fp8_block=True, activation="silu", routed_scaling_factor=1.5,
                                   out_dtype=torch.float32,
                                   cfg=_cfg(groups=groups, groups2=groups, flat=flat, form=form, split=flat,
                                            slots=4 if flat else 1), w13_interleaved=interleaved)
    want = torch.zeros(T, H, dtype=torch.float64)
    for t in range(T):
        for k in range(K):
            e = int(ids[t, k])
            if e < 0:
                continue
            gu = w13_full[e].double() @ x_full[t]
            h = torch.nn.functional.silu(gu[:inter]) * gu[inter:]
            want[t] += float(w[t, k]) * (w2_full[e].double() @ h)
    assert relative_error(out, want * 1.5) < 1e-5


# torch on CUDA divides by a Python scalar as a multiplication by its fp32 reciprocal: the core quantizer's group
# scale there, which the Triton quantizers compute (docs/decisions.md, "The FP8 group scale is the device's")
INV_FP8_MAX = torch.tensor(1.0, dtype=torch.float32) / 448


def _split_amaxes():
    """bf16 amaxes whose scale ``amax / 448`` is exact in fp32 (so many bf16 values of their group sit at e4m3
    rounding ties) and one ulp away when computed as CUDA's torch does (times the fp32 reciprocal)."""
    a = torch.arange(0x4000, 0x4080, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()  # [2, 4)
    exact = (a.double() / 448).float().double() * 448 == a.double()
    return a[exact & (a / 448.0 != a * INV_FP8_MAX)]


def _tied_tokens(T, H, device):
    """bf16 tokens whose every 128-column group has an amax of ``_split_amaxes``: the two scale rules give
    different codes to several values of each group."""
    a = _split_amaxes().to(device)
    x = (torch.randn(T, H, device=device) * 0.6).clamp(-1.9, 1.9)
    cols = torch.arange(0, H, 128, device=device)
    x[:, cols] = a[torch.randint(0, a.numel(), (T, cols.numel()), device=device)] * torch.sign(
        torch.randn(T, cols.numel(), device=device))
    return x.to(torch.bfloat16)


@pytest.mark.skipif(cuda, reason="interpreter path (the GPU test compares the codes)")
def test_fp8_group_scale_is_the_core_quantizers_on_cuda():
    """The Triton quantizers' group scale is ``max(amax, 1e-4) / 448`` as the core quantizer computes it on CUDA
    (times the fp32 reciprocal), not an IEEE division (the core quantizer on the CPU) nor Triton's approximate
    ``/``: every bf16 amax of [2^-7, 8), and the tie-rich ones whose codes the two rules split."""
    from moe_plugin_cuda.triton import ops as triton_ops

    a = torch.arange(0x3c00, 0x4100, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.zeros(a.numel(), 256, dtype=torch.bfloat16)
    x[:, 7], x[:, 200] = a, -a.flip(0)
    _, s = triton_ops.quantize_fp8_groups(x)
    want = torch.stack([a.float(), a.flip(0).float()], 1) * INV_FP8_MAX
    assert torch.equal(s, want)
    assert (s != torch.stack([a.float(), a.flip(0).float()], 1) / 448.0).any()  # (the rules differ here)
    assert _split_amaxes().numel() >= 4
    x = _tied_tokens(5, 300, "cpu")
    q, s = triton_ops.quantize_fp8_groups(x)
    amax = torch.stack([g.float().abs().amax(-1) for g in x.split(128, -1)], -1)
    assert torch.equal(s, amax * INV_FP8_MAX)


def test_decode_config_fills_the_gpu():
    from moe_plugin_cuda.triton import tuning_configs

    for T, K, inter, H in ((1, 8, 768, 2048), (1, 2, 14336, 4096), (1, 8, 2048, 7168), (16, 8, 1536, 4096)):
        for fp8 in (False, True):
            c = tuning_configs.decode_config(T, K, inter, H, fp8)
            n1 = T * K * -(-inter // c["decode"]["BLOCK_I"])
            n2 = T * -(-H // c["down"]["BLOCK_H"])
            assert n1 >= 2 * tuning_configs.DECODE_SMS and n2 >= tuning_configs.DECODE_SMS, (T, K, inter, H, c)


# ------------------------------------------------------------------ on the GPU


def _gpu_case(backend, quant, T_max, T, decode_config=None, **kw):
    """(layer, float64 expected of a forward, x, topk): a layer of ``backend`` whose token lists of up to ``T_max``
    tokens run the decode kernels (``decode_config``: triton's fixed decode launch), random weights, T tokens with
    -1 ids."""
    from cuda_layer_cases import cuda_device, layer_config, random_weights

    from moe_core.layer import MoELayer
    from moe_core.quant import dequantize_weights
    from moe_core.reference.oracle import fp8_round_trip

    options = {"decode_max_tokens": T_max, **({"decode_config": decode_config} if decode_config else {})}
    cfg = layer_config(backend, quant, backend_options={backend: options}, **kw)
    gen = torch.Generator(device="cuda").manual_seed(torch.seed() % 2**31)
    w = random_weights(cfg, gen)
    layer = MoELayer(cfg, device=cuda_device())
    layer.load_weights(**w)
    layer.process_weights()
    assert layer.plan.experts.name == backend
    w13, w2 = dequantize_weights(w, cfg.quant)
    fp8 = quant == "fp8_block"

    def expected(x, topk):  # the scheme in float64: FP8 block quantizes the token and h per 128-column group
        q = (lambda v, where, e: fp8_round_trip(v, 128)) if fp8 else None
        return moe_float64(x.cpu(), topk.weights.cpu(), topk.ids.cpu(), w13.cpu(), w2.cpu(),
                           routed_scaling_factor=cfg.routed_scaling_factor, quantize_activation=q).to(x.device)

    def scheme(x, topk):  # FP8 block: fp8_scheme_reference's (output, flip slack)
        return fp8_scheme_reference(x, topk.weights, topk.ids, w13, w2, cfg.routed_scaling_factor)

    expected.scheme = scheme
    x = torch.randn(T, cfg.hidden_size, device="cuda").to(cfg.params_dtype)
    return layer, expected, x, random_topk(T, cfg)


def _launches():
    from moe_plugin_cuda.triton.launch import stats

    return sum(stats.values())


# triton: odd sizes (I and H not multiples of 128: FP8 scale blocks straddled); cutlass: whole 128x128 blocks
SIZES = {"triton": dict(E=16, K=4, H=328, inter=200), "cutlass": dict(E=16, K=4, H=256, inter=256)}


@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
@pytest.mark.parametrize("T", [0, 1, 3, 16])
def test_decode_layer_matches_float64(backend, quant, T):
    if backend == "cutlass":
        from cuda_layer_cases import need_cutlass

        need_cutlass()
    layer, expected, x, topk = _gpu_case(backend, quant, 16, T, **SIZES[backend])
    if T:
        topk.ids[0, 0] = -1  # a skipped slot
    out = layer(x, topk)
    torch.cuda.synchronize()
    before = _launches()
    again = layer(x, topk)
    torch.cuda.synchronize()
    assert out.shape == (T, x.shape[1]) and out.dtype == x.dtype
    assert torch.isfinite(out).all()
    assert relative_error(out, expected(x, topk)) < TOL[quant]
    assert torch.equal(again, out)  # deterministic: no atomics
    assert _launches() - before == (2 if T else 0)  # the two decode kernels, nothing else


@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
def test_default_path_at_one_token(backend):
    """Out of the decode table: bf16 token lists of one token run the two decode kernels, FP8 block the pipeline."""
    from moe_plugin_cuda.triton import tuning_configs

    if backend == "cutlass":
        from cuda_layer_cases import need_cutlass

        need_cutlass()

    for quant in ("unquantized", "fp8_block"):
        _, layer, _ = layers(backend, quant, E=16, K=4, H=256, inter=256)
        x = torch.randn(1, 256, device="cuda").to(torch.bfloat16)
        topk = random_topk(1, layer.config)
        layer(x, topk)
        torch.cuda.synchronize()
        limit = tuning_configs.DECODE_MAX_TOKENS_FP8 if quant == "fp8_block" else tuning_configs.DECODE_MAX_TOKENS
        for T, launches in ((1, 2 if limit else None), (limit + 1, None)):
            x = torch.randn(T, 256, device="cuda").to(torch.bfloat16)
            topk = random_topk(T, layer.config)
            layer(x, topk)
            torch.cuda.synchronize()
            before = _launches()
            layer(x, topk)
            torch.cuda.synchronize()
            n = _launches() - before
            assert n == launches if launches else n > 2, (quant, T, n)


@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_decode_cuda_graph_capture_replay(backend, quant):
    if backend == "cutlass":
        from cuda_layer_cases import need_cutlass

        need_cutlass()
    for T in (1, 5):
        layer, expected, x, topk = _gpu_case(backend, quant, 8, T, cuda_graph=True, **SIZES[backend])
        replay_on_new_inputs(layer, x, topk, expected, TOL[quant], expected.scheme if quant == "fp8_block" else None)


@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_decode_graph_replay_is_the_eager_call(backend, quant):
    """A decode forward captured in a CUDA graph and replayed on new tokens and routing gives, byte for byte, what
    the same layer computes eagerly on them (the kernels are deterministic: any stale buffer across replays would
    show), 20 times; the worst error against float64 goes to the warnings summary (the FP8 tolerance case of decision 62)."""
    if backend == "cutlass":
        from cuda_layer_cases import need_cutlass

        need_cutlass()
    layer, expected, x, topk = _gpu_case(backend, quant, 8, 1, cuda_graph=True, **SIZES[backend])
    g, out = capture_forward(layer, x, topk)
    errors, slacks = [], []
    for _ in range(20):
        refill_inputs(layer, x, topk)
        g.replay()
        eager = layer(x, topk)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        if quant == "fp8_block":  # the scheme's reference, with the slack of h values at e4m3 rounding midpoints
            ok, err = within_fp8_scheme(out, expected.scheme(x, topk), TOL[quant])
            slacks.append(err)
            assert ok, err
        errors.append(relative_error(out, expected(x, topk)))
    warnings.warn(f"decode graph replay {backend} {quant} T=1: error vs float64 max {max(errors):.4f} median "
                  f"{sorted(errors)[10]:.4f}" + (f"; vs the scheme's reference max {max(slacks):.4f}" if slacks else ""),
                  stacklevel=1)  # (in the summary: the device run's evidence)


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_decode_torch_compile(quant):
    torch._dynamo.reset()  # (see cuda_layer_cases.check_compiled)
    layer, expected, x, topk = _gpu_case("triton", quant, 4, 1, **SIZES["triton"])
    compiled = torch.compile(layer, fullgraph=True)
    for T in (1, 4):
        x = torch.randn(T, x.shape[1], device="cuda").to(x.dtype)
        topk = random_topk(T, layer.config)
        assert relative_error(compiled(x, topk), expected(x, topk)) < TOL[quant]


@needs_gpu
def test_decode_dispatched_fp8_codes():
    """FP8 codes and group scales handed in (an FP8 wire) are used as they came: the same output as quantizing
    inside from the bf16 tokens those codes came from."""
    from moe_plugin_cuda.triton import decode, tuning_configs
    from moe_plugin_cuda.weights import expert_weights

    from moe_core.quant import quantize_fp8_per_token_group

    layer, expected, x, topk = _gpu_case("triton", "fp8_block", 8, 3, **SIZES["triton"])
    w = expert_weights(layer, True)
    q, s = quantize_fp8_per_token_group(x)
    c = layer.config
    run = dict(fp8_block=True, activation="silu", routed_scaling_factor=c.routed_scaling_factor,
               out_dtype=x.dtype, cfg=tuning_configs.decode_config(3, c.top_k, c.intermediate_size, c.hidden_size, True),
               w13_interleaved=True)
    inside, _ = decode.decode_experts(x, None, w.w13, w.w2, w.w13_scale, w.w2_scale, topk.weights, topk.ids, **run)
    given, _ = decode.decode_experts(q, s, w.w13, w.w2, w.w13_scale, w.w2_scale, topk.weights, topk.ids, **run)
    assert torch.equal(inside, given)
    assert relative_error(given, expected(x, topk)) < TOL["fp8_block"]


@needs_gpu
@pytest.mark.parametrize("form", [1, 2])
def test_decode_token_codes_are_the_core_quantizers(form):
    """The gate/up kernels quantize the token exactly as the core quantizer does on the device: with identity
    gate and up rows (e4m3 1.0, scale 1) each h value is silu(v) * v of one dequantized token value v, and a code
    one step off moves it by 6% or more. Tokens whose group scales split the CPU's and CUDA's scale rules."""
    from moe_plugin_cuda.triton import decode

    from moe_core.quant import quantize_fp8_per_token_group

    T, H = 16, 256
    x = _tied_tokens(T, H, "cuda")
    eye = torch.eye(H, device="cuda")
    w13 = torch.cat([eye, eye]).unsqueeze(0).to(torch.float8_e4m3fn)
    scale = torch.ones(1, 2 * H // 128, H // 128, device="cuda")
    ids = torch.zeros(T, 1, dtype=torch.int32, device="cuda")
    h = torch.full((T, H), float("nan"), device="cuda")
    cfg = dict(BLOCK_I=8, GROUPS=2, num_warps=4, num_stages=2, **({"FORM": 2, "SLOTS": 1} if form == 2 else {}))
    decode.gate_up(x, None, w13, scale, ids, h, fp8_block=True, activation="silu", w13_interleaved=False, cfg=cfg)
    q, s = quantize_fp8_per_token_group(x)
    v = q.double() * s.double().repeat_interleave(128, -1)
    want = torch.nn.functional.silu(v) * v
    assert ((h.double() - want).abs() <= 1e-5 * want.abs() + 1e-7).all()


@needs_gpu
@pytest.mark.parametrize("backend", ["triton", "cutlass"])
def test_decode_fp8_tied_tokens_match_the_scheme(backend):
    """At T = 1, tokens whose group scales split the CPU's and CUDA's scale rules (the decode graph-replay
    failures, 0.035-0.046 against 0.03, were such draws measured against a reference quantizing on the CPU):
    within 1% of ``fp8_scheme_reference`` (the output's bf16 rounding is ~0.2%)."""
    if backend == "cutlass":
        from cuda_layer_cases import need_cutlass

        need_cutlass()
    layer, expected, x, topk = _gpu_case(backend, "fp8_block", 8, 1, **SIZES[backend])
    for _ in range(10):
        x = _tied_tokens(1, x.shape[1], "cuda")
        topk = random_topk(1, layer.config)
        ok, err = within_fp8_scheme(layer(x, topk), expected.scheme(x, topk), 0.01)
        assert ok, err


def test_decode_plan_reads_the_device_table(tmp_path):
    """A shape in the device's decode table runs its measured launch up to its max_tokens; another shape the
    heuristic's up to DECODE_MAX_TOKENS; the ``decode_max_tokens`` option overrides either limit."""
    import json

    from moe_plugin_cuda.triton import tuning_configs as tc

    cfg = {"decode": dict(BLOCK_I=16, GROUPS=2, num_warps=4, num_stages=3),
           "down": dict(BLOCK_H=8, GROUPS=4, FLAT=1, num_warps=8, num_stages=3), "PDL": 1}
    table = {tc.decode_shape(128, 8, 768, 2048, "bf16"): {"max_tokens": 4, "config": cfg}}
    (tmp_path / tc.decode_table_name("Some GPU")).write_text(json.dumps(table))
    plan = [tc.decode_plan(T, 128, 8, 768, 2048, "bf16", "Some GPU", str(tmp_path)) for T in (1, 4, 5)]
    assert plan[0] is plan[1] and plan[0] == cfg and plan[2] is None
    assert tc.decode_plan(8, 128, 8, 768, 2048, "bf16", "Some GPU", str(tmp_path), max_tokens=8) == cfg
    assert tc.decode_plan(1, 128, 8, 768, 2048, "bf16", "Some GPU", str(tmp_path), max_tokens=0) is None
    for device in ("Some GPU", "Other GPU", None):  # not in the table: the heuristic's launch, bf16 only by default
        other = tc.decode_plan(1, 64, 6, 512, 1024, "bf16", device, str(tmp_path))
        assert other == tc.decode_config(1, 6, 512, 1024, False)
        assert tc.decode_plan(tc.DECODE_MAX_TOKENS + 1, 64, 6, 512, 1024, "bf16", device, str(tmp_path)) is None
        assert tc.decode_plan(1, 64, 6, 512, 1024, "fp8_block", device, str(tmp_path)) is None  # the pipeline
        fp8 = tc.decode_plan(1, 64, 6, 512, 1024, "fp8_block", device, str(tmp_path), max_tokens=1)
        assert fp8 == tc.decode_config(1, 6, 512, 1024, True)


@needs_gpu
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
@pytest.mark.parametrize("form,flat,pdl,pf", [(f, flat, 1, None) for f, flat in FORMS]
                         + [(2, 0, 2, None), (2, 1, 2, None), (2, 1, 2, (1.0, 1, 1)), (2, 0, 1, (0.3, 0, 0))])
def test_decode_pdl_and_loop_variants(quant, form, flat, pdl, pf):
    """The down kernel launched with programmatic dependent launch (waiting for the gate/up kernel before reading h),
    released past the gate/up loop (``pdl`` 1) or, form 2, as the gate/up programs start (2), either loop form
    (form 1) or split and not (form 2), several groups a step, form 2 with and without Triton's software pipeline
    over its loops (3 stages, through shared memory), with the L2 prefetch (``pf``: the fraction of the down weights
    the form-2 gate/up programs prefetch, its evict_last policy, the weight loads evict_first): eager, replayed, in
    a CUDA graph, against float64; the same bytes every call
    (deterministic, the split's last-program reduction included)."""
    if form == 2:
        stages = 3 if flat == (pdl == 2) else 1  # (pipelined: split with PDL 2, in registers with PDL 1)
        cfg = {"decode": dict(BLOCK_I=4, GROUPS=4, FORM=2, SLOTS=2 if flat else 1, num_warps=2, num_stages=stages),
               "down": dict(BLOCK_H=8, GROUPS=2, FORM=2, SPLIT=flat, num_warps=1, num_stages=stages), "PDL": pdl}
    else:
        cfg = {"decode": dict(BLOCK_I=8, GROUPS=2, num_warps=4, num_stages=3),
               "down": dict(BLOCK_H=8, GROUPS=2, FLAT=flat, num_warps=4, num_stages=3), "PDL": 1}
    sizes = SIZES["triton"]
    if pf:
        cfg.update(L2PF=pf[0], L2PF_KEEP=pf[1])
        cfg["decode"]["STREAM"] = cfg["down"]["STREAM"] = pf[2]
        # (sizes where the bulk prefetch's 16-byte rule holds: an expert's w2 a multiple of 16 bytes; the prefetch
        # runs, it is not switched off)
        sizes = {**sizes, **dict(H=336, inter=202)}
        from moe_plugin_cuda.triton import decode

        w2 = torch.empty(sizes["E"], sizes["H"], sizes["inter"], dtype=torch.float8_e4m3fn, device="cuda")
        assert decode.prefetch_args(w2, None, pf[0], False, 4) is not None
    layer, expected, x, topk = _gpu_case("triton", quant, 4, 3, decode_config=cfg, cuda_graph=True, **sizes)
    first = layer(x, topk)
    assert relative_error(first, expected(x, topk)) < TOL[quant]
    for _ in range(3):  # records, then replays
        assert torch.equal(layer(x, topk), first)
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        layer(x, topk)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = layer(x, topk)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert relative_error(out, expected(x, topk)) < TOL[quant]


@pytest.mark.parametrize("E,H,inter,n_programs,fraction", [(4, 256, 384, 96, 1.0), (3, 130, 70, 7, 0.37),
                                                           (2, 128, 128, 1000, 0.5)])
def test_l2_prefetch_covers_the_fraction_of_each_expert(monkeypatch, E, H, inter, n_programs, fraction):
    """``prefetch_args``: the I-blocks' chunks (16-byte multiples) cover exactly the first ``fraction`` of an expert's
    down weights (rounded down to 16 bytes), the block scales up to 16-byte rounding; off (None) for fraction 0, in
    the interpreter, before sm_90, where an expert's bytes are not 16-byte aligned or its rows padded; a fraction
    past 1 refused."""
    from moe_plugin_cuda.triton import decode

    monkeypatch.setattr(decode, "_interpreting", lambda: False)
    monkeypatch.setattr(decode, "_has_bulk_prefetch", lambda device: True)
    w2 = torch.zeros(E, H, inter, dtype=torch.uint8)
    scale = torch.zeros(E, -(-H // 128), -(-inter // 128))
    args = decode.prefetch_args(w2, scale, fraction, True, n_programs)
    if (H * inter) % 16:
        assert args is None
        return
    w, stride_e, chunk, limit, s, s_stride, s_bytes, level = args
    assert w is w2
    assert stride_e == H * inter and level == 2 and chunk % 16 == 0 and limit % 16 == 0
    assert limit == int(H * inter * fraction) // 16 * 16
    covered = sorted({b for j in range(n_programs) for b in range(j * chunk, min((j + 1) * chunk, limit), 16)})
    assert covered == list(range(0, limit, 16))
    if scale.stride(0) * 4 % 16:
        assert s_bytes == 0
    else:
        assert s is scale and s_stride == scale.stride(0) * 4 and 0 <= scale[0].numel() * 4 - s_bytes < 16
    assert decode.prefetch_args(w2, scale, 0.0, True, n_programs) is None
    padded = torch.zeros(E, H, inter + 16, dtype=torch.uint8)[:, :, :inter]  # (whole rows would read past the end)
    assert decode.prefetch_args(padded, scale, fraction, True, n_programs) is None
    with pytest.raises(ValueError, match="L2PF"):
        decode.prefetch_args(w2, scale, 1.5, False, n_programs)
    monkeypatch.setattr(decode, "_has_bulk_prefetch", lambda device: False)
    assert decode.prefetch_args(w2, scale, fraction, True, n_programs) is None
    monkeypatch.setattr(decode, "_has_bulk_prefetch", lambda device: True)
    monkeypatch.setattr(decode, "_interpreting", lambda: True)
    assert decode.prefetch_args(w2, scale, fraction, True, n_programs) is None


def test_l2_prefetch_reaches_the_kernel_by_name(monkeypatch):
    """The gate/up launch's arguments bound to the kernel's parameter names (no GPU: the launches are captured):
    with ``"L2PF"`` the prefetch parameters get w2, its expert stride in bytes, the chunk and limit, the down block
    scales and their bytes, and ``L2PF`` 2 for a kept prefetch; without, ``L2PF`` 0."""
    from moe_plugin_cuda.triton import decode, kernels

    monkeypatch.setattr(decode, "_interpreting", lambda: False)
    monkeypatch.setattr(decode, "_has_bulk_prefetch", lambda device: True)
    launches = []
    monkeypatch.setattr(decode, "launch", lambda kernel, grid, *args, **kw: launches.append((kernel, args, kw)))
    E, K, H, inter = 8, 4, 256, 512  # (an expert's scales 32 bytes: prefetched too)
    w13 = torch.zeros(E, 2 * inter, H, dtype=torch.uint8)
    w2 = torch.zeros(E, H, inter, dtype=torch.uint8)
    s13, s2 = torch.ones(E, 2 * inter // 128, H // 128), torch.ones(E, H // 128, inter // 128)
    x, ids = torch.randn(1, H), torch.stack([torch.randperm(E)[:K]]).int()
    part = dict(BLOCK_I=4, GROUPS=2, FORM=2, SLOTS=1, num_warps=1, num_stages=1)
    down = dict(BLOCK_H=16, GROUPS=2, FORM=2, SPLIT=1, num_warps=1, num_stages=1)
    for pf in (None, (0.5, 1)):
        launches.clear()
        cfg = {"decode": part, "down": down, "PDL": 2, **({"L2PF": pf[0], "L2PF_KEEP": pf[1]} if pf else {})}
        decode.decode_experts(x, None, w13, w2, s13, s2, torch.rand(1, K), ids, fp8_block=True, activation="silu",
                              routed_scaling_factor=1.0, out_dtype=torch.float32, cfg=cfg, w13_interleaved=True)
        kernel, args, kw = launches[0]
        assert kernel is kernels._decode_gate_up_v2_kernel
        bound = dict(zip(kernel.arg_names[:len(args)], args, strict=True))  # (the constexprs come as keywords)
        assert kw["L2PF"] == (2 if pf else 0)
        if pf:
            assert bound["pf_ptr"] is w2 and bound["pfs_ptr"] is s2
            assert bound["pf_stride_e"] == H * inter and bound["pf_limit"] == H * inter // 2
            assert bound["pf_chunk"] == -(-(H * inter // 2) // (inter // 4) // 16) * 16
            assert bound["pfs_stride_e"] == s2[0].numel() * 4 and bound["pfs_bytes"] == s2[0].numel() * 4


def test_shipped_decode_tables_are_launchable():
    """Every entry of a shipped decode table: a decode launch the kernels take (both parts, FP8's BLOCK_H dividing
    128), a shape key decode_plan finds, max_tokens >= 0."""
    import json

    from moe_plugin_cuda.triton import tuning_configs as tc

    files = sorted(tc.CONFIG_DIR.glob(f"*kernel={tc.DECODE_TABLE}.json"))
    assert files
    for f in files:
        for shape, entry in json.loads(f.read_text()).items():
            E, K, N, H = (int(shape.split(f"{k}=")[1].split(",")[0]) for k in ("E", "K", "N", "H"))
            dtype = shape.split("dtype=")[1]
            assert tc.decode_shape(E, K, N, H, dtype) == shape and entry["max_tokens"] >= 0
            cfg = entry["config"]
            assert {"BLOCK_I", "GROUPS", "num_warps", "num_stages"} <= set(cfg["decode"]), (f.name, shape)
            down_keys = {"SPLIT", "FORM"} if cfg["down"].get("FORM", 1) == 2 else {"FLAT"}
            assert {"BLOCK_H", "GROUPS", "num_warps", "num_stages"} | down_keys <= set(cfg["down"]), (f.name, shape)
            assert not cfg["down"].get("SPLIT") or cfg["decode"].get("FORM") == 2, (f.name, shape)
            assert dtype != "fp8_block" or 128 % cfg["down"]["BLOCK_H"] == 0, (f.name, shape)
            device = f.name.split("device_name=")[1].split(",")[0].replace("_", " ")
            want = cfg if entry["max_tokens"] >= 1 else None
            assert tc.decode_plan(1, E, K, N, H, dtype, device) == want, (f.name, shape)
