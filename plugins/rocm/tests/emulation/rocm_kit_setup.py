"""Process-wide installation of the emulated AMD vendor ops (TEST SUPPORT ONLY).

pytest tests install the emulation per test with ``monkeypatch`` (``conftest.py``). Processes that
exist for one job install it for their whole life: ``ep_worker.py`` (``install_for_process``), and
the conformance kit's spawned EP workers through the kit's ``setup`` hook, ``"rocm_kit_setup:gfx942"``
or ``"rocm_kit_setup:gfx950"`` (this directory must be on ``sys.path``, which spawned workers inherit).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent


def install_for_process(arch: str) -> None:
    """The emulation (``rocm_emulation.install``) for the life of this process, never undone."""
    module = sys.modules.get("rocm_emulation")
    if module is None:
        spec = importlib.util.spec_from_file_location("rocm_emulation", HERE / "__init__.py",
                                                      submodule_search_locations=[str(HERE)])
        module = importlib.util.module_from_spec(spec)
        sys.modules["rocm_emulation"] = module
        spec.loader.exec_module(module)

    class _Patch:  # the subset of pytest's monkeypatch that install() uses
        def setitem(self, d, k, v):
            d[k] = v

        def setattr(self, obj, name, value):
            setattr(obj, name, value)

    module.install(_Patch(), arch)


def _init_mori_with_the_process_group() -> None:
    """MoRI's shmem is initialized once per process, after the process group exists (the README's
    setup). The kit's ``setup`` runs before its workers create the group, so the MoRI init is
    chained onto ``init_process_group`` in this process."""
    import torch.distributed as dist
    from moe_plugin_rocm.mori_dispatcher import init_mori_shmem

    create = dist.init_process_group

    def init_process_group(*args, **kwargs):
        create(*args, **kwargs)
        init_mori_shmem()

    dist.init_process_group = init_process_group


def gfx942() -> None:
    install_for_process("gfx942")
    _init_mori_with_the_process_group()


def gfx950() -> None:
    install_for_process("gfx950")
    _init_mori_with_the_process_group()
