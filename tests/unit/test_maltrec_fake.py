"""MALT's recorder (agent.session.maltrec) in a real session against a fake kernel (tests/support/fake_probes.py):
no root, no BPF, no bcc.

One small program, fed call by call at known times (the fake's clock, which the session and the recorder read as
theirs); every expected figure below is worked out from those calls: the per-stack statistics (MALT's
CallStackInfo: allocations, frees, lifetimes, zero-size requests, reallocs, the bytes alive and at the global
peak), the leaks, the totals, sizeMap, reallocJump, the threads, and the timelines sampled at each tick.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from agent.export.malt import profile_to_json
from agent.kernel.frozen import FrozenProbes
from agent.model.malt import CountMinMaxSum, MaltLeak, MaltProfile, StackKey, check_consistency
from agent.model.options import MassifOptions
from agent.session.maltrec import MaltRecorder
from agent.session.session import Session
from tests.support.fake_probes import FakeCode, FakeProbes, fake_session, log2_bin, probe_settings

SCHEMA = json.loads((Path(__file__).resolve().parents[1] / "malt_schema.json").read_text())
BELOW = ("main", "__libc_start_call_main")


class Run:
    """The program and what the session made of it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        opts = MassifOptions(time_unit="B")
        self.fake = fake = FakeProbes(probe_settings(opts, malt=True))
        monkeypatch.setattr(time, "monotonic_ns", lambda: fake.clock_ns)  # bpf_ktime_get_ns's clock
        code = FakeCode()
        self.a, self.a_free = code.stack("make_a", *BELOW), code.stack("drop", *BELOW)
        self.b, self.c = code.stack("make_b", *BELOW), code.stack("make_c", *BELOW)
        self.grow, self.zero = code.stack("grow", *BELOW), code.stack("make_zero", *BELOW)
        self.session: Session = fake_session(fake, code, opts)
        self.recorder = MaltRecorder(fake, fake.settings.target_tgid)
        self.session.recorder = self.recorder
        fake.start(self.program())
        self.session.run(lambda: fake.alive, threading.Event(), 0.0)  # a tick after each step below
        self.session.finish()
        self.profile: MaltProfile = self.session.malt_profile((), "glibc")

    def program(self) -> Iterator[None]:
        """Steps 10 ns apart (ticks at 0, 10, ... 50 ns), on threads 1 and 2."""
        fake = self.fake
        fake.advance(10)
        a1 = fake.malloc(self.a, 16, inside_ns=5)
        fake.malloc(self.a, 64, inside_ns=5)
        yield
        fake.advance(10)
        fake.free(a1, self.a_free)  # lived 10 ns
        b = fake.malloc(self.b, 4096, fn="calloc", tid=2, inside_ns=7)
        yield
        fake.advance(10)
        c = fake.malloc(self.c, 32, inside_ns=5)
        yield
        fake.advance(10)
        fake.realloc(c, self.grow, 100, inside_ns=9)  # c lived 10 ns
        fake.malloc(self.zero, 0, inside_ns=5)  # the peak: heap 64 + 4096 + 100, and the zero's admin bytes
        yield
        fake.advance(10)
        fake.free(b, self.a_free)  # lived 30 ns
        yield
        fake.exit()

    def key(self, stack: tuple[int, ...], function: str = "malloc") -> StackKey:
        return StackKey(stack, function)


@pytest.fixture
def run(monkeypatch: pytest.MonkeyPatch) -> Run:
    return Run(monkeypatch)


def test_per_stack_statistics_are_the_calls(run: Run) -> None:
    stats = {s.key: s.stats for s in run.profile.stacks}
    a, b, c = run.key(run.a), run.key(run.b, "calloc"), run.key(run.c)
    grow, zero, drop = run.key(run.grow, "realloc"), run.key(run.zero), run.key(run.a_free, "free")
    assert set(stats) == {a, b, c, grow, zero, drop}
    # allocations: count, min, max, sum of the sizes (zero-size requests apart)
    assert stats[a].alloc == CountMinMaxSum(2, 16, 64, 80)
    assert stats[b].alloc == CountMinMaxSum(1, 4096, 4096, 4096)
    assert stats[c].alloc == CountMinMaxSum(1, 32, 32, 32)
    assert stats[grow].alloc == CountMinMaxSum(1, 100, 100, 100)
    assert stats[zero].alloc == CountMinMaxSum() and stats[zero].count_zeros == 1
    assert stats[drop].alloc == CountMinMaxSum()
    # frees, by the stack of the free call; lifetimes, by the stack of the allocation (a realloc ends one)
    assert stats[drop].free == CountMinMaxSum(2, 16, 4096, 16 + 4096)
    assert all(stats[k].free == CountMinMaxSum() for k in (a, b, c, grow, zero))
    assert stats[a].lifetime == CountMinMaxSum(1, 10, 10, 10)
    assert stats[b].lifetime == CountMinMaxSum(1, 30, 30, 30)
    assert stats[c].lifetime == CountMinMaxSum(1, 10, 10, 10)
    assert stats[grow].lifetime == CountMinMaxSum() and stats[zero].lifetime == CountMinMaxSum()
    # reallocs, by realloc's stack: count and the sum of new size - old size
    assert (stats[grow].realloc_count, stats[grow].realloc_sum_delta) == (1, 100 - 32)
    # bytes alive at the end, at most, and at the global peak (after the zero-size request)
    alive = {k: (s.alive_req, s.max_alive_req, s.global_peak) for k, s in stats.items()}
    assert alive == {
        a: (64, 80, 64),
        b: (0, 4096, 4096),
        c: (0, 32, 0),
        grow: (100, 100, 100),
        zero: (0, 0, 0),
        drop: (0, 0, 0),
    }
    frames = {s.key: [f.function for f in s.frames] for s in run.profile.stacks}
    assert frames[grow] == ["grow", *BELOW]


