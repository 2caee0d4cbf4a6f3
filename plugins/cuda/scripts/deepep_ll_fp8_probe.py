"""What DeepEP's low-latency FP8 dispatch really returns, byte for byte (``torchrun --nproc-per-node 2``).

Prints, on rank 0, for each flag set (``round_scale`` / ``use_ue8m0``): dtypes, shapes and strides of
the FP8 rows and their scales, and, for every received row (matched to its source token through
DeepEP's ``src_info`` and ``layout_range``), how many e4m3 bytes and scales differ from

- ``moe_core``: ``moe_core.quant.quantize_fp8_per_token_group`` (``scale = amax/448``, ``q = x / scale``);
- ``deepep``: DeepEP's kernel recipe as transcribed in the emulation
  (``deep_ep_emulation.buffer.quantize_fp8_ll``: ``scale_inv = amax * fl(1/448)``, ``q = x * (448/amax)``).

It also runs the ``deepep`` dispatcher on the same tokens and checks that its dequantized rows equal
DeepEP's own (through the column-major scale views). Needs ``deep_ep`` and 2 GPUs.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests" / "emulation"))


def main() -> int:
    import deep_ep
    from deep_ep_emulation.buffer import pack_ue8m0, quantize_fp8_ll

    from moe_core.quant import quantize_fp8_per_token_group

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", device_id=dev)
    e, k, h, num_max = 256, 8, 7168, 128
    counts = [128, 125]
    gen = torch.Generator().manual_seed(1234)
    xs = [torch.randn(t, h, generator=gen).to(torch.bfloat16) for t in counts]
    ids = [torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)]) for t in counts]
    ids[1][3, 2] = -1
    x, idx = xs[rank].to(dev), ids[rank].to(dev)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_max, h, world, e)
    buf = deep_ep.Buffer(dist.group.WORLD, 0, hint, low_latency_mode=True, num_qps_per_rank=e // world)
    el = e // world
    say = print if rank == 0 else (lambda *a, **kw: None)
    say(f"deep_ep {getattr(deep_ep, '__version__', '?')} from {deep_ep.__file__}")
    for round_scale, ue8m0 in ((False, False), (True, False), (True, True)):
        (q, s), count, handle, _, _ = buf.low_latency_dispatch(x, idx, num_max, e, use_fp8=True,
                                                               round_scale=round_scale, use_ue8m0=ue8m0)
        torch.cuda.synchronize()
        say(f"\n== round_scale={round_scale} use_ue8m0={ue8m0}")
        say(f"rows   {q.dtype} shape {tuple(q.shape)} stride {q.stride()}")
        say(f"scales {s.dtype} shape {tuple(s.shape)} stride {s.stride()} contiguous={s.is_contiguous()}")
        src_info, layout_range = handle[0].cpu(), handle[1].cpu()
        qc, sc, cnt = q.cpu(), s.cpu(), count.cpu()
        stats = {"rows": 0, "bytes_vs_moe_core": 0, "bytes_vs_deepep_recipe": 0,
                 "scales_vs_moe_core": 0, "scales_vs_deepep_recipe": 0, "bytes": 0, "max_rel_dequant_vs_bf16": 0.0}
        order = []
        for le in range(el):
            for src in range(world):
                lr = int(layout_range[le, src])
                begin, n = lr >> 32, lr & 0xFFFFFFFF
                order.append((le, src, begin, n))
                if not n:
                    continue
                toks = src_info[le, begin:begin + n].long()
                xsrc = xs[src][toks]
                mq, ms = quantize_fp8_per_token_group(xsrc, ue8m0=round_scale)
                dq, ds = quantize_fp8_ll(xsrc, round_scale)
                got_q, got_s = qc[le, begin:begin + n], sc[le, begin:begin + n]
                if ue8m0:
                    ms, ds = pack_ue8m0(ms), pack_ue8m0(ds)
                stats["rows"] += n
                stats["bytes"] += got_q.numel()
                stats["bytes_vs_moe_core"] += int((got_q.view(torch.uint8) != mq.view(torch.uint8)).sum())
                stats["bytes_vs_deepep_recipe"] += int((got_q.view(torch.uint8) != dq.view(torch.uint8)).sum())
                stats["scales_vs_moe_core"] += int((got_s != ms).sum())
                stats["scales_vs_deepep_recipe"] += int((got_s != ds).sum())
                if not ue8m0:
                    deq = (got_q.float().view(n, -1, 128) * got_s.unsqueeze(-1)).view(n, h)
                    rel = ((deq - xsrc.float()).abs() / xsrc.float().abs().clamp(min=1e-3)).max()
                    stats["max_rel_dequant_vs_bf16"] = max(stats["max_rel_dequant_vs_bf16"], float(rel))
        valid = sum(n for *_, n in order)
        say(f"received {valid} rows; recv_count sum {int(cnt.sum())}; first blocks (expert, src, begin, n): "
            f"{order[:6]}")
        say("stats:", stats)
        every = [torch.zeros(len(stats), dtype=torch.float64, device=dev) for _ in range(world)]
        dist.all_gather(every, torch.tensor([float(v) for v in stats.values()], dtype=torch.float64, device=dev))
        say("stats on every rank:", [dict(zip(stats, t.tolist(), strict=True)) for t in every])
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
