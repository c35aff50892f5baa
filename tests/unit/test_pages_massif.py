"""Massif's own counting of pages (--pages-as-heap=yes: agent.model.pages.PageMap(massif=True)) and its snapshot
schedule at the page events (agent.model.pageschedule.PageSchedule).

Massif 3.19 keeps one record per page it is told of (ms_main.c record_block, in a hash table that does not look for
the key first), drops the latest record of a page it is told is gone (VG_(HT_remove) finds the newest), and moves the
break by its own arithmetic (ms_new_mem_brk, ms_die_mem_brk). The property test runs the map against a model that
keeps those records page by page. The schedule's tests follow ms_record_page_mem and ms_unrecord_page_mem: a
snapshot after the last page of a range recorded; a peak snapshot before a range unrecorded and a normal one after
its first page only.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from agent.model.maps import MapsEntry
from agent.model.pages import (
    MAP_FIXED,
    MREMAP_FIXED,
    MREMAP_MAYMOVE,
    PAGE_SIZE,
    PRE_EXISTING_SITE,
    PageAccount,
    PageEvent,
    PageMap,
)
from agent.model.pageschedule import PageSchedule
from agent.model.snapshot import SnapshotKind, SnapshotSeries

P = PAGE_SIZE
BASE = 0x7F00_0000_0000
N_PAGES = 48
SITES = (1, 2, 3)


class MassifPages:
    """Massif's block table for pages: page -> its records' sites, oldest first."""

    def __init__(self, brk: int) -> None:
        self.records: dict[int, list[int]] = {}
        self.brk = brk
        self.peak = 0

    def record(self, first: int, n: int, site: int) -> None:
        for p in range(first, first + n):
            self.records.setdefault(p, []).append(site)

    def unrecord(self, first: int, n: int) -> None:
        for p in range(first, first + n):
            got = self.records.get(p)
            if got:
                got.pop()
                if not got:
                    del self.records[p]

    def move_break(self, new: int, site: int) -> None:
        old = self.brk
        lo, hi = min(old, new), max(old, new)
        pages = (hi - 1) // P - (lo - 1) // P  # ms_new_mem_brk / ms_die_mem_brk
        if pages:
            (self.record(lo // P, pages, site) if new > old else self.unrecord(lo // P, pages))
        self.brk = new

    @property
    def total(self) -> int:
        return sum(len(r) for r in self.records.values()) * P

    def by_site(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for sites in self.records.values():
            for s in sites:
                out[s] = out.get(s, 0) + P
        return out


BRK0 = BASE // P + 2 * N_PAGES  # the break's region, in pages, away from the mappings
ops = st.one_of(
    st.tuples(st.just("mmap"), st.sampled_from(SITES), st.integers(0, N_PAGES - 1), st.integers(1, 10)),
    st.tuples(st.just("munmap"), st.integers(0, N_PAGES - 1), st.integers(1, 12)),
    st.tuples(st.just("move"), st.sampled_from(SITES), st.integers(0, N_PAGES - 1), st.integers(1, 6),
              st.integers(0, N_PAGES - 1), st.integers(1, 6)),
    st.tuples(st.just("brk"), st.sampled_from(SITES), st.integers(0, 12 * P)),
)


def _event(op: tuple, t: int) -> PageEvent:
    kind = op[0]
    if kind == "mmap":
        _, site, first, n = op
        return PageEvent("mmap", t, 1, site, BASE + first * P, n * P, flags=MAP_FIXED)
    if kind == "munmap":
        _, first, n = op
        return PageEvent("munmap", t, 1, 0, BASE + first * P, n * P)
    if kind == "move":
        _, site, old, old_n, new, new_n = op
        return PageEvent("mremap", t, 1, site, BASE + old * P, old_n * P, new_addr=BASE + new * P,
                         new_length=new_n * P, flags=MREMAP_MAYMOVE | MREMAP_FIXED)
    _, site, offset = op
    return PageEvent("brk", t, 1, site, BRK0 * P + offset, 0, new_addr=BRK0 * P + offset)


def _apply(model: MassifPages, op: tuple) -> None:
    kind = op[0]
    if kind == "mmap":
        model.record(BASE // P + op[2], op[3], op[1])
    elif kind == "munmap":
        model.unrecord(BASE // P + op[1], op[2])
    elif kind == "move":
        _, site, old, old_n, new, new_n = op
        kept = min(old_n, new_n)
        model.unrecord(BASE // P + old + new_n, old_n - kept)  # shrinking first
        model.unrecord(BASE // P + old, kept)
        model.record(BASE // P + new, kept, site)
        model.record(BASE // P + new + old_n, new_n - kept, site)
    else:
        model.move_break(BRK0 * P + op[2], op[1])
    model.peak = max(model.peak, model.total)


def _valid(op: tuple) -> bool:
    if op[0] == "move":  # the kernel refuses overlapping ranges
        _, _, old, old_n, new, new_n = op
        return new + new_n <= old or old + old_n <= new
    return True


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=50))
def test_property_map_keeps_massifs_records(seq: list[tuple]) -> None:
    pm = PageMap(massif=True)
    pm.brk_base = pm.brk = pm.brk_top = BRK0 * P
    model = MassifPages(BRK0 * P)
    for t, op in enumerate(filter(_valid, seq), start=1):
        pm.apply(_event(op, t))
        _apply(model, op)
        assert pm.total == model.total
        assert pm.live_by_site() == model.by_site()
        # The top records are the kernel's view: what a later unmap finds first.
        top = {s // P + i: site for s, e, site in pm.intervals() for i in range((e - s) // P) if s // P < BRK0}
        assert top == {p: r[-1] for p, r in model.records.items() if p < BRK0}
    assert pm.peak_total == model.peak


def test_map_fixed_over_live_pages_keeps_them_until_unmapped_twice() -> None:
    pm = PageMap(massif=True)
    pm.apply(PageEvent("mmap", 1, 1, 1, BASE, 8 * P))
    pm.apply(PageEvent("mmap", 2, 1, 2, BASE + 2 * P, 3 * P, flags=MAP_FIXED))
    assert pm.live_by_site() == {1: 8 * P, 2: 3 * P} and pm.stats.mapped_over_bytes == 3 * P
    pm.apply(PageEvent("munmap", 3, 1, 0, BASE, 8 * P))
    assert pm.live_by_site() == {1: 3 * P} and pm.stats.mapped_over_bytes == 0
    assert pm.intervals() == [(BASE + 2 * P, BASE + 5 * P, 1)]
    pm.apply(PageEvent("munmap", 4, 1, 0, BASE, 8 * P))
    assert pm.total == 0


def test_unaligned_break_moves_by_massifs_arithmetic() -> None:
    # sbrk(100), sbrk(3 pages + 50), sbrk(-(3 pages + 150)) from a page-aligned break b
    b = BRK0 * P
    pm = PageMap(massif=True)
    pm.brk_base = pm.brk = pm.brk_top = b
    pm.apply(PageEvent("brk", 1, 1, 1, b + 100, 0, new_addr=b + 100))
    assert pm.live_by_site() == {1: P}
    pm.apply(PageEvent("brk", 2, 1, 2, b + 3 * P + 150, 0, new_addr=b + 3 * P + 150))
    # From the page holding the old break: page b again (twice now), and pages b+1, b+2, not b+3.
    assert pm.live_by_site() == {1: P, 2: 3 * P}
    assert pm.site_at(b + 3 * P) is None
    pm.apply(PageEvent("brk", 3, 1, 3, b, 0, new_addr=b))
    # Back to b: four pages from page b up: b's latest record, b+1 and b+2 go (b+3 had none); b's first record
    # stays, for good, though the kernel has no page there.
    assert pm.live_by_site() == {1: P}


def test_the_kernels_view_is_kept_without_massif() -> None:
    pm = PageMap()
    pm.apply(PageEvent("mmap", 1, 1, 1, BASE, 8 * P))
    pm.apply(PageEvent("mmap", 2, 1, 2, BASE + 2 * P, 3 * P, flags=MAP_FIXED))
    assert pm.live_by_site() == {1: 5 * P, 2: 3 * P}


def test_massif_counts_no_vdso() -> None:
    maps = [
        MapsEntry(BASE, BASE + 4 * P, "r-xp", 0, "08:01", 7, "/bin/prog"),
        MapsEntry(BASE + 16 * P, BASE + 20 * P, "r--p", 0, "00:00", 0, "[vvar]"),
        MapsEntry(BASE + 20 * P, BASE + 22 * P, "r-xp", 0, "00:00", 0, "[vdso]"),
    ]
    assert PageMap.from_maps(maps).total == 10 * P
    assert PageMap.from_maps(maps, massif=True).live_by_site() == {PRE_EXISTING_SITE: 4 * P}


# ---- the schedule ---------------------------------------------------------------------------------------


def _scheduled(detailed_freq: int = 1) -> tuple[PageAccount, SnapshotSeries]:
    series = SnapshotSeries(detailed_freq=detailed_freq, max_snapshots=100)
    acc = PageAccount(PageMap(massif=True), PageSchedule(series, 0.0, lambda b, ns: b))
    return acc, series


def test_snapshots_after_a_range_mapped_and_around_the_first_page_unmapped() -> None:
    acc, series = _scheduled()
    acc.apply([PageEvent("mmap", 1, 1, 1, BASE, 3 * P), PageEvent("munmap", 2, 1, 0, BASE, 3 * P)])
    got = [(s.time, s.heap_B, s.kind) for s in series.snapshots]
    assert got == [
        (3 * P, 3 * P, SnapshotKind.DETAILED),  # after the whole mapping
        (3 * P, 3 * P, SnapshotKind.PEAK),  # before the unmapping
        (4 * P, 2 * P, SnapshotKind.DETAILED),  # after its first page: Massif takes none after the others
    ]
    assert acc.time_b == 6 * P
    owed = acc.schedule.take_owed() if acc.schedule else []
    assert [live for _, live in owed] == [{1: 3 * P}, {1: 3 * P}, {1: 2 * P}]


def test_an_unmapping_whose_first_page_is_not_mapped_takes_no_snapshot() -> None:
    acc, series = _scheduled()
    acc.apply([PageEvent("mmap", 1, 1, 1, BASE + P, 2 * P), PageEvent("munmap", 2, 1, 0, BASE, 3 * P)])
    assert [(s.time, s.heap_B) for s in series.snapshots] == [(2 * P, 2 * P)]
    assert acc.time_b == 4 * P and acc.total == 0


def test_a_move_is_the_old_size_moved_then_the_growth() -> None:
    acc, series = _scheduled()
    acc.apply([
        PageEvent("mmap", 1, 1, 1, BASE, 2 * P),
        PageEvent("mremap", 2, 1, 2, BASE, 2 * P, new_addr=BASE + 8 * P, new_length=5 * P,
                  flags=MREMAP_MAYMOVE | MREMAP_FIXED),
    ])
    # mmap; the peak before the old pages go; after their first page; after the two moved; after the growth
    assert [(s.time, s.heap_B) for s in series.snapshots] == [
        (2 * P, 2 * P), (2 * P, 2 * P), (3 * P, P), (6 * P, 2 * P), (9 * P, 5 * P),
    ]
