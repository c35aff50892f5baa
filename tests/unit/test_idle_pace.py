"""IdlePace (agent/session/session.py): how long a sampling loop waits while its target does nothing, or little."""

from __future__ import annotations

import math

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


def test_a_light_target_is_looked_at_less_often_down_to_the_light_cap() -> None:
    pace = IdlePace(0.05)
    light = int(IdlePace.LIGHT_RATE * 0.05) - 1  # calls in one interval, under the light rate
    waits = [pace.active(light, 0.05) for _ in range(10)]
    quiet = IdlePace.QUIET_TICKS
    assert waits[:quiet] == [0.05] * quiet and not any(w > IdlePace.LIGHT_MAX for w in waits)
    assert waits[quiet:quiet + 2] == [0.1, IdlePace.LIGHT_MAX] and waits[-1] == IdlePace.LIGHT_MAX
    assert pace.paced()


def test_a_busy_look_brings_back_the_interval() -> None:
    pace = IdlePace(0.05)
    for _ in range(10):
        pace.active(1, 0.2)
    busy = int(IdlePace.LIGHT_RATE * 0.2)
    assert pace.active(busy, 0.2) == 0.05
    assert not pace.paced() and pace.light_ticks == 0


def test_a_quiet_target_waits_longer_than_a_light_one() -> None:
    quiet, light = IdlePace(0.05), IdlePace(0.05)
    assert max(quiet.idle() for _ in range(20)) == IdlePace.IDLE_MAX > IdlePace.LIGHT_MAX
    assert max(light.active(0, 0.05) for _ in range(20)) == IdlePace.LIGHT_MAX


def test_sampled_mode_looks_at_a_busy_target_as_at_a_light_one() -> None:
    """Sampled mode (no light rate): however many calls the kernel counts, the waits grow after one look at the
    interval, to the sampled cap (twice a second); a quiet target still waits longer."""
    pace = IdlePace.sampled(0.05)
    waits = [pace.active(1_000_000, 0.05) for _ in range(10)]
    assert waits[:5] == [0.05, 0.1, 0.2, 0.4, IdlePace.SAMPLED_LIGHT_MAX] and waits[-1] == 0.5 and pace.paced()
    assert max(pace.idle() for _ in range(20)) == IdlePace.IDLE_MAX
    exact = IdlePace(0.05)  # its twin on the default: the same calls keep the interval
    assert [exact.active(1_000_000, 0.05) for _ in range(10)] == [0.05] * 10


def test_a_sampled_worker_of_two_seconds_is_looked_at_half_as_often_as_before() -> None:
    """A prefork server's worker that lives two seconds, busy throughout: sampled mode's looks (the first at the
    attach, then at each wait), against the light pace it had before."""
    def looks(pace: IdlePace, life: float) -> int:
        t, n = 0.0, 1
        while (t := t + pace.active(1_000_000, 0.05)) < life:
            n += 1
        return n

    assert looks(IdlePace.sampled(0.05), 2.0) == 7
    assert looks(IdlePace(0.05, math.inf), 2.0) == 14  # the light pace, capped at LIGHT_MAX
