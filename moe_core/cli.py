"""The ``moe-core`` command line: backends, plan, doctor, demo, bench, tune, completion.

Built on click (parsing, help, errors, shell completion) with rich for tables and progress.
Exit status, for every command: 0 ok; 1 problems found (``doctor``, a ``demo`` mismatch, a bench
with nothing to time); 2 a usage error or an explicit choice that cannot be met (an unknown or
unusable ``--dispatcher`` / ``--experts-backend`` / ``--allow`` name, no plan for the layer).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap
import time
from typing import Any, Iterable, Optional, Sequence

import click
from rich.console import Console
from rich.table import Table

from moe_core import __version__
from moe_core import bench as bench_lib
from moe_core.backends import BackendSpec, Code, Role
from moe_core.config import PRESETS, MoEConfig, preset, scaled_preset
from moe_core.contracts import Activation, QuantScheme, WireDtype
from moe_core.devices import DEVICE_KINDS, local_device_kind
from moe_core.planner import Plan, PlanError, Rejection, plan
from moe_core.plugins import PluginLoadError, PluginManager, get_plugin_manager

OK, PROBLEMS, USAGE = 0, 1, 2  # exit codes
TABLE_WIDTH = 100  # tables fit 100 columns (narrower terminals wrap them to fit)
DEVICE_CHOICES = tuple(DEVICE_KINDS)
QUANT_CHOICES = tuple(str(q) for q in QuantScheme)


class SuggestingChoice(click.Choice):
    """``click.Choice`` (the error lists the choices) that also says which one was probably meant."""

    def convert(self, value: Any, param: Optional[click.Parameter], ctx: Optional[click.Context]) -> Any:
        try:
            return super().convert(value, param, ctx)
        except click.BadParameter as exc:
            exc.message += did_you_mean(str(value), [str(c) for c in self.choices])
            raise


def did_you_mean(value: str, names: Iterable[str]) -> str:
    """" Did you mean 'x'?" for the names that begin with ``value`` or else the closest one (difflib)."""
    names = list(names)
    close = [n for n in names if value and n.startswith(value)] or difflib.get_close_matches(value, names, n=1,
                                                                                             cutoff=0.5)
    return f" Did you mean {' or '.join(map(repr, close[:3]))}?" if close else ""


def console(stderr: bool = False) -> Console:
    """Tables on stdout fit the terminal (at most 100 columns); log lines on stderr are never wrapped."""
    width = min(shutil.get_terminal_size((TABLE_WIDTH, 24)).columns, TABLE_WIDTH)
    return Console(width=width, stderr=stderr, highlight=False, markup=False, soft_wrap=stderr)


# --------------------------------------------------------------------------- plugins and names


@dataclasses.dataclass
class Options:
    """The group's options, shared by every command."""

    allow: Optional[tuple[str, ...]]
    block: tuple[str, ...]
    strict: bool
    _manager: Optional[PluginManager] = None

    def manager(self) -> PluginManager:
        if self._manager is None:
            try:
                if self.allow is None and not self.block and not self.strict:
                    self._manager = get_plugin_manager()
                else:
                    self._manager = PluginManager(allow=self.allow, block=self.block, strict=self.strict)
            except PluginLoadError as exc:  # --strict
                click.echo(f"error: a plugin did not load (--strict): {exc}", err=True)
                raise click.exceptions.Exit(PROBLEMS) from exc
            self._check_names(self._manager)
        return self._manager

    def _check_names(self, manager: PluginManager) -> None:
        """``--allow`` of a plugin that is not installed is an unmet choice (exit 2); ``--block`` of one
        is only noted (blocking what is absent is harmless, and scripts block on every machine)."""
        known = sorted({r.name for r in manager.records})
        for name in self.allow or ():
            if name not in known:
                raise click.BadParameter(f"no installed plugin is named {name!r}; installed: "
                                         f"{', '.join(known)}.{did_you_mean(name, known)}", param_hint="--allow")
        for name in self.block:
            if name not in known:
                click.echo(f"note: --block {name}: no installed plugin has that name (installed: {', '.join(known)})."
                           + did_you_mean(name, known), err=True)


