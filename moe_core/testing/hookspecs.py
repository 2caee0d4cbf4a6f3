"""pytest hook the conformance kit adds (registered by ``moe_core.testing.plugin``)."""

import pytest


@pytest.hookspec
def pytest_moe_kit_configure(config, options):
    """Adjust the conformance kit's options before its cases are generated.

    :param config: the pytest config.
    :param options: a ``dict`` of ``moe_core.testing.KitOptions`` fields, filled from the command
        line; change it in place. Typical use in a plugin's ``conftest.py``: set ``setup`` to a
        ``"module:function"`` that installs emulated vendor ops (it runs before plugins load, here
        and in every spawned EP worker) and ``device="cpu"``, ``device_kind="npu"``.

    Called once, after conftests are loaded, only when ``--moe-backend`` is given.
    """
