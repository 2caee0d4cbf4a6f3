"""One GPU, no communication: the local layout work of ``torch_a2a``'s masked mode, timed per variant,
to pick what the dispatcher should use before changing it (end to end, replacing ``embedding_bag`` by
gather + bmm did not help although it should move fewer bytes; this measures each piece alone). The
compiled variants are what ``torch_a2a`` runs on CUDA (docs/decisions.md, decision 16).

- combine reduce: ``out[t] = sum_k w[t, k] * slab[index[t, k]]`` over the ``[E_local * C*W, H]`` slab
  (``index`` / ``w`` as ``torch_a2a`` builds them: pairs not here point at a valid row with weight 0);
  variants: ``embedding_bag``, gather ``[rows, K, H]`` + bmm, a loop over K of weighted row gathers
  (eager), and the same loop under ``torch.compile`` (inductor fuses it into one kernel that reads
  each slab row once: ``torch_a2a``'s);
- dispatch expand: write each received row into its K slab rows: ``index_put_``, ``index_copy_`` of
  the repeated rows, the compiled loop over K, and one compiled scatter of the broadcast rows
  (``torch_a2a``'s).

Bytes: the reduce must read ``rows x K x H x elem`` once (0.94 GB for DeepSeek-V3, 4096 tokens/rank,
W = 2); the table gives each variant's time and the bandwidth that byte count implies.

    python benchmarks/ep/masked_layout_variants.py [--tokens 4096 --world 2 --hidden 7168 --experts 256 --top-k 8]
    python benchmarks/ep/masked_layout_variants.py --cpu --tokens 64 --hidden 256 --experts 16   # smoke test
"""

from __future__ import annotations

import argparse
import json
import time

import torch

# the loops torch_a2a compiles on CUDA (the variants under test here)
from moe_core.distributed.torch_a2a import _expand_pairs_flat as expand_flat
from moe_core.distributed.torch_a2a import _reduce_pairs_loop as reduce_k_loop


def reduce_embedding_bag(slab, index, w):
    return torch.nn.functional.embedding_bag(index, slab, per_sample_weights=w, mode="sum")


def reduce_gather_bmm(slab, index, w):
    rows, k = index.shape
    picked = slab.index_select(0, index.reshape(-1)).view(rows, k, -1)
    return torch.bmm(w.unsqueeze(1), picked).squeeze(1)


def expand_index_put(slab, rows, write_index):
    slab.index_put_((write_index,), rows.unsqueeze(1))
    return slab


def expand_index_copy(slab, rows, write_index):
    k = write_index.shape[1]
    slab.index_copy_(0, write_index.reshape(-1), rows.repeat_interleave(k, dim=0))
    return slab


def expand_k_loop(slab, rows, write_index):
    """A loop over K (inductor: K kernels; measured slower than the flat scatter, kept to compare)."""
    for k in range(write_index.shape[1]):
        slab[write_index[:, k]] = rows


def make_case(tokens, world, hidden, experts, top_k, dtype, device, gen):
    """The shapes and index patterns of one rank's masked combine / dispatch (uniform routing)."""
    el, cw = experts // world, tokens * world
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(cw)])  # [CW, K] global ids
    mine = ids // el == 0  # experts of rank 0
    local = torch.where(mine, ids, el)
    seen = torch.zeros(el + 1, cw, dtype=torch.int64).scatter_(0, local.T, 1).cumsum(1)
    slab_index = (seen.gather(0, local.T).T + local * cw - 1).clamp(max=el * cw)
    first = slab_index.gather(1, mine.to(torch.int8).argmax(1, keepdim=True))
    index = torch.where(mine, slab_index, first).clamp(max=el * cw - 1)
    scratch = torch.arange(el * cw, el * cw + cw).unsqueeze(1)
    write_index = torch.where(mine, slab_index, torch.where(mine.any(1, keepdim=True), first, scratch))
    w = torch.where(mine, torch.rand(cw, top_k, generator=gen), 0.0).to(dtype)
    slab = torch.randn(el * cw + cw, hidden, generator=gen).to(dtype)
    rows = torch.randn(cw, hidden, generator=gen).to(dtype)
    return {k: v.to(device) for k, v in dict(slab=slab, index=index, w=w, write_index=write_index, rows=rows).items()}


