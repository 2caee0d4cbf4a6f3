"""qwen3-30b bf16 T=4096 read 844-847 us alone in six fresh processes and 906-942 after other cells of the
same process (full bench runs 2 and 3, and with T=1024 first). Same kernels, same routing: is it where the
caching allocator puts the pipeline's buffers? One process, one layer; before each timing a spacer of a
different size stays allocated, which moves the buffers the forward (and its CUDA graph pool) get.

    bash benchmarks/cuda/run_h100.sh $OUT install && python3 benchmarks/cuda/h100_session17/probe_alloc_offset.py
"""
from __future__ import annotations

import argparse
import statistics

import torch

from moe_core.bench import _fill_weights, _graph_time, _time
from moe_core.config import preset
from moe_core.contracts import TopK
from moe_core.layer import MoELayer
from moe_core.planner import plan
from moe_core.router import route

MB = 1 << 20


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--quant", default="unquantized")
    p.add_argument("--tokens", type=int, default=4096)
    args = p.parse_args()
    dev = torch.device("cuda", 0)
    cfg = preset(args.preset, quant=args.quant, device="cuda", experts="cutlass")
    layer = MoELayer(cfg, plan=plan(cfg), check_ids=False, device=dev)
    _fill_weights(layer, cfg, seed=0)
    T = args.tokens
    g = torch.Generator(device=dev).manual_seed(1000 + T)
    x = torch.randn((T, cfg.hidden_size), generator=g, device=dev).to(cfg.params_dtype)
    topk = route(torch.randn((T, cfg.num_experts), generator=g, device=dev), cfg.top_k, cfg.router, None)
    topk = TopK(topk.weights.contiguous(), topk.ids.contiguous())
    print(f"# {torch.cuda.get_device_name()}: {args.preset} {args.quant} T={T}, graph replay us per call "
          "(10 calls a graph, median), eager us; spacer = MB kept allocated before the timing", flush=True)
    for spacer_mb in (0, 1, 2, 3, 5, 8, 13, 21, 34, 55, 0, 1.5, 2.5, 130, 0):
        spacer = torch.empty(int(spacer_mb * MB), dtype=torch.uint8, device=dev)
        with torch.no_grad():
            graph = _graph_time(layer, x, topk, dev, 10)
            eager = statistics.median(_time(lambda: layer(x, topk), dev, 10, 3))
        print(f"spacer {spacer_mb:6.1f} MB: graph {graph * 1e6:7.1f} us, eager {eager * 1e6:7.1f} us", flush=True)
        del spacer
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
