"""heapscope's own log (agent.log): a log that cannot be written any more never raises into the profile."""

from __future__ import annotations

import io
import os
import sys

import pytest

from agent.log import LineLog


def test_a_closed_pipe_loses_lines_counted_and_said_once_writing_works_again(monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = os.pipe()
    os.close(read_end)  # `… 2>&1 | grep -m1 …` once grep has its line
    broken = open(write_end, "w", buffering=1)  # noqa: SIM115
    monkeypatch.setattr(sys, "stderr", broken)
    log = LineLog()
    for n in range(3):
        log.say(f"line {n}")  # EPIPE: counted, never raised
    assert log.lost == 3
    working = io.StringIO()
    monkeypatch.setattr(sys, "stderr", working)
    log.say("after")
    assert working.getvalue() == "heapscope: 3 earlier lines of this log could not be written\nheapscope: after\n"
    assert log.lost == 3
    log.say("again")
    assert working.getvalue().endswith("heapscope: again\n") and working.getvalue().count("could not") == 1
    with pytest.raises(OSError):
        broken.close()  # its buffer still holds what could not be written


def test_a_closed_stream_loses_lines_too(monkeypatch: pytest.MonkeyPatch) -> None:
    closed = io.StringIO()
    closed.close()
    monkeypatch.setattr(sys, "stderr", closed)
    log = LineLog()
    log.say("x")
    assert log.lost == 1
