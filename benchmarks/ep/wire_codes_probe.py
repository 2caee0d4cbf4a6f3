"""Why the NCCL layout test saw INT8 rows one code off (docs/decisions.md, decision 57), on one CUDA GPU.

    PYTHONPATH=. python benchmarks/ep/wire_codes_probe.py [--tokens 4096] [--hidden 7168]

Quantizes the same bf16 activations for the wire three ways - the core quantizer (eager), and
``torch_a2a``'s ``_normal_wire_rows`` inductor-compiled without and with inductor's IEEE-division
switch (what ``torch_a2a`` compiles with) - and prints, per wire dtype, how many codes and scales
differ from the core quantizer's. Expected: some codes differ without the switch (Triton's
approximate ``/``), none with it. Exits 1 if the switched compile differs.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from moe_core.contracts import WireDtype  # noqa: E402
from moe_core.distributed import torch_a2a  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.tokens, args.hidden, generator=gen).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 256, (args.tokens, 8), generator=gen).int().cuda()
    weights = torch.rand(args.tokens, 8, generator=gen).cuda()
    switch = torch_a2a._eager_division_switch()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, inductor switch: {switch or 'none'}")
    bad = False
    ieee = {switch: True} if switch else None
    # each line printed as it is measured (a run cut short keeps the first ones): INT8 both ways first
    for wire, label, options in ((WireDtype.INT8, "approximate /", {}), (WireDtype.INT8, "IEEE division", ieee),
                                 (WireDtype.FP8, "IEEE division", ieee), (WireDtype.FP8, "approximate /", {})):
        if options is None:
            continue
        want_q, want_s, _ = torch_a2a._normal_wire_rows(x, ids, weights, wire)
        torch._dynamo.reset()
        q, s, _ = torch.compile(torch_a2a._normal_wire_rows, fullgraph=True, options=options)(x, ids, weights, wire)
        codes = int((q.view(torch.uint8) != want_q.view(torch.uint8)).sum())
        scales = int((s != want_s).sum())
        print(f"{wire} {label}: {codes} of {q.numel()} codes and {scales} of {s.numel()} scales differ "
              "from the core quantizer's", flush=True)
        bad |= label == "IEEE division" and bool(codes or scales)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
