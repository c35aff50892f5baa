"""What a test needs of the machine, asked in one place: tests/conftest.py reads each test's `needs` marker with
`missing`, and the capability fixtures there use it too.

A need is "root"; "bpf" (root, BPF with uprobes and kernel headers, through the product's own probe,
agent.process.capability.check_environment); a group of programs named below ("binutils"); or a program on PATH.
"""

from __future__ import annotations

import functools
import os
import shutil
from typing import NoReturn

import pytest

IN_CI = os.environ.get("CI", "").lower() == "true"

GROUPS: dict[str, tuple[str, ...]] = {
    "binutils": ("addr2line", "objdump", "nm", "readelf", "objcopy", "strip"),
}

# The Debian package of a program whose name does not say it (scripts/apt-packages-dev.txt installs them).
PACKAGES: dict[str, str] = {
    "ms_print": "valgrind",
    "callgrind_annotate": "valgrind",
    "promtool": "prometheus",
    "systemd-analyze": "systemd",
    "man": "man-db",
    "c++filt": "binutils",
    "setpriv": "util-linux",
    "musl-gcc": "musl-tools",
    "go": "golang-go",
}


@functools.cache
def missing(need: str) -> str | None:
    """Why `need` is not met on this machine, or None when it is."""
    if need == "root":
        return None if os.geteuid() == 0 else "needs root"
    if need == "bpf":
        if os.geteuid() != 0:
            return "needs root (BPF uprobes)"
        from agent.process.capability import check_environment

        problems = check_environment()
        return "; ".join(problems) if problems else None
    programs = GROUPS.get(need, (need,))
    absent = [p for p in programs if shutil.which(p) is None]
    if not absent:
        return None
    if need in GROUPS:
        return f"needs {need} ({', '.join(absent)} missing)"
    package = PACKAGES.get(need)
    return f"needs {need}" + (f" (Debian: {package})" if package else "")


def require(*needs: str) -> None:
    """Skip unless every need is met: for a fixture that builds or runs with a tool (a fixture takes no marker)."""
    reasons = [why for need in needs if (why := missing(need))]
    if reasons:
        pytest.skip("; ".join(reasons))


def unavailable(reason: str) -> NoReturn:
    """Skip locally, fail in CI: a CI run that silently skips what it was set up for would prove nothing."""
    if IN_CI:
        pytest.fail(f"integration environment unusable in CI: {reason}", pytrace=False)
    pytest.skip(reason)
