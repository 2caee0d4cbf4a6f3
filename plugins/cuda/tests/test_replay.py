"""The decode host path: ``triton.replay`` (a fused_experts call's launches recorded once per key and issued again
with the next call's pointers) and what one decode forward of a ``MoELayer`` costs the host, as exact counts.

CPU: Triton's compiled launchers emulated (``triton_launch_emulation``: every launch runs the kernel in Triton's
interpreter, a replay's integer pointers turned back into tensors): a replayed call gives exactly the bytes of the
pipeline run as usual, whatever the inputs; a call whose key changed records again; a call that cannot be replayed
runs as usual. GPU (``gpu`` marker): the same on the device (compiled kernels)."""

from __future__ import annotations

import dataclasses
import os
import sys

import pytest
import torch

cuda = torch.cuda.is_available()
if os.environ.get("CI"):
    import triton  # noqa: F401
else:
    triton = pytest.importorskip("triton")

E, K, H, INTER = 8, 2, 256, 128


def _weights(fp8: bool, device, dtype, checkpoint: bool = False):
    """(w13, w2, w13_scale, w2_scale) as the kernels take them (unquantized: ``dtype``, gate/up interleaved);
    ``checkpoint``: also the unquantized checkpoint-layout (w13, w2), for the float64 reference."""
    from moe_plugin_cuda.weights import interleave_gate_up

    from moe_core.plugin_api import quant

    w13 = torch.randn(E, 2 * INTER, H, device=device) / H ** 0.5
    w2 = torch.randn(E, H, INTER, device=device) / INTER ** 0.5
    if fp8:
        q = quant.quantize_weights(w13, w2, "fp8_block")
        weights = q["w13"], q["w2"], q["w13_scale"], q["w2_scale"]
        return (weights, None) if checkpoint else weights
    w13, w2 = w13.to(dtype), w2.to(dtype)
    weights = interleave_gate_up(w13), w2, None, None
    return (weights, (w13, w2)) if checkpoint else weights


def _cfg(b_tma: int):
    return {"gemm1": dict(BLOCK_M=16, BLOCK_N=128, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, TWO_ACC=1),
            "gemm2": dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, GROUP_M=1, num_warps=4, num_stages=2, B_TMA=b_tma)}


def _inputs(T, device, offset=0, dtype=torch.bfloat16):
    wide = torch.randn(T, H + 8, device=device).to(dtype)
    hidden = wide[:, offset:offset + H]
    ids = torch.stack([torch.randperm(E, device=device)[:K] for _ in range(T)]).int()
    ids[torch.rand(T, K, device=device) < 0.25] = -1
    return hidden, torch.rand(T, K, device=device), ids


def _run(ops, hidden, w, ids, weights, fp8, cfg, programs, descriptors, layouts):
    w13, w2, s13, s2 = weights
    return ops.fused_experts(hidden, None, w13, w2, s13, s2, w, ids, fp8_block=fp8, activation="silu",
                             routed_scaling_factor=1.3, out_dtype=hidden.dtype, cfg=cfg, w13_interleaved=not fp8,
                             descriptors=descriptors, layouts=layouts, programs=programs)


# the interpreter computes fp16 / fp32 reliably (numpy has no bf16; its fp8 casts are not the GPU's: there the FP8
# case checks the bytes of replay against the pipeline, the numerics are the GPU test's and the layer tests')
DTYPE = torch.bfloat16 if cuda else torch.float32


@pytest.fixture
def device(monkeypatch):
    """The GPU, or the CPU with the compiled launchers emulated."""
    if cuda:
        return torch.device("cuda")
    import triton_launch_emulation

    triton_launch_emulation.install(monkeypatch)
    return torch.device("cpu")


