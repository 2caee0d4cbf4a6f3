"""``moe-cuda-tune``: search Triton launch configs for model presets on this GPU and save them.

For each preset x quant x T it times the whole Triton pipeline (align + GEMM1 + GEMM2 + reduce)
with ``triton.testing.do_bench`` (median) over a small candidate list per BLOCK_M: first GEMM1's
candidates with a fixed GEMM2, then GEMM2's with the best GEMM1. The table is written as
``E=..,N=..,H=..,device_name=..,dtype=...json`` (see ``tuning_configs``) into ``--out-dir``
(default: the installed package's ``configs/``), where the backend finds it.

    moe-cuda-tune --presets qwen3-30b-a3b --quant unquantized fp8_block --out-dir ./configs
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Optional

import torch

DEFAULT_TOKENS = (1, 16, 64, 256, 1024, 4096, 16384)


def _c(bm, bn, bk, w, s, g):
    return dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=g, num_warps=w, num_stages=s)


def candidates(bm: int, fp8: bool) -> tuple[list[dict], list[dict]]:
    big = bm >= 64
    g = 16 if big else 1
    if fp8:
        if big:
            g1 = [(64, 128, 4, 4), (128, 128, 4, 3), (128, 128, 8, 3), (64, 128, 8, 4), (64, 64, 4, 4)]
            g2 = [(128, 128, 8, 3), (128, 128, 4, 4), (256, 128, 8, 3), (64, 128, 4, 4), (128, 64, 8, 4)]
        else:
            g1 = [(64, 128, 4, 4), (128, 128, 4, 3), (64, 128, 4, 3), (32, 128, 4, 4)]
            g2 = [(64, 128, 4, 4), (128, 128, 4, 3), (32, 128, 4, 4), (128, 128, 4, 4)]
    else:
        if big:
            g1 = [(64, 64, 4, 4), (64, 64, 8, 4), (128, 64, 8, 3), (64, 128, 8, 3), (128, 32, 8, 4)]
            g2 = [(128, 64, 8, 4), (256, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 4), (128, 64, 4, 4)]
        else:
            g1 = [(64, 64, 4, 4), (64, 128, 4, 3), (32, 128, 4, 4), (128, 64, 4, 4), (128, 128, 8, 3)]
            g2 = [(64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 4), (32, 128, 4, 4), (128, 128, 8, 3)]
    return ([_c(bm, bn, bk, w, s, g) for bn, bk, w, s in g1], [_c(bm, bn, bk, w, s, g) for bn, bk, w, s in g2])


def block_ms(M: int, E: int, K: int) -> list[int]:
    r = M * K / E
    if r <= 8:
        return [16]
    if r <= 24:
        return [16, 32]
    if r <= 64:
        return [32, 64]
    return [64, 128]


def tune_preset(name: str, quant: str, tokens, out_dir: Path, rep_ms: int, log) -> Path:
    import triton.testing

    from moe_core import quant as q
    from moe_core.config import preset
    from moe_core.router import route
    from moe_plugin_cuda import triton_ops, tuning_configs
    from moe_plugin_cuda.triton_experts import config_dtype

    cfg = preset(name, quant=quant, device="cuda")
    E, K, H, inter = cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    fp8 = quant == "fp8_block"
    w13 = torch.empty((E, 2 * inter, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
    w2 = torch.empty((E, H, inter), dtype=w13.dtype, device=dev)
    s13 = s2 = None
    if fp8:
        s13 = torch.empty((E, math.ceil(2 * inter / 128), math.ceil(H / 128)), device=dev)
        s2 = torch.empty((E, math.ceil(H / 128), math.ceil(inter / 128)), device=dev)
    step = max(1, (1 << 28) // (3 * H * inter))
    for e0 in range(0, E, step):
        a = torch.randn((min(step, E - e0), 2 * inter, H), generator=g, device=dev) / math.sqrt(H)
        b = torch.randn((min(step, E - e0), H, inter), generator=g, device=dev) / math.sqrt(inter)
        if fp8:
            t = q.quantize_weights(a, b, "fp8_block")
            w13[e0:e0 + step], w2[e0:e0 + step] = t["w13"], t["w2"]
            s13[e0:e0 + step], s2[e0:e0 + step] = t["w13_scale"], t["w2_scale"]
        else:
            w13[e0:e0 + step], w2[e0:e0 + step] = a, b
    bias = torch.randn(E, generator=g, device=dev) if cfg.router.use_correction_bias else None
    table: dict[int, dict] = {}
    path = out_dir / tuning_configs.config_file_name(E, inter, H, torch.cuda.get_device_name(),
                                                     config_dtype(cfg.quant, torch.bfloat16))
    for M in tokens:
        x = torch.randn((M, H), generator=g, device=dev).to(torch.bfloat16)
        topk = route(torch.randn((M, E), generator=g, device=dev), K, cfg.router, bias)

        def run(c):
            return lambda: triton_ops.fused_experts(
                x, None, w13, w2, s13, s2, topk.weights, topk.ids, activation="silu",
                routed_scaling_factor=1.0, out_dtype=torch.bfloat16, cfg=c)

        def timed(c):
            try:
                return triton.testing.do_bench(run(c), warmup=5, rep=rep_ms, return_mode="median")
            except Exception as exc:  # e.g. out of shared memory for this tile shape
                log(f"    skip {c}: {type(exc).__name__}: {str(exc)[:80]}")
                return float("inf")

        best = (float("inf"), None)
        t0 = time.time()
        for bm in block_ms(M, E, K):
            c1s, c2s = candidates(bm, fp8)
            ms1 = [(timed({"gemm1": c1, "gemm2": c2s[0]}), i) for i, c1 in enumerate(c1s)]
            c1 = c1s[min(ms1)[1]]
            ms2 = [(timed({"gemm1": c1, "gemm2": c2}), i) for i, c2 in enumerate(c2s)]
            t, i = min(ms2)
            if t < best[0]:
                best = (t, {"gemm1": c1, "gemm2": c2s[i]})
        heur = tuning_configs.heuristic(M, E, K, inter, H, fp8)
        t_heur = timed(heur)
        if t_heur <= best[0]:
            best = (t_heur, heur)
        table[M] = best[1]
        log(f"  {name} {quant} T={M}: {best[0] * 1e3:.1f} us (heuristic {t_heur * 1e3:.1f} us) "
            f"{best[1]['gemm1']} / {best[1]['gemm2']}  [{time.time() - t0:.0f}s]")
        tuning_configs.save_table(path, table)  # after every T: a cut-off run keeps what it found
    return path


def main(argv: Optional[list[str]] = None) -> int:
    from moe_core.config import PRESETS
    from moe_plugin_cuda import tuning_configs

    p = argparse.ArgumentParser(prog="moe-cuda-tune", description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b", "qwen3-235b-a22b", "deepseek-v3"],
                   choices=sorted(PRESETS))
    p.add_argument("--quant", nargs="+", default=["unquantized", "fp8_block"], choices=["unquantized", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=list(DEFAULT_TOKENS))
    p.add_argument("--out-dir", default=str(tuning_configs.CONFIG_DIR))
    p.add_argument("--rep-ms", type=int, default=40, help="do_bench repetition time per candidate")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("moe-cuda-tune needs a CUDA GPU", file=sys.stderr)
        return 1

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    log(f"tuning on {torch.cuda.get_device_name()}")
    for name in args.presets:
        for quant in args.quant:
            path = tune_preset(name, quant, args.tokens, Path(args.out_dir), args.rep_ms, log)
            log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
