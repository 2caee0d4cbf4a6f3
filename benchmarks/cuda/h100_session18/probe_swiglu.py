"""The SwiGLU epilogue on CUTLASS's bf16 GEMM1 (variants 13, 14) against the same kernels without it (9, 10)
plus the separate SiLU x up pass, on the bench's routing (seed 1000 + T, the preset's router).

Per cell: GEMM1 + activation alone (the part the epilogue replaces), then the whole grouped pipeline
(``cutlass_ops.fused_experts``: gather, GEMM1, activation, GEMM2, reduce) with GEMM2 on variant 10 and 9.
CUDA-graph replay, median of 100 ms.

    bash benchmarks/cuda/run_h100.sh $OUT install && python3 benchmarks/cuda/h100_session18/probe_swiglu.py
"""
from __future__ import annotations

from functools import partial

import torch
import triton
import triton.testing
from moe_plugin_cuda import cutlass_lib, cutlass_ops, triton_ops
from moe_plugin_cuda.weights import interleave_gate_up_

from moe_core.bench import floor_model
from moe_core.config import preset
from moe_core.router import route

CELLS = [(p, T) for p in ("qwen3-30b-a3b", "qwen3-235b-a22b", "mixtral-8x7b") for T in (1024, 4096, 16384)]  # (deepseek: its router needs a bias)
dev = torch.device("cuda")


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def main() -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; graph replay, median of 100 ms", flush=True)
    for name, T in CELLS:
        cfg = preset(name, quant="unquantized", device="cuda")
        E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
        rg = torch.Generator(device=dev).manual_seed(1000 + T)  # the bench's routing
        x = torch.randn((T, H), generator=rg, device=dev).to(torch.bfloat16)
        topk = route(torch.randn((T, E), generator=rg, device=dev), K, cfg.router, None)
        ids = topk.ids.contiguous()
        load = torch.bincount(ids[ids >= 0].flatten(), minlength=E)
        floor = floor_model(cfg, T, int((load > 0).sum()), 3.0e12, 732e12)["floor_s"] * 1e6
        w13 = interleave_gate_up_((torch.randn(E, 2 * inter, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16))
        w2 = (torch.randn(E, H, inter, device=dev, generator=g) / inter ** 0.5).to(torch.bfloat16)
        counts, start, row_of_slot, rows = triton_ops.expert_rows(ids, E, 1)
        a, _ = cutlass_ops.quantize_into_rows(x, None, ids, row_of_slot, E, rows=rows, quantize=False)
        used = start[-1:] + counts[-1:]
        d1 = torch.empty(rows, 2 * inter, dtype=torch.bfloat16, device=dev)
        h = torch.empty(rows, inter, dtype=torch.bfloat16, device=dev)

        def plain(v):
            cutlass_ops.cutlass_gemm(a, None, w13, None, d1, counts, start, variant=v)
            cutlass_ops.silu_mul(d1, torch.bfloat16, True, used)

        line = [f"{name} bf16 T={T} (floor {floor:.0f} us, bar {floor / 0.7:.0f}): GEMM1 + SiLU x up"]
        for v in (9, 10):
            line.append(f"v{v} + pass {bench(partial(plain, v)):.1f}")
        for v in cutlass_lib.variants_for("bf16", "swiglu"):
            line.append(f"v{v} fused {bench(partial(cutlass_ops.cutlass_gemm, a, None, w13, None, h, counts, start, variant=v)):.1f}")
        print("  ".join(line), flush=True)
        line = ["    pipeline"]
        for v in ((9, 10), (13, 10), (14, 10), (9, 9), (13, 9)):
            run = partial(cutlass_ops.fused_experts, x, None, w13, w2, None, None, topk.weights, ids,
                          routed_scaling_factor=1.0, out_dtype=torch.bfloat16, gemm=cutlass_ops.CUTLASS_BF16,
                          variants=v, w13_interleaved=True)
            us = bench(run)
            line.append(f"{v} {us:.1f} ({floor / us:.2f})")
        print("  ".join(line), flush=True)
        del w13, w2, a, d1, h
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