def _replays(fp8, b_tma, device, decode=False):
    """(T, offset) cases, each run three times: recorded, then replayed twice with fresh inputs; every result
    against the pipeline run as usual on the same inputs (bytes) and, bf16, the float64 math."""
    from moe_plugin_cuda.triton import launch, ops
    from moe_plugin_cuda.triton.replay import Programs
    from moe_plugin_cuda.workspace import Layouts

    from moe_core.reference.oracle import moe_float64, relative_error

    weights, checkpoint = _weights(fp8, device, DTYPE, checkpoint=True)
    cfg = _cfg(b_tma) if not decode else {  # form 2, gate/up slots in pairs, split down: 2 launches
        "decode": dict(BLOCK_I=4, SLOTS=2, GROUPS=2, FORM=2, num_warps=1, num_stages=1),
        "down": dict(BLOCK_H=8, GROUPS=2, FORM=2, SPLIT=1, num_warps=1, num_stages=1)}
    launches = 2 if decode else 4
    programs, descriptors, layouts = Programs(), {}, Layouts()
    cases = ((1, 0), (3, 1)) if decode else ((1, 0), (3, 8), (3, 1), (17, 0))  # (decode: slow in the interpreter)
    for T, offset in cases:  # offset 1: hidden rows 2 bytes off 16-byte alignment
        for i in range(3):
            hidden, w, ids = _inputs(T, device, offset, DTYPE)
            before = launch.stats["replayed"]
            got = _run(ops, hidden, w, ids, weights, fp8, cfg, programs, descriptors, layouts)
            replayed = launch.stats["replayed"] - before
            want = _run(ops, hidden, w, ids, weights, fp8, cfg, None, descriptors, layouts)
            assert torch.equal(got, want), (T, offset, i)
            assert replayed == (0 if i == 0 else launches), (T, offset, i, replayed)  # (FP8: quantized in align, GEMM1)
            if checkpoint is not None:
                ref = moe_float64(hidden, w, ids, *checkpoint, routed_scaling_factor=1.3)
                assert relative_error(got, ref) < (1e-2 if DTYPE is torch.bfloat16 else 1e-4), (T, offset, i)
    return programs


# (fp8, b_tma, decode): the pipeline, and the decode kernels (whose output and scratch share one allocation); the
# FP8 decode kernels take minutes in the interpreter: on the GPU only (test_decode checks their math on the CPU)
REPLAY_CASES = [(False, 0, False), (False, 1, False), (True, 1, False), (False, 0, True), (True, 0, True)]


@pytest.mark.skipif(cuda, reason="emulated launchers (the GPU test runs the compiled ones)")
@pytest.mark.parametrize("fp8,b_tma,decode", REPLAY_CASES[:-1])
def test_replayed_calls_give_the_pipelines_bytes_emulated(fp8, b_tma, decode, device):
    programs = _replays(fp8, b_tma, device, decode)
    assert len(programs) == (2 if decode else 4)  # one per (T, alignment class)


@pytest.mark.gpu
@pytest.mark.skipif(not cuda, reason="needs a CUDA GPU")
@pytest.mark.parametrize("fp8,b_tma,decode", REPLAY_CASES)
def test_replayed_calls_give_the_pipelines_bytes(fp8, b_tma, decode, device):
    programs = _replays(fp8, b_tma, device, decode)
    assert len(programs) == (2 if decode else 4)


