"""qwen3-30b bf16 T=4096: the shipped Triton config vs alternatives, whole pipelines, round-robin after warm-up."""
import statistics, torch, triton, triton.testing
from functools import partial
from moe_core.config import preset
from moe_core.router import route
from moe_plugin_cuda import triton_ops, tuning_configs
from moe_plugin_cuda.weights import interleave_gate_up_

dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
cfg = preset("qwen3-30b-a3b", quant="unquantized", device="cuda")
E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16); interleave_gate_up_(w13)
w2 = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
T = 4096
x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router, None)
base, src = tuning_configs.get_config(T, E, K, I, H, "bf16", torch.cuda.get_device_name(), None)
print("shipped", src, base)
def c(bm, bn, bk, gm, w, s):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=w, num_stages=s, TWO_ACC=0, B_TMA=1)
cands = {"shipped": base,
         "g2 BN128": {"gemm1": base["gemm1"], "gemm2": c(128, 128, 64, 16, 8, 4)},
         "g1 BN128": {"gemm1": c(128, 128, 64, 16, 8, 4), "gemm2": base["gemm2"]},
         "GM32": {"gemm1": {**base["gemm1"], "GROUP_M": 32}, "gemm2": {**base["gemm2"], "GROUP_M": 32}},
         "GM8": {"gemm1": {**base["gemm1"], "GROUP_M": 8}, "gemm2": {**base["gemm2"], "GROUP_M": 8}},
         "stages 3/4": {"gemm1": {**base["gemm1"], "num_stages": 3}, "gemm2": {**base["gemm2"], "num_stages": 4}},
         "BM64 BN256 w8": {"gemm1": c(64, 256, 64, 16, 8, 4), "gemm2": c(64, 256, 64, 16, 8, 3)},
         "BM64 BN256 w4": {"gemm1": c(64, 256, 64, 16, 4, 4), "gemm2": c(64, 256, 64, 16, 4, 4)},
         "BM64 BN128 w4": {"gemm1": c(64, 128, 64, 16, 4, 4), "gemm2": c(64, 128, 64, 16, 4, 4)},
         "BK128 s2/s2": {"gemm1": {**base["gemm1"], "BLOCK_K": 128, "num_stages": 2}, "gemm2": {**base["gemm2"], "BLOCK_K": 128, "num_stages": 2}}}
runs = {}
for k, cf in cands.items():
    fn = partial(triton_ops.fused_experts, x, None, w13, w2, None, None, topk.weights, topk.ids, activation="silu",
                 cfg=cf, w13_interleaved=True, routed_scaling_factor=1.0, out_dtype=torch.bfloat16)
    try:
        ref = fn(); torch.cuda.synchronize(); runs[k] = fn
    except Exception as e:
        print("skip", k, type(e).__name__, str(e)[:120])
times = {k: [] for k in runs}
triton.testing.do_bench(runs["shipped"], warmup=500, rep=500)
for r in range(5):
    for k, fn in runs.items():
        torch.cuda.synchronize()
        times[k].append(triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3)
med0 = statistics.median(times["shipped"])
for k, v in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
    print(f"{k:16s} median {statistics.median(v):7.1f} us  ratio {statistics.median(v)/med0:.3f}  rounds {[round(t) for t in v]}", flush=True)
