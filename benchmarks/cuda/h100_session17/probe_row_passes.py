"""The row-wise passes around the grouped GEMMs (SiLU x up, with and without FP8 requantization, and the FP8
group quantizer) with ROWS rows a program (``triton_ops.ROW_PASS_ELEMS`` elements) against one row a program
(ROW_PASS_ELEMS = 1: the kernels as they were up to session 16), on the shapes of the cells they run in.
Outputs must be equal bit for bit; times are graph replays (median), GB/s counts bytes read and written.
Ran at commit fed2a77, whose row-pass kernels (ROWS rows a program) were reverted after this measurement: no
gain worth them (2-6% on some shapes, 9% slower on others; the passes already ran at 2.0-3.0 TB/s).

    bash benchmarks/cuda/run_h100.sh $OUT install && python3 benchmarks/cuda/h100_session17/probe_row_passes.py
"""
from __future__ import annotations

import torch
import triton.testing

from moe_plugin_cuda import cutlass_ops, triton_ops

dev = torch.device("cuda")
ELEMS = (1, 2048, 4096, 8192, 16384)


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3


def sweep(label, fn, nbytes):
    outs, times = {}, {}
    for e in ELEMS:
        triton_ops.ROW_PASS_ELEMS = e
        outs[e] = fn()
        times[e] = bench(fn)
    base = outs[1]
    for e in ELEMS[1:]:
        for a, b in zip(base if isinstance(base, tuple) else (base,), outs[e] if isinstance(outs[e], tuple)
                        else (outs[e],), strict=True):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), (label, e)
    cells = "  ".join(f"{e}: {t:7.1f} us {nbytes / t / 1e3:5.0f} GB/s" for e, t in times.items())
    print(f"{label:58s} {cells}", flush=True)


def main():
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; "
          "elements a program: time, bandwidth (1 = one row a program, as before)", flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    # (cell, rows allocated, rows used, I, d1 dtype): d1 is GEMM1's output [rows, 2I]
    silu_cases = [("qwen3-30b T=16384 fp8 (deepgemm path)", 131072 + 128 * 127, 131072 + 128 * 64, 768, torch.bfloat16),
                  ("qwen3-30b T=4096 fp8 (cutlass, fp32 D)", 32768, 32768, 768, torch.float32),
                  ("qwen3-30b T=4096 fp8 (cutlass, bf16 D)", 32768, 32768, 768, torch.bfloat16),
                  ("qwen3-235b T=4096 fp8 (deepgemm path)", 32768 + 128 * 127, 32768 + 128 * 64, 1536, torch.bfloat16),
                  ("deepseek-v3 T=4096 fp8 (deepgemm path)", 32768 + 256 * 127, 32768 + 256 * 64, 2048,
                   torch.bfloat16)]
    for name, rows, used_rows, inter, dtype in silu_cases:
        d1 = torch.randn(rows, 2 * inter, device=dev, generator=g).to(dtype)
        used = torch.tensor([used_rows], dtype=torch.int32, device=dev)
        nbytes = used_rows * (2 * inter * d1.element_size() + inter + 4 * -(-inter // 128))
        sweep(f"silu_mul_quant {name}", lambda d1=d1, used=used, n=used_rows, mn="deepgemm" in name: tuple(
            t[:n] for t in cutlass_ops.silu_mul_quant(d1, mn_major=mn, rows_used=used)), nbytes)
        del d1
    for name, rows, used_rows, inter in [("qwen3-235b T=4096 bf16 (cutlass path)", 32768, 32768, 1536),
                                         ("deepseek-v3 T=4096 bf16 (cutlass path)", 32768, 32768, 2048),
                                         ("mixtral T=4096 bf16 (cutlass path)", 8192, 8192, 14336),
                                         ("qwen3-30b T=16384 bf16 (if cutlass)", 131072, 131072, 768)]:
        d1 = torch.randn(rows, 2 * inter, device=dev, generator=g).to(torch.bfloat16)
        used = torch.tensor([used_rows], dtype=torch.int32, device=dev)
        sweep(f"silu_mul interleaved {name}", lambda d1=d1, used=used, n=used_rows: cutlass_ops.silu_mul(
            d1, torch.bfloat16, True, used)[:n], used_rows * inter * 6)
        del d1
    for name, rows, width, dtype in [("h of qwen3-30b T=4096 fp8 (triton path, fp32 h)", 32768, 768, torch.float32),
                                     ("x of deepseek-v3 T=4096", 4096, 7168, torch.bfloat16),
                                     ("x of qwen3-30b T=16384", 16384, 2048, torch.bfloat16),
                                     ("x of qwen3-235b T=4096", 4096, 4096, torch.bfloat16)]:
        x = torch.randn(rows, width, device=dev, generator=g).to(dtype)
        sweep(f"quantize_fp8_groups {name}", lambda x=x: triton_ops.quantize_fp8_groups(x),
              rows * width * (x.element_size() + 1) + rows * 4 * -(-width // 128))


if __name__ == "__main__":
    main()
