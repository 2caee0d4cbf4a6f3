"""CI without a GPU for the triton backend's CUTLASS path (``cutlass_ops``): the pipeline around the
grouped GEMMs (sort, gather, activation + re-quantization, weighted reduce) runs in Triton's
interpreter with the GEMM emulated in torch (``cutlass_ops.reference_gemm``, same contract), on
fp32 stand-ins of the FP8 codes (the interpreter's fp8 casts are unreliable; the GPU tests run the
real thing)."""

from __future__ import annotations

import os

import pytest
import torch

from moe_core import MoEConfig
from moe_core.backends import Code
from moe_core.reference.oracle import moe_float64, relative_error

cuda = torch.cuda.is_available()
if os.environ.get("CI"):
    import triton  # noqa: F401  (CI must run these, never skip them)
else:
    pytest.importorskip("triton")


def _block_scaled(E, n, k):
    """fp32 stand-ins of an FP8 block-scaled weight: codes, one scale per 128x128 block, and their product."""
    w = torch.randn(E, n, k) * 50
    s = (torch.rand(E, -(-n // 128), -(-k // 128)) + 0.5) / (50 * k ** 0.5)
    return w, s, w * s.repeat_interleave(128, 1)[:, :n].repeat_interleave(128, 2)[:, :, :k]


def _acts(T, H):
    a = torch.randn(T, H) * 100
    s = (torch.rand(T, -(-H // 128)) + 0.5) / 100
    return a, s, a * s.repeat_interleave(128, 1)[:, :H]


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("T,E,K,H,inter", [(0, 4, 2, 128, 128), (1, 8, 3, 256, 128), (37, 6, 2, 384, 256),
                                           (130, 5, 4, 128, 384)])
def test_fused_pipeline_interpreter(T, E, K, H, inter):
    from moe_plugin_cuda import cutlass_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    a, a_s, x = _acts(T, H)
    w13, s13, w13_full = _block_scaled(E, 2 * inter, H)
    w2, s2, w2_full = _block_scaled(E, H, inter)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int() if T else torch.zeros(0, K, dtype=torch.int32)
    if T:
        ids[torch.rand(T, K) < 0.2] = -1
        ids[ids == E - 1] = -1  # one expert gets no rows: a group of 0
    w = torch.rand(T, K)
    out = cutlass_ops.fused_experts(a, a_s, interleave_gate_up(w13), w2, cutlass_ops.row_scales(s13, inter), s2, w,
                                    ids, routed_scaling_factor=1.5, out_dtype=torch.float32,
                                    gemm=cutlass_ops.reference_gemm, code_dtype=torch.float32)
    assert out.shape == (T, H)
    ref = moe_float64(x, w, ids, w13_full, w2_full, routed_scaling_factor=1.5)
    assert relative_error(out, ref) < 1e-4


def test_row_scales_follow_interleaved_rows():
    from moe_plugin_cuda import cutlass_ops
    from moe_plugin_cuda.weights import interleave_gate_up

    E, inter, H = 2, 200, 256  # I not a multiple of 128: up rows straddle scale blocks
    w, s13, full = _block_scaled(E, 2 * inter, H)
    rows = cutlass_ops.row_scales(s13, inter)
    assert rows.shape == (E, 2 * inter, H // 128)
    assert torch.allclose(interleave_gate_up(w) * rows.repeat_interleave(128, 2)[:, :, :H], interleave_gate_up(full))


@pytest.mark.skipif(cuda, reason="interpreter path")
def test_silu_mul_quant_scales_interpreter():
    """The activation's per-(row, 128-group) scales, partial last group included, are the core quantizer's."""
    from moe_core.quant import quantize_fp8_per_token_group
    from moe_plugin_cuda import cutlass_ops

    d1 = torch.randn(9, 2 * 200) * 3  # interleaved: gate j, up j in columns 2j, 2j+1
    h = torch.nn.functional.silu(d1[:, 0::2]) * d1[:, 1::2]
    q, s = cutlass_ops.silu_mul_quant(d1, torch.float32)
    assert torch.allclose(s, quantize_fp8_per_token_group(h)[1], rtol=1e-6, atol=0)
    assert relative_error(q * s.repeat_interleave(128, 1)[:, :200], h) < 1e-6


def test_cutlass_problem_reasons(monkeypatch, tmp_path):
    from moe_plugin_cuda import cutlass_lib, probes

    monkeypatch.setattr(probes, "_cuda_capability", lambda: ((8, 0), None))
    assert "SM90a only" in probes.cutlass_problem()
    monkeypatch.setattr(probes, "_cuda_capability", lambda: ((9, 0), None))
    monkeypatch.delenv("MOE_CUDA_CUTLASS_LIB", raising=False)
    monkeypatch.setenv("CUTLASS_DIR", str(tmp_path))
    monkeypatch.setattr(cutlass_lib, "nvcc", lambda: None)
    assert "no nvcc" in probes.cutlass_problem()
    monkeypatch.delenv("CUTLASS_DIR")
    monkeypatch.setattr(cutlass_lib, "cutlass_dir", lambda: None)
    assert "nvidia-cutlass" in probes.cutlass_problem() or "CUTLASS" in probes.cutlass_problem()
    monkeypatch.setenv("MOE_CUDA_CUTLASS_LIB", str(tmp_path / "missing.so"))
    assert "does not exist" in probes.cutlass_problem()
