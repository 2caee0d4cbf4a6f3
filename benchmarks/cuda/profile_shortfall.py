"""Where the time goes in the cells that miss the floor bar: the planner's pick (the cutlass backend's
path for T: its Triton kernels or a grouped GEMM pipeline), kernel times per call from torch.profiler.

    python3 benchmarks/cuda/profile_shortfall.py [--cell "qwen3-30b-a3b unquantized 4096" ...]

Per cell: the pipeline time (graph replay, median), the floor (``moe_core.bench.floor_model``, every expert
touched), GEMM1 and GEMM2 kernel time (the two GEMM launches of each call, in launch order), "GEMMs alone"
(the floor over the GEMMs' time: what the layer would reach if everything else were free), the kernels
around them, and each GEMM against its own two limits: its weight bytes at 3.0 TB/s and its FLOPs at the
floor's peak. Uniform routing (softmax over random logits), as the bench on these presets.
"""

from __future__ import annotations

import argparse
import collections
from functools import partial

import torch

CELLS = ["qwen3-30b-a3b unquantized 4096", "qwen3-30b-a3b unquantized 16384", "qwen3-30b-a3b fp8_block 4096",
         "qwen3-30b-a3b fp8_block 16384", "qwen3-235b-a22b unquantized 4096", "qwen3-235b-a22b fp8_block 4096"]
GEMM_NAMES = ("_moe_gemm_kernel", "cutlass", "deep_gemm", "sm90_", "Gemm")
BW, PEAK = 3.0e12, {"unquantized": 732e12, "fp8_block": 1288e12}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cell", action="append", help="'preset quant T' (repeatable; default: the six short cells)")
    p.add_argument("--calls", type=int, default=5)
    args = p.parse_args()

    import triton.testing
    from moe_plugin_cuda.cutlass import experts as cutlass_experts
    from moe_plugin_cuda.weights import interleave_gate_up_

    from moe_core.bench import floor_model
    from moe_core.config import preset
    from moe_core.quant import quantize_weights
    from moe_core.router import route

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    devname = torch.cuda.get_device_name()
    loaded = None
    for cell in args.cell or CELLS:
        name, quant, T = cell.split()
        T = int(T)
        cfg = preset(name, quant=quant, device="cuda")
        E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
        fp8 = quant == "fp8_block"
        if loaded != (name, quant):
            loaded = None
            w13 = w2 = s13 = s2 = None
            torch.cuda.empty_cache()
            w13 = torch.randn(E, 2 * inter, H, device=dev, generator=g) / H ** 0.5
            w2 = torch.randn(E, H, inter, device=dev, generator=g) / inter ** 0.5
            if fp8:  # the cutlass backend keeps FP8 w13 in the checkpoint layout
                w = quantize_weights(w13, w2, "fp8_block")
                w13, w2, s13, s2 = w["w13"], w["w2"], w["w13_scale"], w["w2_scale"]
            else:  # bf16: gate/up interleaved, as the backends keep it
                w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16)
                interleave_gate_up_(w13)
                s13 = s2 = None
            torch.cuda.empty_cache()
            loaded = (name, quant)
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router)
        table_dtype = "fp8_block" if fp8 else "bf16"
        path = cutlass_experts.choose_path(T, E, K, inter, H, devname, None, None, None, table_dtype)[0]
        fn = partial(cutlass_experts.run_fused, x, None, w13, w2, s13, s2, topk.weights, topk.ids, fp8_block=fp8,
                     table_dtype=table_dtype, routed_scaling_factor=1.0, out_dtype=torch.bfloat16, min_rows=None,
                     config_dir=None, grouped_gemm=None)
        fn()
        torch.cuda.synchronize()
        us = triton.testing.do_bench_cudagraph(fn, rep=300, return_mode="median") * 1e3
        touched = int(torch.unique(topk.ids[topk.ids >= 0]).numel())
        floor_us = floor_model(cfg, T, touched, BW, PEAK[quant])["floor_s"] * 1e6

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
        kernels = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                         key=lambda e: e.time_range.start)
        per_name: dict[str, float] = collections.defaultdict(float)
        gemm = [0.0, 0.0]
        n_gemm = 0
        for e in kernels:
            t = e.time_range.elapsed_us() / args.calls
            if any(s in e.name for s in GEMM_NAMES):
                gemm[n_gemm % 2] += t
                n_gemm += 1
            else:
                per_name[e.name[:60]] += t
        assert n_gemm == 2 * args.calls, f"expected 2 GEMM launches per call, saw {n_gemm} in {args.calls} calls"
        wb = 1 if fp8 else 2
        limits = [(E * 2 * inter * H * wb / BW * 1e6, 2.0 * T * K * H * 2 * inter / PEAK[quant] * 1e6),
                  (E * H * inter * wb / BW * 1e6, 2.0 * T * K * inter * H / PEAK[quant] * 1e6)]
        rest = sum(per_name.values())
        print(f"{name} {quant} T={T} (path {path}): {us:.0f} us per call (graph replay), floor {floor_us:.0f} us "
              f"-> {floor_us / us:.2f} of the floor; kernels {sum(gemm) + rest:.0f} us per call (eager, "
              f"{args.calls} calls)")
        for i, (t, (mem, math)) in enumerate(zip(gemm, limits, strict=True)):
            print(f"  GEMM{i + 1} {t:8.1f} us   weights at 3.0 TB/s {mem:6.1f} us, FLOPs at peak {math:6.1f} us "
                  f"(max {max(mem, math):.0f}, sum {mem + math:.0f})")
        print(f"  GEMMs alone: {floor_us / sum(gemm):.2f} of the floor")
        for k, t in sorted(per_name.items(), key=lambda kv: -kv[1])[:6]:
            print(f"  {t:8.1f} us  {k}")
        print(flush=True)


if __name__ == "__main__":
    main()
