"""Probe: CUTLASS 4.2 ptr-array grouped bf16 GEMMs (cooperative and ping-pong, bf16_grouped_probe.cu) against
DeepGEMM's bf16 grouped GEMM (the cutlass backend's kernel) on the MoE GEMMs of the short bf16 cells, the
experts' rows from a real routing (uniform softmax top-k). GEMM kernels alone, no gather / SiLU / reduce.

    LIBS=dir/with/libbf16g_v*.so python3 benchmarks/cuda/h100_session14/probe_bf16_grouped.py
"""
import ctypes
import glob
import os
import re

import torch
import triton.testing

from moe_core.config import preset
from moe_core.router import route
from moe_plugin_cuda import cutlass_ops, deepgemm_lib, triton_ops

NAMES = {0: "cutlass coop 128x128", 1: "cutlass coop 128x256", 2: "cutlass ping 64x128", 3: "cutlass ping 64x256",
         4: "cutlass coop 128x256 c2x1", 5: "cutlass ping 64x256 c2x1"}
CELLS = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("qwen3-235b-a22b", 4096)]
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
libs = {}
for path in sorted(glob.glob(os.path.join(os.environ.get("LIBS", "."), "libbf16g_v*.so"))):
    lib = ctypes.CDLL(path)
    lib.moe_bf16g_ws.restype = ctypes.c_size_t
    lib.moe_bf16g_run.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 6
    libs[int(re.search(r"_v(\d+)\.so", path).group(1))] = lib


def bench(fn):
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3


for name, T in CELLS:
    cfg = preset(name, quant="unquantized", device="cuda")
    E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router)
    m_sizes = torch.bincount(topk.ids.reshape(-1).long(), minlength=E).to(torch.int32)
    for gemm, (N, Kd) in (("GEMM1", (2 * inter, H)), ("GEMM2", (H, inter))):
        w = (torch.randn(E, N, Kd, device=dev, generator=g) / Kd ** 0.5).to(torch.bfloat16)
        rows = int(m_sizes.sum())
        start = torch.cumsum(m_sizes, 0, dtype=torch.int64) - m_sizes.long()
        a = torch.randn(rows, Kd, device=dev, generator=g).to(torch.bfloat16)
        d = torch.empty(rows, N, device=dev, dtype=torch.bfloat16)
        problems = torch.stack([m_sizes, torch.full_like(m_sizes, N), torch.full_like(m_sizes, Kd)], 1).contiguous()
        ex = torch.arange(E, device=dev, dtype=torch.int64)
        ptrs = torch.stack([a.data_ptr() + start * Kd * 2, w.data_ptr() + ex * N * Kd * 2,
                            d.data_ptr() + start * N * 2]).contiguous()
        ref_rows = slice(int(start[3]), int(start[3] + m_sizes[3]))
        want = a[ref_rows].float() @ w[3].float().T
        flops = 2.0 * rows * N * Kd
        print(f"{name} bf16 T={T} {gemm}: {E} experts, {rows} rows (mean {rows / E:.0f}), N={N}, K={Kd}", flush=True)
        for k, lib in sorted(libs.items()):
            ws = torch.empty(lib.moe_bf16g_ws(E), dtype=torch.uint8, device=dev)

            def run(lib=lib, ws=ws):
                rc = lib.moe_bf16g_run(E, problems.data_ptr(), ptrs[0].data_ptr(), ptrs[1].data_ptr(),
                                       ptrs[2].data_ptr(), ws.data_ptr(), torch.cuda.current_stream().cuda_stream)
                assert rc == 0, rc
            try:
                run()
                torch.cuda.synchronize()
                err = ((d[ref_rows].float() - want).norm() / want.norm()).item()
                us = bench(run)
                print(f"  {NAMES[k]:28s} {us:8.1f} us  {flops / us / 1e6:6.0f} TFLOP/s  rel.err {err:.1e}", flush=True)
            except Exception as exc:
                print(f"  {NAMES[k]:28s} failed: {type(exc).__name__} {str(exc)[:100]}", flush=True)
        # DeepGEMM: experts' rows start on multiples of 128
        counts, starts128, _, R = triton_ops.expert_rows(topk.ids, E, deepgemm_lib.ROW_ALIGN)
        a128 = torch.randn(R, Kd, device=dev, generator=g).to(torch.bfloat16)
        d128 = torch.empty(R, N, device=dev, dtype=torch.bfloat16)
        for v in range(len(deepgemm_lib.BF16_VARIANTS)):
            try:
                fn = lambda v=v: cutlass_ops.deepgemm_bf16_gemm(a128, None, w, None, d128, counts, starts128, v)  # noqa: E731
                fn()
                us = bench(fn)
                print(f"  deepgemm bf16 variant {v:<13d} {us:8.1f} us  {flops / us / 1e6:6.0f} TFLOP/s", flush=True)
            except Exception as exc:
                print(f"  deepgemm bf16 variant {v} failed: {type(exc).__name__} {str(exc)[:100]}", flush=True)
        del w, a, d, a128, d128
        torch.cuda.empty_cache()
