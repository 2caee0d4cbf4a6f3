"""Profile one cell of the Triton experts pipeline (default: qwen3-30b-a3b fp8_block T=4096).

Prints the launch config used (tuned file or heuristic), per-kernel device times (torch.profiler),
and registers / spills of every compiled ``_moe_gemm_kernel`` variant (from Triton's kernel cache).
Run it under ``ncu`` for SM / memory throughput (run_h100.sh does):

    python benchmarks/cuda/profile_triton.py --preset qwen3-30b-a3b --quant fp8_block --tokens 4096 \
        --config-dir CONFIGS [--no-torch-profiler]
"""

from __future__ import annotations

import argparse

import torch


def compiled_gemm_variants():
    """(constexprs, n_regs, n_spills) of each compiled GEMM kernel; best effort across Triton versions."""
    from moe_plugin_cuda.triton import kernels as K

    out = []
    for caches in getattr(K._moe_gemm_kernel, "device_caches", {}).values():
        kernels = caches[0] if isinstance(caches, tuple) else caches
        for kern in kernels.values():
            try:
                kern._init_handles()
            except Exception:
                pass
            consts = getattr(getattr(kern, "src", None), "constants", None)
            keep = ("GATE", "FP8", "QUANT_OUT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
            if isinstance(consts, dict):
                consts = {str(k[-1] if isinstance(k, tuple) else k): v for k, v in consts.items()}
                consts = {k: consts[k] for k in keep if k in consts}
            meta = getattr(kern, "metadata", None)
            out.append((consts, getattr(meta, "num_warps", None), getattr(meta, "num_stages", None),
                        getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--quant", default="fp8_block", choices=["unquantized", "fp8_block"])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--config-dir", default=None)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--no-torch-profiler", action="store_true")
    args = p.parse_args()

    from moe_plugin_cuda.triton import ops as triton_ops
    from moe_plugin_cuda.triton import tuning_configs
    from moe_plugin_cuda.tune import _make_weights

    from moe_core.bench import balanced_correction_bias
    from moe_core.config import preset
    from moe_core.router import route

    cfg = preset(args.preset, quant=args.quant, device="cuda")
    E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fp8 = args.quant == "fp8_block"
    w13, w2, s13, s2 = _make_weights(E, H, inter, fp8, g, dev, interleave=True)
    M = args.tokens
    x = torch.randn((M, H), generator=g, device=dev).to(torch.bfloat16)
    bias = balanced_correction_bias(E, g, dev) if cfg.router.use_correction_bias else None
    topk = route(torch.randn((M, E), generator=g, device=dev), K, cfg.router, bias)
    launch, source = tuning_configs.get_config(M, E, K, inter, H, tuning_configs.table_dtype(cfg.quant, torch.bfloat16),
                                               torch.cuda.get_device_name(), args.config_dir)
    print(f"{args.preset} {args.quant} T={M}: config from {source}: {launch}", flush=True)

    def run():
        return triton_ops.fused_experts(x, None, w13, w2, s13, s2, topk.weights, topk.ids, fp8_block=fp8,
                                        activation="silu",
                                        routed_scaling_factor=1.0, out_dtype=torch.bfloat16, cfg=launch,
                                        w13_interleaved=True)

    for _ in range(2):  # compile + warm up
        run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(args.iters):
        run()
    end.record()
    torch.cuda.synchronize()
    print(f"pipeline: {start.elapsed_time(end) / args.iters * 1e3:.1f} us per call", flush=True)
    if not args.no_torch_profiler:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                run()
            torch.cuda.synchronize()
        try:
            table = prof.key_averages().table(sort_by="device_time_total", row_limit=12)
        except Exception:  # older torch names it cuda_time_total
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)
        print(table, flush=True)
    for consts, warps, stages, regs, spills in compiled_gemm_variants():
        print(f"_moe_gemm_kernel {consts} warps={warps} stages={stages}: {regs} registers/thread, {spills} spills",
              flush=True)


if __name__ == "__main__":
    main()
