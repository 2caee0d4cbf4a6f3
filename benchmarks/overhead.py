"""Per-forward framework overhead of MoELayer (issue 2, item 11). Not a test: run it and read.

    python benchmarks/overhead.py [--json out.json]

Times the same dispatch -> apply -> combine through trivial backends (declared by a plugin in this
file: dispatch wraps the input, apply returns it, combine unwraps it), so that backend work is
near zero and what remains is the framework's own cost:
  direct : the plan's bound backend methods called by hand (the floor)
  layer  : MoELayer.forward (input validation + bound calls), with and without the expert-id
           range check (a reduction and a host sync, default on for CPU layers)
  pluggy : the three stages through pluggy's hook callers (what a hook loop per call would cost)
Overhead = (path - direct). Each figure is the median over repeats of the mean of N calls.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

import moe_core as mc
from moe_core import quant
from moe_core.contracts import QuantizedActivations, StandardCombine, StandardDispatch
from moe_core.plugins import PluginManager


class NullDispatcher(mc.Dispatcher):
    def dispatch(self, hidden_states, topk):
        return StandardDispatch(QuantizedActivations(hidden_states), topk)

    def combine(self, combine_input):
        return combine_input.hidden


class NullExperts(mc.Experts):
    def apply(self, layer, dispatched):
        return StandardCombine(dispatched.hidden.data)


class NullPlugin(mc.BackendPlugin):
    def backends(self):
        common = dict(formats=(mc.Format.STANDARD,), devices=frozenset({"cpu"}), priority=1000,
                      graph_safe_formats=frozenset({mc.Format.STANDARD}))
        return [mc.BackendSpec(name="null_dispatch", role=mc.Role.DISPATCHER, impl=f"{__name__}:NullDispatcher",
                               **common),
                mc.BackendSpec(name="null_experts", role=mc.Role.EXPERTS, impl=f"{__name__}:NullExperts", **common)]


def per_call_us(fn, calls: int, repeats: int) -> float:
    for _ in range(calls // 10):
        fn()
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(1)

    manager = PluginManager(entry_points=[])
    manager.register(NullPlugin(), "null", source="benchmarks/overhead.py")
    cfg = mc.MoEConfig(num_experts=4, top_k=1, hidden_size=16, intermediate_size=16)
    w13, w2 = torch.randn(4, 32, 16), torch.randn(4, 16, 16)
    layers = {}
    for check in (True, False):
        layer = mc.MoELayer(cfg, check_ids=check, manager=manager)
        assert layer.plan.experts.name == "null_experts"
        layer.load_weights(**quant.quantize_weights(w13, w2, cfg.quant))
        layer.process_weights()
        layers[check] = layer
    layer = layers[False]
    x = torch.randn(1, 16).to(torch.bfloat16)
    topk = mc.TopK(torch.ones(1, 1), torch.zeros(1, 1, dtype=torch.int32))
    d, e = layer.dispatcher, layer.experts
    hook = manager.hook

    def direct():
        return d.combine(e.apply(layer, d.dispatch(x, topk)))

    def via_pluggy():
        dispatched = hook.dispatch(backend=d, hidden_states=x, topk=topk)
        return hook.combine(backend=d, combine_input=hook.apply(backend=e, layer=layer, dispatched=dispatched))

    with torch.inference_mode():
        # interleave the paths in each round so drift on a shared machine hits all of them
        rounds = {"direct": [], "layer": [], "layer_check_ids": [], "pluggy": []}
        fns = {"direct": direct, "layer": lambda: layer(x, topk), "layer_check_ids": lambda: layers[True](x, topk),
               "pluggy": via_pluggy}
        for _ in range(5):
            for name, fn in fns.items():
                rounds[name].append(per_call_us(fn, args.calls, args.repeats // 5 or 1))
    t = {k: min(v) for k, v in rounds.items()}
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} torch thread, "
                   f"torch {torch.__version__}, python {platform.python_version()}",
        "direct_us": round(t["direct"], 2),
        "layer_overhead_us": round(t["layer"] - t["direct"], 2),
        "layer_check_ids_overhead_us": round(t["layer_check_ids"] - t["direct"], 2),
        "pluggy_overhead_us": round(t["pluggy"] - t["direct"], 2),
    }
    for k, v in result.items():
        print(f"{k:30s} {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":  # noqa: E305
    main()
