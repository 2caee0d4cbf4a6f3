"""Where does MoELayer time go beyond the Triton pipeline? (one cell, default qwen3-30b-a3b fp8_block T=4096)

    python benchmarks/cuda/layer_vs_kernels.py --config-dir CONFIGS [--preset P --quant Q --tokens T]

Times, on the same inputs and weights: MoELayer(x, topk) with a sync per call (as ``moe-core bench`` does),
the same back to back, and the per-kernel device times of the layer call (torch.profiler).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from moe_core.bench import _fill_weights, _time
from moe_core.config import preset
from moe_core.layer import MoELayer
from moe_core.router import route


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="qwen3-30b-a3b")
    p.add_argument("--quant", default="fp8_block")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--config-dir", default=None)
    a = p.parse_args()
    dev = torch.device("cuda")
    opts = {"triton": {"config_dir": a.config_dir}} if a.config_dir else {}
    cfg = preset(a.preset, quant=a.quant, device="cuda", experts="triton", backend_options=opts)
    layer = MoELayer(cfg, device=torch.device('cuda', torch.cuda.current_device()))
    _fill_weights(layer, cfg, seed=0)
    print(layer.plan.explain().splitlines()[:6], flush=True)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn((a.tokens, cfg.hidden_size), generator=g, device=dev).to(cfg.params_dtype)
    topk = route(torch.randn((a.tokens, cfg.num_experts), generator=g, device=dev), cfg.top_k, cfg.router,
                 layer.correction_bias)
    for check in (True, False):
        layer.check_ids = check
        synced = statistics.median(_time(lambda: layer(x, topk), dev, 10, 3))
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            layer(x, topk)
        e.record()
        torch.cuda.synchronize()
        print(f"check_ids={check}: synced per call {synced * 1e6:.1f} us, back to back "
              f"{s.elapsed_time(e) / 10 * 1e3:.1f} us", flush=True)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            layer(x, topk)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=20), flush=True)


if __name__ == "__main__":
    main()
