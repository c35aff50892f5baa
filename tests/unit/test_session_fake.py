"""The session (agent.session.session) against a fake kernel (tests/support/fake_probes.py): no root, no BPF, no bcc.

A real Session runs its real sampling loop (Session.run) over a target the test drives call by call; every expected
figure is worked out here from the calls fed: Massif's extra bytes of a small block (its size rounded up to 16, plus
the 8 bytes of --heap-admin), its --time-unit=B clock (the sum of the changes in heap + extra) and its schedule
(a snapshot after each event once the interval has passed; a peak snapshot before a free that comes down from a
new high).
"""

from __future__ import annotations

import itertools
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, cast

import pytest

from agent.kernel.abi import EV_EXIT
from agent.kernel.frozen import FrozenProbes
from agent.model.options import MassifOptions
from agent.model.snapshot import SnapshotSeries
from agent.model.stack import Frame
from agent.model.tree import IndexedTree, Tree
from agent.session.session import IdlePace, Session
from tests.support.fake_probes import FakeCode, FakeProbes, fake_session, probe_settings

if TYPE_CHECKING:
    from agent.kernel.probes import HeapProbes

ROOT = Path(__file__).resolve().parents[2]
PPM = 10_000  # --peak-inaccuracy=1.0, in millionths


def extra(size: int) -> int:
    """Massif's extra bytes of a block below 4 MiB at the default --alignment and --heap-admin."""
    return (-size) % 16 + 8


def names(stack: Sequence[Frame]) -> tuple[str | None, ...]:
    return tuple(f.function for f in stack)


def tree_bytes(tree: Tree | None) -> dict[tuple[str | None, ...], int]:
    """A tree's bytes by stack, each named from the allocating function to main (as Massif prints it)."""
    assert isinstance(tree, IndexedTree)
    return {names(stack): n for stack, n in tree.stacks().items()}


def shape(series: SnapshotSeries) -> list[tuple[int, int, int, str]]:
    return [(s.time, s.heap_B, s.heap_extra_B, s.kind.value) for s in series.snapshots]


def run(session: Session, fake: FakeProbes, target: Iterator[None]) -> threading.Event:
    """The session's loop until the target exits (or ends its profile), sampling at every turn."""
    stop = threading.Event()
    fake.start(target)
    session.run(lambda: fake.alive, stop, 0.0)
    return stop


class Program:
    """The fake target's code and the stacks it allocates from (innermost first, as the kernel walks them)."""

    def __init__(self) -> None:
        self.code = FakeCode()
        below = ("main", "__libc_start_call_main")
        self.f = self.code.stack("f", *below)
        self.g = self.code.stack("g", *below)
        self.h = self.code.stack("h", *below)
        self.launcher = self.code.stack("spawn", "launcher_main")


@pytest.mark.parametrize("burst", [False, True], ids=["call-by-call", "burst"])
def test_points_are_massifs_snapshots_with_the_trees_of_their_instants(burst: bool) -> None:
    """Each call is a point (the interval is 0 until the series culls), the free from the high a peak point before
    it; every third snapshot is detailed, with the tree of its own instant, also when the session reads the points
    long after (a burst of calls between two ticks: the trees come from the snapshot log)."""
    opts = MassifOptions(time_unit="B", detailed_freq=3)
    fake, p = FakeProbes(probe_settings(opts)), Program()
    session = fake_session(fake, p.code, opts)
    pause = () if burst else (None,)

    def target() -> Iterator[None]:
        a = fake.malloc(p.f, 100)
        yield from pause
        b = fake.malloc(p.g, 200)
        yield from pause
        fake.free(b)
        yield from pause
        fake.malloc(p.f, 50)
        yield from pause
        fake.malloc(p.g, 30)
        yield
        fake.free(a)
        fake.exit()

    run(session, fake, target())
    session.finish()
    t1 = 100 + extra(100)
    t2 = t1 + 200 + extra(200)
    t3 = t2 + 200 + extra(200)
    t4 = t3 + 50 + extra(50)
    t5 = t4 + 30 + extra(30)
    high = extra(100) + extra(200)
    assert shape(session.series)[:7] == [
        (0, 0, 0, "normal"),
        (t1, 100, extra(100), "normal"),
        (t2, 300, high, "detailed"),
        (t2, 300, high, "peak"),
        (t3, 100, extra(100), "normal"),
        (t4, 150, extra(100) + extra(50), "normal"),
        (t5, 180, extra(100) + extra(50) + extra(30), "detailed"),
    ]
    snaps = session.series.snapshots
    at_high = {("f", "main"): 100, ("g", "main"): 200}
    assert tree_bytes(snaps[2].tree) == at_high
    assert tree_bytes(snaps[3].tree) == at_high
    assert tree_bytes(snaps[6].tree) == {("f", "main"): 150, ("g", "main"): 30}
    assert session.trees_at_instant == 3 and session.trees_missed == 0
    # The target's last call, just before its exit: its point, then the profile's end.
    t6 = t5 + 100 + extra(100)
    assert shape(session.series)[7:] == [(t6, 80, extra(50) + extra(30), "normal")]
    final = session.final
    assert final is not None and (final.time, final.heap_B) == (t6, 80)
    assert tree_bytes(final.tree) == {("f", "main"): 50, ("g", "main"): 30}
    c = session.end_counters
    assert c is not None and (c.peak_heap, c.peak_extra, c.peak_time_b) == (300, high, t2)


