"""CI without a GPU: plugin declarations and probes, and the Triton kernels in the interpreter."""

from __future__ import annotations

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
    assert names == {"triton", "grouped_mm", "deepep", "cutedsl"}
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


def test_deepep_not_installed_hint():
    from moe_plugin_cuda import probes

    r = probes.probe_deepep()
    assert r.code is Code.NOT_INSTALLED and "DeepEP" in r.hint


def test_deepep_checks():
    from moe_core import MoEConfig
    from moe_plugin_cuda import probes

    cfg = MoEConfig(num_experts=18, top_k=2, hidden_size=1000, intermediate_size=64, ep_size=3, cuda_graph=True,
                    device="cuda")
    codes = [r.code for r in probes.check_deepep(cfg, None)]
    assert Code.UNSUPPORTED_PARALLEL in codes and codes.count(Code.UNSUPPORTED_SHAPE) >= 2


triton = pytest.importorskip("triton")


def _case(T, E, K, H, inter, dtype):
    x = torch.randn(T, H, dtype=dtype)
    w13 = (torch.randn(E, 2 * inter, H) / H ** 0.5).to(dtype)
    w2 = (torch.randn(E, H, inter) / inter ** 0.5).to(dtype)
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]).int() if T else torch.zeros(0, K, dtype=torch.int32)
    if T:
        ids[torch.rand(T, K) < 0.2] = -1
    return x, w13, w2, torch.rand(T, K), ids


CFG = {"gemm1": dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=4, num_stages=2),
       "gemm2": dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=1, num_warps=4, num_stages=2)}


@pytest.mark.skipif(cuda, reason="interpreter path (the GPU tests cover the device)")
@pytest.mark.parametrize("T,E,K,H,inter,dtype,act", [
    (0, 4, 2, 32, 32, torch.float32, "silu"), (1, 8, 3, 64, 32, torch.float16, "silu"),
    (5, 4, 2, 48, 40, torch.float32, "silu"), (37, 6, 2, 96, 80, torch.float32, "gelu")])
def test_fused_experts_interpreter(T, E, K, H, inter, dtype, act):
    from moe_plugin_cuda import triton_ops

    x, w13, w2, w, ids = _case(T, E, K, H, inter, dtype)
    out = triton_ops.fused_experts(x, None, w13, w2, None, None, w, ids, activation=act, routed_scaling_factor=1.5,
                                   out_dtype=dtype, cfg=CFG)
    assert out.shape == (T, H)
    ref = moe_float64(x, w, ids, w13, w2, activation=act, routed_scaling_factor=1.5)
    assert relative_error(out, ref) < (1e-2 if dtype is torch.float16 else 1e-4)


@pytest.mark.skipif(cuda, reason="interpreter path")
def test_masked_experts_interpreter():
    from moe_plugin_cuda import triton_ops

    E, C, H, inter = 4, 10, 48, 40
    x = torch.randn(E, C, H)
    w13, w2 = torch.randn(E, 2 * inter, H) / 7, torch.randn(E, H, inter) / 6
    mm = torch.tensor([0, 10, 3, 7], dtype=torch.int32)
    out = triton_ops.masked_experts(x, None, mm, w13, w2, None, None, activation="silu", routed_scaling_factor=2.0,
                                    out_dtype=torch.float32, cfg=CFG)
    for e in range(E):
        m = int(mm[e])
        if m:
            ids = torch.full((m, 1), e, dtype=torch.int32)
            ref = moe_float64(x[e, :m], torch.ones(m, 1), ids, w13, w2, routed_scaling_factor=2.0)
            assert relative_error(out[e, :m], ref) < 1e-4


@pytest.mark.skipif(cuda, reason="interpreter path")
@pytest.mark.parametrize("numel_tokens,E,bm", [(1, 8, 16), (3000, 37, 16), (700, 256, 64)])
def test_align_block_size(numel_tokens, E, bm):
    from moe_plugin_cuda import triton_ops

    ids = torch.randint(-1, E, (numel_tokens, 5), dtype=torch.int32)
    sorted_ids, expert_ids, post_pad, _ = triton_ops.align_block_size(ids, E, bm)
    flat = ids.reshape(-1)
    total = int(post_pad)
    assert total == sum((int((flat == e).sum()) + bm - 1) // bm * bm for e in range(E))
    seen = sorted_ids[:total]
    real = seen[seen < flat.numel()]
    assert sorted(real.tolist()) == torch.nonzero(flat >= 0).flatten().tolist()  # every valid slot once, no -1
    for b in range(total // bm):
        rows = sorted_ids[b * bm:(b + 1) * bm]
        rows = rows[rows < flat.numel()].long()
        assert (flat[rows] == expert_ids[b]).all()
