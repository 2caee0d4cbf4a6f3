"""The architecture, checked from the source (docs/decisions.md): moe_core's imports run one way,
and plugins reach the core only through its public surface.

The graph is built from the AST, not by importing: an edge ``a -> b`` is an ``import`` in module
``a`` that names module ``b`` (``from pkg import name`` names ``pkg.name`` when that is a module,
else ``pkg``). Importing a submodule runs its parent packages' ``__init__`` too; like import-linter
and grimp, the graph does not count that as an edge, or every package with re-exports would be a cycle.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ROOT / "moe_core"
PUBLIC = ("moe_core", "moe_core.plugin_api", "moe_core.testing")  # and moe_core.testing.*
PLUGINS = {
    "cuda": ROOT / "plugins/cuda/moe_plugin_cuda",
    "rocm": ROOT / "plugins/rocm/moe_plugin_rocm",
    "npu": ROOT / "plugins/npu/moe_plugin_npu",
    "example": ROOT / "examples/moe-plugin-example/moe_plugin_example",
}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module
    line: int
    local: bool  # inside a function (runs at call time, not at import time)


def _module_name(path: Path, package_dir: Path) -> str:
    parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(path: Path, package_dir: Path, modules: set[str], type_checking: bool = False) -> list[Import]:
    """Every import in ``path``, resolved against ``modules``; ``if TYPE_CHECKING:`` blocks only
    when ``type_checking``."""
    name = _module_name(path, package_dir)
    is_package = path.name == "__init__.py"
    found: list[Import] = []

    def resolve(node: ast.ImportFrom) -> str:
        if not node.level:
            return node.module or ""
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_checking:
                for sub in child.orelse:
                    visit_stmt(sub, local)
                continue
            visit_stmt(child, local)

    def visit_stmt(child: ast.AST, local: bool) -> None:
        if isinstance(child, ast.Import):
            found.extend(Import(name, alias.name, child.lineno, local) for alias in child.names)
        elif isinstance(child, ast.ImportFrom):
            base = resolve(child)
            for alias in child.names:
                target = f"{base}.{alias.name}"
                found.append(Import(name, target if target in modules else base, child.lineno, local))
        else:
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inner)

    visit(ast.parse(path.read_text(), str(path)), False)
    return found


def _modules(package_dir: Path) -> set[str]:
    return {_module_name(p, package_dir) for p in package_dir.rglob("*.py")}


def _package_imports(package_dir: Path, known: set[str] = frozenset(),
                     type_checking: bool = False) -> tuple[set[str], list[Import]]:
    modules = _modules(package_dir)
    files = sorted(package_dir.rglob("*.py"))
    return modules, [imp for p in files for imp in _imports(p, package_dir, modules | known, type_checking)]


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """A path ``start -> ... -> goal`` in ``graph`` (depth first), or None."""
    stack, seen = [(start, [start])], {start}
    while stack:
        node, path = stack.pop()
        if node == goal:
            return path
        for nxt in sorted(graph.get(node, ())):
            if nxt not in seen:
                seen.add(nxt)
                stack.append((nxt, path + [nxt]))
    return None


def _core_graph(with_local: bool = False) -> tuple[dict[str, set[str]], list[Import]]:
    """moe_core's module-level import graph (plus the function-local edges when ``with_local``),
    and the function-local imports."""
    modules, imports = _package_imports(CORE)
    internal = [i for i in imports if i.target in modules and i.target != i.source]
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for imp in internal:
        if with_local or not imp.local:
            graph[imp.source].add(imp.target)
    return graph, [i for i in internal if i.local]


def test_core_module_imports_have_no_cycle():
    graph, _ = _core_graph()
    cycles = set()
    for source, targets in graph.items():
        for target in targets:
            back = _reaches(graph, target, source)
            if back is not None:
                cycles.add(" -> ".join([source] + back))
    assert not cycles, "module-level import cycles in moe_core:\n  " + "\n  ".join(sorted(cycles))


def test_no_function_local_import_closes_a_cycle():
    """A function-local import whose target imports its module back (at module level or, in turn,
    inside a function) is a cycle hidden from the module-level graph."""
    graph, local = _core_graph(with_local=True)
    hidden = []
    for imp in local:
        back = _reaches(graph, imp.target, imp.source)
        if back is not None:
            hidden.append(f"{imp.source}:{imp.line} imports {imp.target} inside a function, "
                          f"and {' -> '.join(back)} imports it back")
    assert not hidden, "function-local imports hiding a cycle:\n  " + "\n  ".join(sorted(set(hidden)))


def test_the_graph_sees_the_imports_it_must():
    """The checks above are only as good as the graph: it must hold edges known to exist."""
    graph, local = _core_graph()
    assert "moe_core.planner" in graph["moe_core.layer"]
    assert "moe_core.contracts" in graph["moe_core.backends"]
    assert all(i.source != "moe_core.hookspecs" for i in local)  # its imports are all TYPE_CHECKING-only
    assert "moe_core.layer" not in graph["moe_core.hookspecs"]


def _is_public(module: str) -> bool:
    return module in PUBLIC or module.startswith("moe_core.testing.")


@pytest.mark.parametrize("plugin", sorted(PLUGINS))
def test_plugin_imports_only_the_public_core(plugin):
    """Non-test code of a plugin imports from moe-core only ``moe_core``, ``moe_core.plugin_api``
    and ``moe_core.testing*`` (docs/decisions.md), so core internals can move. Type-only imports
    count too: they break as surely when a module moves."""
    core_modules = _modules(CORE)
    _, imports = _package_imports(PLUGINS[plugin], core_modules, type_checking=True)
    private = sorted({f"{i.source}:{i.line} imports {i.target}" for i in imports
                      if i.target.split(".")[0] == "moe_core" and not _is_public(i.target)})
    assert not private, f"plugin {plugin} imports core internals:\n  " + "\n  ".join(private)
    assert core_modules  # the core was found (an empty tree would pass vacuously)


def test_the_checks_catch_a_hidden_cycle(tmp_path):
    """On a package with a cycle closed inside a function, the same graph code reports it."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n"
                              "def f():\n    from pkg.a import thing\n")
    modules, imports = _package_imports(pkg)
    edges = {(i.source, i.target, i.local) for i in imports}
    assert ("pkg.a", "pkg.b", False) in edges and ("pkg.b", "pkg.a", True) in edges
    assert [i.line for i in imports if i.target == "pkg.a"] == [5]  # the TYPE_CHECKING import is not counted
    graph = {m: {i.target for i in imports if i.source == m and not i.local} for m in modules}
    assert _reaches(graph, "pkg.b", "pkg.a") is None and _reaches(graph, "pkg.a", "pkg.b") == ["pkg.a", "pkg.b"]