def timed(fn, iters, device, graph):
    for _ in range(3):
        fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters * 1e3
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            fn()
        fn = g.replay
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--cpu", action="store_true")
    p.add_argument("--expand-words", action="store_true", help="expand int64 words (as torch_a2a does), not bf16")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    dtype = torch.bfloat16
    c = make_case(args.tokens, args.world, args.hidden, args.experts, args.top_k, dtype, device,
                  torch.Generator().manual_seed(0))
    slab_rows = c["slab"][: c["slab"].shape[0] - c["rows"].shape[0]]  # the slab without its scratch rows
    want = reduce_k_loop(slab_rows, c["index"], c["w"]).float()
    compiled_reduce = torch.compile(reduce_k_loop, dynamic=False, fullgraph=True)
    compiled_expand = torch.compile(expand_k_loop, dynamic=False, fullgraph=True)
    compiled_flat = torch.compile(expand_flat, dynamic=False, fullgraph=True)
    reduce_bytes = c["index"].numel() * args.hidden * 2
    results = []
    for name, fn in [("reduce embedding_bag", reduce_embedding_bag), ("reduce gather+bmm", reduce_gather_bmm),
                     ("reduce k-loop eager", reduce_k_loop), ("reduce k-loop compiled", compiled_reduce)]:
        out = fn(slab_rows, c["index"], c["w"])
        err = float((out.float() - want).norm() / want.norm())
        for graph in ([False, True] if device.type == "cuda" else [False]):
            ms = timed(lambda fn=fn: fn(slab_rows, c["index"], c["w"]), args.iters, device, graph)
            results.append(dict(variant=name, graph=graph, ms=ms, GBps=reduce_bytes / ms / 1e6, rel_err=err))
    expand_bytes = c["write_index"].numel() * args.hidden * 2
    if args.expand_words:  # as torch_a2a moves rows: int64 words of the wire bytes
        c["slab"], c["rows"] = c["slab"].view(torch.int64), c["rows"].view(torch.int64)
    ref = expand_index_put(c["slab"].clone(), c["rows"], c["write_index"])
    for name, fn in [("expand index_put", expand_index_put), ("expand index_copy", expand_index_copy),
                     ("expand k-loop compiled", compiled_expand), ("expand flat compiled", compiled_flat)]:
        slab = c["slab"].clone()
        fn(slab, c["rows"], c["write_index"])  # in place
        same = bool(torch.equal(slab, ref))
        for graph in ([False, True] if device.type == "cuda" else [False]):
            ms = timed(lambda fn=fn, slab=slab: fn(slab, c["rows"], c["write_index"]), args.iters, device, graph)
            results.append(dict(variant=name, graph=graph, ms=ms, GBps=expand_bytes / ms / 1e6, same=same))
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"{name}: tokens/rank {args.tokens}, world {args.world}, H {args.hidden}, E {args.experts}, "
          f"top-{args.top_k}; reduce reads {reduce_bytes / 1e9:.2f} GB, expand writes {expand_bytes / 1e9:.2f} GB")
    print("| variant | graph | ms | GB/s | check |\n|---|---|---|---|---|")
    for r in results:
        check = f"rel err {r['rel_err']:.1e}" if "rel_err" in r else ("same slab" if r["same"] else "DIFFERS")
        print(f"| {r['variant']} | {r['graph']} | {r['ms']:.3f} | {r['GBps']:.0f} | {check} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, args=vars(args), results=results), f, indent=1)


if __name__ == "__main__":
    main()
