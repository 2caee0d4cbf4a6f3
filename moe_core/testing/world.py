"""Run one function on ``world`` spawned ranks over gloo on 127.0.0.1, bounded by a timeout.

For tests of EP backends (a plugin's own, or a vendor's against emulated ops)::

    results = run_gloo_world(my_rank_body, 2, case, seed, setup="my_emulation:install", timeout=120)

``body(rank, world, *args)`` must be a module-level (picklable) function; its return value comes
back per rank. ``setup`` ("module:function") runs in each worker before the process group exists
(e.g. installs emulated vendor ops). Any rank's exception, a rank that dies, or the timeout raises
``RuntimeError`` naming the ranks (with their tracebacks); workers still running are killed.
"""

from __future__ import annotations

import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_core.testing.kit import run_setup


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, setup: Optional[str], body: Callable, args: tuple, q: Any) -> None:
    try:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        run_setup(setup)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        result = body(rank, world, *args)
        dist.barrier()
        q.put((rank, result, None))
    except BaseException:
        q.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_gloo_world(body: Callable, world: int, *args: Any, setup: Optional[str] = None,
                   timeout: float = 120.0) -> list:
    """``[body(rank, world, *args) for each rank]``, each in its own process (see the module doc)."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, setup, body, args, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            try:
                rank, res, err = q.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline:
                    errors.append(f"no result from rank(s) {sorted(set(range(world)) - set(results))} within {timeout}s")
                    break
                if not any(p.is_alive() for p in procs) and q.empty():
                    errors.append(f"ranks exited without a result (exit codes {[p.exitcode for p in procs]})")
                    break
                continue
            if err:
                errors.append(f"rank {rank}:\n{err}")
                break  # the others may wait forever in a collective with it
            results[rank] = res
    finally:
        for p in procs:
            p.join(timeout=0.1 if errors else 5)
            if p.is_alive():
                p.kill()
    if errors:
        raise RuntimeError(f"world of {world} on gloo failed:\n" + "\n".join(errors))
    return [results[r] for r in range(world)]