def check_backend_name(manager: PluginManager, value: str, option: str, roles: Sequence[Role]) -> None:
    """A usage error (with the choices and the closest name) unless ``value`` names a declared backend
    of one of ``roles``; names a plugin that failed to load, which may have been the one declaring it."""
    if value == "auto":
        return
    spec = manager.spec(value)
    what = " or ".join(str(r) for r in roles)
    if spec is not None and spec.role in roles:
        return
    if spec is not None:
        raise click.BadParameter(f"{value!r} is the name of {ARTICLE[spec.role]} {spec.role} backend, not of "
                                 f"{ARTICLE[roles[0]]} {what} backend", param_hint=option)
    names = sorted({n for s in manager.specs if s.role in roles for n in (s.name, s.qualified_name)})
    message = f"no {what} backend is named {value!r}; choose from: auto, {', '.join(names)}."
    message += did_you_mean(value, names)
    failed = [r.name for r in manager.failed()]
    if failed:
        message += f" Plugin(s) that failed to load (run `moe-core doctor`): {', '.join(failed)}."
    raise click.BadParameter(message, param_hint=option)


ARTICLE = {Role.DISPATCHER: "a", Role.EXPERTS: "an", Role.FUSED: "a"}
pass_options = click.make_pass_decorator(Options)


# --------------------------------------------------------------------------- the group


def _print_version(ctx: click.Context, _param: click.Parameter, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    torch_version = _installed_version("torch") or "absent"
    click.echo(f"moe-core {__version__} from {os.path.dirname(os.path.abspath(__file__))} "
               f"(Python {platform.python_version()}, torch {torch_version})")
    ctx.exit(OK)


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": TABLE_WIDTH},
             epilog="Exit status: 0 ok, 1 problems found, 2 usage error or an explicit choice that cannot be met. "
                    "Shell completion: eval \"$(moe-core completion bash)\" (or zsh, fish).")
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_print_version,
              help="Print the versions of moe-core, Python and torch, and exit.")
@click.option("--allow", multiple=True, metavar="PLUGIN", help="Load only these plugins (repeatable).")
@click.option("--block", multiple=True, metavar="PLUGIN", help="Never load these plugins (repeatable).")
@click.option("--strict", is_flag=True, help="Fail (exit 1) when a plugin does not load, instead of listing it.")
@click.pass_context
def app(ctx: click.Context, allow: tuple[str, ...], block: tuple[str, ...], strict: bool) -> None:
    """Mixture-of-Experts backends: list, plan, check, run, time."""
    ctx.obj = Options(allow=allow or None, block=block, strict=strict)


# --------------------------------------------------------------------------- backends


def _backend_row(manager: PluginManager, spec: BackendSpec, distribution: str) -> dict[str, Any]:
    reason = manager.availability(spec)
    return {"plugin": spec.plugin, "plugin_version": spec.plugin_version, "backend": spec.name,
            "role": str(spec.role), "available": reason.ok, "code": str(reason.code),
            "message": reason.message, "hint": reason.hint,
            # the declared capabilities (BackendSpec), for tools that pick or compare backends
            "qualified_name": spec.qualified_name, "distribution": distribution,
            "devices": sorted(spec.devices), "quant_schemes": sorted(map(str, spec.quant_schemes)),
            "formats": [str(f) for f in spec.formats], "wire_dtypes": [str(d) for d in spec.wire_dtypes],
            "activations": sorted(map(str, spec.activations)), "priority": spec.priority, "ep": str(spec.ep),
            "graph_safe_formats": sorted(map(str, spec.graph_safe_formats)),
            "graph_safe_on_request": sorted(map(str, spec.graph_safe_on_request)),
            "quantizes_internally": spec.quantizes_internally, "packages": list(spec.packages),
            "description": spec.description}


CAPABILITY_KEYS = ("qualified_name", "distribution", "devices", "quant_schemes", "formats", "wire_dtypes",
                   "activations", "priority", "ep", "graph_safe_formats", "graph_safe_on_request", "quantizes_internally", "packages",
                   "description")


def backend_rows(manager: PluginManager) -> list[dict[str, Any]]:
    """One row per declared backend and per plugin that did not load, sorted by plugin, role, name."""
    distributions = {r.name: r.distribution for r in manager.records}
    rows = [_backend_row(manager, spec, distributions.get(spec.plugin, "")) for spec in manager.specs]
    for record in manager.failed():  # a plugin that did not load still shows, with why
        rows.append({"plugin": record.name, "plugin_version": record.version, "backend": None, "role": None,
                     "available": False, "code": str(record.status.code), "message": record.status.message,
                     "hint": record.status.hint, **dict.fromkeys(CAPABILITY_KEYS),
                     "distribution": record.distribution})
    return sorted(rows, key=lambda r: (r["plugin"], r["role"] or "", r["backend"] or ""))


