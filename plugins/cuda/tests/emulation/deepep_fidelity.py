"""What moe-core relies on from DeepEP v1.2.1's ``deep_ep.Buffer``, as cases that run unchanged on the
emulation (gloo, CPU) and on the real library (NCCL, 2 GPUs): ``test_deepep_fidelity.py`` runs both.

``run_fidelity(rank, world, device)`` checks, on whatever ``deep_ep`` is imported:

- low-latency dispatch, BF16 and FP8 (plain, ``round_scale``, ``round_scale + use_ue8m0``), with and
  without the receive hook: rows ``[E_l, R*num_max, H]`` contiguous; scales fp32
  ``[E_l, C, H/128]`` or int32 ``[E_l, C, H/512]`` with column-major strides ``(G*C, 1, C)``;
  ``recv_count`` = the pairs routed to each expert; ``layout_range`` blocks ``(begin << 32 | n)`` per
  source rank tiling ``[0, count)``; ``src_info`` naming each row's source token; every row's bytes
  and scales equal to ``deep_ep_emulation.buffer.quantize_fp8_ll`` (DeepEP's in-kernel recipe) bit for
  bit; UE8M0 bytes = the exponent byte of the fp32 scale, 4 per int, low byte first;
- result tensors are fresh per call (a held result survives later calls);
- ``Buffer.low_latency_dispatch`` is v1.2.1's wrapper of ``Buffer.runtime``'s, which the plugin's hot path calls
  (the FP8 cases without ``round_scale`` and the UE8M0 case call the runtime, as the plugin does);
- normal dispatch: FP8 payload and scales pass through unchanged, rows grouped by source rank.

Receive order is free: the returned ``order_sorted`` says whether every block arrived in source
token order (the emulation shuffles, so code that relies on order fails in CI).
Run directly with ``torchrun --nproc-per-node 2 plugins/cuda/tests/emulation/deepep_fidelity.py``.
"""

from __future__ import annotations

import os
import pathlib
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from deep_ep_emulation.buffer import pack_ue8m0, quantize_fp8_ll  # noqa: E402
from moe_plugin_cuda.deepep import wraps_runtime_dispatch  # noqa: E402

E, K, H, NUM_MAX = 16, 4, 7168, 16


def _data(world: int):
    gen = torch.Generator().manual_seed(20261125)
    counts = [NUM_MAX - 3 - 2 * r for r in range(world)]
    xs = [torch.randn(t, H, generator=gen).to(torch.bfloat16) for t in counts]
    ids = []
    for t in counts:
        i = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(t)])
        i[0, 1] = -1  # a -1 slot
        ids.append(i)
    return xs, ids


