"""Discovery through real installed distributions (a dist-info on sys.path), and its failures."""

import pytest

import moe_core as mc
from moe_core.plugins import PluginLoadError, PluginManager

GOOD = """
from moe_core import BackendPlugin, BackendSpec, Role, Format, QuantScheme, available

class Good(BackendPlugin):
    def backends(self):
        return [BackendSpec(name="good_experts", role=Role.EXPERTS, impl="moe_core.reference.experts:ReferenceExperts",
                            formats=(Format.STANDARD,), devices=frozenset({"cpu"}), priority=5,
                            quant_schemes=frozenset({QuantScheme.UNQUANTIZED}),
                            probe=lambda: available("always"))]

plugin = Good()
"""

RAISES = """
raise ImportError("vendor library libacme.so not found")
"""

WRONG_SIGNATURE = """
from moe_core import hookimpl, HOOKSPEC_VERSION

class Wrong:
    moe_core_hookspec_version = HOOKSPEC_VERSION

    @hookimpl
    def dispatch(self, backend, hidden_states, topk, not_an_argument):
        return None

plugin = Wrong()
"""

OLD_API = """
from moe_core import BackendPlugin

class Old(BackendPlugin):
    moe_core_hookspec_version = (0, 3)
    def backends(self):
        return []

plugin = Old()
"""

BACKENDS_RAISE = """
from moe_core import BackendPlugin

class Broken(BackendPlugin):
    def backends(self):
        raise RuntimeError("no device table for this driver")

plugin = Broken()
"""

DUPLICATE = """
from moe_core import BackendPlugin, BackendSpec, Role, Format

class Dup(BackendPlugin):
    def backends(self):
        return [BackendSpec(name="good_experts", role=Role.EXPERTS, impl="moe_core.reference.experts:ReferenceExperts",
                            formats=(Format.STANDARD,), devices=frozenset({"cpu"}), priority=1)]

plugin = Dup()
"""


def test_good_plugin_is_discovered_with_its_distribution_version(install_dist):
    install_dist("moe-plugin-good", "good_plugin", GOOD, entry="good", version="1.2.3")
    manager = PluginManager()
    spec = manager.spec("good_experts")
    assert spec is not None and spec.plugin == "good" and spec.plugin_version == "1.2.3"
    assert manager.spec("good.good_experts") is spec
    assert manager.availability(spec).ok
    assert manager.spec("reference") is not None  # the built-in plugin registers the same way


def test_plugin_raising_on_import_is_recorded_and_the_rest_work(install_dist):
    install_dist("moe-plugin-good", "good_plugin", GOOD, entry="good")
    install_dist("moe-plugin-broken", "broken_plugin", RAISES, entry="broken")
    manager = PluginManager()
    [failed] = [r for r in manager.failed() if r.name == "broken"]
    assert failed.status.code is mc.Code.LOAD_ERROR
    assert "libacme.so" in failed.status.message and "Traceback" in failed.status.traceback
    assert "broken_plugin" in failed.status.hint
    assert manager.spec("good_experts") is not None
    with pytest.raises(PluginLoadError, match="libacme.so"):
        PluginManager(strict=True)


def test_wrong_hook_signature_is_api_mismatch(install_dist):
    install_dist("moe-plugin-wrong", "wrong_plugin", WRONG_SIGNATURE, entry="wrong")
    manager = PluginManager()
    [failed] = [r for r in manager.failed() if r.name == "wrong"]
    assert failed.status.code is mc.Code.API_MISMATCH and "not_an_argument" in failed.status.message
    assert not manager.pm.has_plugin("wrong")


def test_hookspec_version_mismatch(install_dist):
    install_dist("moe-plugin-old", "old_plugin", OLD_API, entry="old")
    [failed] = [r for r in PluginManager().failed() if r.name == "old"]
    assert failed.status.code is mc.Code.API_MISMATCH and "(0, 3)" in failed.status.message


def test_allow_and_block_lists(install_dist):
    install_dist("moe-plugin-good", "good_plugin", GOOD, entry="good")
    install_dist("moe-plugin-broken", "broken_plugin", RAISES, entry="broken")
    allowed = PluginManager(allow=["good"])
    assert allowed.failed() == [] and allowed.spec("good_experts") is not None  # nothing else was even imported
    assert {r.name: r.status.code for r in allowed.records}["broken"] is mc.Code.DISABLED
    blocked = PluginManager(block=["good", "broken"])
    assert blocked.spec("good_experts") is None and "broken" not in {r.name for r in blocked.failed()}
    assert PluginManager(block=["reference"]).spec("reference") is None


def test_duplicate_backend_names_resolve_deterministically(install_dist):
    install_dist("moe-plugin-good", "good_plugin", GOOD, entry="good")
    install_dist("moe-plugin-dup", "dup_plugin", DUPLICATE, entry="dup")
    for _ in range(2):
        manager = PluginManager()
        assert manager.spec("good_experts").plugin == "good"  # priority 5 beats 1
        assert manager.spec("dup.good_experts").plugin == "dup"
        [note] = manager.duplicates
        assert "'good_experts'" in note and "dup.good_experts" in note


def test_probe_that_raises_becomes_load_error():
    spec = mc.BackendSpec(name="x", role=mc.Role.EXPERTS, impl="nowhere:X", formats=(mc.Format.STANDARD,),
                          devices=frozenset({"cpu"}), probe="no_such_module_anywhere:probe")
    reason = spec.run_probe()
    assert reason.code is mc.Code.LOAD_ERROR and "ModuleNotFoundError" in reason.message and reason.traceback


def test_strict_mode_raises_with_the_failing_record_not_the_last_one(install_dist):
    install_dist("moe-plugin-abad", "abad_plugin", BACKENDS_RAISE, entry="abad")  # loads before "good"
    install_dist("moe-plugin-good", "good_plugin", GOOD, entry="good")
    with pytest.raises(PluginLoadError, match="(?s)^abad: LOAD_ERROR.*no device table for this driver"):
        PluginManager(strict=True)
    [failed] = [r for r in PluginManager().failed() if r.name == "abad"]  # non-strict: recorded, the rest load
    assert "no device table" in failed.status.message


def _spec(**changes):
    fields = dict(name="x", role=mc.Role.EXPERTS, impl="nowhere:X", formats=(mc.Format.STANDARD,),
                  devices=frozenset({"cpu"}))
    return mc.BackendSpec(**{**fields, **changes})


def test_backend_spec_ep_is_typed_and_accepts_the_old_strings():
    assert _spec().ep is mc.EPSupport.NONE  # the default: no backend claims EP without saying so
    for text, member in (("none", mc.EPSupport.NONE), ("any", mc.EPSupport.ANY), ("required", mc.EPSupport.REQUIRED)):
        assert _spec(ep=text).ep is member  # converted once, at the boundary
        assert _spec(ep=member).ep is member
    with pytest.raises(ValueError, match="BackendSpec.ep of backend 'x' must be one of 'none', 'any', 'required'.*"
                                         "got 'sometimes'"):
        _spec(ep="sometimes")


def test_backend_spec_has_no_plugin_until_registered():
    spec = _spec()
    assert spec.plugin is None and spec.plugin_version is None and spec.qualified_name == "x"
    registered = PluginManager(entry_points=[]).spec("reference")
    assert registered.plugin == "reference" and registered.qualified_name == "reference.reference"
