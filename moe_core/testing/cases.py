"""The conformance kit's vocabulary: options, cases, the context they run in, and their verdicts.

Below the checks (``checks``, ``ep``) and the engine that generates and runs cases (``kit``), so
those import it one way (docs/decisions.md).
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from moe_core.backends import BackendSpec, Role, load_object
from moe_core.config import MoEConfig
from moe_core.contracts import Format, QuantScheme, WireDtype
from moe_core.devices import DeviceKind
from moe_core.planner import negotiate_dtype
from moe_core.plugins import PluginManager
from moe_core.testing.data import Shape

__all__ = ["KitOptions", "Case", "KitContext", "CaseResult", "KitFailure", "KitSkip", "run_setup", "make_manager"]

REFERENCE_DISPATCHER = "reference.standard"  # the dispatcher experts cases run behind
REFERENCE_EXPERTS = "reference.reference"
# accelerators first: a backend declaring cuda and cpu is certified where it is fast
KIND_PREFERENCE = (DeviceKind.CUDA, DeviceKind.ROCM, DeviceKind.NPU, DeviceKind.CPU)


class KitFailure(AssertionError):
    """A conformance case failed; the message names the case and what was wrong."""


class KitSkip(Exception):
    """A case cannot run here (no device, backend unavailable, ...); the message says why."""


ManagerFactory = Union[str, Callable[[], Any], None]


@dataclass(frozen=True)
class KitOptions:
    """How the kit runs.

    :param backends: backend names to certify (bare ``triton`` or qualified ``cuda.triton``).
    :param setup: ``"module:function"`` called (no arguments) before plugins are loaded, in this
        process and in every spawned EP worker: install emulated vendor ops there.
    :param manager_factory: ``"module:function"`` (or, in-process only, a callable) returning the
        ``moe_core.plugins.PluginManager`` to use; default: the installed plugins.
    :param device: torch device where tensors live (e.g. ``"cpu"`` for a plan targeting ``npu``
        whose vendor ops are emulated on CPU); default: the device of the kind the backend runs on.
    :param device_kind: the config's device kind (``cpu``/``cuda``/``rocm``/``npu``); default: the
        first of the backend's declared kinds present on this machine.
    :param ep_sizes: EP world sizes for dispatcher cases (gloo on CPU, NCCL on CUDA).
    :param seed: data seed (default: fresh each run, printed in the report for replay).
    :param select: only cases whose id contains one of these substrings.
    :param ep_timeout_s: hard limit for one spawned EP world.
    """

    backends: tuple[str, ...]
    setup: Optional[str] = None
    manager_factory: ManagerFactory = None
    device: Optional[str] = None
    device_kind: Optional[str] = None
    shape: Shape = Shape()
    ep_sizes: tuple[int, ...] = (1, 2, 4)
    seed: Optional[int] = None
    select: tuple[str, ...] = ()
    ep_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if isinstance(self.backends, str):
            object.__setattr__(self, "backends", (self.backends,))
        if isinstance(self.select, str):
            object.__setattr__(self, "select", (self.select,))
        if self.seed is None:
            object.__setattr__(self, "seed", random.SystemRandom().randrange(1, 2**31))


@dataclass(frozen=True)
class Case:
    """One conformance case of one backend. ``id`` is stable across runs (it names the item)."""

    backend: str
    id: str
    run: Callable[["KitContext", "Case"], None] = field(compare=False, repr=False)
    params: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def title(self) -> str:
        return f"[{self.backend}] {self.id}"


@dataclass(frozen=True)
class CaseResult:
    backend: str
    case_id: str
    status: str  # "passed", "failed", "skipped"
    message: str = ""
    seconds: float = 0.0


def run_setup(setup: Optional[str]) -> None:
    if setup:
        load_object(setup)()


def make_manager(factory: ManagerFactory) -> Any:
    if factory is None:
        return PluginManager()
    fn = load_object(factory) if isinstance(factory, str) else factory
    return fn()


class KitContext:
    """State shared by the cases of one kit run: options, plugin manager, caches, results."""

    def __init__(self, options: KitOptions, manager: Any = None) -> None:
        self.options = options
        self._manager = manager
        self.results: list[CaseResult] = []
        self.cache: dict[Any, Any] = {}

    @property
    def manager(self) -> Any:
        if self._manager is None:
            run_setup(self.options.setup)
            self._manager = make_manager(self.options.manager_factory)
        return self._manager

    @property
    def shape(self) -> Shape:
        return self.options.shape

    def spec(self, name: str) -> BackendSpec:
        spec = self.manager.spec(name)
        if spec is None:
            raise KitFailure(f"backend {name!r} is not declared by any loaded plugin; {self.describe_plugins()}")
        return spec

    def describe_plugins(self) -> str:
        names = sorted({s.qualified_name for s in self.manager.specs})
        text = "known backends: " + ", ".join(names)
        failed = self.manager.failed()
        if failed:
            text += "; plugins that failed to load: " + "; ".join(f"{r.name}: {r.status}" for r in failed)
        return text

    def generator(self, case: Case, salt: str = "") -> torch.Generator:
        """A generator seeded from the run seed and the case id: data differ between runs, and a
        failing case replays exactly with ``--moe-kit-seed``."""
        gen = torch.Generator()
        gen.manual_seed(self.options.seed ^ zlib.crc32(f"{case.backend}/{case.id}/{salt}".encode()))
        return gen

    # ------------------------------------------------------------ where a backend runs

    def placement(self, spec: BackendSpec) -> tuple[str, torch.device]:
        """(config device kind, torch device) for ``spec``, or ``KitSkip`` when no declared kind
        is present on this machine."""
        opts = self.options
        if opts.device_kind:
            if opts.device_kind not in spec.devices:
                raise KitSkip(f"--moe-kit-device-kind {opts.device_kind} is not among the declared devices "
                              f"{sorted(spec.devices)}")
            kind = opts.device_kind
        else:
            present = [k for k in KIND_PREFERENCE if k in spec.devices and k.is_present()]
            if not present:
                raise KitSkip(f"none of the declared devices {sorted(spec.devices)} is present on this machine "
                              "(use --moe-kit-device-kind/--moe-kit-device with emulated vendor ops)")
            kind = present[0].value
        device = torch.device(opts.device) if opts.device else torch.device(DeviceKind(kind).torch_device_type)
        return kind, device

    def record(self, result: CaseResult) -> None:
        self.results.append(result)

    def natural_wire(self, spec: BackendSpec, scheme: QuantScheme, fmt: Format) -> WireDtype:
        """The wire dtype the planner's dtype chain (the core's rules and every loaded plugin's)
        gives ``spec`` for ``scheme`` behind the kit's dispatcher (``spec`` itself when fused):
        the dtype a user gets without choosing, so the main cases certify that one."""
        s = self.shape
        fused = spec.role is Role.FUSED
        config = MoEConfig(
            num_experts=s.num_experts, top_k=s.top_k, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
            quant=scheme, params_dtype=torch.bfloat16, device=self._config_kind(spec),
            dispatcher=spec.qualified_name if fused else REFERENCE_DISPATCHER, experts=spec.qualified_name,
            max_tokens_per_rank=s.tokens_large if fused else None)
        dispatcher = None if fused else self.manager.spec(REFERENCE_DISPATCHER)
        decision, _ = negotiate_dtype(self.manager, config, dispatcher, spec, Format.FUSED if fused else fmt)
        if decision is None or decision.dtype is None:  # the chain refuses: the case reports the planner's reasons
            return spec.wire_dtypes[0]
        return decision.dtype

    def _config_kind(self, spec: BackendSpec) -> str:
        """The device kind a config for ``spec`` targets, without skipping (cases are still being made)."""
        if self.options.device_kind:
            return self.options.device_kind
        present = [k.value for k in KIND_PREFERENCE if k in spec.devices and k.is_present()]
        return (present or sorted(spec.devices))[0]
