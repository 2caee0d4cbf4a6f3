"""The one process-world launcher: run a function on ``world`` spawned ranks on 127.0.0.1, bounded
by a timeout. The kit's EP cases, the core's EP tests and the plugins' tests all start ranks here.

For tests of EP backends (a plugin's own, or a vendor's against emulated ops)::

    results = run_gloo_world(my_rank_body, 2, case, seed, setup="my_emulation:install", timeout=120)

``body(rank, world, *args)`` must be a module-level (picklable) function; it runs after the
process group exists and its return value comes back per rank. Spawned ranks inherit the
parent's ``sys.path``, so a body in a test-support module on that path is importable there.
``setup`` ("module:function") runs in each rank before the process group exists (e.g. installs
emulated vendor ops). With ``backend="nccl"`` rank ``r`` uses GPU ``r``.

``spawn_world`` reports every rank's outcome (its value, or why it has none); ``run_gloo_world``
returns the values and raises ``RuntimeError`` naming the failing ranks (with their tracebacks).
The first rank that fails ends the world (the others may wait forever in a collective with it);
ranks still running at the end are killed.
"""

from __future__ import annotations

import datetime
import queue as queue_mod
import socket
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from moe_core.backends import load_object

__all__ = ["RankOutcome", "free_port", "run_gloo_world", "spawn_world"]


@dataclass(frozen=True)
class RankOutcome:
    """What one rank returned, or why it returned nothing (``error``: a traceback or a sentence)."""

    rank: int
    value: Any = None
    error: Optional[str] = None

    @property
    def ok(self) -> bool:
        return self.error is None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, backend: str, setup: Optional[str], timeout: float,
               body: Callable, args: tuple, q: Any) -> None:
    try:
        torch.set_num_threads(1)  # the ranks share the machine's cores
        if setup:
            load_object(setup)()
        if backend == "nccl":
            torch.cuda.set_device(rank)
        # a collective whose peer died fails within the world's time, with a message, not a kill
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=max(30.0, timeout / 2)))
        result = body(rank, world, *args)
    except BaseException:
        q.put((rank, None, traceback.format_exc()))
        return
    q.put((rank, result, None))  # before the teardown: a rank whose device is broken may hang there
    try:
        dist.barrier()  # no rank tears the group down while another still uses it
        dist.destroy_process_group()
    except Exception:
        pass  # the result is delivered; the parent kills a rank that hangs here


def spawn_world(body: Callable, world: int, *args: Any, setup: Optional[str] = None, timeout: float = 120.0,
                backend: str = "gloo") -> list[RankOutcome]:
    """Every rank's outcome of ``body(rank, world, *args)`` (see the module doc); never raises for a rank."""
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, backend, setup, timeout, body, args, q), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    outcomes: dict[int, RankOutcome] = {}
    failed_rank: Optional[int] = None
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            try:
                rank, value, error = q.get(timeout=1.0)
            except queue_mod.Empty:
                if time.monotonic() > deadline or (not any(p.is_alive() for p in procs) and q.empty()):
                    break
                continue
            outcomes[rank] = RankOutcome(rank, value, error)
            if error is not None:
                failed_rank = rank
                break
    finally:
        killed = set()
        for rank, p in enumerate(procs):
            p.join(timeout=0.1 if failed_rank is not None else 5)
            if p.is_alive():  # hung (in a collective, or in teardown after its result): kill our own rank
                p.kill()
                p.join(timeout=5)
                killed.add(rank)
    for rank, p in enumerate(procs):
        if rank in outcomes:
            continue
        if failed_rank is not None:
            why = f"stopped: rank {failed_rank} failed"
        elif rank in killed:
            why = f"no result within {timeout:.0f}s (a collective never completed)"
        else:
            why = f"exited with code {p.exitcode} without a result"
        outcomes[rank] = RankOutcome(rank, error=why)
    return [outcomes[r] for r in range(world)]


def run_gloo_world(body: Callable, world: int, *args: Any, setup: Optional[str] = None,
                   timeout: float = 120.0) -> list:
    """``[body(rank, world, *args) for each rank]``, each in its own process over gloo (see the module doc)."""
    outcomes = spawn_world(body, world, *args, setup=setup, timeout=timeout)
    errors = [f"rank {o.rank}:\n{o.error}" for o in outcomes if not o.ok]
    if errors:
        raise RuntimeError(f"world of {world} on gloo failed:\n" + "\n".join(errors))
    return [o.value for o in outcomes]