@pytest.mark.skipif(cuda, reason="emulated launchers")
def test_what_changes_the_key_or_cannot_be_replayed(device):
    """A new config object, another hidden stride or other weights record again; a call whose weights need a copy
    (non-contiguous top-k weights) is kept as not replayable and runs as usual, correct."""
    from moe_plugin_cuda.triton import launch, ops
    from moe_plugin_cuda.triton.replay import Programs

    weights = _weights(False, device, DTYPE)
    programs = Programs()

    def run(hidden, w, ids, cfg, weights=weights):
        before = dict(launch.stats)
        out = _run(ops, hidden, w, ids, weights, False, cfg, programs, {}, None)
        want = _run(ops, hidden, w, ids, weights, False, cfg, None, {}, None)
        assert torch.equal(out, want)
        return launch.stats["replayed"] - before["replayed"]

    cfg = _cfg(0)
    hidden, w, ids = _inputs(2, device, dtype=DTYPE)
    assert run(hidden, w, ids, cfg) == 0 and run(hidden, w, ids, cfg) == 4
    assert run(hidden, w, ids, _cfg(0)) == 0  # an equal config, another object: recorded again
    assert run(hidden.contiguous(), w, ids, cfg) == 0  # rows H apart, not H + 8
    assert run(hidden, w, ids, cfg, _weights(False, device, DTYPE)) == 0  # other weights
    assert len(programs) == 4
    # the weights are keyed by identity and whole address: the same tensor moved (``.data =``, what a loader may
    # do) or another tensor over the same memory records again; the program keeps its weights alive (an id of a
    # freed tensor could name another one)
    w13, w2, _, _ = moved = tuple(t.clone() if t is not None else None for t in weights)
    assert run(hidden, w, ids, cfg, moved) == 0 and run(hidden, w, ids, cfg, moved) == 4
    w13.data = w13.data.clone()
    assert run(hidden, w, ids, cfg, moved) == 0 and run(hidden, w, ids, cfg, moved) == 4
    assert run(hidden, w, ids, cfg, (w13.view(w13.shape), *moved[1:])) == 0
    assert all(any(t is w2 for t in p.keep) for p in list(programs.values())[-3:])
    assert len(programs) == 7
    strided_w = torch.rand(K, 2, device=device).t()  # [T, K] not contiguous: flattening it copies
    assert run(hidden, strided_w, ids, cfg) == 0 and run(hidden, strided_w, ids, cfg) == 0
    assert len(programs) == 8 and programs[next(reversed(programs))] is None


@pytest.mark.skipif(cuda, reason="emulated launchers")
def test_a_launcher_refusing_integer_pointers_turns_replay_off(device, monkeypatch):
    """A launcher that takes tensors only (a TypeError before it launches): that key runs as usual from then on,
    correct."""
    import triton_launch_emulation
    from moe_plugin_cuda.triton import launch, ops
    from moe_plugin_cuda.triton.replay import Programs

    emulated = triton_launch_emulation.Emulated.run

    def tensors_only(self, *args):
        if any(type(args[9 + i]) is int for i in self.pointers):
            raise TypeError("pointer argument must be a tensor")
        return emulated(self, *args)

    monkeypatch.setattr(triton_launch_emulation.Emulated, "run", tensors_only)
    weights, programs, cfg = _weights(False, device, DTYPE), Programs(), _cfg(0)
    for _ in range(3):
        hidden, w, ids = _inputs(3, device, dtype=DTYPE)
        before = launch.stats["replayed"]
        got = _run(ops, hidden, w, ids, weights, False, cfg, programs, {}, None)
        assert torch.equal(got, _run(ops, hidden, w, ids, weights, False, cfg, None, {}, None))
        assert launch.stats["replayed"] == before
    assert list(programs.values()) == [None]


# ------------------------------------------------------------------ one decode forward of a layer, exact counts


def _decode_layer(quant, device, monkeypatch, experts="cutlass"):
    """A qwen3-30b-a3b-shaped MoELayer planned for the H100 (its tuned tables), weights unfilled (never read here)."""
    from moe_plugin_cuda import probes
    from moe_plugin_cuda.cutlass import experts as cutlass_experts
    from moe_plugin_cuda.cutlass import lib as cutlass_lib

    from moe_core import MoELayer
    from moe_core.backends import available
    from moe_core.config import preset
    from moe_core.planner import plan

    monkeypatch.setattr(probes, "probe_cutlass", lambda: available("emulated"))
    monkeypatch.setattr(probes, "probe_triton", lambda: available("emulated"))
    monkeypatch.setattr(cutlass_lib, "library", lambda *a, **k: None)
    monkeypatch.setattr(cutlass_experts, "_device_name", lambda index: "NVIDIA H100 80GB HBM3")
    cfg = preset("qwen3-30b-a3b", quant=quant, device="cuda", experts=experts)
    the_plan = dataclasses.replace(plan(cfg, dry_run=True), dry_run=False)  # (planned for the GPU, built here)
    layer = MoELayer(cfg, plan=the_plan, check_ids=False, device=device)
    if experts == "triton":
        layer.experts._device_name = "NVIDIA H100 80GB HBM3"  # (its tables, as on the GPU)
    layer._loaded = True
    if quant == "unquantized":
        layer.experts.w13_layout.mark(layer.w13)  # (as if interleaved: the values are never read)
    layer.process_weights()
    return cfg, layer