def test_a_run_target_counts_from_its_exec_and_ends_cleanly_at_its_exit() -> None:
    """`run`: the calls before the exec (the launcher's) are not the program's; the target is held at its exec, at
    each change of its loaded objects and at its exit(), where the session reads what it must (before_exit) while
    the target is still there, then lets it go; the loop ends once it is gone, without being stopped."""
    opts = MassifOptions(time_unit="B")
    fake, p = FakeProbes(probe_settings(opts, run=True)), Program()
    session = fake_session(fake, p.code, opts)
    held: list[tuple[int, bool, int]] = []
    session.before_exit = lambda: held.append((fake.stopped(), fake.alive, session.counters().heap))

    def target() -> Iterator[None]:
        fake.malloc(p.launcher, 4000)
        yield
        fake.exec()
        yield
        a = fake.malloc(p.f, 100)
        yield
        fake.loader()
        yield
        fake.malloc(p.g, 40)
        yield
        fake.free(a)
        yield
        fake.exit()

    stop = run(session, fake, target())
    assert not fake.alive and not stop.is_set() and fake.stopped() == 0
    assert held == [(EV_EXIT, True, 40)]
    assert not session.exec_ended()
    session.finish()
    c = session.end_counters
    assert c is not None
    assert (c.execs, c.n_allocs, c.n_frees, c.heap, c.blocks, c.peak_heap) == (1, 2, 1, 40, 1, 140)
    t3 = 100 + extra(100) + 40 + extra(40)
    assert shape(session.series) == [
        (0, 0, 0, "normal"),
        (100 + extra(100), 100, extra(100), "normal"),
        (t3, 140, extra(100) + extra(40), "normal"),
        (t3, 140, extra(100) + extra(40), "peak"),
        (t3 + 100 + extra(100), 40, extra(40), "normal"),
    ]
    final = session.final
    assert final is not None and final.heap_B == 40
    assert tree_bytes(final.tree) == {("f", "main"): 0, ("g", "main"): 40}  # f's stack has allocated: it stays
    assert session.summary().counters.n_allocs == 2


def test_a_second_exec_ends_the_profile_and_disarms_the_probes() -> None:
    """The target exec's another program: the profile ends there, the target runs on, and what the new program
    allocates is not counted."""
    opts = MassifOptions(time_unit="B")
    fake, p = FakeProbes(probe_settings(opts, run=True)), Program()
    session = fake_session(fake, p.code, opts)

    def target() -> Iterator[None]:
        fake.exec()
        yield
        fake.malloc(p.f, 100)
        yield
        fake.exec()
        yield
        fake.malloc(p.g, 999)
        yield
        fake.exit()

    run(session, fake, target())
    assert session.exec_ended() and fake.alive
    fake.wait_events(0)  # the new program allocates
    assert fake.counters().heap == 100 and fake.counters().n_allocs == 1
    session.finish()
    c = session.end_counters
    assert c is not None and (c.execs, c.heap) == (2, 100)
    final = session.final
    assert final is not None and tree_bytes(final.tree) == {("f", "main"): 100}


