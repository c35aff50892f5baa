"""IdlePace (agent/session/session.py): how long a sampling loop waits while its target does nothing."""

from __future__ import annotations

from agent.session.session import IdlePace


def test_quiet_ticks_keep_the_interval_then_the_wait_doubles_up_to_the_cap() -> None:
    pace = IdlePace(0.05)
    waits = [pace.idle() for _ in range(12)]
    quiet = IdlePace.QUIET_TICKS
    assert waits[:quiet] == [0.05] * quiet
    grown = waits[quiet:]
    assert grown[:4] == [0.1, 0.2, 0.4, 0.8]
    assert all(w == IdlePace.IDLE_MAX for w in grown[4:])


def test_activity_brings_back_the_interval() -> None:
    pace = IdlePace(0.05)
    for _ in range(10):
        pace.idle()
    pace.active()
    assert pace.idle_ticks == 0
    assert pace.idle() == 0.05


def test_an_interval_longer_than_the_cap_is_kept() -> None:
    pace = IdlePace(2.0)
    assert [pace.idle() for _ in range(8)] == [2.0] * 8