@app.command()
@click.option("--json", "as_json", is_flag=True, help="Print every row as JSON, with the declared capabilities.")
@pass_options
def backends(options: Options, as_json: bool) -> int:
    """List every backend and whether it is usable here (and if not: code, message, hint)."""
    manager = options.manager()
    rows = backend_rows(manager)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return OK
    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in ("BACKEND", "ROLE", "VERSION", "STATUS"):
        table.add_column(column, no_wrap=True)
    table.add_column("DETAIL", overflow="fold")
    for r in rows:
        name = f"{r['plugin']}.{r['backend']}" if r["backend"] else f"{r['plugin']} (plugin)"
        detail = "" if r["available"] else r["message"]
        if r["hint"]:
            detail += f" (hint: {r['hint']})"
        table.add_row(name, r["role"] or "-", r["plugin_version"], "available" if r["available"] else r["code"],
                      detail, style=None if r["available"] else "dim")
    console().print(table)
    for note in manager.duplicates:
        click.echo(f"note: {note}", err=True)
    return OK


# --------------------------------------------------------------------------- plan

SIZE = click.IntRange(min=1)


def plan_options(fn: Any) -> Any:
    """The layer options of ``plan`` (sizes, scheme, parallelism, explicit backend choices)."""
    decorators = [
        click.option("--preset", type=SuggestingChoice(sorted(PRESETS)),
                     help="A published model's layer sizes and router (the size options override them)."),
        click.option("--experts", type=SIZE, help="Number of experts (global)."),
        click.option("--top-k", type=SIZE, help="Experts per token."),
        click.option("--hidden", type=SIZE, help="Hidden size."),
        click.option("--intermediate", type=SIZE, help="Intermediate size of one expert."),
        click.option("--quant", type=SuggestingChoice(QUANT_CHOICES), default="unquantized", show_default=True,
                     help="Quantization scheme of the experts."),
        click.option("--activation", type=SuggestingChoice([str(a) for a in Activation]), default="silu",
                     show_default=True, help="Experts' activation."),
        click.option("--ep", type=SIZE, default=1, show_default=True, help="Expert-parallel group size."),
        click.option("--max-tokens-per-rank", type=SIZE, help="Capacity of masked (low-latency) dispatch."),
        click.option("--dispatcher", default="auto", show_default=True,
                     help="Dispatcher backend (`moe-core backends` lists them); an explicit one fails closed."),
        click.option("--experts-backend", default="auto", show_default=True,
                     help="Experts (or fused) backend; an explicit one fails closed."),
        click.option("--dispatch-dtype", type=SuggestingChoice(["auto"] + [str(d) for d in WireDtype]),
                     default="auto", show_default=True, help="Dtype on the dispatch wire."),
        click.option("--dispatch-format", type=SuggestingChoice(["auto", "standard", "ep_normal", "ep_masked"]),
                     default="auto", show_default=True, help="Dispatch format."),
        click.option("--device", type=SuggestingChoice(DEVICE_CHOICES),
                     help="Target device kind [default: this machine's]."),
        click.option("--cuda-graph", is_flag=True, help="Only graph-safe plans."),
        click.option("--dry-run", is_flag=True,
                     help="Plan for a target device this machine lacks: do not require backends to be usable here."),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def config_from_options(o: dict[str, Any]) -> MoEConfig:
    choices = dict(quant=QuantScheme(o["quant"]), ep_size=o["ep"], device=o["device"] or local_device_kind(),
                   cuda_graph=o["cuda_graph"], dispatcher=o["dispatcher"], experts=o["experts_backend"],
                   dispatch_dtype=o["dispatch_dtype"], dispatch_format=o["dispatch_format"],
                   activation=Activation(o["activation"]), max_tokens_per_rank=o["max_tokens_per_rank"])
    sizes = {"num_experts": o["experts"], "top_k": o["top_k"], "hidden_size": o["hidden"],
             "intermediate_size": o["intermediate"]}
    try:
        if o["preset"]:
            return preset(o["preset"], **{k: v for k, v in sizes.items() if v is not None}, **choices)
        missing = [f"--{flag}" for flag, key in (("experts", "num_experts"), ("top-k", "top_k"), ("hidden", "hidden_size"),
                                                 ("intermediate", "intermediate_size")) if sizes[key] is None]
        if missing:
            raise click.UsageError(f"give --preset NAME ({', '.join(sorted(PRESETS))}), or the layer's sizes: "
                                   f"{', '.join(missing)} missing")
        return MoEConfig(**sizes, **choices)
    except ValueError as exc:  # the config's own validation: a usage error, with its message
        raise click.UsageError(str(exc)) from exc


def concerns_user(rejection: Rejection, config: MoEConfig, manager: PluginManager) -> bool:
    """Whether a rejected pair says something about what the user asked: hidden are the pairs in which a
    backend the user did not name is built for another device kind (``rocm.mori x npu.npu_gmm`` on a
    CUDA target); an explicitly named backend always concerns the user."""
    named = {config.dispatcher, config.experts} - {"auto"}
    for name in {rejection.dispatcher, rejection.experts}:
        spec = manager.spec(name)
        if spec is None or name in named or spec.name in named:
            continue
        if config.device not in spec.devices:
            return False
    return True


def explain(result: Plan, manager: PluginManager, verbose: bool) -> str:
    """``Plan.explain()`` with the rejections that concern the user (all with ``verbose``)."""
    if verbose:
        return result.explain()
    shown = tuple(r for r in result.rejected if concerns_user(r, result.config, manager))
    text = dataclasses.replace(result, rejected=shown).explain()
    hidden = len(result.rejected) - len(shown)
    if hidden:
        text += f"\n  ({hidden} rejected candidate(s) built for other devices not shown: -v or --json lists them)"
    return text


@app.command("plan")
@plan_options
@click.option("-v", "--verbose", is_flag=True, help="List every rejected candidate (default: those that concern "
              "the target device and the backends you named).")
@click.option("--json", "as_json", is_flag=True, help="Print the plan, or the error, as JSON (every rejection).")
@pass_options
def plan_command(options: Options, verbose: bool, as_json: bool, **layer: Any) -> int:
    """Negotiate backends for a layer: the chosen plan, the dtype chain and why candidates were rejected."""
    config = config_from_options(layer)
    manager = options.manager()
    check_backend_name(manager, config.dispatcher, "--dispatcher", (Role.DISPATCHER, Role.FUSED))
    check_backend_name(manager, config.experts, "--experts-backend", (Role.EXPERTS, Role.FUSED))
    try:
        result = plan(config, manager=manager, dry_run=layer["dry_run"])
    except PlanError as err:
        if as_json:
            click.echo(json.dumps(err.to_json(), indent=2))
            return USAGE
        shown = err.rejected if verbose else tuple(r for r in err.rejected if concerns_user(r, config, manager))
        lines = [f"error: {err.summary}"] + [str(r) for r in (shown or err.rejected)]
        if len(shown) and len(shown) < len(err.rejected):
            lines.append(f"  ({len(err.rejected) - len(shown)} rejected candidate(s) built for other devices not "
                         "shown: -v or --json lists them)")
        click.echo("\n".join(lines), err=True)
        return USAGE
    click.echo(json.dumps(result.to_json(), indent=2) if as_json else explain(result, manager, verbose))
    return OK


# --------------------------------------------------------------------------- doctor


def _installed_version(package: str) -> Optional[str]:
    """The version of the distribution providing import name ``package``, without importing it;
    None when it is not installed ("installed" when it is but no distribution names it)."""
    try:
        if importlib.util.find_spec(package) is None:
            return None
    except (ImportError, ValueError):
        return None
    for dist in importlib.metadata.packages_distributions().get(package, [package]):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "installed"


def _nvidia_driver() -> Optional[str]:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10)
        return out.stdout.splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