def run_fidelity(rank: int, world: int, device: torch.device) -> dict:
    import deep_ep

    g = dist.group.WORLD
    el, cap = E // world, world * NUM_MAX
    xs, ids = _data(world)
    x, idx = xs[rank].to(device), ids[rank].to(device)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(NUM_MAX, H, world, E)
    cfg = deep_ep.Buffer.get_dispatch_config(world)
    nvl = max(cfg.get_nvl_buffer_size_hint(H * 2, world),
              deep_ep.Buffer.get_combine_config(world).get_nvl_buffer_size_hint(H * 2, world))
    buf = deep_ep.Buffer(g, nvl, hint, low_latency_mode=True, num_qps_per_rank=el)
    checked, sorted_blocks, blocks = [], 0, 0
    held = []
    for use_fp8, round_scale, ue8m0, hook in ((False, False, False, False), (True, False, False, False),
                                              (True, True, False, True), (True, True, True, False)):
        name = "bf16" if not use_fp8 else "fp8" + ("-round" if round_scale else "") + ("-ue8m0" if ue8m0 else "")
        if use_fp8 and not round_scale or ue8m0:  # the C++ runtime's call, as moe-core's hot path makes it
            data, scales, count, src_info, layout, _, recv_hook = buf.runtime.low_latency_dispatch(
                x, idx, None, None, NUM_MAX, E, use_fp8, round_scale, ue8m0, False, False)
            recv, handle = (data, scales) if use_fp8 else data, (src_info, layout)
        else:  # the public wrapper
            recv, count, handle, _, recv_hook = buf.low_latency_dispatch(
                x, idx, NUM_MAX, E, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=ue8m0, return_recv_hook=hook)
        if hook:
            recv_hook()
        if device.type == "cuda":
            torch.cuda.synchronize()
        data, scales = recv if use_fp8 else (recv, None)
        held.append(data)
        assert data.dtype == (torch.float8_e4m3fn if use_fp8 else torch.bfloat16), name
        assert tuple(data.shape) == (el, cap, H) and data.is_contiguous(), (name, data.shape, data.stride())
        if use_fp8:
            groups = H // 512 if ue8m0 else H // 128
            assert scales.dtype == (torch.int32 if ue8m0 else torch.float32), (name, scales.dtype)
            assert tuple(scales.shape) == (el, cap, groups), (name, scales.shape)
            assert scales.stride() == (groups * cap, 1, cap), (name, scales.stride())
        data_c, count_c = data.cpu(), count.cpu()
        scales_c = scales.cpu() if use_fp8 else None
        src_info, layout = handle[0].cpu(), handle[1].cpu()
        assert count.dtype == torch.int32 and tuple(count.shape) == (el,)
        for j in range(el):
            ge = rank * el + j
            want = sorted((s, t) for s in range(world) for t in range(xs[s].shape[0]) if bool((ids[s][t] == ge).any()))
            assert int(count_c[j]) == len(want), (name, j, int(count_c[j]), len(want))
            got, spans = [], []
            for s in range(world):
                begin, n = int(layout[j, s]) >> 32, int(layout[j, s]) & 0xFFFFFFFF
                spans.append((begin, n))
                toks = src_info[j, begin:begin + n].long()
                got += [(s, int(t)) for t in toks]
                if n:
                    blocks += 1
                    sorted_blocks += int(bool((toks[1:] >= toks[:-1]).all()))
                    src = xs[s][toks]
                    rows = data_c[j, begin:begin + n]
                    if not use_fp8:
                        assert torch.equal(rows.view(torch.int16), src.view(torch.int16)), (name, j, s)
                        continue
                    q, sinv = quantize_fp8_ll(src, round_scale)
                    assert torch.equal(rows.view(torch.uint8), q.view(torch.uint8)), \
                        (name, j, s, int((rows.view(torch.uint8) != q.view(torch.uint8)).sum()))
                    got_s = scales_c[j, begin:begin + n]
                    want_s = pack_ue8m0(sinv) if ue8m0 else sinv
                    assert torch.equal(got_s, want_s), (name, j, s, int((got_s != want_s).sum()))
            tiles = sorted(sp for sp in spans if sp[1])
            pos = 0
            for begin, n in tiles:
                assert begin == pos, (name, j, spans)
                pos += n
            assert pos == len(want) and sorted(got) == want, (name, j)
        checked.append(name)
    assert len({d.data_ptr() for d in held}) == len(held), "result tensors must be fresh per call"
    checked.append("fresh-results")
    # the plugin calls the runtime itself only where Buffer.low_latency_dispatch is v1.2.1's wrapper of it
    assert wraps_runtime_dispatch(deep_ep.Buffer), "Buffer.low_latency_dispatch is not v1.2.1's wrapper"
    checked.append("runtime-wrapper")

    # normal mode: the FP8 payload and its scales pass through; rows grouped by source rank, ascending
    per_rank, per_rdma, per_expert, in_rank, _ = buf.get_dispatch_layout(idx, E)
    q, s = quantize_fp8_ll(x.cpu(), False)
    (rq, rs), r_idx, r_w, counts, nh, _ = buf.dispatch(
        (q.to(device), s.to(device)), num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma,
        is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
        topk_weights=torch.ones(idx.shape, dtype=torch.float32, device=device))
    want_rows, want_scales = [], []
    for src in range(world):
        qs, ss = quantize_fp8_ll(xs[src], False)
        mine = ((ids[src] >= rank * el) & (ids[src] < (rank + 1) * el)).any(dim=1)
        want_rows.append(qs[mine])
        want_scales.append(ss[mine])
    assert torch.equal(rq.cpu().view(torch.uint8), torch.cat(want_rows).view(torch.uint8)), "normal FP8 rows"
    assert torch.equal(rs.cpu(), torch.cat(want_scales)), "normal FP8 scales"
    checked.append("normal-fp8-passthrough")
    return {"checked": checked, "order_sorted": sorted_blocks == blocks, "blocks": blocks,
            "emulated": bool(getattr(deep_ep, "EMULATED", False))}


def on_cpu(rank: int, world: int) -> dict:
    """``run_fidelity`` on the CPU (the emulation, through ``run_gloo_world``)."""
    return run_fidelity(rank, world, torch.device("cpu"))


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    result = run_fidelity(rank, world, device)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank}: fidelity ok {result}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
