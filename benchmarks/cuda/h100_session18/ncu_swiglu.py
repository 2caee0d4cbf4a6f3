"""One GEMM1 launch per CUTLASS bf16 variant (argv: variant numbers) on qwen3-30b-a3b bf16 T=4096's rows (the bench's
routing), for ncu to profile: why the SwiGLU epilogue variants run slower than the TMA-epilogue ones.

    ncu --kernel-name regex:device_kernel --section SpeedOfLight --section WarpStateStats ... \
        python3 benchmarks/cuda/h100_session18/ncu_swiglu.py 9 13
"""
import sys

import torch
from moe_plugin_cuda import cutlass_lib, cutlass_ops, triton_ops

from moe_core.config import preset
from moe_core.router import route

dev = torch.device("cuda")
cfg = preset("qwen3-30b-a3b", quant="unquantized", device="cuda")
E, K, H, inter, T = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size, 4096
rg = torch.Generator(device=dev).manual_seed(1000 + T)
x = torch.randn((T, H), generator=rg, device=dev).to(torch.bfloat16)
ids = route(torch.randn((T, E), generator=rg, device=dev), K, cfg.router, None).ids.contiguous()
w13 = (torch.randn(E, 2 * inter, H, device=dev) / H ** 0.5).to(torch.bfloat16)
counts, start, row_of_slot, rows = triton_ops.expert_rows(ids, E, 1)
a, _ = cutlass_ops.quantize_into_rows(x, None, ids, row_of_slot, E, rows=rows, quantize=False)
for v in map(int, sys.argv[1:]):
    cols = inter if cutlass_lib.VARIANTS[v][3] == "swiglu" else 2 * inter
    d = torch.empty(rows, cols, dtype=torch.bfloat16, device=dev)
    cutlass_ops.cutlass_gemm(a, None, w13, None, d, counts, start, variant=v)
torch.cuda.synchronize()