def test_with_the_target_held_at_each_culling_the_series_is_massifs() -> None:
    """`run` with --time-unit=B: at each culling the kernel holds the target until the session has set the new
    interval, so the snapshots are Massif's own: the same times, totals and peaks, culled alike."""
    opts = MassifOptions(time_unit="B", max_snapshots=10, detailed_freq=1_000)
    fake, p = FakeProbes(probe_settings(opts, run=True)), Program()
    session = fake_session(fake, p.code, opts)
    massif = SnapshotSeries(detailed_freq=opts.detailed_freq, max_snapshots=opts.max_snapshots)
    massif.add(0, 0, 0, 0)
    rng = random.Random(5)

    def target() -> Iterator[None]:
        fake.exec()
        yield
        live: list[tuple[int, int]] = []
        heap = xtra = clock = peak_level = 0
        for i in range(400):
            free = bool(live) and (i >= 300 or rng.random() < 0.4)
            if free:
                address, size = live.pop(rng.randrange(len(live)))
                if heap + xtra > peak_level:  # Massif's peak snapshot, before the free
                    peak_level = (heap + xtra) * (1_000_000 + PPM) // 1_000_000
                    massif.add_peak_point(clock, heap, xtra, 0)
                fake.free(address)
            else:
                size = rng.choice([8, 24, 100, 1000, 5000]) + rng.randrange(16)
                live.append((fake.malloc(rng.choice([p.f, p.g, p.h]), size), size))
            sign = -1 if free else 1
            heap, xtra, clock = heap + sign * size, xtra + sign * extra(size), clock + size + extra(size)
            massif.add_point(clock, heap, xtra, 0)
            yield
        fake.exit()

    run(session, fake, target())
    session.finish()
    assert massif.n_cullings >= 3 and massif.n_peaks_taken >= 3  # the case exercises both
    assert shape(session.series) == shape(massif)
    got = session.series
    assert (got.n_taken, got.n_peaks_taken, got.n_cullings) == (massif.n_taken, massif.n_peaks_taken, massif.n_cullings)


