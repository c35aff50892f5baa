"""The idle analysis' starvation decision (agent.session.priority.StarvationWatch): pure, fed run delays."""

from __future__ import annotations

from agent.session.priority import CHECK_EVERY, RAISED_FOR, STARVED_AT, StarvationWatch

MS = 1_000_000


def _feed(watch: StarvationWatch, start: float, delays_ms: list[float]) -> list[str | None]:
    """One observation a CHECK_EVERY from `start`, each window's run delay as given; the decisions."""
    total, out = 0.0, []
    watch.observe(start, 0)
    for i, d in enumerate(delays_ms, 1):
        total += d
        out.append(watch.observe(start + i * CHECK_EVERY, int(total * MS)))
    return out


def test_a_thread_that_gets_its_cpu_stays_idle() -> None:
    w = StarvationWatch()
    window_ms = CHECK_EVERY * 1000
    assert _feed(w, 100.0, [0.2, 3.0, window_ms * STARVED_AT * 0.9] * 10) == [None] * 30
    assert not w.raised and w.raises == 0


def test_a_starved_thread_is_raised_held_and_let_go_when_the_machine_has_room() -> None:
    w = StarvationWatch()
    starved = CHECK_EVERY * 1000 * STARVED_AT  # the threshold itself counts
    held = int(RAISED_FOR / CHECK_EVERY)
    got = _feed(w, 0.0, [1.0, starved] + [1.0] * (held + 1))
    assert got[:2] == [None, "raise"] and w.raises == 1
    # at normal with room to spare it still stays RAISED_FOR, then goes back to idle once
    assert got[2:-1] == [None] * (held - 1) + ["idle"] and got[-1] is None and not w.raised


def test_a_machine_that_stays_full_keeps_the_thread_raised_and_repeats_raise_it_longer() -> None:
    w = StarvationWatch()
    full = CHECK_EVERY * 1000 * 0.6
    windows = int(3 * RAISED_FOR / CHECK_EVERY)
    got = _feed(w, 0.0, [full] * windows)
    assert got[0] == "raise" and got[1:] == [None] * (windows - 1) and w.raises == 1 and w.raised
    # room again: back to idle after the hold; starved again: raised for twice as long
    t = windows * CHECK_EVERY
    first = _feed(w, t, [1.0])
    assert first == ["idle"]
    second = _feed(w, t + 2 * CHECK_EVERY, [full] + [1.0] * int(2 * RAISED_FOR / CHECK_EVERY + 1))
    assert second[0] == "raise" and w.raises == 2
    assert second.index("idle") == int(2 * RAISED_FOR / CHECK_EVERY)


def test_observations_closer_than_a_window_are_not_due() -> None:
    w = StarvationWatch()
    assert w.due(5.0)
    w.observe(5.0, 0)
    assert not w.due(5.0 + CHECK_EVERY / 2) and w.due(5.0 + CHECK_EVERY)
