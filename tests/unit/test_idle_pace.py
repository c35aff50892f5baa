"""IdlePace (agent/session/session.py): how long a sampling loop waits while its target does nothing, or little."""

from __future__ import annotations

import math

from agent.session.session import IdlePace, on_grid


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
    """Sampled mode (no light rate): however many calls the kernel counts, every wait is a second, from the first
    look on; a quiet target waits as long."""
    pace = IdlePace.sampled(0.05)
    assert pace.interval == IdlePace.SAMPLED_WAIT == 1.0
    waits = [pace.active(1_000_000, 0.05) for _ in range(10)]
    assert waits == [1.0] * 10 and pace.paced()
    assert max(pace.idle() for _ in range(20)) == IdlePace.IDLE_MAX
    assert IdlePace.sampled(2.0).active(1_000_000, 2.0) == 2.0  # a longer --sample-interval is kept
    exact = IdlePace(0.05)  # its twin on the default: the same calls keep the interval
    assert [exact.active(1_000_000, 0.05) for _ in range(10)] == [0.05] * 10


def _looks(pace: IdlePace, life: float) -> list[float]:
    """When Session.run looks at a target busy throughout a life of `life` seconds: at the attach, one interval of
    the pace later, then after each wait the pace gives."""
    times, t = [0.0], pace.interval
    while t < life:
        times.append(round(t, 3))
        t += pace.active(1_000_000, 0.05)
    return times


def test_a_sampled_worker_of_three_seconds_is_looked_at_three_times() -> None:
    """A prefork server's worker that lives three seconds (apache2's under ab), busy throughout: sampled mode's
    looks, against the paces it had before: a quarter second, then half a second, then once a second (five looks,
    two of them in its first 0.75 s); before that, the interval doubled from 0.05 s up to twice a second (nine,
    five in its first 0.4 s); and the light pace of exact mode (capped at LIGHT_MAX)."""
    assert _looks(IdlePace.sampled(0.05), 3.0) == [0.0, 1.0, 2.0]
    quarter = IdlePace(0.25, math.inf, 1.0, 0)
    assert _looks(quarter, 3.0) == [0.0, 0.25, 0.75, 1.75, 2.75]
    before = IdlePace(0.05, math.inf, 0.5, 1)
    assert _looks(before, 3.0) == [0.0, 0.05, 0.1, 0.2, 0.4, 0.8, 1.3, 1.8, 2.3, 2.8]
    assert len(_looks(IdlePace(0.05, math.inf), 3.0)) == 20


def test_a_history_kept_more_often_than_sampled_mode_looks_gets_a_look_at_each_of_its_samples() -> None:
    """`at_most` (the pipeline gives --store-interval): a busy target's looks are never further apart; the default
    store interval (1 s) leaves the pace as it is."""
    assert _looks(IdlePace.sampled(0.05, 0.5), 3.0) == [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    assert _looks(IdlePace.sampled(0.05, 0.1), 0.5) == [0.0, 0.1, 0.2, 0.3, 0.4]
    default = [0.0, 1.0, 2.0]
    assert _looks(IdlePace.sampled(0.05, 1.0), 3.0) == _looks(IdlePace.sampled(0.05), 3.0) == default


def test_a_look_due_is_moved_to_the_nearest_instant_of_the_grid_after_now() -> None:
    """on_grid: sampled mode's looks of every target fall on the same instants, the multiples of the pace's
    interval on the monotonic clock; a look due just after one of them waits for it no longer than it would have,
    give or take half an interval, and one overdue goes to the next instant to come."""
    assert on_grid(10.3, 9.3, 1.0) == 10.0
    assert on_grid(10.6, 9.6, 1.0) == 11.0
    assert on_grid(5.0, 7.2, 1.0) == 8.0  # overdue: the next instant after now
    assert on_grid(8.0, 8.0, 1.0) == 9.0  # never now
    assert on_grid(1.26, 1.05, 0.25) == 1.25
