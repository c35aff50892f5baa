"""When the uprobes are attached as uprobe_multi links (agent.kernel.links.uprobe_links_supported): pure logic."""

from __future__ import annotations

import os
from typing import Any

import pytest

from agent.kernel import links

_REAL = os.uname()


def _uname(release: str) -> Any:
    real = _REAL
    return os.uname_result((real.sysname, real.nodename, release, real.version, real.machine))


@pytest.mark.parametrize(
    ("release", "expected"),
    [
        ("6.18.44-fc-v669", True),
        ("6.10.0", True),
        ("6.6.30", False),
        ("6.5.13-amd64", False),
        ("5.15.0-91-generic", False),
        ("7.0.1", True),
        ("weird", False),
    ],
)
def test_links_from_linux_6_10(monkeypatch: pytest.MonkeyPatch, release: str, expected: bool) -> None:
    monkeypatch.delenv("HEAPSCOPE_UPROBE_LINKS", raising=False)
    monkeypatch.setattr(links.os, "uname", lambda: _uname(release))
    assert links.uprobe_links_supported() is expected


def test_environment_keeps_perf_events(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(links.os, "uname", lambda: _uname("6.18.0"))
    monkeypatch.setenv("HEAPSCOPE_UPROBE_LINKS", "0")
    assert not links.uprobe_links_supported()
    monkeypatch.setenv("HEAPSCOPE_UPROBE_LINKS", "1")
    assert links.uprobe_links_supported()
