"""Backend declarations (``BackendSpec``) and structured availability (``Reason``, ``Code``).

A plugin declares its backends as static data: listing them never imports a vendor library.
The implementation class and the probe are named as lazy ``"module:attr"`` strings.
"""

from __future__ import annotations

import importlib
import traceback
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

from moe_core.contracts import Activation, Format, QuantScheme, WireDtype, _StrEnum

if TYPE_CHECKING:
    from moe_core.config import MoEConfig

__all__ = ["Role", "EPSupport", "Code", "Reason", "BackendSpec", "available", "unavailable", "load_object"]


class Role(_StrEnum):
    DISPATCHER = "dispatcher"
    EXPERTS = "experts"
    FUSED = "fused"  # dispatch + experts + combine in one backend


class EPSupport(_StrEnum):
    """How a backend stands to expert parallelism (``BackendSpec.ep``)."""

    NONE = "none"  # single rank only
    ANY = "any"  # with and without an EP group
    REQUIRED = "required"  # only with an EP group of size > 1


class Code(_StrEnum):
    """Why a backend or a combination cannot be used."""

    OK = "OK"
    NOT_INSTALLED = "NOT_INSTALLED"
    LOAD_ERROR = "LOAD_ERROR"
    API_MISMATCH = "API_MISMATCH"
    NO_DEVICE = "NO_DEVICE"
    UNSUPPORTED_ARCH = "UNSUPPORTED_ARCH"
    UNSUPPORTED_QUANT = "UNSUPPORTED_QUANT"
    UNSUPPORTED_SHAPE = "UNSUPPORTED_SHAPE"
    UNSUPPORTED_PARALLEL = "UNSUPPORTED_PARALLEL"
    UNSUPPORTED_FEATURE = "UNSUPPORTED_FEATURE"  # a model feature the backend does not declare (expert biases)
    FORMAT_MISMATCH = "FORMAT_MISMATCH"
    NO_COMMON_DTYPE = "NO_COMMON_DTYPE"
    NOT_GRAPH_SAFE = "NOT_GRAPH_SAFE"
    DISABLED = "DISABLED"


@dataclass(frozen=True)
class Reason:
    """One structured verdict: a code, a sentence, and what the user can do about it."""

    code: Code
    message: str
    hint: str = ""
    traceback: Optional[str] = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.code is Code.OK

    def to_json(self) -> dict[str, str]:
        return {"code": str(self.code), "message": self.message, "hint": self.hint}

    def __str__(self) -> str:
        text = f"{self.code}: {self.message}"
        return f"{text} (hint: {self.hint})" if self.hint else text


def available(message: str = "available") -> Reason:
    return Reason(Code.OK, message)


def unavailable(code: Code, message: str, hint: str = "") -> Reason:
    return Reason(code, message, hint)


def from_exception(code: Code, what: str, exc: BaseException) -> Reason:
    """A ``Reason`` for an exception, keeping its traceback."""
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return Reason(code, f"{what}: {type(exc).__name__}: {exc}", "", tb)


def load_object(path: str) -> Any:
    """Import ``"package.module:attr"`` (the lazy reference format of specs)."""
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"expected 'module:attr', got {path!r}")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def _enum(backend: str, field_name: str, kind: type, value: Any) -> Any:
    if kind is str:
        if not isinstance(value, str):
            raise TypeError(f"BackendSpec {backend!r}: {field_name} entries must be str, got {value!r}")
        return value
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"BackendSpec {backend!r}: {field_name} has {value!r}, expected one of "
                         f"{', '.join(str(m) for m in kind)}") from None


Probe = Callable[[], Reason]
Check = Callable[["MoEConfig", "BackendSpec"], list[Reason]]


