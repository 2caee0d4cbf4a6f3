"""Probe: sgl-deep-gemm 0.2.5's SM90 FP8 "MegaMoE" (one persistent kernel: GEMM1, SwiGLU + FP8 quant, GEMM2,
top-k combine; dispatch over NVLink symmetric memory) on one H100, world size 1, against the planner's pick
(the cutlass backend) on the same FP8 block-128 weights and routing.

    python3 benchmarks/cuda/h100_session14/probe_mega_moe.py [preset:T ...]

Not part of the plugin: this only measures whether the fused kernel is worth integrating.
"""
import os
import statistics
import sys
import traceback

import torch
import torch.distributed as dist
import triton.testing

os.environ.setdefault("CUDA_HOME", "/usr/local/cuda")
CELLS = [("qwen3-30b-a3b", 4096), ("qwen3-30b-a3b", 16384), ("qwen3-235b-a22b", 4096), ("qwen3-235b-a22b", 16384),
         ("qwen3-30b-a3b", 1024), ("mixtral-8x7b", 4096), ("deepseek-v3", 4096)]
if len(sys.argv) > 1:
    CELLS = [(a.split(":")[0], int(a.split(":")[1])) for a in sys.argv[1:]]

dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29533", rank=0, world_size=1)
torch.cuda.set_device(0)
import deep_gemm  # noqa: E402

from moe_core.bench import floor_model  # noqa: E402
from moe_core.config import preset  # noqa: E402
from moe_core.quant import quantize_weights  # noqa: E402
from moe_core.router import route  # noqa: E402
from moe_plugin_cuda import cutlass_experts  # noqa: E402

print("deep_gemm from", deep_gemm.__file__, flush=True)
dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
for name, T in CELLS:
    try:
        cfg = preset(name, quant="fp8_block", device="cuda")
        E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
        w13 = torch.randn(E, 2 * inter, H, device=dev, generator=g) / H ** 0.5
        w2 = torch.randn(E, H, inter, device=dev, generator=g) / inter ** 0.5
        w = quantize_weights(w13, w2, "fp8_block")
        del w13, w2
        torch.cuda.empty_cache()
        w13, w2, s13, s2 = w["w13"], w["w2"], w["w13_scale"], w["w2_scale"]
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router)
        ids, tw = topk.ids.to(torch.int32).contiguous(), topk.weights.float().contiguous()

        ours = lambda: cutlass_experts.run_fused(x, None, w13, w2, s13, s2, tw, ids, 1.0, torch.bfloat16, -1, "", "")  # noqa: E731
        ref = ours().float()

        buf = deep_gemm.get_symm_buffer_for_sm90_mega_moe(dist.group.WORLD, E, T, K, H, inter)
        l1, l2 = deep_gemm.transform_weights_for_mega_moe_sm90((w13, s13), (w2, s2))
        y = torch.empty(T, H, dtype=torch.bfloat16, device=dev)

        def mega():
            deep_gemm.mega_moe_pre_dispatch_sm90(x, ids, tw, buf.x, buf.x_sf, buf.topk_idx, buf.topk_weights, T)
            deep_gemm.fp8_mega_moe(y, l1, l2, buf)
            return y

        out = mega().float()
        torch.cuda.synchronize()
        err = ((out - ref).norm() / ref.norm()).item()
        floor_us = floor_model(cfg, T, E, 3.0e12, 1288e12)["floor_s"] * 1e6
        times = {"ours (planner)": [], "mega": []}
        for _ in range(3):
            for k, fn in (("ours (planner)", ours), ("mega", mega)):
                torch.cuda.synchronize()
                times[k].append(triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median") * 1e3)
        try:
            graph_us = triton.testing.do_bench_cudagraph(mega, rep=200, return_mode="median") * 1e3
        except Exception as exc:  # capture may not be supported
            graph_us = f"graph capture failed: {type(exc).__name__}: {str(exc)[:120]}"
        print(f"{name} fp8_block T={T}: floor {floor_us:.0f} us; relative difference mega vs ours {err:.4f}", flush=True)
        for k, v in times.items():
            m = statistics.median(v)
            print(f"  {k:16s} {m:8.1f} us eager ({floor_us / m:.2f} of the floor)  rounds {[round(t) for t in v]}",
                  flush=True)
        print(f"  mega graph replay: {graph_us if isinstance(graph_us, str) else f'{graph_us:.1f} us'}", flush=True)
        buf.destroy()
        del buf, l1, l2, w13, w2, s13, s2, w, y
        torch.cuda.empty_cache()
    except Exception:
        print(f"{name} T={T}: FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
        torch.cuda.empty_cache()
dist.destroy_process_group()
