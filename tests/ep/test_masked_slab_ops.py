"""The masked slab's expand / reduce kernels of ``torch_a2a``: the functions it compiles on CUDA agree
with the eager ops it uses elsewhere (``index_put_``, ``embedding_bag``), eager and compiled.
Random O(1) data, repeated pair rows (pairs not on a rank point at a row already written), every
word dtype the byte views use."""

import pytest
import torch

from moe_core.distributed import torch_a2a as a2a
from moe_core.testing.data import rel_error


def _case(n, k, rows, h, dtype, gen):
    index = torch.randint(0, rows, (n, k), generator=gen)
    weights = torch.rand(n, k, generator=gen) + 0.1
    if k > 2:
        index[:, 1] = index[:, 0]  # a repeated row, as for pairs that are not on this rank
        weights[:, -1] = 0.0  # weight 0 pairs, as for pairs not here
    if dtype.is_floating_point:
        table = torch.randn(rows, h, generator=gen).to(dtype)
    else:
        table = torch.randint(-1000, 1000, (rows, h), generator=gen).to(dtype)
    return table, index, weights


@pytest.mark.parametrize("n,k", [(0, 4), (1, 1), (37, 8)])
def test_reduce_loop_matches_embedding_bag(n, k):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    table, index, w = _case(n, k, 53, 96, torch.bfloat16, gen)
    want = (table.double()[index] * w.double().unsqueeze(-1)).sum(1)  # float64, independent
    loop = a2a._reduce_pairs_loop(table, index, w)
    assert loop.dtype == table.dtype and loop.shape == (n, 96)
    assert rel_error(loop, want) < 1e-2
    assert rel_error(a2a.reduce_pairs(table, index, w), want) < 1e-2  # CPU: embedding_bag
    plain = table.double()[index].sum(1)  # weights None: a plain sum (normal mode's combine)
    assert rel_error(a2a._reduce_pairs_loop(table, index, None), plain) < 1e-2
    assert rel_error(a2a.reduce_pairs(table, index, None), plain) < 1e-2


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8, torch.float32])
def test_expand_flat_matches_index_put(dtype):
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    n, k, slab_rows = 29, 8, 300
    rows, _, _ = _case(n, 1, n, 24, dtype, gen)
    # distinct targets per pair, except repeats that carry the same row (as torch_a2a writes them)
    write_index = torch.randperm(slab_rows, generator=gen)[: n * k].view(n, k)
    write_index[:, 1] = write_index[:, 0]
    slab = torch.zeros(slab_rows, 24, dtype=dtype)
    want = slab.clone().index_put_((write_index,), rows.unsqueeze(1))
    a2a._expand_pairs_flat(slab, rows, write_index)
    assert torch.equal(slab, want)
    assert torch.equal(slab[write_index[:, 3]], rows)


def test_compiled_loops_match_on_cpu(monkeypatch):
    """The compiled path (CUDA's) traced and run by inductor on CPU: same results as the eager ops."""
    monkeypatch.setattr(a2a, "_fused_layout", lambda device: True)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    table, index, w = _case(41, 8, 67, 64, torch.bfloat16, gen)
    want = torch.nn.functional.embedding_bag(index, table.float(), per_sample_weights=w, mode="sum")
    assert rel_error(a2a.reduce_pairs(table, index, w), want) < 1e-2
    assert rel_error(a2a.reduce_pairs(table, index[:, :2], None), table.float()[index[:, :2]].sum(1)) < 1e-2
    rows = torch.randint(-(2**40), 2**40, (41, 8), generator=gen)
    write_index = torch.randperm(400, generator=gen)[:41 * 8].view(41, 8)
    slab = torch.zeros(400, 8, dtype=torch.int64)
    a2a.expand_pairs(slab, rows, write_index)
    assert torch.equal(slab, torch.zeros_like(slab).index_put_((write_index,), rows.unsqueeze(1)))


def test_inside_an_outer_torch_compile(monkeypatch):
    """A layer compiled by the user (fullgraph) traces through the compiled helpers into its own graph."""
    monkeypatch.setattr(a2a, "_fused_layout", lambda device: True)
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    table, index, w = _case(13, 4, 29, 32, torch.float32, gen)
    write_index = torch.randperm(200, generator=gen)[:13 * 4].view(13, 4)

    def step(table, index, w, write_index):
        slab = torch.zeros(200, 32)
        a2a.expand_pairs(slab, table[:13], write_index)
        return a2a.reduce_pairs(table, index, w), slab

    got = torch.compile(step, fullgraph=True, backend="aot_eager")(table, index, w, write_index)
    want = (torch.nn.functional.embedding_bag(index, table, per_sample_weights=w, mode="sum"),
            torch.zeros(200, 32).index_put_((write_index,), table[:13].unsqueeze(1)))
    assert rel_error(got[0], want[0]) < 1e-5 and torch.equal(got[1], want[1])
