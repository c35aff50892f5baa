"""The capability skips of every test, in one place.

A test that needs something of the machine says what: `@pytest.mark.needs("gcc", "valgrind")` (root, BPF, a
program on PATH, a group such as "binutils": tests/support/capability.py). Where it is missing the test is
skipped, or, an integration test in CI (CI=true), failed. Every such test is also marked `tools`, which `make unit`
leaves out (`-m "not tools"`), so that the unit run needs no root and no external tools.

The fixtures below ask the same questions for whole groups of integration tests.
"""

from __future__ import annotations

import pytest

from tests.support.capability import missing, unavailable


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("needs") is not None:
            item.add_marker(pytest.mark.tools)


@pytest.hookimpl(tryfirst=True)  # before the fixtures, which may build with the tools
def pytest_runtest_setup(item: pytest.Item) -> None:
    reasons = [why for mark in item.iter_markers("needs") for need in mark.args if (why := missing(need))]
    if not reasons:
        return
    if item.get_closest_marker("integration") is not None:
        unavailable("; ".join(reasons))
    pytest.skip("; ".join(reasons))


@pytest.fixture(scope="session")
def bpf_ready() -> None:
    """Root, BPF, uprobes and headers, asked through the product's own probe."""
    why = missing("bpf")
    if why:
        unavailable(why)


@pytest.fixture(scope="session")
def valgrind_tools() -> None:
    """Valgrind, its readers and the compilers the integration tests build their programs with."""
    for tool in ("valgrind", "ms_print", "callgrind_annotate", "gcc", "g++"):
        why = missing(tool)
        if why:
            unavailable(why)
