"""nox sessions: tests, lint, demo, the conformance kit per plugin, and the CPU overhead benchmark.

torch is pinned to 2.13.0 (the local CPU wheel on CI machines): never let a session resolve a
CUDA build of torch there.
"""

import nox

TORCH = "torch==2.13.0"
PLUGINS = ["-e", "plugins/cuda[test]", "-e", "plugins/rocm", "-e", "plugins/npu", "-e", "examples/moe-plugin-example"]
nox.options.sessions = ["tests", "lint"]


@nox.session(python="3.11")
def tests(session: nox.Session) -> None:
    """The whole suite: core, EP (gloo), conformance kit, plugins against emulated vendor ops."""
    session.install(TORCH, "-e", ".[test]", *PLUGINS)
    session.run("python", "-m", "pytest", "-q", *session.posargs)


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "moe_core", "tests", "benchmarks", "plugins", "examples", "noxfile.py")


@nox.session(python="3.11")
def demo(session: nox.Session) -> None:
    """The main job on the embedded default (CPU reference backends)."""
    session.install(TORCH, "-e", ".")
    session.run("moe-core", "demo", *session.posargs)


@nox.session(python="3.11")
@nox.parametrize("backend", ["reference", "standard", "torch_a2a", "simple"])
def conformance(session: nox.Session, backend: str) -> None:
    """The conformance kit on one backend (as a vendor would run it on theirs)."""
    session.install(TORCH, "-e", ".[test]", "-e", "examples/moe-plugin-example")
    session.run("python", "-m", "pytest", "-q", "-p", "no:cacheprovider", "--moe-backend", backend, *session.posargs)


@nox.session(python="3.11")
def overhead(session: nox.Session) -> None:
    """Per-forward framework overhead of MoELayer on this CPU (benchmarks/overhead.py)."""
    session.install(TORCH, "-e", ".")
    session.run("python", "benchmarks/overhead.py", *session.posargs)
