"""Availability probes of the Ascend backends. They never raise and import vendor code only when
called (never at plugin import).

What they tell apart, in order:

1. ``torch_npu`` not installed                         -> ``NOT_INSTALLED``
2. ``import torch_npu`` fails (CANN missing/not sourced) -> ``LOAD_ERROR`` (traceback kept)
3. no NPU visible                                       -> ``NO_DEVICE``
4. an SoC the backend does not support                  -> ``UNSUPPORTED_ARCH``
5. DeepEP for Ascend missing, broken, or without the API -> ``NOT_INSTALLED`` / ``LOAD_ERROR`` /
   ``API_MISMATCH`` (dispatcher and fused backend only)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import sys
from typing import Any, Callable, Optional

from moe_core.plugin_api import Code, Reason, available, from_exception, unavailable

# SoC names as ``torch_npu.npu.get_device_name()`` reports them.
A2_PREFIX = "Ascend910B"  # Atlas 800T A2 / 900 A2 (910B1-910B4)
A3_PREFIX = "Ascend910_93"  # Atlas A3 (910_9391, 910_9392, ...)

# grouped matmul (npu_grouped_matmul, init/finalize routing) and DeepEP-Ascend: A2 and A3.
GMM_SOCS = (A2_PREFIX, A3_PREFIX)
DEEPEP_SOCS = (A2_PREFIX, A3_PREFIX)
# fused_deep_moe (FUSED_DEEP_MOE, W8A8 INT8): documented for A3 (vendor-apis section 7).
FUSEEP_SOCS = (A3_PREFIX,)

_CANN_LIBS = ("libascendcl", "libhccl", "libacl_op_compiler", "libge_runner", "libgraph", "libtorch_npu")
_CANN_HINT = ("install the Ascend CANN toolkit matching torch_npu and source it "
              "(`source /usr/local/Ascend/ascend-toolkit/set_env.sh`) so that libascendcl.so and libhccl.so "
              "are found")


def _installed(name: str) -> bool:
    if name in sys.modules:
        return sys.modules[name] is not None
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _import(name: str) -> Any:
    return importlib.import_module(name)


def torch_npu_state(socs: tuple[str, ...]) -> Reason:
    """Reason for torch_npu + CANN + an NPU of one of ``socs`` (name prefixes)."""
    if not _installed("torch_npu"):
        return unavailable(Code.NOT_INSTALLED, "torch_npu is not installed",
                           "pip install moe-plugin-npu[ascend] (torch-npu matching your torch version), plus the "
                           "Ascend CANN toolkit")
    try:
        torch_npu = _import("torch_npu")
    except Exception as exc:  # ImportError/OSError when CANN's shared libraries are missing
        text = str(exc)
        what = ("import torch_npu failed: CANN runtime libraries not found"
                if any(lib in text for lib in _CANN_LIBS) else "import torch_npu failed")
        return dataclasses.replace(from_exception(Code.LOAD_ERROR, what, exc), hint=_CANN_HINT)
    try:
        npu = torch_npu.npu
        if not npu.is_available() or npu.device_count() < 1:
            return unavailable(Code.NO_DEVICE, "torch_npu is installed but no Ascend NPU is visible",
                               "check `npu-smi info` and ASCEND_RT_VISIBLE_DEVICES")
        soc = str(npu.get_device_name(0))
    except Exception as exc:
        return dataclasses.replace(from_exception(Code.NO_DEVICE, "querying the NPU failed", exc),
                                   hint="check the Ascend driver with `npu-smi info`")
    if not soc.startswith(socs):
        return unavailable(Code.UNSUPPORTED_ARCH, f"SoC {soc} is not supported by this backend",
                           "supported SoCs: " + ", ".join(f"{p}*" for p in socs))
    return available(f"torch_npu {getattr(torch_npu, '__version__', '?')} on {soc}")


def deep_ep_state(required: tuple[str, ...]) -> Reason:
    """Reason for DeepEP-Ascend (the ``deep_ep`` package of sgl-kernel-npu) with ``Buffer`` methods."""
    hint = "install DeepEP for Ascend: the `deep_ep` wheel built from sgl-kernel-npu (python/deep_ep)"
    if not _installed("deep_ep"):
        return unavailable(Code.NOT_INSTALLED, "deep_ep (DeepEP for Ascend) is not installed", hint)
    try:
        deep_ep = _import("deep_ep")
        buffer_cls = deep_ep.Buffer
    except Exception as exc:  # e.g. the CUDA build of DeepEP on an Ascend host
        return dataclasses.replace(from_exception(Code.LOAD_ERROR, "import deep_ep failed", exc),
                                   hint="the installed deep_ep may be the CUDA build; " + hint)
    missing = [m for m in required if not callable(getattr(buffer_cls, m, None))]
    if missing:
        return unavailable(Code.API_MISMATCH, f"deep_ep.Buffer lacks {', '.join(missing)}: not the Ascend build "
                           "or too old", hint)
    return available()


def _chain(*steps: Callable[[], Reason]) -> Reason:
    last: Optional[Reason] = None
    for step in steps:
        last = step()
        if not last.ok:
            return last
    assert last is not None
    return last


def probe_npu_gmm() -> Reason:
    return torch_npu_state(GMM_SOCS)


def probe_deepep_npu() -> Reason:
    return _chain(lambda: torch_npu_state(DEEPEP_SOCS),
                  lambda: deep_ep_state(("get_dispatch_layout", "dispatch", "combine",
                                         "low_latency_dispatch", "low_latency_combine")))


def probe_fuseep() -> Reason:
    def fuse_mode() -> Reason:
        try:
            _import("deep_ep.buffer").FuseMode  # noqa: B018
        except Exception as exc:
            return dataclasses.replace(from_exception(Code.API_MISMATCH, "deep_ep.buffer.FuseMode missing", exc),
                                       hint="upgrade DeepEP for Ascend (sgl-kernel-npu) to a build with fused_deep_moe")
        return available()

    return _chain(lambda: torch_npu_state(FUSEEP_SOCS), lambda: deep_ep_state(("fused_deep_moe",)), fuse_mode)
