"""Probe torch symmetric memory on this machine for ``torch_a2a``'s direct-write exchange (issue #32): world 2 on
NCCL (one GPU a rank, 127.0.0.1). Checks and times, printing one line each:

1. ``symm_mem.empty`` + ``rendezvous`` on the EP group (its backend, the peers' buffer pointers);
2. a Triton kernel that writes every peer's rows through a table of peer base pointers (what the direct-write
   exchange does), then ``barrier``: the rows each rank received are the senders' bytes;
3. the same captured in a CUDA graph and replayed (new data each replay);
4. the time of that exchange against ``all_to_all_single`` of the same bytes, at 128 and 4096 rows of
   ``--row-bytes`` a rank and peer (CUDA events, median of ``--iters``).

    python benchmarks/ep/probe_symm_mem.py [--row-bytes 14400] [--iters 20]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton
import triton.language as tl
from moe_plugin_cuda.triton.a2a import peer_addresses


@triton.jit
def _put_rows(src_ptr, peers_ptr, ROWS, ROW_WORDS, RANK, W: tl.constexpr, BW: tl.constexpr):
    """Program (r, i): row i of this rank's chunk for rank r into rank r's buffer at row RANK * ROWS + i."""
    r = tl.program_id(0)
    i = tl.program_id(1).to(tl.int64)
    dst = tl.load(peers_ptr + r).to(tl.pointer_type(tl.int32))
    src = src_ptr + (r * ROWS + i) * ROW_WORDS
    out = dst + (RANK * ROWS + i) * ROW_WORDS
    for start in range(0, ROW_WORDS, BW):
        offs = start + tl.arange(0, BW)
        tl.store(out + offs, tl.load(src + offs, mask=offs < ROW_WORDS), mask=offs < ROW_WORDS)


def _median_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        t = torch.tensor([a.elapsed_time(b)], device="cuda")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(float(t))
    return statistics.median(times)


def _probe_rows(rows: int, words: int, rank: int, world: int, group, iters: int, say) -> None:
    """One size: correctness eager and replayed, then the times."""
    import torch.distributed._symmetric_memory as symm_mem

    recv = symm_mem.empty(world * rows, words, dtype=torch.int32, device="cuda")
    hdl = symm_mem.rendezvous(recv, group)
    peers = torch.tensor(peer_addresses(recv, hdl), dtype=torch.int64, device="cuda")
    say(f"rows {rows}: buffer at offset {recv.data_ptr() - hdl.buffer_ptrs[rank]} of the handle's allocation",
        flush=True)
    send = torch.empty(world * rows, words, dtype=torch.int32, device="cuda")

    def exchange():
        hdl.barrier(channel=0)  # the peers are done reading their buffers
        _put_rows[(world, rows)](send, peers, rows, words, rank, W=world, BW=1024, num_warps=4)
        hdl.barrier(channel=0)  # every peer's rows have landed here

    def expect():
        return torch.cat([torch.full((rows, words), 1000 * s + rank, dtype=torch.int32, device="cuda")
                          for s in range(world)])

    for r in range(world):
        send[r * rows:(r + 1) * rows] = 1000 * rank + r
    exchange()
    torch.cuda.synchronize()
    ok = torch.equal(recv, expect())
    say(f"rows {rows}: eager direct write {'OK' if ok else 'WRONG'}", flush=True)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        exchange()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.cuda.graph(graph):
        exchange()
    send += 1  # new data: a replay must move it
    recv.zero_()
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    torch.cuda.synchronize()
    ok = torch.equal(recv, expect() + 1)
    say(f"rows {rows}: graph replay {'OK' if ok else 'WRONG'}", flush=True)
    out = torch.empty_like(send)
    ms_direct = _median_ms(graph.replay, iters)
    ms_eager = _median_ms(exchange, iters)
    ms_nccl = _median_ms(lambda: dist.all_to_all_single(out, send), iters)
    mb = send.numel() * 4 / 1e6
    say(f"rows {rows} ({mb:.1f} MB a rank): direct graph {ms_direct * 1e3:.1f} us, direct eager "
        f"{ms_eager * 1e3:.1f} us, nccl all_to_all_single {ms_nccl * 1e3:.1f} us", flush=True)


def worker(rank: int, world: int, port: int, args) -> None:
    import torch.distributed._symmetric_memory as symm_mem

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", world_size=world, rank=rank,
                            device_id=torch.device("cuda", rank))
    group = dist.group.WORLD
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name(0)}, "
        f"symm_mem backend {symm_mem.get_backend('cuda')!r}", flush=True)
    if hasattr(symm_mem, "is_symm_mem_enabled_for_group") and not symm_mem.is_symm_mem_enabled_for_group(group.group_name):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            symm_mem.enable_symm_mem_for_group(group.group_name)
    for rows in (128, 4096):
        _probe_rows(rows, args.row_bytes // 4, rank, world, group, args.iters, say)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--row-bytes", type=int, default=14400)
    p.add_argument("--iters", type=int, default=20)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(args.world, port, args), nprocs=args.world, start_method="spawn")


if __name__ == "__main__":
    main()
