"""Where the time of the cutlass experts' FP8 pipeline goes, on one preset x T (torch.profiler).

    python3 benchmarks/cuda/profile_cutlass.py --preset qwen3-235b-a22b --tokens 16384 \
        [--config-dir D] [--grouped-gemm cutlass|deepgemm]

The backend's own choice at T (its tuned table, the shipped one or D's: which grouped GEMM and kernels, or
its Triton kernels); ``--grouped-gemm`` forces that grouped GEMM. Uniform routing (softmax over random
logits, as the bench's presets without a correction bias); prints the per-call pipeline time (CUDA
events, median of --iters) and the kernel table.
"""

from __future__ import annotations

import argparse
import statistics

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-235b-a22b")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--grouped-gemm", default="", choices=["", "cutlass", "deepgemm"],
                   help="force the grouped pipeline on this GEMM (default: the table's choice)")
    p.add_argument("--config-dir", default="", help="a directory of tuned tables (as the backend's config_dir)")
    args = p.parse_args()

    from moe_plugin_cuda.cutlass import experts as cutlass_experts

    from moe_core.config import preset
    from moe_core.quant import quantize_weights

    cfg = preset(args.preset, quant="fp8_block", device="cuda")
    E, K, H, inter, T = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, args.tokens
    w = {}
    for e0 in range(0, E, 16):  # quantize a few experts at a time (fp32 staging of all would not fit)
        part = quantize_weights(torch.randn(min(16, E - e0), 2 * inter, H, device="cuda") / H ** 0.5,
                                torch.randn(min(16, E - e0), H, inter, device="cuda") / inter ** 0.5, "fp8_block")
        for k, v in part.items():
            w.setdefault(k, []).append(v)
    w = {k: torch.cat(v) for k, v in w.items()}
    x = torch.randn(T, H, device="cuda").to(torch.bfloat16)
    topk_w, ids = torch.softmax(torch.randn(T, E, device="cuda"), -1).topk(K, -1)
    ids = ids.to(torch.int32)
    min_rows = 0 if args.grouped_gemm else None
    path, cfg1, variants = cutlass_experts.choose_path(T, E, K, inter, H, torch.cuda.get_device_name(),
                                                       args.config_dir or None, min_rows, args.grouped_gemm or None)
    runs = f"Triton {cfg1}" if path == "triton" else f"{path} kernels {variants}"
    print(f"{args.preset} fp8_block T={T}: runs {runs}", flush=True)

    def run():
        return cutlass_experts.run_fused(x, None, w["w13"], w["w2"], w["w13_scale"], w["w2_scale"], topk_w, ids,
                                         fp8_block=True, table_dtype="fp8_block", routed_scaling_factor=1.0,
                                         out_dtype=torch.bfloat16, min_rows=min_rows,
                                         config_dir=args.config_dir or None, grouped_gemm=args.grouped_gemm or None)

    for _ in range(3):
        run()
    times = []
    for _ in range(args.iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    print(f"{args.preset} fp8_block T={T} {path}: pipeline {statistics.median(times):.1f} us per call "
          f"(eager, median of {args.iters})", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            run()
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))


if __name__ == "__main__":
    main()