def test_in_ms_the_points_and_the_peak_are_timed_by_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """--time-unit=ms: a point's time is its event's, in whole milliseconds since the session started; so is the
    peak's, and the end is when sampling stopped."""
    opts = MassifOptions(time_unit="ms")
    fake, p = FakeProbes(probe_settings(opts)), Program()
    monkeypatch.setattr(time, "monotonic_ns", lambda: fake.clock_ns)  # bpf_ktime_get_ns's clock
    session = fake_session(fake, p.code, opts)
    ms = 1_000_000

    def target() -> Iterator[None]:
        fake.advance(2 * ms)
        a = fake.malloc(p.f, 100)
        yield
        fake.advance(5 * ms + ms // 2)
        fake.malloc(p.g, 200)
        yield
        fake.advance(4 * ms + ms // 2)
        fake.free(a)
        yield
        fake.advance(ms)
        fake.exit()

    run(session, fake, target())
    session.finish()
    high = extra(100) + extra(200)
    assert shape(session.series) == [
        (0, 0, 0, "normal"),
        (2, 100, extra(100), "normal"),
        (7, 300, high, "normal"),
        (12, 300, high, "peak"),
        (12, 200, extra(200), "normal"),
    ]
    c = session.end_counters
    assert c is not None and session.peak_time(c) == 7
    assert session.final is not None and session.final.time == 13


def test_an_ended_profile_reads_its_copy_and_xtree_full_charges_frees_to_their_stacks() -> None:
    """Once finished and frozen (the probes unloaded), the profile answers from the copy of the maps: the final
    snapshot, the counters per stack, and each site's bytes at the peak, also of a site that changed after it (its
    value at the peak is kept when it changes: f's 40 bytes, not its 140 of an earlier high); with
    --xtree-memory=full the freed bytes go to the stack of the free."""
    opts = MassifOptions(time_unit="B", xtree_memory="full")
    fake, p = FakeProbes(probe_settings(opts)), Program()
    session = fake_session(fake, p.code, opts)

    def target() -> Iterator[None]:
        a = fake.malloc(p.f, 100)
        a2 = fake.malloc(p.f, 40)
        fake.free(a, p.h)
        yield
        fake.malloc(p.g, 300)  # the peak: f holds 40 bytes
        yield
        fake.free(a2, p.h)
        yield
        fake.exit()

    run(session, fake, target())
    session.finish()
    c = session.end_counters
    assert c is not None and c.peak_heap == 340
    session.freeze(FrozenProbes(cast("HeapProbes", fake), c))
    fake.malloc(p.g, 1000)  # the live maps move on: the profile does not
    assert session.live is None
    assert session.snapshot_model(detailed=True) is session.final
    merged = {names(stack)[:2]: s for stack, s in session.merged_sites(massif_trim=False).items()}
    assert {k: (s.cur_bytes, s.cur_blocks, s.tot_bytes, s.tot_blocks) for k, s in merged.items()} == {
        ("f", "main"): (0, 0, 140, 2),
        ("g", "main"): (300, 1, 300, 1),
        ("h", "main"): (0, 0, 0, 0),
    }
    assert {k: (s.freed_bytes, s.freed_blocks) for k, s in merged.items()} == {
        ("f", "main"): (0, 0),
        ("g", "main"): (0, 0),
        ("h", "main"): (140, 2),
    }
    sites = session.read_sites(c.peak_gen)
    assert {names(session.frames_of(k))[:2]: s.peak_bytes for k, s in sites.items()} == {
        ("f", "main"): 40,
        ("g", "main"): 300,
        ("h", "main"): 0,
    }


def test_stacks_beyond_the_kernels_table_go_to_the_overflow_site() -> None:
    """The site ids are used up: the calls of new stacks are counted, under one node that says their stack was not
    recorded."""
    opts = MassifOptions(time_unit="B")
    fake, p = FakeProbes(probe_settings(opts, max_stacks=3)), Program()
    session = fake_session(fake, p.code, opts)

    def target() -> Iterator[None]:
        fake.malloc(p.f, 100)
        fake.malloc(p.g, 200)
        fake.malloc(p.h, 300)  # site ids 1 and 2 are taken: the table holds 3 with the overflow site
        fake.malloc(p.launcher, 400)
        yield
        fake.exit()

    run(session, fake, target())
    session.finish()
    final = session.final
    assert final is not None
    assert tree_bytes(final.tree) == {("f", "main"): 100, ("g", "main"): 200, ("[stack not recorded]",): 700}
    assert session.end_counters is not None and session.end_counters.dropped_stacks == 2


def test_the_fake_runs_without_root_and_without_bcc() -> None:
    """These tests and the MALT recorder's, run again with bcc made unimportable: they pass, and bcc was never
    loaded."""
    code = (
        "import sys, pytest\n"
        "sys.modules['bcc'] = None  # any import of bcc fails\n"
        "files = ['tests/unit/test_session_fake.py', 'tests/unit/test_maltrec_fake.py']\n"
        "status = pytest.main(['-q', '-p', 'no:cacheprovider', '-k', 'not without_bcc', *files])\n"
        "loaded = [m for m in sys.modules if m.startswith('bcc') and sys.modules[m] is not None]\n"
        "assert status == 0 and not loaded, (status, loaded)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, capture_output=True)


def test_sampled_looks_of_every_target_come_on_one_grid_one_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled mode: three targets' loops, each in its own thread as the daemon runs them and begun at different
    instants, look at their targets on
    the instants of one grid (multiples of the pace's interval on the monotonic clock), one look at a time for the
    whole process (LOOKS), so that they run back to back."""
    step = 0.1
    monkeypatch.setattr(IdlePace, "SAMPLED_WAIT", step)
    opts = MassifOptions(time_unit="B")
    looks: list[tuple[int, float, float]] = []
    record = threading.Lock()

    def loop(n: int) -> None:
        time.sleep(n * step / 3)  # attached at three phases of the step: without the grid, their looks keep them
        fake, p = FakeProbes(replace(probe_settings(opts), sampled=True)), Program()
        session = fake_session(fake, p.code, opts)
        sample = session.sample

        def timed() -> None:
            start = time.monotonic()
            sample()
            time.sleep(0.003)  # a look that waits on the kernel lets the other threads run meanwhile
            with record:
                looks.append((n, start, time.monotonic()))

        session.sample = timed  # type: ignore[method-assign]

        def target() -> Iterator[None]:
            end = time.monotonic() + 1.2
            while time.monotonic() < end:
                fake.malloc(p.f, 64)
                time.sleep(0.002)
                yield
            fake.exit()

        run(session, fake, target())

    threads = [threading.Thread(target=loop, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    firsts = {n: min(start for m, start, _ in looks if m == n) for n in range(3)}  # each at its loop's start
    later = sorted((start, end, n) for n, start, end in looks if start > firsts[n])
    assert {n for _, _, n in later} == {0, 1, 2} and len(later) >= 3 * 8
    overlaps = [(a, b) for a, b in itertools.pairwise(later) if b[0] < a[1]]
    assert not overlaps, "two looks ran at once"
    # Each look begins a little after an instant of the grid: the wake's lateness and the looks before it in line.
    # (Off the grid, the loops' looks would keep the three phases they began at: a third of them at most this near.)
    phase = sorted((start % step) for start, _, _ in later)
    assert phase[3 * len(phase) // 4] < 0.3 * step, f"the looks are not on the grid: phases {phase}"
