"""The ``moe-core`` command line: backends, plan, doctor, demo, bench, tune."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Optional, Sequence

from moe_core.backends import Code, Role
from moe_core.config import PRESETS, MoEConfig, preset
from moe_core.contracts import Activation, QuantScheme, WireDtype
from moe_core.devices import DEVICE_KINDS, local_device_kind
from moe_core.planner import PlanError, plan
from moe_core.plugins import PluginManager, get_plugin_manager


def _manager(args: argparse.Namespace) -> PluginManager:
    if args.allow is None and not args.block and not args.strict:
        return get_plugin_manager()
    return PluginManager(allow=args.allow, block=args.block or (), strict=args.strict)


# --------------------------------------------------------------------------- backends


def _backend_rows(manager: PluginManager) -> list[dict[str, Any]]:
    rows = []
    for spec in manager.specs:
        reason = manager.availability(spec)
        rows.append({"plugin": spec.plugin, "plugin_version": spec.plugin_version, "backend": spec.name,
                     "role": str(spec.role), "available": reason.ok, "code": str(reason.code),
                     "message": reason.message, "hint": reason.hint})
    for record in manager.failed():  # a plugin that did not load still shows, with why
        rows.append({"plugin": record.name, "plugin_version": record.version, "backend": None, "role": None,
                     "available": False, "code": str(record.status.code), "message": record.status.message,
                     "hint": record.status.hint})
    return rows


def cmd_backends(args: argparse.Namespace) -> int:
    manager = _manager(args)
    rows = _backend_rows(manager)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = [("PLUGIN", "VERSION", "BACKEND", "ROLE", "STATUS", "DETAIL")]
    for r in rows:
        detail = r["message"] or ""  # for a usable backend, what it found (a vendor library's version, say)
        if r["hint"] and not r["available"]:
            detail += f" (hint: {r['hint']})"
        table.append((r["plugin"], r["plugin_version"], r["backend"] or "-", r["role"] or "-",
                      "available" if r["available"] else r["code"], detail))
    widths = [max(len(str(row[i])) for row in table) for i in range(5)]  # the detail (row[5]) is not padded
    for row in table:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[5])
    for note in manager.duplicates:
        print(f"note: {note}", file=sys.stderr)
    return 0


# --------------------------------------------------------------------------- plan


def _config_from_args(args: argparse.Namespace) -> MoEConfig:
    choices = dict(quant=QuantScheme(args.quant), ep_size=args.ep, device=args.device, cuda_graph=args.cuda_graph,
                   dispatcher=args.dispatcher, experts=args.experts_backend, dispatch_dtype=args.dispatch_dtype,
                   dispatch_format=args.dispatch_format, activation=Activation(args.activation), max_tokens_per_rank=args.max_tokens_per_rank)
    if args.preset:
        sizes = {k: v for k, v in (("num_experts", args.experts), ("top_k", args.top_k),
                                   ("hidden_size", args.hidden), ("intermediate_size", args.intermediate)) if v}
        return preset(args.preset, **sizes, **choices)
    missing = [flag for flag, v in (("--experts", args.experts), ("--top-k", args.top_k), ("--hidden", args.hidden),
                                    ("--intermediate", args.intermediate)) if not v]
    if missing:
        raise SystemExit(f"moe-core plan: give --preset NAME, or all of {', '.join(missing)}")
    return MoEConfig(num_experts=args.experts, top_k=args.top_k, hidden_size=args.hidden,
                     intermediate_size=args.intermediate, **choices)


def cmd_plan(args: argparse.Namespace) -> int:
    try:
        config = _config_from_args(args)
    except ValueError as exc:
        print(f"moe-core plan: {exc}", file=sys.stderr)
        return 2
    try:
        result = plan(config, manager=_manager(args), dry_run=args.dry_run)
    except PlanError as err:
        if args.json:
            print(json.dumps(err.to_json(), indent=2))
        else:
            print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_json(), indent=2) if args.json else result.explain())
    return 0


# --------------------------------------------------------------------------- doctor


def cmd_doctor(args: argparse.Namespace) -> int:
    from moe_core.runtime import Dispatcher, Experts, FusedMoE

    manager = _manager(args)
    problems = 0
    for record in manager.records:
        status = "ok" if record.status.ok else str(record.status.code)
        print(f"plugin {record.name} {record.version} ({record.source}): {status}")
        if not record.status.ok and record.status.code is not Code.DISABLED:
            problems += 1
            print(f"  {record.status.message}")
            if record.status.traceback:
                print("  " + record.status.traceback.rstrip().replace("\n", "\n  "))
    try:
        manager.pm.check_pending()
    except Exception as exc:  # hookimpls without a spec
        problems += 1
        print(f"hook validation: {exc}")
    for note in manager.duplicates:
        print(f"duplicate: {note}")
    base = {Role.DISPATCHER: Dispatcher, Role.EXPERTS: Experts, Role.FUSED: FusedMoE}
    for spec in manager.specs:
        reason = manager.availability(spec)
        if not reason.ok:
            print(f"backend {spec.qualified_name}: {reason.code} ({reason.message})")
            continue
        try:  # an available backend's implementation must import and have the right base class
            cls = spec.load_impl()
            if not (isinstance(cls, type) and issubclass(cls, base[spec.role])):
                raise TypeError(f"{spec.impl} is not a subclass of moe_core.{base[spec.role].__name__}")
            print(f"backend {spec.qualified_name}: ok")
        except Exception as exc:
            problems += 1
            print(f"backend {spec.qualified_name}: implementation {spec.impl} does not validate: "
                  f"{type(exc).__name__}: {exc}")
    print(f"{problems} problem(s)")
    return 1 if problems else 0


# --------------------------------------------------------------------------- demo


def cmd_demo(args: argparse.Namespace) -> int:
    """Build a layer for a preset scaled to CPU size, run it, check it against float64."""
    import torch

    from moe_core import quant
    from moe_core.layer import MoELayer
    from moe_core.reference.experts import activation_quantizer
    from moe_core.reference.oracle import moe_float64, relative_error

    base = PRESETS[args.preset]
    scale = args.scale
    h = max(16, base["hidden_size"] // scale // 16 * 16)
    i = max(16, base["intermediate_size"] // scale // 16 * 16)
    config = preset(args.preset, hidden_size=h, intermediate_size=i, quant=QuantScheme(args.quant),
                    params_dtype=torch.bfloat16)
    print(f"demo: {args.preset} scaled 1/{scale}: E={config.num_experts} top-{config.top_k} H={h} I={i} "
          f"quant={config.quant}, T={args.tokens}")
    t0 = time.perf_counter()
    layer = MoELayer(config)
    print(layer.plan.explain())
    gen = torch.Generator().manual_seed(args.seed)
    w13 = torch.randn(config.num_experts, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(config.num_experts, h, i, generator=gen) / i ** 0.5
    checkpoint = quant.quantize_weights(w13, w2, config.quant)
    if config.router.use_correction_bias:
        checkpoint["correction_bias"] = torch.randn(config.num_experts, generator=gen) * 0.1
    layer.load_weights(**checkpoint)
    layer.process_weights()
    t_build = time.perf_counter() - t0

    x = torch.randn(args.tokens, h, generator=gen).to(torch.bfloat16)
    logits = torch.randn(args.tokens, config.num_experts, generator=gen)
    out = layer(x, router_logits=logits)  # warm-up
    times = []
    for _ in range(args.repeat):
        t0 = time.perf_counter()
        out = layer(x, router_logits=logits)
        times.append(time.perf_counter() - t0)

    topk = layer_topk(layer, logits)
    dw13, dw2 = quant.dequantize_weights(checkpoint, config.quant)
    qa = activation_quantizer(config.quant)
    gs = {"a13": checkpoint.get("a13_global_scale"), "a2": checkpoint.get("a2_global_scale")}
    t0 = time.perf_counter()
    ref = moe_float64(x, topk.weights, topk.ids, dw13, dw2, activation=config.activation,
                      routed_scaling_factor=config.routed_scaling_factor,
                      quantize_activation=None if qa is None else
                      (lambda v, which, e: qa(v.float(), None if gs[which] is None else gs[which][e])))
    t_ref = time.perf_counter() - t0
    err = relative_error(out, ref)
    tol = 1e-2 if config.quant is not QuantScheme.NVFP4 else 2e-1
    times.sort()
    print(f"build + load: {t_build * 1e3:.1f} ms; forward median {times[len(times) // 2] * 1e3:.2f} ms "
          f"(min {times[0] * 1e3:.2f} ms, {args.repeat} runs); float64 oracle {t_ref * 1e3:.0f} ms")
    print(f"relative error vs independent float64 computation: {err:.2e} (tolerance {tol:.0e}) -> "
          f"{'OK' if err <= tol else 'MISMATCH'}")
    return 0 if err <= tol else 1


def layer_topk(layer: Any, logits: Any) -> Any:
    from moe_core.router import route

    return route(logits, layer.config.top_k, layer.config.router, layer.correction_bias)


# --------------------------------------------------------------------------- bench


def cmd_bench(args: argparse.Namespace, rest: Sequence[str]) -> int:
    try:
        from moe_core import bench
    except ImportError as exc:
        print(f"moe-core bench is not available in this build: {exc}", file=sys.stderr)
        return 2
    return bench.main(list(rest))


# --------------------------------------------------------------------------- tune

TUNERS_GROUP = "moe_core.tuners"  # entry points: name -> main(argv) -> exit code, e.g. the cuda plugin's


def cmd_tune(rest: Sequence[str]) -> int:
    """``moe-core tune`` lists the installed tuners; ``moe-core tune NAME [-- args]`` runs one (it writes
    the launch configs its backends read on this machine)."""
    from importlib.metadata import entry_points

    tuners = {ep.name: ep for ep in entry_points(group=TUNERS_GROUP)}
    args = [a for a in rest if a != "--"]
    if not args or args[0] in ("-h", "--help"):
        if not tuners:
            print("no tuner installed (plugins register one under the entry-point group "
                  f"'{TUNERS_GROUP}', e.g. moe-plugin-cuda)")
            return 2 if not args else 0
        print("tuners (run: moe-core tune NAME -- --help):")
        for name in sorted(tuners):
            print(f"  {name:10s} {tuners[name].value}")
        return 0
    name, tuner_args = args[0], args[1:]
    if name not in tuners:
        print(f"no tuner named {name!r}; installed: {', '.join(sorted(tuners)) or 'none'}", file=sys.stderr)
        return 2
    try:
        return int(tuners[name].load()(tuner_args) or 0)
    except SystemExit as exc:  # argparse's --help / usage errors
        return exc.code if isinstance(exc.code, int) else 1


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moe-core", description="Mixture-of-Experts backends: list, plan, check, run.")
    parser.add_argument("--allow", action="append", metavar="PLUGIN", help="load only these plugins (repeatable)")
    parser.add_argument("--block", action="append", metavar="PLUGIN", help="never load these plugins (repeatable)")
    parser.add_argument("--strict", action="store_true", help="fail on a plugin that does not load")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list every backend and whether it is usable here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_backends)

    p = sub.add_parser("plan", help="negotiate backends for a layer and explain every rejection")
    p.add_argument("--preset", choices=sorted(PRESETS))
    p.add_argument("--experts", type=int, help="number of experts (global)")
    p.add_argument("--top-k", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--quant", default="unquantized", choices=[str(q) for q in QuantScheme])
    p.add_argument("--activation", default="silu", choices=[str(a) for a in Activation])
    p.add_argument("--ep", type=int, default=1, help="expert-parallel group size")
    p.add_argument("--max-tokens-per-rank", type=int, help="capacity of masked (low-latency) dispatch")
    p.add_argument("--dispatcher", default="auto")
    p.add_argument("--experts-backend", default="auto")
    p.add_argument("--dispatch-dtype", default="auto", choices=["auto"] + [str(d) for d in WireDtype])
    p.add_argument("--dispatch-format", default="auto", choices=["auto", "standard", "ep_normal", "ep_masked"])
    p.add_argument("--device", default=None, choices=DEVICE_KINDS,
                   help="target device kind (default: this machine's)")
    p.add_argument("--cuda-graph", action="store_true", help="only graph-safe plans")
    p.add_argument("--dry-run", action="store_true",
                   help="plan for a target device this machine lacks: do not require backends to be available here")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("doctor", help="check plugins and hook implementations; non-zero exit on problems")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("demo", help="run a CPU-sized layer of a preset and check it against float64")
    p.add_argument("--preset", default="deepseek-v3", choices=sorted(PRESETS))
    p.add_argument("--quant", default="unquantized", choices=[str(q) for q in QuantScheme])
    p.add_argument("--scale", type=int, default=16, help="divide hidden and intermediate sizes by this")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("bench", help="time the usable experts backends (options: moe-core bench -- --help)",
                       add_help=False)
    p.set_defaults(func=None)
    p = sub.add_parser("tune", help="list the installed tuners, or run one: moe-core tune NAME -- ARGS "
                                    "(writes launch configs for this machine's GPU)", add_help=False)
    p.set_defaults(func=None)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    passthrough = [i for i, a in enumerate(argv) if a in ("bench", "tune")]
    if passthrough:  # everything after the first of them belongs to that tool's own parser
        idx = passthrough[0]
        args = parser.parse_args(argv[: idx + 1])
        rest = [a for a in argv[idx + 1:] if a != "--"]
        return cmd_bench(args, rest) if argv[idx] == "bench" else cmd_tune(rest)
    args = parser.parse_args(argv)
    if getattr(args, "device", "unset") is None:
        args.device = local_device_kind()
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
