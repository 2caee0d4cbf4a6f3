"""A/B in one run: the cutlass experts' bf16 DeepGEMM pipeline with GEMM1's SiLU x up in the epilogue
(our gated copy of DeepGEMM's kernel) vs GEMM1 writing [R, 2I] and a separate SiLU x up pass.

    python3 benchmarks/cuda/gated_epilogue_ab.py [--presets P ...] [--tokens T ...] [--config-dir D]

Same kernels (the table's DeepGEMM variants at T, or the defaults), same routing, bf16 weights
interleaved as the backend keeps them; timed alternately (A, B, A, B, ...) from CUDA-graph replays
after a warm-up, median per call, so that clock/power drift hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--presets", nargs="+", default=["qwen3-235b-a22b", "deepseek-v3", "mixtral-8x7b"])
    p.add_argument("--tokens", nargs="+", type=int, default=[4096, 16384])
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--config-dir", default="")
    args = p.parse_args()

    import triton.testing
    from moe_plugin_cuda import cutlass_experts, cutlass_ops, triton_ops
    from moe_plugin_cuda.weights import interleave_gate_up_

    from moe_core.bench import balanced_correction_bias
    from moe_core.config import preset
    from moe_core.router import route

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"{torch.cuda.get_device_name()}: gated GEMM1 epilogue vs GEMM1 + SiLU x up pass (us per call)")
    for name in args.presets:
        w13 = w2 = None  # (the previous preset's weights go before the next ones are allocated)
        torch.cuda.empty_cache()
        cfg = preset(name, quant="unquantized", device="cuda")
        E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
        w13 = torch.empty((E, 2 * inter, H), dtype=torch.bfloat16, device=dev)
        w2 = torch.empty((E, H, inter), dtype=torch.bfloat16, device=dev)
        for e0 in range(0, E, 16):
            n = min(16, E - e0)
            w13[e0:e0 + n] = torch.randn((n, 2 * inter, H), generator=g, device=dev) / H ** 0.5
            w2[e0:e0 + n] = torch.randn((n, H, inter), generator=g, device=dev) / inter ** 0.5
        interleave_gate_up_(w13)
        for T in args.tokens:
            x = torch.randn((T, H), generator=g, device=dev).to(torch.bfloat16)
            bias = balanced_correction_bias(E, g, dev) if cfg.router.use_correction_bias else None
            topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router, bias)
            path, _, variants = cutlass_experts.choose_path(T, E, K, inter, H, torch.cuda.get_device_name(),
                                                            args.config_dir, 0, "deepgemm", "bf16")
            if path != "deepgemm":
                print(f"  {name} T={T}: no DeepGEMM path ({path})")
                continue
            layer = partial(cutlass_ops.fused_experts, x, None, w13, w2, None, None, topk.weights, topk.ids,
                            routed_scaling_factor=1.0, out_dtype=torch.bfloat16, variants=variants,
                            w13_interleaved=True)
            runs = {"gated": partial(layer, gemm=cutlass_ops.DEEPGEMM_BF16),
                    "separate": partial(layer, gemm=cutlass_ops.DEEPGEMM_BF16._replace(gated=None))}
            a, b = runs["gated"](), runs["separate"]()
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            times = {k: [] for k in runs}
            torch.cuda.synchronize()
            triton.testing.do_bench(runs["gated"], warmup=200, rep=200)  # warm the GPU to its sustained clock
            for _ in range(args.rounds):
                for k, fn in runs.items():
                    torch.cuda.synchronize()
                    times[k].append(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3)
            # GEMM1 alone, gated vs writing [R, 2I] (+ the SiLU x up pass): where the difference is
            counts, start, row_of_slot, rows = triton_ops.expert_rows(topk.ids, E, 128)
            a, _ = cutlass_ops.quantize_into_rows(x, None, topk.ids, row_of_slot, E, rows=rows, quantize=False)
            h = torch.empty((rows, inter), dtype=torch.bfloat16, device=dev)
            d1 = torch.empty((rows, 2 * inter), dtype=torch.bfloat16, device=dev)
            parts = {"gemm1 gated": partial(cutlass_ops.deepgemm_bf16_gemm, a, None, w13, None, h, counts, start,
                                            variant=variants[0], gated=True),
                     "gemm1 [R, 2I]": partial(cutlass_ops.deepgemm_bf16_gemm, a, None, w13, None, d1, counts, start,
                                              variant=variants[0]),
                     "silu x up pass": partial(cutlass_ops.silu_mul, d1, torch.bfloat16, True)}
            for k, fn in parts.items():
                torch.cuda.synchronize()
                times[k] = [triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3]
            tg, ts = statistics.median(times["gated"]), statistics.median(times["separate"])
            print(f"  {name:16s} T={T:5d} kernels {variants}: gated {tg:8.1f}  separate {ts:8.1f}  "
                  f"ratio {tg / ts:.3f}  (outputs differ by {err:.1e}; rounds {times})", flush=True)


if __name__ == "__main__":
    main()
