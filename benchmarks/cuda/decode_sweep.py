"""The triton decode kernels on the GPU (issue 31; docs/decisions.md, "A decode path: two GEMV launches, no
alignment"): which launch configs, and from which T the decode path stops winning.

    python benchmarks/cuda/decode_sweep.py [--presets ...] [--quant ...] [--tokens 1 4 16] [--json FILE]
        [--warm-only]

Per preset x quant x T (the preset's weights as the triton experts keep them, random routing as ``decode.py``
makes it): each decode kernel alone per candidate config (GRAPH_CALLS launches in one CUDA graph, replayed; us a
launch, median), then the triton layer with the decode path (``decode_max_tokens``, the fastest configs as
``decode_config``) against the same layer without it (``decode_max_tokens=0``, the pipeline): graph, eager (L2
flushed) and host time, as ``decode.py`` measures them, and the heuristic's configs (``tuning_configs.decode_config``)
in the layer. ``--warm-only``: compile every candidate once (parallel processes fill Triton's cache).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Any, Optional

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from decode import eager_times, floor_us, graph_time  # noqa: E402
from host_time import PRESETS, build_layer, host_times, make_inputs, warm_up  # noqa: E402

from moe_core.config import preset  # noqa: E402
from moe_core.contracts import QuantScheme  # noqa: E402

GATE_UP = [dict(BLOCK_I=bi, num_warps=w, num_stages=s) for bi in (8, 16, 32, 64) for w, s in ((4, 1), (4, 3), (8, 3))]
DOWN = [dict(BLOCK_H=bh, num_warps=w, num_stages=s) for bh in (8, 16, 32, 64) for w, s in ((4, 1), (4, 3), (8, 3))]


def kernel_args(layer, cfg, T: int):
    from moe_plugin_cuda.weights import expert_weights

    x, topk, touched = make_inputs(cfg, layer, T)
    fp8 = cfg.quant is QuantScheme.FP8_BLOCK
    w = expert_weights(layer, fp8)
    h = torch.empty(T * cfg.top_k, cfg.intermediate_size, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    return x, topk, touched, w, h, out, fp8


def sweep_cell(name: str, q: str, T: int, layer, cfg, reps: int, warm_only: bool) -> dict[str, Any]:
    from moe_plugin_cuda.triton import decode

    x, topk, touched, w, h, out, fp8 = kernel_args(layer, cfg, T)
    experts = layer.experts
    interleaved = getattr(experts.decision, "w13_interleaved", True)
    bk = 128 if fp8 else 256
    dev = x.device
    results: dict[str, Any] = {"preset": name, "quant": q, "T": T, "floor_us": round(floor_us(cfg, T, touched), 2)}
    best = {}
    for part, cands in (("decode", GATE_UP), ("down", DOWN)):
        timed = []
        for c in cands:
            c = {**c, **({"BLOCK_K": bk} if part == "decode" else {"BLOCK_I": bk})}
            if part == "decode":
                def call(c=c):
                    decode.gate_up(x, None, w.w13, w.w13_scale, topk.ids, h, fp8_block=fp8, activation="silu",
                                   w13_interleaved=interleaved, cfg=c)
            else:
                def call(c=c):
                    decode.down(h, w.w2, w.w2_scale, topk.ids, topk.weights, out, fp8_block=fp8,
                                routed_scaling_factor=1.0, cfg=c)
            try:
                call()
                torch.cuda.synchronize(dev)
                if warm_only:
                    continue
                timed.append((graph_time(call, dev, reps) * 1e6, c))
            except Exception as exc:  # a config that does not compile or run: report it, keep the others
                print(f"  {name} {q} T={T} {part} {c}: FAILED {type(exc).__name__}: {str(exc)[:200]}",
                      file=sys.stderr)
        if timed:
            timed.sort(key=lambda r: r[0])
            best[part] = timed[0][1]
            results[part] = [[round(t, 2), c] for t, c in timed[:4]]
            print(f"  {name:16s} {q:11s} T={T:<3d} {part:6s} best {timed[0][0]:.1f} us {timed[0][1]} "
                  f"(worst {timed[-1][0]:.1f})", file=sys.stderr, flush=True)
    if warm_only or len(best) < 2:
        return results
    # the layer: decode with the best configs, with the heuristic's, and the pipeline
    variants = {"decode_best": {"decode_max_tokens": T, "decode_config": best},
                "decode_heuristic": {"decode_max_tokens": T, "decode_config": None},
                "pipeline": {"decode_max_tokens": 0, "decode_config": None}}
    for label, opts in variants.items():
        experts.decode_max_tokens = opts["decode_max_tokens"]
        experts.decode_config = opts["decode_config"]
        experts._fused_configs.clear()

        def fwd():
            return layer(x, topk)

        with torch.no_grad():
            warm_up(fwd, dev)
            g = graph_time(fwd, dev, reps) * 1e6
            e = statistics.median(eager_times(fwd, dev, reps)) * 1e6
            hst = statistics.median(host_times(fwd, dev, reps)) * 1e6
        results[label] = {"graph_us": round(g, 2), "eager_us": round(e, 2), "host_us": round(hst, 2)}
        print(f"  {name:16s} {q:11s} T={T:<3d} layer {label:16s} graph {g:.1f} eager {e:.1f} host {hst:.1f} "
              f"floor {results['floor_us']} frac {results['floor_us'] / g:.2f}", file=sys.stderr, flush=True)
    results["best_config"] = best
    return results


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", nargs="+", default=list(PRESETS))
    p.add_argument("--quant", nargs="+", default=["unquantized", "fp8_block"])
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16])
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--json", default=None)
    p.add_argument("--warm-only", action="store_true")
    args = p.parse_args(argv)
    dev = torch.device("cuda", torch.cuda.current_device())
    rows = []
    for name in args.presets:
        for q in args.quant:
            cfg = preset(name, quant=q, device="cuda", experts="triton")
            layer = build_layer(cfg, dev)
            for T in args.tokens:
                try:
                    rows.append(sweep_cell(name, q, T, layer, cfg, args.reps, args.warm_only))
                except Exception as exc:
                    print(f"  {name} {q} T={T}: FAILED {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
            layer = None
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
