"""Kernel times of the planner's DeepGEMM bf16 pipeline and of the Triton pipeline, per cell (torch.profiler),
to price a mixed pipeline: Triton GEMM1 (gather + SiLU fused) + DeepGEMM GEMM2."""
import collections, torch
from torch.profiler import profile, ProfilerActivity
from moe_core.bench import balanced_correction_bias
from moe_core.config import preset
from moe_core.router import route
from moe_plugin_cuda import cutlass_experts, triton_ops
from moe_plugin_cuda.weights import interleave_gate_up_

dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
devname = torch.cuda.get_device_name()
CELLS = [("qwen3-235b-a22b", (4096, 16384)), ("qwen3-30b-a3b", (4096, 16384)), ("deepseek-v3", (16384,)), ("mixtral-8x7b", (16384,))]
N = 5
for name, tokens in CELLS:
    cfg = preset(name, quant="unquantized", device="cuda")
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g, dtype=torch.bfloat16) / H ** 0.5)
    w2 = (torch.randn(E, H, I, device=dev, generator=g, dtype=torch.bfloat16) / I ** 0.5)
    interleave_gate_up_(w13)
    bias = balanced_correction_bias(E, g, dev) if cfg.router.use_correction_bias else None
    for T in tokens:
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router, bias)
        path, tcfg, _ = cutlass_experts.choose_path(T, E, K, I, H, devname, "", -1, "", "bf16")
        pipes = {"deepgemm": lambda: cutlass_experts.run_fused(x, None, w13, w2, None, None, topk.weights, topk.ids, 1.0,
                                                               torch.bfloat16, 0, "", "deepgemm"),
                 "triton": lambda: triton_ops.fused_experts(x, None, w13, w2, None, None, topk.weights, topk.ids,
                                                            activation="silu", routed_scaling_factor=1.0,
                                                            out_dtype=torch.bfloat16, cfg=tcfg, w13_interleaved=True)}
        for pname, fn in pipes.items():
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(N):
                    fn()
                torch.cuda.synchronize()
            agg = collections.defaultdict(float); cnt = collections.Counter()
            evs = sorted((ev for ev in prof.events() if ev.device_type.name == "CUDA"), key=lambda e: e.time_range.start)
            per_call = len(evs) // N
            for i, ev in enumerate(evs):  # kernels by their place in the call: GEMM1 and GEMM2 apart
                key = f"#{i % per_call} {ev.name[:50]}"
                agg[key] += ev.device_time / N
                cnt[key] += 1
            tot = sum(agg.values())
            print(f"{name} T={T} {pname} (planner path {path}): kernels {tot:.0f} us per call", flush=True)
            for k, v in sorted(agg.items(), key=lambda kv: -kv[1]):
                print(f"    {v:8.1f} us  x{cnt[k] // N}  {k}", flush=True)
    del w13, w2
    torch.cuda.empty_cache()