@dataclass(frozen=True)
class BackendSpec:
    """Static declaration of one backend. Returned by ``moe_core_backends``.

    Capabilities are data that the core's planner checks; anything that is not expressible as
    data goes in ``check``, a lazy function ``(config, spec) -> list[Reason]`` run at plan time.

    - ``formats``: dispatcher: formats it can produce, in preference order; experts: formats
      it accepts; fused: ``(Format.FUSED,)``.
    - ``wire_dtypes``: dtypes the dispatcher can carry / the experts accept, preferred first.
    - ``graph_safe_formats``: formats in which the backend never syncs with the host, so it can
      be captured in a CUDA graph.
    - ``graph_safe_on_request``: formats in which the backend runs a capturable variant only when
      the layer asks for CUDA graphs (``MoEConfig.cuda_graph``); without the request it may sync
      (``torch_a2a``'s normal mode reads exact counts on the host unless asked). The planner
      treats them as graph-safe under ``cuda_graph`` and ranks them after ``graph_safe_formats``.
    - ``devices``: device kinds it runs on: ``"cpu"``, ``"cuda"``, ``"rocm"``, ``"npu"``.
    - ``impl``: ``"module:Class"``; the class is instantiated with a ``BackendContext`` at plan
      time (see ``moe_core.runtime``).
    - ``probe``: ``"module:function"`` returning a ``Reason`` (OK or why not); it must be cheap,
      never raise and never import a vendor library at module import time of the plugin.
    - ``quantizes_internally``: the experts take BF16 and quantize themselves (dtype chain step 2).
    - ``ep``: an ``EPSupport``: ``NONE`` (single rank only; the default, so that no backend claims
      expert parallelism without saying so), ``ANY`` (works with and without an EP group: experts that
      compute on the rank's local experts) or ``REQUIRED`` (only with an EP group of size > 1:
      dispatchers and fused backends that communicate). The strings ``"none"``, ``"any"``,
      ``"required"`` are accepted and converted here, once. The kit checks the claim both ways.
    - ``plugin`` / ``plugin_version``: ``None`` until the plugin manager registers the spec.
    - ``priority``: higher wins among candidates that can serve a layer; ``priority_reason`` says why
      this backend ranks where it does (the plan quotes it when it picks this backend over a
      lower-priority one that could also serve).
    - ``keeps_loaded_weights``: ``process_weights`` never rewrites the loaded tensors in place,
      so they may be shared with their owner (``MoELayer.adopt_weights`` of a Hugging Face
      module's parameters); undeclared means the owner's tensors are copied once first.
    - ``expert_bias``: the experts add ``w13_bias`` / ``w2_bias`` (``MoEConfig.expert_bias``);
      undeclared means refused. The clamped ``Activation.SWIGLU_OAI`` is declared in
      ``activations`` like any other activation.
    - ``packages``: import names of the vendor Python packages the backend needs (what its probe
      looks for); ``moe-core doctor`` reports their installed versions. Never imported by the core.
    """

    name: str
    role: Role
    impl: str
    formats: tuple[Format, ...]
    devices: frozenset[str]
    wire_dtypes: tuple[WireDtype, ...] = (WireDtype.BF16,)
    quant_schemes: frozenset[QuantScheme] = frozenset({QuantScheme.UNQUANTIZED})
    activations: frozenset[Activation] = frozenset({Activation.SILU})
    graph_safe_formats: frozenset[Format] = frozenset()
    graph_safe_on_request: frozenset[Format] = frozenset()
    ep: EPSupport = EPSupport.NONE
    priority: int = 0
    priority_reason: str = ""
    probe: Optional[Union[str, Probe]] = None
    check: Optional[Union[str, Check]] = None
    quantizes_internally: bool = False
    description: str = ""
    expert_bias: bool = False
    keeps_loaded_weights: bool = False
    packages: tuple[str, ...] = ()
    # filled in by the plugin manager at registration:
    plugin: Optional[str] = None
    plugin_version: Optional[str] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"backend name {self.name!r} must be a simple identifier")
        # declared data is checked here, where the plugin builds it, not later in the planner:
        # strings become the enums (as in MoEConfig); a bare string for a collection is refused
        object.__setattr__(self, "role", _enum(self.name, "role", Role, self.role))
        for name, kind, wrap in (("formats", Format, tuple), ("wire_dtypes", WireDtype, tuple),
                                 ("quant_schemes", QuantScheme, frozenset), ("activations", Activation, frozenset),
                                 ("graph_safe_formats", Format, frozenset),
                                 ("graph_safe_on_request", Format, frozenset), ("devices", str, frozenset)):
            value = getattr(self, name)
            if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list, set, frozenset)):
                raise TypeError(f"BackendSpec {self.name!r}: {name} must be a tuple/frozenset of {kind.__name__}, "
                                f"got {value!r}")
            object.__setattr__(self, name, wrap(_enum(self.name, name, kind, v) for v in value))
        for name in ("impl", "description"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"BackendSpec {self.name!r}: {name} must be a str, got {getattr(self, name)!r}")
        if type(self.priority) is not int:
            raise TypeError(f"BackendSpec {self.name!r}: priority must be an int, got {self.priority!r}")
        if not isinstance(self.quantizes_internally, bool):
            raise TypeError(f"BackendSpec {self.name!r}: quantizes_internally must be a bool, "
                            f"got {self.quantizes_internally!r}")
        try:
            object.__setattr__(self, "ep", EPSupport(self.ep))
        except ValueError:
            raise ValueError(f"BackendSpec.ep of backend {self.name!r} must be one of "
                             f"{', '.join(repr(str(e)) for e in EPSupport)} (moe_core.EPSupport), got {self.ep!r}") from None
        if self.role is Role.FUSED and self.formats != (Format.FUSED,):
            raise ValueError("a fused backend declares formats=(Format.FUSED,)")

    @property
    def qualified_name(self) -> str:
        return f"{self.plugin}.{self.name}" if self.plugin else self.name

    def run_probe(self) -> Reason:
        """Availability on this machine. Never raises: errors become ``LOAD_ERROR``."""
        if self.probe is None:
            return available()
        try:
            fn = load_object(self.probe) if isinstance(self.probe, str) else self.probe
            reason = fn()
            if not isinstance(reason, Reason):
                return Reason(Code.LOAD_ERROR, f"probe of {self.name} returned {reason!r}")
            return reason
        except (Exception, SystemExit) as exc:  # a broken probe must not break listing (nor exit the process)
            return from_exception(Code.LOAD_ERROR, f"probe of {self.name} raised", exc)

    def run_check(self, config: "MoEConfig") -> list[Reason]:
        if self.check is None:
            return []
        try:
            fn = load_object(self.check) if isinstance(self.check, str) else self.check
            reasons = list(fn(config, self))
            if not all(isinstance(r, Reason) for r in reasons):
                raise TypeError(f"the check must return a list of Reason, got {reasons!r}")
            return [r for r in reasons if not r.ok]
        except (Exception, SystemExit) as exc:
            return [from_exception(Code.LOAD_ERROR, f"config check of {self.name} raised", exc)]

    def load_impl(self) -> type:
        return load_object(self.impl)
