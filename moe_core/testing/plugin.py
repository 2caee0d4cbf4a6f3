"""pytest11 entry point of the conformance kit. Inert unless ``--moe-backend`` is given.

With ``--moe-backend NAME`` (repeatable) the kit's cases for each named backend become the test
items of the session (other tests are deselected unless ``--moe-kit-with-tests``), and a report
(backend, passed / failed / skipped with the reasons) is printed at the end.
"""

from __future__ import annotations

from typing import Any

import pytest


def pytest_addoption(parser: Any) -> None:
    group = parser.getgroup("moe-core", "moe-core conformance kit")
    group.addoption("--moe-backend", action="append", default=[], metavar="NAME",
                    help="run the conformance kit for this backend, bare or qualified name (repeatable)")
    group.addoption("--moe-kit-seed", type=int, default=None, metavar="N",
                    help="data seed (default: fresh each run; the report prints it for replay)")
    group.addoption("--moe-kit-setup", default=None, metavar="MODULE:FUNCTION",
                    help="called before plugins load, here and in EP workers (install emulated vendor ops)")
    group.addoption("--moe-kit-manager", default=None, metavar="MODULE:FUNCTION",
                    help="returns the moe_core PluginManager to test with (default: installed plugins)")
    group.addoption("--moe-kit-device", default=None, metavar="DEVICE",
                    help="torch device for tensors (e.g. cpu for an npu plan with emulated ops)")
    group.addoption("--moe-kit-device-kind", default=None, metavar="KIND",
                    help="config device kind: cpu, cuda, rocm or npu (default: a declared kind present here)")
    group.addoption("--moe-kit-ep-sizes", default="1,2,4", metavar="N,N,...",
                    help="EP world sizes for dispatcher cases (default 1,2,4)")
    group.addoption("--moe-kit-shape", default=None, metavar="E,K,H,I",
                    help="experts, top-k, hidden and intermediate sizes (default 8,4,256,256)")
    group.addoption("--moe-kit-with-tests", action="store_true", default=False,
                    help="also run the tests pytest collected, not only the kit")


def pytest_addhooks(pluginmanager: Any) -> None:
    from moe_core.testing import hookspecs

    pluginmanager.add_hookspecs(hookspecs)


def pytest_configure(config: Any) -> None:
    if config.getoption("moe_backend"):
        config.pluginmanager.register(KitSession(config), "moe_core_kit_session")


class KitItem(pytest.Item):
    def __init__(self, *, case: Any, ctx: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.case, self.ctx = case, ctx

    def runtest(self) -> None:
        from moe_core.testing.kit import KitFailure, execute

        result = execute(self.ctx, self.case)
        if result.status == "skipped":
            pytest.skip(result.message)
        if result.status == "failed":
            raise KitFailure(result.message)

    def repr_failure(self, excinfo: Any, style: Any = None) -> str:
        from moe_core.testing.kit import KitFailure

        if isinstance(excinfo.value, KitFailure):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Any, None, str]:
        return self.path, None, f"moe-kit {self.case.title}"


class KitBackend(pytest.Collector):
    """Groups one backend's cases (node id ``moe-kit[<backend>]::<case>``)."""

    def collect(self) -> list[Any]:
        return []


class KitSession:
    def __init__(self, config: Any) -> None:
        self.config = config
        self.ctx: Any = None

    def pytest_ignore_collect(self, collection_path: Any, config: Any) -> Any:
        # kit only: do not import the test files under the current directory / testpaths
        return None if config.getoption("moe_kit_with_tests") else True

    def _options(self) -> Any:
        from moe_core.testing.data import Shape
        from moe_core.testing.kit import KitOptions

        get = self.config.getoption
        fields: dict[str, Any] = dict(
            backends=tuple(get("moe_backend")), seed=get("moe_kit_seed"), setup=get("moe_kit_setup"),
            manager_factory=get("moe_kit_manager"), device=get("moe_kit_device"),
            device_kind=get("moe_kit_device_kind"),
            ep_sizes=tuple(int(x) for x in get("moe_kit_ep_sizes").split(",") if x.strip()),
        )
        if get("moe_kit_shape"):
            fields["shape"] = Shape.parse(get("moe_kit_shape"))
        self.config.hook.pytest_moe_kit_configure(config=self.config, options=fields)
        return KitOptions(**fields)

    @pytest.hookimpl(tryfirst=True)  # before -k / -m deselection, so they apply to kit items
    def pytest_collection_modifyitems(self, session: Any, config: Any, items: list[Any]) -> None:
        from moe_core.testing.kit import KitContext, KitFailure, generate_cases

        options = self._options()
        self.ctx = KitContext(options)
        kit_items = []
        for name in options.backends:
            try:
                spec = self.ctx.spec(name)
            except KitFailure as exc:
                raise pytest.UsageError(f"--moe-backend {name}: {exc}") from None
            name = f"moe-kit[{spec.qualified_name}]"
            parent = KitBackend.from_parent(session, name=name, nodeid=name)
            for case in generate_cases(spec, options, self.ctx.manager):
                kit_items.append(KitItem.from_parent(parent, name=case.id, case=case, ctx=self.ctx))
        if not config.getoption("moe_kit_with_tests") and items:
            config.hook.pytest_deselected(items=list(items))
            items[:] = []
        items[:0] = kit_items

    def pytest_report_header(self, config: Any) -> str:
        return f"moe-core conformance kit: {', '.join(config.getoption('moe_backend'))}"

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        from moe_core.testing.kit import KitReport

        if self.ctx is None:
            return
        report = KitReport(self.ctx.options.seed, self.ctx.results)
        terminalreporter.section("moe-core conformance kit report")
        terminalreporter.write_line(report.text())
