"""How far can the best GEMM kernels we have take the six cells that miss the floor bar?

Per cell (the bench's routing: seed 1000 + T, the preset's router), each MoE GEMM timed alone on the
routing's rows, with every kernel available on this machine:
  bf16: the CUTLASS 4.2 ptr-array grouped kernels of the plugin's library (packed rows), DeepGEMM's SM90
        bf16 grouped GEMM (rows 128-aligned), ``torch._grouped_mm`` (packed rows), the shipped table's
        Triton GEMMs (GEMM1 gathers its rows and applies SiLU x up itself: more work than the others);
  FP8 block 128x128: the CUTLASS block-scaled kernels, DeepGEMM's FP8 grouped GEMM, the Triton GEMMs,
        and ``torch._scaled_grouped_mm`` with row-wise scales (a cheaper scheme than the block one:
        no per-128 K promotion; shown as a bound, it is not this scheme);
  and as a tensor-core ceiling for the shape, cuBLAS on one dense GEMM of the same rows, N and K with
  one expert's weight (``torch.mm`` / ``torch._scaled_mm`` row-wise): a grouped GEMM does no better.
Then the best GEMM1 + best GEMM2 ("GEMMs alone": gather, activation, quantization and reduction free),
with the reduction kernel and the alignment added ("+ reduce"), each as a fraction of the floor, next to
the time the bar allows (floor / 0.7 bf16, / 0.6 FP8).

    bash benchmarks/cuda/run_h100.sh $OUT install && python3 benchmarks/cuda/h100_session17/probe_gemm_bound.py
"""
from __future__ import annotations

import json
import sys
from functools import partial
from pathlib import Path

import torch
import triton
import triton.testing
from moe_plugin_cuda import cutlass_lib, cutlass_ops, deepgemm_lib, triton_ops, tuning_configs
from moe_plugin_cuda import triton_kernels as K_
from moe_plugin_cuda.weights import interleave_gate_up_

from moe_core.bench import floor_model
from moe_core.config import preset
from moe_core.quant import quantize_weights
from moe_core.router import route

CELLS = [("qwen3-30b-a3b", "unquantized", 4096), ("qwen3-30b-a3b", "unquantized", 16384),
         ("qwen3-235b-a22b", "unquantized", 4096), ("qwen3-30b-a3b", "fp8_block", 4096),
         ("qwen3-30b-a3b", "fp8_block", 16384), ("qwen3-235b-a22b", "fp8_block", 4096)]
PEAK = {"unquantized": 732e12, "fp8_block": 1288e12}
BAR = {"unquantized": 0.7, "fp8_block": 0.6}
FP8 = torch.float8_e4m3fn
CONFIGS = Path(triton_ops.__file__).parent / "configs"
dev = torch.device("cuda")


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def table_entry(E, K, inter, H, quant, T):
    name = (f"E={E},N={inter},H={H},device_name={torch.cuda.get_device_name().replace(' ', '_')},"
            f"dtype={'bf16' if quant == 'unquantized' else 'fp8_block'},kernel=cutlass-v1.json")
    table = json.loads((CONFIGS / name).read_text())
    entry = table[min(table, key=lambda k: abs(int(k) - T))]
    if "gemm1" not in entry:  # bf16: the cutlass backend's Triton kernels run the triton backend's table
        entry, _ = tuning_configs.get_config(T, E, K, inter, H, "bf16", torch.cuda.get_device_name())
    return entry


def rows_layout(ids, E, align):
    counts, start, row_of_slot, rows = triton_ops.expert_rows(ids, E, align)
    return counts, start, row_of_slot, rows


def time_gemm(results, label, fn, flops):
    try:
        us = bench(fn)
    except Exception as exc:  # a kernel that cannot run this shape: say so, go on
        print(f"    {label:34s} failed: {type(exc).__name__}: {str(exc).splitlines()[0][:120]}", flush=True)
        return
    results[label] = us
    print(f"    {label:34s} {us:9.1f} us  {flops / us / 1e6:6.0f} TFLOP/s", flush=True)


