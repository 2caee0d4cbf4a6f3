"""qwen3-30b bf16: Triton GEMM1 / GEMM2 / reduce alone vs DeepGEMM bf16 GEMM2 on the same rows (sorted, 128-aligned)."""
import torch, triton, triton.testing
from functools import partial
from moe_core.config import preset
from moe_core.router import route
from moe_plugin_cuda import triton_ops, tuning_configs, cutlass_ops, deepgemm_lib
from moe_plugin_cuda.weights import interleave_gate_up_
from moe_plugin_cuda import triton_kernels as K_

dev = torch.device("cuda"); g = torch.Generator(device=dev).manual_seed(0)
def t(fn):
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3
for name in ["qwen3-30b-a3b"]:
    cfg = preset(name, quant="unquantized", device="cuda")
    E, K, H, I = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    w13 = (torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5).to(torch.bfloat16); interleave_gate_up_(w13)
    w2 = (torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5).to(torch.bfloat16)
    for T in (4096, 16384):
        x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
        topk = route(torch.randn((T, E), generator=g, device=dev), K, cfg.router, None)
        ids = topk.ids.contiguous()
        c, _ = tuning_configs.get_config(T, E, K, I, H, "bf16", torch.cuda.get_device_name(), None)
        bm = c["gemm1"]["BLOCK_M"]
        sorted_ids, expert_ids, post_pad, nb = triton_ops.align_block_size(ids, E, bm)
        kw = dict(align=(sorted_ids, expert_ids, post_pad), masked_m=None, num_rows=T * K, capacity=0, num_m_blocks=nb)
        g1 = partial(triton_ops.gemm1, x, None, w13, None, a_row_div=K, activation="silu", fp8=False,
                     w13_interleaved=True, out_dtype=torch.bfloat16, cfg1=c["gemm1"], **kw)
        h, _ = g1()
        y = torch.empty(T * K, H, dtype=torch.bfloat16, device=dev)
        wts = topk.weights.reshape(-1).contiguous()
        g2 = partial(triton_ops.gemm2, h, None, w2, None, y, wts, out_scale=1.0, fp8=False, cfg2=c["gemm2"], **kw)
        res = {"align": t(partial(triton_ops.align_block_size, ids, E, bm)), "tri gemm1": t(g1), "tri gemm2": t(g2)}
        counts, start, ros, rows = triton_ops.expert_rows(ids, E, 128)
        hs = torch.randn(rows, I, device=dev, generator=g).to(torch.bfloat16)
        ys = torch.empty(rows, H, dtype=torch.bfloat16, device=dev)
        for v in range(len(deepgemm_lib.BF16_VARIANTS)):
            if deepgemm_lib.runnable(v, H, deepgemm_lib.BF16_VARIANTS):
                res[f"dg gemm2 v{v}"] = t(partial(cutlass_ops.deepgemm_bf16_gemm, hs, None, w2, None, ys, counts, start, variant=v))
        xs = torch.randn(rows, H, device=dev, generator=g).to(torch.bfloat16)
        d1 = torch.empty(rows, 2 * I, dtype=torch.bfloat16, device=dev)
        for v in range(len(deepgemm_lib.BF16_VARIANTS)):
            if deepgemm_lib.runnable(v, 2 * I, deepgemm_lib.BF16_VARIANTS):
                res[f"dg gemm1 v{v}"] = t(partial(cutlass_ops.deepgemm_bf16_gemm, xs, None, w13, None, d1, counts, start, variant=v))
        out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
        res["reduce"] = t(lambda: K_._moe_reduce_kernel[(T, triton.cdiv(H, 1024))](y, ids, out, H, 1.0, E, ros, wts, K=K, BLOCK_H=1024, MAPPED=False))
        print(name, T, "rows", rows, {k: round(v, 1) for k, v in res.items()}, flush=True)