class _Counts:
    """Per call of ``fn``: torch operations (by name), launches by path, and calls of moe-core's and the plugin's
    Python functions."""

    def __init__(self, fn) -> None:
        from moe_plugin_cuda.triton import launch
        from torch.utils._python_dispatch import TorchDispatchMode

        ops: list = []

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.append(str(func))
                return func(*args, **(kwargs or {}))

        roots = tuple(os.path.dirname(__import__(m).__file__) for m in ("moe_core", "moe_plugin_cuda"))
        calls: list = []

        def profile(frame, event, arg):
            # (comprehensions are frames of their own before Python 3.12 only: not counted)
            if event == "call" and frame.f_code.co_filename.startswith(roots) and not frame.f_code.co_name.startswith("<"):
                calls.append(frame.f_code.co_name)

        before = dict(launch.stats)
        with Ops():
            fn()
        self.ops = sorted(ops)
        self.launches = {k: launch.stats[k] - before[k] for k in before if launch.stats[k] != before[k]}
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
        self.calls = calls


# the layer's second decode forward at T = 1 (the first records): what the host does, exactly. A change that adds
# work per forward fails here; one that removes some updates these numbers (docs/decisions.md, "A decode forward
# replays its launches")
DECODE_FORWARD = {
    # quant: (torch ops, launches replayed by the pipeline, Python calls in moe-core and the plugin: the layer's
    # forward, _routed, the experts' apply_tokens, expert_weights, [cutlass: run_fused], run_fused or fused_experts,
    # launch.direct_state and its _hooks_idle; the replay's generated launcher is not counted, nor the emulated one)
    "unquantized": (["aten.empty.memory_format"] * 2, 4, 8),
    "fp8_block": (["aten.empty.memory_format"] * 2, 5, 8),
}


def _launches(quant, cfg) -> int:
    """The two decode kernels where the H100's decode table runs this shape at T = 1, else the pipeline's launches."""
    from moe_plugin_cuda.triton import tuning_configs

    decode = tuning_configs.decode_plan(1, cfg.num_experts, cfg.top_k, cfg.intermediate_size, cfg.hidden_size,
                                        tuning_configs.table_dtype(cfg.quant, cfg.params_dtype), "NVIDIA H100 80GB HBM3")
    return 2 if decode is not None else DECODE_FORWARD[quant][1]


@pytest.mark.skipif(cuda, reason="emulated launchers on the CPU")
@pytest.mark.parametrize("experts", ["cutlass", "triton"])
@pytest.mark.parametrize("quant", ["unquantized", "fp8_block"])
def test_decode_forward_host_work(quant, experts, monkeypatch):
    """qwen3-30b-a3b at T = 1 with the cutlass or triton experts and the H100's tables: after the first forward,
    each one is two allocations (workspace, output; the decode kernels': one, the output a view of it) and its
    launches replayed, nothing else (no contract objects: the standard dispatcher passes the tokens through)."""
    import triton_launch_emulation

    from moe_core.contracts import TopK

    log = triton_launch_emulation.install(monkeypatch, execute=False)
    cfg, layer = _decode_layer(quant, torch.device("cpu"), monkeypatch, experts)
    x = torch.randn(1, cfg.hidden_size).to(cfg.params_dtype)
    w, ids = torch.softmax(torch.randn(1, cfg.num_experts), -1).topk(cfg.top_k, -1)
    topk = TopK(w, ids.int())
    with torch.no_grad():
        layer(x, topk)  # records
        counts = _Counts(lambda: layer(x, topk))
    ops, _, calls = DECODE_FORWARD[quant]
    replayed = _launches(quant, cfg)
    if replayed == 2:  # the decode kernels: the output and their scratch in one allocation (the output a view of it)
        ops = ["aten.empty.memory_format", "aten.as_strided.default"]
    assert counts.ops == sorted(ops)
    assert counts.launches == {"replayed": replayed}
    assert [path for path, _ in log].count("launcher") == 2 * replayed  # (each forward: none through kernel[grid])
    assert len(counts.calls) == calls, str(counts.calls)