def one_gemm(quant, E, N, Kd, ids, T, K, g):
    """Every kernel on one of the two GEMMs (N columns, Kd deep) of this routing; ``{label: us}``."""
    fp8 = quant == "fp8_block"
    res = {}
    counts, start, _, rows = rows_layout(ids, E, 1)
    c128, s128, _, rows128 = rows_layout(ids, E, 128)
    used = T * K
    flops = 2.0 * used * N * Kd
    w = torch.randn(E, N, Kd, device=dev, generator=g) / Kd ** 0.5
    if fp8:
        q = quantize_weights(w, w[:, :1], "fp8_block")  # (w2: a placeholder, only w13's codes are used)
        wq, ws = q["w13"], q["w13_scale"]
        del w
        a, a_s = triton_ops.quantize_fp8_groups(torch.randn(rows, Kd, device=dev, generator=g).to(torch.bfloat16))
        for v in cutlass_lib.variants_for("fp8", "bf16") + cutlass_lib.variants_for("fp8", "fp32"):
            d = torch.empty(rows, N, device=dev, dtype=torch.float32 if cutlass_lib.VARIANTS[v][3] == "fp32"
                            else torch.bfloat16)
            name = " ".join(cutlass_lib.VARIANTS[v][1:])
            time_gemm(res, f"cutlass {name}", partial(cutlass_ops.cutlass_gemm, a, a_s, wq, ws, d, counts, start,
                                                      variant=v), flops)
        a128, a128_s = triton_ops.quantize_fp8_groups(
            torch.randn(rows128, Kd, device=dev, generator=g).to(torch.bfloat16))
        a128_s = a128_s.t().contiguous().t()  # DeepGEMM: MN-major scales
        d128 = torch.empty(rows128, N, device=dev, dtype=torch.bfloat16)
        for v, spec in enumerate(deepgemm_lib.FP8_VARIANTS):
            if deepgemm_lib.runnable(v, N, deepgemm_lib.FP8_VARIANTS):
                time_gemm(res, f"deepgemm fp8 {spec}", partial(cutlass_ops.deepgemm_gemm, a128, a128_s, wq, ws, d128,
                                                               c128, s128, variant=v), flops)
        # row-wise scales (a cheaper scheme): PyTorch's grouped FP8 GEMM and cuBLAS dense
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        sa = torch.rand(rows, device=dev, generator=g) + 0.5
        sb = torch.rand(E, N, device=dev, generator=g) + 0.5
        time_gemm(res, "torch._scaled_grouped_mm (rowwise)",
                  lambda: torch._scaled_grouped_mm(a, wq.transpose(-2, -1), sa, sb, offs=offs,
                                                   out_dtype=torch.bfloat16), flops)
        dense_b = wq[0].t()
        time_gemm(res, "ceiling: cuBLAS dense fp8 rowwise",
                  lambda: torch._scaled_mm(a[:used], dense_b, sa[:used, None], sb[0][None, :],
                                           out_dtype=torch.bfloat16), flops)
    else:
        wb = w.to(torch.bfloat16)
        del w
        a = torch.randn(rows, Kd, device=dev, generator=g).to(torch.bfloat16)
        d = torch.empty(rows, N, device=dev, dtype=torch.bfloat16)
        for v in cutlass_lib.variants_for("bf16", "bf16"):
            name = " ".join(cutlass_lib.VARIANTS[v][1:3])
            time_gemm(res, f"cutlass {name}", partial(cutlass_ops.cutlass_gemm, a, None, wb, None, d, counts, start,
                                                      variant=v), flops)
        a128 = torch.randn(rows128, Kd, device=dev, generator=g).to(torch.bfloat16)
        d128 = torch.empty(rows128, N, device=dev, dtype=torch.bfloat16)
        for v, spec in enumerate(deepgemm_lib.BF16_VARIANTS):
            if deepgemm_lib.runnable(v, N, deepgemm_lib.BF16_VARIANTS):
                time_gemm(res, f"deepgemm bf16 {spec}", partial(cutlass_ops.deepgemm_bf16_gemm, a128, None, wb, None,
                                                                d128, c128, s128, variant=v), flops)
        offs = torch.cumsum(counts, 0, dtype=torch.int32)
        time_gemm(res, "torch._grouped_mm", lambda: torch._grouped_mm(a, wb.transpose(-2, -1), offs=offs), flops)
        dense_b = wb[0].t()
        time_gemm(res, "ceiling: cuBLAS dense bf16", lambda: torch.mm(a[:used], dense_b), flops)
    return res