def test_leaks_totals_sizes_jumps_and_threads_are_the_calls(run: Run) -> None:
    p = run.profile
    assert p.leaks == [
        MaltLeak(run.key(run.grow, "realloc"), 1, 100),
        MaltLeak(run.key(run.a), 1, 64),
        MaltLeak(run.key(run.zero), 1, 0),
    ]
    t = p.totals
    assert (t.alloc_count, t.alloc_bytes) == (6, 16 + 64 + 4096 + 32 + 100 + 0)  # the realloc counts as one
    assert (t.free_count, t.free_bytes) == (2, 16 + 4096 + 32)  # the realloc's old block is freed bytes
    assert t.peak_bytes == 64 + 4096 + 100
    assert p.size_map == {16: 1, 64: 1, 4096: 1, 32: 1, 100: 1, 0: 1}
    assert p.realloc_jump == {(32, 100): 1}
    threads = {th.tid: {fn: (s.count, s.sum, s.time) for fn, s in th.stats.items()} for th in p.threads}
    assert threads == {
        1: {"malloc": (4, 16 + 64 + 32 + 0, 4 * 5), "free": (2, 0, 0), "realloc": (1, 100, 9)},
        2: {"calloc": (1, 4096, 7)},
    }
    assert p.globals.max_thread_count == 2
    assert check_consistency(p) == []
    resolve = run.session.symbolizer.resolver(run.session.maps.mappings)
    for version in ("1.1", "1.6"):
        jsonschema.validate(profile_to_json(p, format_version=version, resolve=resolve), SCHEMA)


def test_timelines_are_the_ticks(run: Run) -> None:
    """A tick every 10 ns: the memory timeline holds the heap's highest point since the tick before (the kernel's
    window) and the stack that set it, and the live blocks; the bandwidth what each interval allocated and freed;
    the size scatter the sizes allocated by the tick that saw them; the lifetime scatter each freed block's size
    and life."""
    mem = run.profile.memory_timeline
    assert mem.per_points == 1
    ticks = mem.values[::10]
    assert [(v[0], v[4]) for v in ticks] == [(0, 0), (80, 2), (4160, 2), (4192, 3), (4260, 4), (4260, 3)]
    assert mem.callsites[::10] == [
        None,
        run.key(run.a),
        run.key(run.b, "calloc"),
        run.key(run.c),
        run.key(run.grow, "realloc"),
        None,  # only a free since the tick before: the highest point was at that tick
    ]
    bandwidth = run.profile.memory_bandwidth.values[::10]
    assert bandwidth == [(0, 0, 0, 0), (80, 2, 0, 0), (4096, 1, 16, 1), (32, 1, 0, 0), (100, 2, 32, 0), (0, 0, 4096, 1)]
    sizes = {(10, 16): 1, (10, 64): 1, (20, 4096): 1, (30, 32): 1, (40, 100): 1, (40, 0): 1}
    assert run.profile.size_over_time.points == {(t, log2_bin(size)): n for (t, size), n in sizes.items()}
    lives = {(16, 10): 1, (32, 10): 1, (4096, 30): 1}
    assert run.profile.lifetime_over_size.points == {(log2_bin(s), log2_bin(life)): n for (s, life), n in lives.items()}


def test_the_ends_profile_is_built_from_the_probes_copy_when_first_asked(run: Run) -> None:
    """Once the probes are frozen (the program about to be unloaded), MALT's profile of the end is built from the
    copy of its tables alone, whenever it is first asked: the same profile as one built from the live maps."""
    session, fake = run.session, run.fake
    assert session.end_counters is not None
    session.freeze(FrozenProbes(fake, session.end_counters, malt=True))

    def unloaded(*_: object) -> None:
        raise AssertionError("the probes are unloaded")

    for name in ("_site_view", "_read_stack", "size_map", "realloc_jumps", "thread_stats", "life_histogram"):
        setattr(fake, name, unloaded)
    fake.advance(1_000)  # asked later: the run's length is still the end's
    after = session.malt_profile((), "glibc")
    assert after.run.runtime == run.profile.run.runtime
    after = replace(after, run=replace(after.run, date=run.profile.run.date))  # to the minute: may have turned
    resolve = session.symbolizer.resolver(session.maps.mappings)
    assert profile_to_json(after, resolve=resolve) == profile_to_json(run.profile, resolve=resolve)
    assert len(after.stacks) == 6 and after.size_map and after.threads and after.lifetime_over_size.points
