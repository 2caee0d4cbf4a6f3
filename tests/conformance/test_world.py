"""moe_core.testing.run_gloo_world: results per rank, and a failing rank fails the world promptly."""

import time

import pytest
import torch
import torch.distributed as dist

from moe_core.testing.world import run_gloo_world


def _sum_of_ranks(rank: int, world: int, scale: int) -> int:
    t = torch.tensor([rank * scale])
    dist.all_reduce(t)
    return int(t)


def _rank1_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise ValueError("rank 1 is broken")
    dist.barrier()  # rank 0 would wait here forever


@pytest.mark.timeout(120)
def test_results_by_rank():
    assert run_gloo_world(_sum_of_ranks, 3, 10, timeout=60) == [30, 30, 30]


@pytest.mark.timeout(120)
def test_a_failing_rank_fails_the_world_with_its_traceback():
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="(?s)rank 1:.*ValueError: rank 1 is broken"):
        run_gloo_world(_rank1_fails, 2, timeout=60)
    assert time.monotonic() - t0 < 50  # not the timeout
