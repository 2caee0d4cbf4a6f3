"""PERSISTENT (a few programs per SM walk the tiles in one flattened loop: a tile's epilogue overlaps the
next tile's first loads) vs the shipped Triton configs: whole pipelines, round-robin after a warm-up, and
the persistent output checked bit for bit against the per-tile launch (same tiles, same K order).

    git apply benchmarks/cuda/h100_session16/persistent_gemm.patch   # the PERSISTENT kernel option (not kept)
    python3 benchmarks/cuda/h100_session16/probe_persistent.py [preset ...]
"""
import statistics, sys, torch, triton, triton.testing
from functools import partial
from moe_core.bench import balanced_correction_bias
from moe_core.config import preset
from moe_core.quant import quantize_weights
from moe_core.router import route
from moe_plugin_cuda import cutlass_experts, triton_ops, tuning_configs
from moe_plugin_cuda.weights import interleave_gate_up_

dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
devname = torch.cuda.get_device_name()
ROUNDS, REP = 3, 150
CELLS = [("qwen3-30b-a3b", "unquantized", (1024, 4096, 16384)), ("qwen3-30b-a3b", "fp8_block", (1024, 4096)),
         ("qwen3-235b-a22b", "fp8_block", (64, 1024)), ("qwen3-235b-a22b", "unquantized", (1024, 4096)),
         ("mixtral-8x7b", "unquantized", (1024,)), ("deepseek-v3", "fp8_block", (1024,))]
if len(sys.argv) > 1:
    CELLS = [c for c in CELLS if c[0] in sys.argv[1:]]


def halves(c):
    return {k: {**v, "TAIL_TILES": 1} for k, v in c.items()}


def c_(bm, bn, bk, gm, w, s, **kw):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=gm, num_warps=w, num_stages=s, **kw)


for name, quant, tokens in CELLS:
    cfg = preset(name, quant=quant, device="cuda")
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    fp8 = quant == "fp8_block"
    dt = torch.float32 if fp8 else torch.bfloat16  # (deepseek in fp32 would not fit next to its copies)
    w13 = torch.randn(E, 2 * I, H, device=dev, generator=g, dtype=dt) / H ** 0.5
    w2 = torch.randn(E, H, I, device=dev, generator=g, dtype=dt) / I ** 0.5
    if fp8:
        w = quantize_weights(w13, w2, "fp8_block"); del w13, w2
        w13, w2, s13, s2 = w["w13"], w["w2"], w["w13_scale"], w["w2_scale"]
    else:
        w13, w2 = w13.to(torch.bfloat16), w2.to(torch.bfloat16); interleave_gate_up_(w13); s13 = s2 = None
    torch.cuda.empty_cache()
    bias = balanced_correction_bias(E, g, dev) if cfg.router.use_correction_bias else None
    for T in tokens:
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router, bias)
        path, tcfg, _ = cutlass_experts.choose_path(T, E, K, I, H, devname, "", -1, "", "fp8_block" if fp8 else "bf16")
        if fp8:
            tcfg = {k: tcfg[k] for k in ("gemm1", "gemm2")}
        cands = {"planner (" + path + ")": partial(cutlass_experts.run_fused, x, None, w13, w2, s13, s2, topk.weights,
                                                  topk.ids, 1.0, torch.bfloat16, -1, "", "")}
        tri = partial(triton_ops.fused_experts, x, None, w13, w2, s13, s2, topk.weights, topk.ids, activation="silu",
                      routed_scaling_factor=1.0, out_dtype=torch.bfloat16, w13_interleaved=not fp8)
        base = {k: {**v, "TAIL_TILES": 0} for k, v in tcfg.items()}
        variants = {"triton shipped": tcfg}
        if tcfg["gemm1"].get("TAIL_TILES", 0):
            variants["no half tiles"] = base

        def pers(n, which=("gemm1", "gemm2")):
            return {k: {**v, "PERSISTENT": n} if k in which else v for k, v in base.items()}
        variants.update({"PERSISTENT 1": pers(1), "PERSISTENT 2": pers(2), "PERSISTENT 1 gemm1": pers(1, ("gemm1",)),
                         "PERSISTENT 1 gemm2": pers(1, ("gemm2",))})
        for k, c in variants.items():
            cands[k] = partial(tri, cfg=c)
        try:
            same = torch.equal(tri(cfg=pers(1)), tri(cfg=base)) and torch.equal(tri(cfg=pers(2)), tri(cfg=base))
            print(f"  persistent output bit for bit the per-tile launch's: {same}", flush=True)
        except Exception as e:
            print("  persistent failed:", type(e).__name__, str(e)[:300], flush=True)
        runs, ref = {}, None
        for k, fn in cands.items():
            try:
                out = fn(); torch.cuda.synchronize()
            except Exception as e:
                print("  skip", k, type(e).__name__, str(e)[:160], flush=True); continue
            if ref is None:
                ref = out.float()
            err = ((out.float() - ref).norm() / ref.norm()).item()
            runs[k] = fn
            if err > 3e-2:
                print(f"  WRONG {k}: relative error {err:.3g} vs planner", flush=True)
        times = {k: [] for k in runs}
        triton.testing.do_bench(next(iter(runs.values())), warmup=300, rep=300)
        for r in range(ROUNDS):
            for k, fn in runs.items():
                torch.cuda.synchronize()
                times[k].append(triton.testing.do_bench_cudagraph(fn, rep=REP, return_mode="median") * 1e3)
        base = statistics.median(times[next(iter(runs))])
        print(f"{name} {quant} T={T} (planner path {path}; triton cfg {tcfg})", flush=True)
        for k, v in sorted(times.items(), key=lambda kv: statistics.median(kv[1])):
            m = statistics.median(v)
            print(f"  {k:32s} {m:8.1f} us  vs planner {m / base:.3f}  rounds {[round(t) for t in v]}", flush=True)
    del w13, w2, s13, s2
    torch.cuda.empty_cache()