CORE_PACKAGES = ("torch", "pluggy", "click", "rich", "numpy", "matplotlib")


def environment(manager: PluginManager) -> dict[str, Any]:
    """What ``vllm collect-env`` tells: Python, torch and its accelerator build, the devices, and the
    versions of the core's packages and of every vendor package the installed backends declare."""
    import torch

    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            gpus.append({"index": i, "name": props.name, "capability": f"{props.major}.{props.minor}",
                         "memory_gib": round(props.total_memory / 2**30, 1)})
    vendor = sorted({p for spec in manager.specs for p in spec.packages})
    return {
        "moe_core": __version__,
        "python": platform.python_version(), "python_executable": sys.executable, "platform": platform.platform(),
        "cpu": bench_lib.cpu_name(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "torch_cuda": torch.version.cuda, "torch_hip": getattr(torch.version, "hip", None),
        "device_kind": local_device_kind(), "gpus": gpus,
        "nvidia_driver": _nvidia_driver() if torch.version.cuda else None,
        "packages": {p: _installed_version(p) for p in (*CORE_PACKAGES, *[v for v in vendor if v not in CORE_PACKAGES])},
    }


def doctor_report(manager: PluginManager) -> dict[str, Any]:
    from moe_core.runtime import Dispatcher, Experts, FusedMoE

    problems: list[str] = []
    plugins = []
    for record in manager.records:
        plugins.append({"plugin": record.name, "version": record.version, "source": record.source,
                        "distribution": record.distribution, "code": str(record.status.code),
                        "message": record.status.message, "hint": record.status.hint,
                        "traceback": record.status.traceback})
        if not record.status.ok and record.status.code is not Code.DISABLED:
            problems.append(f"plugin {record.name}: {record.status}")
    hooks = "ok"
    try:
        manager.pm.check_pending()
    except Exception as exc:  # hookimpls without a spec
        hooks = str(exc)
        problems.append(f"hook validation: {exc}")
    base = {Role.DISPATCHER: Dispatcher, Role.EXPERTS: Experts, Role.FUSED: FusedMoE}
    backends_ = []
    for spec in manager.specs:
        reason = manager.availability(spec)
        row = {"backend": spec.qualified_name, "role": str(spec.role), "code": str(reason.code),
               "message": reason.message, "hint": reason.hint}
        if reason.code in (Code.LOAD_ERROR, Code.API_MISMATCH):  # `backends` shows these as faults, not as absence
            problems.append(f"backend {spec.qualified_name}: {reason}")
        elif reason.ok:
            try:  # an available backend's implementation must import and have the right base class
                cls = spec.load_impl()
                if not (isinstance(cls, type) and issubclass(cls, base[spec.role])):
                    raise TypeError(f"{spec.impl} is not a subclass of moe_core.{base[spec.role].__name__}")
            except Exception as exc:
                row.update(code=str(Code.LOAD_ERROR), message=f"implementation {spec.impl} does not validate: "
                                                               f"{type(exc).__name__}: {exc}")
                problems.append(f"backend {spec.qualified_name}: {row['message']}")
        backends_.append(row)
    return {"environment": environment(manager), "plugins": plugins, "hooks": hooks,
            "duplicates": manager.duplicates, "backends": backends_, "problems": problems}


@app.command()
@click.option("--json", "as_json", is_flag=True, help="Print the report (environment, plugins, backends) as JSON.")
@pass_options
def doctor(options: Options, as_json: bool) -> int:
    """Check the environment, plugins, hook implementations and backends; exit 1 on any problem."""
    report = doctor_report(options.manager())
    if as_json:
        click.echo(json.dumps(report, indent=2))
        return PROBLEMS if report["problems"] else OK
    env = report["environment"]
    lines = ["environment:",
             f"  moe-core {env['moe_core']}, Python {env['python']} ({env['python_executable']})",
             f"  platform {env['platform']}; CPU {env['cpu']} ({env['cpu_count']} cores)",
             f"  torch {env['torch']}" + (f", CUDA {env['torch_cuda']}" if env["torch_cuda"] else "")
             + (f", HIP {env['torch_hip']}" if env["torch_hip"] else "") + f"; this machine's device kind: "
             f"{env['device_kind']}" + (f"; NVIDIA driver {env['nvidia_driver']}" if env["nvidia_driver"] else "")]
    lines += [f"  GPU {g['index']}: {g['name']} (sm {g['capability']}, {g['memory_gib']} GiB)" for g in env["gpus"]]
    lines.append(textwrap.fill(", ".join(f"{p} {v or 'absent'}" for p, v in env["packages"].items()),
                               TABLE_WIDTH, initial_indent="  packages: ", subsequent_indent="    "))
    lines.append("plugins:")
    for p in report["plugins"]:
        status = "ok" if p["code"] == "OK" else p["code"]
        lines.append(f"  {p['plugin']} {p['version']} ({p['source']}): {status}")
        if p["code"] not in ("OK", "DISABLED"):
            lines.append(f"    {p['message']}")
            if p["traceback"]:
                lines.append("    " + p["traceback"].rstrip().replace("\n", "\n    "))
    if report["hooks"] != "ok":
        lines.append(f"hook validation: {report['hooks']}")
    lines += [f"duplicate: {note}" for note in report["duplicates"]]
    lines.append("backends:")
    for b in sorted(report["backends"], key=lambda b: b["backend"]):
        lines.append(f"  {b['backend']}: " + ("ok" if b["code"] == "OK" else f"{b['code']} ({b['message']})"))
    lines.append(f"{len(report['problems'])} problem(s)")
    lines += [f"  - {p}" for p in report["problems"]]
    click.echo("\n".join(lines))
    return PROBLEMS if report["problems"] else OK


# --------------------------------------------------------------------------- demo


@app.command()
@click.option("--preset", "preset_name", type=SuggestingChoice(sorted(PRESETS)), default="deepseek-v3",
              show_default=True, help="The model whose layer to run.")
@click.option("--quant", type=SuggestingChoice(QUANT_CHOICES), default="unquantized", show_default=True,
              help="Quantization scheme of the experts.")
@click.option("--scale", type=click.IntRange(min=1), default=16, show_default=True,
              help="Divide the hidden and intermediate sizes by this (kept multiples of 16).")
@click.option("--tokens", type=click.IntRange(min=1), default=64, show_default=True, help="Tokens in the batch.")
@click.option("--repeat", type=click.IntRange(min=1), default=5, show_default=True, help="Timed forward calls.")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the weights and inputs.")
@click.option("-v", "--verbose", is_flag=True, help="List every rejected candidate of the plan.")
@pass_options
def demo(options: Options, preset_name: str, quant: str, scale: int, tokens: int, repeat: int, seed: int,
         verbose: bool) -> int:
    """Run a CPU-sized layer of a preset and check it against an independent float64 computation."""
    import torch

    from moe_core import quant as quant_lib
    from moe_core.layer import MoELayer
    from moe_core.reference.experts import activation_quantizer
    from moe_core.reference.oracle import moe_float64, relative_error
    from moe_core.router import route

    config = scaled_preset(preset_name, scale, quant=QuantScheme(quant), params_dtype=torch.bfloat16)
    h, i = config.hidden_size, config.intermediate_size
    click.echo(f"demo: {preset_name} scaled 1/{scale}: E={config.num_experts} top-{config.top_k} H={h} I={i} "
               f"quant={config.quant}, T={tokens}")
    t0 = time.perf_counter()
    layer = MoELayer(config, manager=options.manager())
    click.echo(explain(layer.plan, options.manager(), verbose))
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(config.num_experts, 2 * i, h, generator=gen) / h ** 0.5
    w2 = torch.randn(config.num_experts, h, i, generator=gen) / i ** 0.5
    checkpoint = quant_lib.quantize_weights(w13, w2, config.quant)
    if config.router.use_correction_bias:
        checkpoint["correction_bias"] = torch.randn(config.num_experts, generator=gen) * 0.1
    layer.load_weights(**checkpoint)
    layer.process_weights()
    t_build = time.perf_counter() - t0

    x = torch.randn(tokens, h, generator=gen).to(torch.bfloat16)
    logits = torch.randn(tokens, config.num_experts, generator=gen)
    out = layer(x, router_logits=logits)  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = layer(x, router_logits=logits)
        times.append(time.perf_counter() - t0)

    topk = route(logits, config.top_k, config.router, layer.correction_bias)
    dw13, dw2 = quant_lib.dequantize_weights(checkpoint, config.quant)
    qa = activation_quantizer(config.quant)
    gs = {"a13": checkpoint.get("a13_global_scale"), "a2": checkpoint.get("a2_global_scale")}
    t0 = time.perf_counter()
    ref = moe_float64(x, topk.weights, topk.ids, dw13, dw2, activation=config.activation,
                      routed_scaling_factor=config.routed_scaling_factor,
                      quantize_activation=None if qa is None else
                      (lambda v, which, e: qa(v.float(), None if gs[which] is None else gs[which][e])))
    t_ref = time.perf_counter() - t0
    err = relative_error(out, ref)
    tol = 1e-2  # every scheme: the oracle applies the scheme's own activation quantization
    times.sort()
    click.echo(f"build + load: {t_build * 1e3:.1f} ms; forward median {times[len(times) // 2] * 1e3:.2f} ms "
               f"(min {times[0] * 1e3:.2f} ms, {repeat} runs); float64 oracle {t_ref * 1e3:.0f} ms")
    click.echo(f"relative error vs independent float64 computation: {err:.2e} (tolerance {tol:.0e}) -> "
               f"{'OK' if err <= tol else 'MISMATCH'}")
    return OK if err <= tol else PROBLEMS


# --------------------------------------------------------------------------- bench


class ListOptionsCommand(click.Command):
    """A command whose repeatable options also take several values after one flag
    (``--tokens 1 16 64``, argparse's ``nargs="+"``, the form benchmarks/cuda/run_h100.sh uses), and
    which ignores a leading ``--`` (``moe-core bench -- ARGS``, the form before the command had its own
    options). Only for commands without positional arguments: every bare word continues the list."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        lists = {opt for p in self.params if isinstance(p, click.Option) and p.multiple for opt in p.opts}
        args = args[1:] if args[:1] == ["--"] else args
        out: list[str] = []
        current, expects_value = None, False
        for arg in args:
            if arg.startswith("-") and not expects_value:
                current = arg if arg in lists else None
                expects_value = current is not None
                out.append(arg)
            elif current is not None and not expects_value:
                out += [current, arg]
            else:
                out.append(arg)
                expects_value = False
        return super().parse_args(ctx, out)


@app.command(cls=ListOptionsCommand)
@click.option("--presets", multiple=True, type=SuggestingChoice(sorted(PRESETS)), metavar="NAME...",
              help="Presets to time [default: all four]. Several values may follow one flag.")
@click.option("--tokens", multiple=True, type=click.IntRange(min=1), metavar="T...",
              help="Token counts [default: 1..16384 on a GPU, 1 16 64 256 on a CPU].")
@click.option("--quant", multiple=True, type=SuggestingChoice(QUANT_CHOICES), metavar="SCHEME...",
              help="Quant schemes [default: unquantized fp8_block on a GPU, unquantized on a CPU].")
@click.option("--backends", "backend_names", multiple=True, metavar="NAME...",
              help="Experts backends [default: every usable one; on an accelerator not the reference, the slow "
                   "oracle].")
@click.option("--scale", type=click.IntRange(min=1), default=None,
              help="Divide hidden and intermediate sizes by this, as `demo` does [default: 1 on a GPU, 16 on a CPU].")
@click.option("--device", type=SuggestingChoice(DEVICE_CHOICES), help="Device kind [default: this machine's].")
@click.option("--dtype", type=SuggestingChoice(["bf16", "fp16", "fp32"]), default="bf16", show_default=True,
              help="Activation and weight dtype of unquantized layers.")
@click.option("--iters", type=click.IntRange(min=1), default=None,
              help="Timed calls per cell (halved from T=4096) [default: 20 on a GPU, 5 on a CPU].")
@click.option("--warmup", type=click.IntRange(min=0), default=None,
              help="Untimed calls before timing a cell [default: 3 on a GPU, 2 on a CPU].")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch threads [default: 1 on a CPU (steady timings on a shared machine), torch's own elsewhere].")
@click.option("--no-graph", is_flag=True, help="Eager timing only (no CUDA-graph replay).")
@click.option("--graph-max-tokens", type=click.IntRange(min=1), default=4096, show_default=True,
              help="Time CUDA-graph replay only up to this many tokens.")
@click.option("--bw", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Memory bandwidth in bytes/s for the floor model [default: the device's, where known].")
@click.option("--peak-bf16", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Peak bf16 FLOP/s for the floor model [default: the device's, where known].")
@click.option("--peak-fp8", type=click.FloatRange(min=0, min_open=True), default=None,
              help="Peak FP8 FLOP/s for the floor model [default: the device's, where known].")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write every result here; a CSV and a PNG plot go beside it "
                   "[default: moe-core-bench-DEVICE-TIME.json in this directory].")
@click.option("--backend-options", default=None, metavar="JSON",
              help='JSON of backend_options for every layer, e.g. \'{"triton": {"config_dir": "DIR"}}\'.')
@pass_options
def bench(options: Options, **opts: Any) -> int:
    """Time the usable experts backends through MoELayer on this machine: a table, and JSON, CSV and a
    PNG plot of every cell (the plot needs matplotlib: pip install 'moe-core[plot]')."""
    manager = options.manager()
    kind = opts["device"] or local_device_kind()
    for name in opts["backend_names"]:
        check_backend_name(manager, name, "--backends", (Role.EXPERTS, Role.FUSED))
    try:
        backend_options = json.loads(opts["backend_options"]) if opts["backend_options"] else {}
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="--backend-options") from exc
    settings = bench_lib.Settings.for_device(
        kind, presets=opts["presets"], tokens=opts["tokens"], quants=opts["quant"], backends=opts["backend_names"],
        scale=opts["scale"], dtype=opts["dtype"], iters=opts["iters"], warmup=opts["warmup"], threads=opts["threads"],
        graph=not opts["no_graph"], graph_max_tokens=opts["graph_max_tokens"], bw=opts["bw"],
        peak_bf16=opts["peak_bf16"], peak_fp8=opts["peak_fp8"], backend_options=backend_options,
        json_path=opts["json_path"], argv=sys.argv[1:])
    return bench_lib.run(settings, manager, console(stderr=True), console())


# --------------------------------------------------------------------------- tune

TUNERS_GROUP = "moe_core.tuners"  # entry points: name -> main(argv) -> exit code, e.g. the cuda plugin's


@app.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
             add_help_option=False)
@click.argument("name", required=False)
@click.argument("tuner_args", nargs=-1, type=click.UNPROCESSED)
def tune(name: Optional[str], tuner_args: tuple[str, ...]) -> int:
    """List the installed tuners, or run one: moe-core tune NAME -- ARGS (writes launch configs for this
    machine's GPU; moe-core tune NAME -- --help lists its options)."""
    tuners = {ep.name: ep for ep in importlib.metadata.entry_points(group=TUNERS_GROUP)}
    if name is None or name in ("-h", "--help"):
        if not tuners:
            click.echo("no tuner installed (plugins register one under the entry-point group "
                       f"'{TUNERS_GROUP}', e.g. moe-plugin-cuda)")
            return USAGE if name is None else OK
        click.echo("tuners (run: moe-core tune NAME -- --help):")
        for tuner in sorted(tuners):
            click.echo(f"  {tuner:10s} {tuners[tuner].value}")
        return OK
    if name not in tuners:
        raise click.BadParameter(f"no tuner named {name!r}; installed: {', '.join(sorted(tuners)) or 'none'}."
                                 + did_you_mean(name, tuners), param_hint="NAME")
    args = [a for a in tuner_args if a != "--"]
    try:
        return int(tuners[name].load()(args) or 0)
    except SystemExit as exc:  # argparse's --help / usage errors
        return exc.code if isinstance(exc.code, int) else PROBLEMS


# --------------------------------------------------------------------------- completion


@app.command()
@click.argument("shell", type=SuggestingChoice(["bash", "zsh", "fish"]))
def completion(shell: str) -> int:
    """Print the shell completion script: eval "$(moe-core completion bash)" in ~/.bashrc (zsh, fish alike)."""
    from click.shell_completion import get_completion_class

    cls = get_completion_class(shell)
    assert cls is not None  # the choices are click's built-in shells
    click.echo(cls(app, {}, "moe-core", "_MOE_CORE_COMPLETE").source())
    return OK


# --------------------------------------------------------------------------- entry point


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 problems found, 2 usage error)."""
    try:
        code = app.main(args=list(sys.argv[1:] if argv is None else argv), prog_name="moe-core",
                        standalone_mode=False)
    except click.ClickException as exc:  # usage errors (2), with their message
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        return PROBLEMS
    except BrokenPipeError:  # `moe-core plan ... | head`: stop quietly, as pip does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return PROBLEMS
    return OK if code is None else int(code)


if __name__ == "__main__":
    sys.exit(main())