def triton_gemms(quant, E, K, H, inter, ids, T, g):
    """The shipped cutlass-v1 table's Triton GEMMs for this T (GEMM1 with its gather and SiLU x up)."""
    fp8 = quant == "fp8_block"
    cfg = table_entry(E, K, inter, H, quant, T)
    c1, c2 = {**cfg["gemm1"], "A_TMA": 0}, cfg["gemm2"]
    align = triton_ops.align_block_size(ids, E, c1["BLOCK_M"], bool(c1.get("TAIL_TILES", 0)))
    w13 = torch.randn(E, 2 * inter, H, device=dev, generator=g) / H ** 0.5
    w2 = torch.randn(E, H, inter, device=dev, generator=g) / inter ** 0.5
    x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
    if fp8:
        q = quantize_weights(w13, w2, "fp8_block")
        w13, w2, s13, s2 = q["w13"], q["w2"], q["w13_scale"], q["w2_scale"]
        x, xs = triton_ops.quantize_fp8_groups(x)
    else:
        w13, w2, s13, s2, xs = w13.to(torch.bfloat16), w2.to(torch.bfloat16), None, None, None
        interleave_gate_up_(w13)
    kw = dict(align=align, masked_m=None, num_rows=T * K, capacity=0, num_m_blocks=align.max_blocks)
    g1 = partial(triton_ops.gemm1, x, xs, w13, s13, a_row_div=K, activation="silu", fp8=fp8,
                 w13_interleaved=not fp8, out_dtype=torch.bfloat16, cfg1=c1, row_order=bool(c2.get("A_TMA", 0)), **kw)
    h, hs = g1()
    y = torch.empty(T * K, H, dtype=torch.bfloat16, device=dev)
    wts = torch.rand(T * K, device=dev, generator=g)
    g2 = partial(triton_ops.gemm2, h, hs, w2, s2, y, wts, out_scale=1.0, fp8=fp8, cfg2=c2, **kw)
    out = torch.empty(T, H, dtype=torch.bfloat16, device=dev)
    ids32 = ids.to(torch.int32).contiguous()
    block_h = min(1024, triton.next_power_of_2(H))
    reduce = partial(K_._moe_reduce_kernel[(T, triton.cdiv(H, block_h))], y, ids32, out, H, 1.0, E, ids32, ids32,
                     K=K, BLOCK_H=block_h, MAPPED=False)
    return {"gemm1": bench(g1), "gemm2": bench(g2), "reduce": bench(reduce),
            "align": bench(partial(triton_ops.align_block_size, ids, E, c1["BLOCK_M"],
                                   bool(c1.get("TAIL_TILES", 0))))}


def main() -> None:
    g = torch.Generator(device=dev).manual_seed(0)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "GEMM kernels alone, graph replay, median of 100 ms", flush=True)
    summary = []
    for name, quant, T in CELLS:
        cfg = preset(name, quant=quant, device="cuda")
        E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
        rg = torch.Generator(device=dev).manual_seed(1000 + T)  # the bench's routing
        torch.randn((T, H), generator=rg, device=dev)
        topk = route(torch.randn((T, E), generator=rg, device=dev), K, cfg.router, None)
        ids = topk.ids.contiguous()
        load = torch.bincount(ids[ids >= 0].flatten(), minlength=E)
        floor = floor_model(cfg, T, int((load > 0).sum()), 3.0e12, PEAK[quant])["floor_s"] * 1e6
        print(f"{name} {quant} T={T}: floor {floor:.0f} us, bar {floor / BAR[quant]:.0f} us "
              f"(rows per expert {load.float().mean():.0f} mean, {int(load.max())} max)", flush=True)
        tri = triton_gemms(quant, E, K, H, inter, ids, T, g)
        print(f"    triton (shipped table): GEMM1 {tri['gemm1']:.1f} us (with gather, SiLU x up), GEMM2 "
              f"{tri['gemm2']:.1f} us, reduce {tri['reduce']:.1f} us, align {tri['align']:.1f} us", flush=True)
        best = {}
        for gemm, (N, Kd) in (("GEMM1", (2 * inter, H)), ("GEMM2", (H, inter))):
            print(f"  {gemm}: N={N}, K={Kd}", flush=True)
            res = one_gemm(quant, E, N, Kd, ids, T, K, g)
            res[f"triton {gemm.lower()} (shipped)"] = tri[gemm.lower()]
            grouped = {k: v for k, v in res.items() if not k.startswith("ceiling") and "rowwise" not in k}
            best[gemm] = min(grouped.items(), key=lambda kv: kv[1])
            best[gemm + " ceiling"] = min(((k, v) for k, v in res.items() if k.startswith("ceiling")),
                                          key=lambda kv: kv[1], default=(None, float("nan")))
            torch.cuda.empty_cache()
        gemms = best["GEMM1"][1] + best["GEMM2"][1]
        ceiling = best["GEMM1 ceiling"][1] + best["GEMM2 ceiling"][1]
        plus = gemms + tri["reduce"] + tri["align"]
        row = {"cell": f"{name} {quant} T={T}", "floor_us": floor, "bar_us": floor / BAR[quant],
               "best_gemm1": best["GEMM1"], "best_gemm2": best["GEMM2"], "gemms_us": gemms,
               "gemms_frac": floor / gemms, "plus_reduce_us": plus, "plus_reduce_frac": floor / plus,
               "dense_ceiling_us": ceiling, "dense_ceiling_frac": floor / ceiling}
        summary.append(row)
        print(f"  => best GEMM1 {best['GEMM1'][0]} {best['GEMM1'][1]:.0f} + GEMM2 {best['GEMM2'][0]} "
              f"{best['GEMM2'][1]:.0f} = {gemms:.0f} us ({floor / gemms:.2f} of floor); + reduce + align "
              f"{plus:.0f} us ({floor / plus:.2f}); dense cuBLAS ceiling {ceiling:.0f} us "
              f"({floor / ceiling:.2f}); bar {BAR[quant]}", flush=True)
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
