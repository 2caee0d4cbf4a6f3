"""pytest11 entry point of the conformance kit. Inert unless ``--moe-backend`` is given."""


def pytest_addoption(parser):
    group = parser.getgroup("moe-core", "moe-core conformance kit")
    group.addoption("--moe-backend", action="append", default=[], metavar="NAME",
                    help="run the conformance kit for this backend (repeatable)")
