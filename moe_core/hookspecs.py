"""Hook specifications of moe-core (pluggy project ``moe_core``): the public plugin contract.

A plugin is any object (usually a ``moe_core.BackendPlugin`` instance) registered under the
entry-point group ``moe_core.plugins`` whose methods are marked with ``@moe_core.hookimpl``.
Hook implementations may accept a subset of a spec's arguments (pluggy's rule), so specs can
gain arguments in minor versions without breaking plugins.

``HOOKSPEC_VERSION`` is ``(major, minor)``. A plugin declares the version it was written for in
the attribute ``moe_core_hookspec_version``; a different major, or a newer minor than the
core's, is reported as ``API_MISMATCH`` and the plugin is not registered.

Stage hooks (``dispatch``, ``apply``, ``combine``, ``process_weights``) are **not** called per
forward: the layer calls the backend objects bound in its plan directly. The hooks are the
traced path (``MoELayer(..., trace=True)``), which goes through pluggy with monitoring, and the
way tools call a stage generically. Exactly one plugin owns a backend object and answers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import pluggy

if TYPE_CHECKING:
    import torch

    from moe_core.backends import BackendSpec
    from moe_core.contracts import CombineInput, DispatchOutput, TopK
    from moe_core.layer import MoELayer
    from moe_core.dtype_chain import DtypeDecision, DtypeRequest
    from moe_core.runtime import Dispatcher, Experts, FusedMoE

PROJECT = "moe_core"
HOOKSPEC_VERSION = (1, 0)

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def moe_core_backends() -> "list[BackendSpec]":
    """Declare this plugin's backends.

    :return: a list of ``BackendSpec`` (static data; the implementation and probe are lazy
        ``"module:attr"`` strings).

    Called once per plugin manager, at discovery. Every plugin answers (collect-all). Must not
    import a vendor library: listing backends has to work on machines without the hardware.
    """


@hookspec(firstresult=True)
def select_dispatch_dtype(request: "DtypeRequest") -> "Optional[DtypeDecision]":
    """Choose the wire dtype of dispatched activations for one (dispatcher, experts) pair.

    :param request: the layer config, the two specs, the format and the dtypes both sides can
        carry (``request.common``), plus the steps decided so far.
    :return: ``request.decide(dtype, reason)`` to decide, or ``None`` to pass.

    Called once per candidate pair at plan time. The first non-``None`` result wins. The core
    answers the user's explicit choice (``tryfirst``), "experts that quantize internally take
    BF16", and the core default (``trylast``). Plugins answer their own rules (what their experts'
    quant scheme requires, their platform default). Hardware validation is done by **wrappers**
    (``@hookimpl(wrapper=True)``) that receive the decision from ``yield`` and may return
    ``decision.then(dtype, reason, warning=...)`` or ``decision.reject(code, message, hint)``;
    every step is kept in the plan's ``dtype_trail``.
    """


@hookspec(firstresult=True)
def dispatch(backend: "Dispatcher", hidden_states: "torch.Tensor", topk: "TopK") -> "Optional[DispatchOutput]":
    """Dispatch tokens to where their experts live.

    :param backend: the dispatcher object bound in the plan.
    :param hidden_states: ``[T, H]`` activations of this rank.
    :param topk: this rank's routing (global expert ids).
    :return: a ``DispatchOutput`` of the plan's format, or ``None`` if ``backend`` is not yours.

    Called only on the traced path; the owner of ``backend`` answers.
    """


@hookspec(firstresult=True)
def apply(backend: "Experts", layer: "MoELayer", dispatched: "DispatchOutput") -> "Optional[CombineInput]":
    """Run the experts on dispatched tokens.

    :param backend: the experts object bound in the plan.
    :param layer: the ``MoELayer`` owning the (processed) weights.
    :param dispatched: what ``dispatch`` returned.
    :return: the ``CombineInput`` of the same format (weighted or not, per the format's rule), or
        ``None`` if ``backend`` is not yours.
    """


@hookspec(firstresult=True)
def combine(backend: "Dispatcher", combine_input: "CombineInput") -> "Optional[torch.Tensor]":
    """Return expert outputs to the tokens' ranks and reduce over top-k.

    :return: ``[T, H]`` for this rank's tokens, or ``None`` if ``backend`` is not yours.
    """


@hookspec(firstresult=True)
def process_weights(backend: "Experts | FusedMoE", layer: "MoELayer") -> "Optional[bool]":
    """Convert the layer's loaded weights to ``backend``'s layout, in place.

    :return: ``True`` once done, or ``None`` if ``backend`` is not yours.

    Called by ``MoELayer.process_weights()`` after weights load and after every reload, for the
    plan's experts (or fused) backend only, so a layout is never applied for a backend the plan
    did not choose. Must be idempotent.
    """
