"""Page-level accounting (--pages-as-heap): synthetic syscall event streams into agent.model.pages.PageMap.

Every expected figure is derived in the test from the case's own page counts (P = one page). The rules are
Valgrind 3.19's massif/ms_main.c and coregrind's do_mremap/sys_brk (see agent/model/pages.py), except where the
kernel and Massif part ways; those cases say which one they follow. The property test compares the map
with a naive model that keeps one entry per page.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from agent.model.maps import ANON as ANON_PATH
from agent.model.maps import MapsEntry, parse_maps_full
from agent.model.pages import (
    MAP_FIXED,
    MREMAP_DONTUNMAP,
    MREMAP_FIXED,
    MREMAP_MAYMOVE,
    PAGE_SIZE,
    PRE_EXISTING_SITE,
    PageEvent,
    PageMap,
    page_up,
    parse_start_brk,
    parse_start_stack,
)
from tests.support.reference import mapped_total

P = PAGE_SIZE
BASE = 0x7F00_0000_0000  # an address in the mmap area, page aligned
A, B, C = 11, 22, 33  # site ids

_clock = iter(range(1, 10**9))


def ev(kind: str, site: int, addr: int, length: int = 0, **kw: int | bool) -> PageEvent:
    return PageEvent(kind=kind, time_ns=next(_clock), tid=1, site=site, addr=addr, length=length, **kw)  # type: ignore[arg-type]


def mmap(site: int, addr: int, length: int, flags: int = 0) -> PageEvent:
    return ev("mmap", site, addr, length, flags=flags)


def munmap(site: int, addr: int, length: int) -> PageEvent:
    return ev("munmap", site, addr, length)


def mremap(site: int, old: int, old_len: int, new: int, new_len: int, flags: int = 0) -> PageEvent:
    return ev("mremap", site, old, old_len, new_addr=new, new_length=new_len, flags=flags)


def brk(site: int, requested: int, result: int) -> PageEvent:
    return ev("brk", site, requested, 0, new_addr=result)


def check_consistent(pm: PageMap) -> None:
    """total == sum by site == bytes of the intervals; the intervals are sorted, disjoint and merged."""
    ivs = pm.intervals()
    assert pm.total == sum(pm.live_by_site().values()) == sum(e - s for s, e, _ in ivs)
    ever, gone = pm.mapped_ever_by_site(), pm.unmapped_by_site()
    assert {s: b for s in ever.keys() | gone.keys() if (b := ever.get(s, 0) - gone.get(s, 0))} == pm.live_by_site()
    for (_, e0, site0), (s1, _, site1) in itertools.pairwise(ivs):
        assert e0 <= s1
        assert e0 < s1 or site0 != site1  # neighbours of one site are kept merged


# ----------------------------------------------------------------------------------------------------------
# mmap and munmap


def test_mmap_lengths_are_rounded_up_to_pages() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 1))  # 1 byte -> 1 page
    pm.apply(mmap(B, BASE + 16 * P, 3 * P + 1))  # 3 pages and a byte -> 4 pages
    assert pm.live_by_site() == {A: 1 * P, B: 4 * P}
    assert pm.total == 5 * P
    check_consistent(pm)


def test_munmap_head_tail_and_middle_hole() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 16 * P))
    pm.apply(munmap(A, BASE, 2 * P))  # head: pages 0-1
    pm.apply(munmap(A, BASE + 13 * P, 3 * P))  # tail: pages 13-15
    pm.apply(munmap(A, BASE + 6 * P, 4 * P - 100))  # hole: pages 6-9 (length rounded up)
    # left: pages 2-5 and 10-12
    assert pm.live_by_site() == {A: (4 + 3) * P}
    assert pm.intervals() == [(BASE + 2 * P, BASE + 6 * P, A), (BASE + 10 * P, BASE + 13 * P, A)]
    assert pm.site_at(BASE + 7 * P) is None
    assert pm.stats.unknown_unmapped_bytes == 0
    check_consistent(pm)


def test_munmap_spanning_several_mappings_of_several_sites() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 4 * P))  # pages 0-3
    pm.apply(mmap(B, BASE + 6 * P, 4 * P))  # pages 6-9 (4-5 are a hole)
    pm.apply(mmap(C, BASE + 10 * P, 4 * P))  # pages 10-13
    pm.apply(munmap(A, BASE + 2 * P, 10 * P))  # pages 2-11: A loses 2, B all 4, C 2; the hole is 2 pages
    assert pm.live_by_site() == {A: 2 * P, C: 2 * P}
    assert pm.stats.unknown_unmapped_bytes == 2 * P
    check_consistent(pm)


def test_munmap_of_a_range_never_seen_is_counted_and_changes_nothing() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 2 * P))
    pm.apply(munmap(B, BASE + 100 * P, 3 * P))
    assert pm.live_by_site() == {A: 2 * P}
    assert pm.stats.unknown_unmapped_bytes == 3 * P
    assert pm.stats.applied == 2


def test_map_fixed_over_part_of_a_mapping_replaces_those_pages() -> None:
    # The kernel's rule (and /proc/PID/maps'): the 4 pages change hands. Massif 3.19 would count them twice,
    # because its block table takes a second block at the same address.
    pm = PageMap()
    pm.apply(mmap(A, BASE, 16 * P))
    pm.apply(mmap(B, BASE + 8 * P, 4 * P, flags=MAP_FIXED))
    assert pm.live_by_site() == {A: 12 * P, B: 4 * P}
    assert pm.total == 16 * P
    assert pm.site_at(BASE + 8 * P) == B and pm.site_at(BASE + 12 * P) == A
    assert pm.stats.replaced_without_fixed_bytes == 0
    pm.apply(munmap(C, BASE, 16 * P))
    assert pm.live_by_site() == {} and pm.total == 0


def test_map_fixed_across_two_mappings_and_a_hole() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 4 * P))  # pages 0-3
    pm.apply(mmap(B, BASE + 6 * P, 4 * P))  # pages 6-9
    pm.apply(mmap(C, BASE + 2 * P, 6 * P, flags=MAP_FIXED))  # pages 2-7: A loses 2, B loses 2
    assert pm.live_by_site() == {A: 2 * P, B: 2 * P, C: 6 * P}
    check_consistent(pm)


def test_overlap_without_map_fixed_is_counted_but_follows_the_kernel() -> None:
    # Only possible after lost events: the map still reflects what the kernel says is at that address.
    pm = PageMap()
    pm.apply(mmap(A, BASE, 4 * P))
    pm.apply(mmap(B, BASE + 2 * P, 4 * P))
    assert pm.live_by_site() == {A: 2 * P, B: 4 * P}
    assert pm.stats.replaced_without_fixed_bytes == 2 * P


# ----------------------------------------------------------------------------------------------------------
# mremap


def test_mremap_grow_in_place_charges_only_the_new_tail_to_the_caller() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 4 * P))
    pm.apply(mremap(B, BASE, 4 * P, BASE, 10 * P, flags=MREMAP_MAYMOVE))
    assert pm.live_by_site() == {A: 4 * P, B: (10 - 4) * P}
    assert pm.site_at(BASE + 3 * P) == A and pm.site_at(BASE + 4 * P) == B


def test_mremap_shrink_in_place_unmaps_the_tail_whoever_mapped_it() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 4 * P))
    pm.apply(mremap(B, BASE, 4 * P, BASE, 10 * P))  # A 4, B 6
    pm.apply(mremap(C, BASE, 10 * P, BASE, 3 * P + 1))  # new size rounds to 4 pages: B's 6 go
    assert pm.live_by_site() == {A: 4 * P}
    pm.apply(mremap(C, BASE, 4 * P, BASE, 1 * P))  # A keeps 1
    assert pm.live_by_site() == {A: 1 * P}
    check_consistent(pm)


def test_mremap_move_charges_the_whole_new_range_to_the_caller() -> None:
    # Massif's ms_copy_mem_remap: unrecord the old pages, record the new ones with the mremap caller's stack.
    pm = PageMap()
    new = BASE + 100 * P
    pm.apply(mmap(A, BASE, 4 * P))
    pm.apply(mremap(B, BASE, 4 * P, new, 9 * P, flags=MREMAP_MAYMOVE))
    assert pm.live_by_site() == {B: 9 * P}
    assert pm.site_at(BASE) is None
    # As Massif's xtree sees it: A's 4 pages were freed, B allocated 9.
    assert pm.mapped_ever_by_site() == {A: 4 * P, B: 9 * P}
    assert pm.unmapped_by_site() == {A: 4 * P}
    assert pm.intervals() == [(new, new + 9 * P, B)]


def test_mremap_move_of_pages_from_two_sites_and_shrink_while_moving() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 4 * P))
    pm.apply(mremap(B, BASE, 4 * P, BASE, 6 * P))  # A 4, B 2
    target = BASE + 50 * P
    pm.apply(mmap(C, target, 8 * P))  # something already at the target
    # MREMAP_FIXED to the target with 3 pages: old 6 pages go, C loses 3, the caller (A) gets 3.
    pm.apply(mremap(A, BASE, 6 * P, target, 3 * P, flags=MREMAP_MAYMOVE | MREMAP_FIXED))
    assert pm.live_by_site() == {A: 3 * P, C: (8 - 3) * P}
    assert pm.stats.replaced_without_fixed_bytes == 0
    check_consistent(pm)


def test_mremap_dontunmap_and_old_size_zero_keep_the_old_range() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 4 * P))
    pm.apply(mremap(B, BASE, 4 * P, BASE + 20 * P, 4 * P, flags=MREMAP_MAYMOVE | MREMAP_DONTUNMAP))
    pm.apply(mremap(C, BASE, 0, BASE + 40 * P, 2 * P, flags=MREMAP_MAYMOVE))
    assert pm.live_by_site() == {A: 4 * P, B: 4 * P, C: 2 * P}


# ----------------------------------------------------------------------------------------------------------
# brk


def test_brk_grows_and_shrinks_from_the_first_brk0_base() -> None:
    base = 0x5555_5600_0000
    pm = PageMap()
    pm.apply(brk(A, 0, base))  # the loader's brk(0): base, empty region
    assert pm.brk_base == base and pm.total == 0
    pm.apply(brk(A, base + 5000, base + 5000))  # break at 1 page + 904 B -> pages 0-1
    pm.apply(brk(B, base + 3 * P + 1, base + 3 * P + 1))  # -> pages 0-3: B gets pages 2-3
    pm.apply(brk(B, base + 4 * P, base + 4 * P))  # same page-rounded top: nothing
    assert pm.live_by_site() == {A: 2 * P, B: 2 * P}
    pm.apply(brk(C, base + P + 1, base + P + 1))  # top -> 2 pages: B's 2 pages go
    assert pm.live_by_site() == {A: 2 * P}
    pm.apply(brk(C, base + 10, base + 10))  # top -> 1 page
    assert pm.live_by_site() == {A: 1 * P}
    pm.apply(brk(C, base, base))  # back to empty
    assert pm.live_by_site() == {} and pm.brk_top == base
    assert pm.stats.unknown_unmapped_bytes == 0


def test_brk_refused_by_the_kernel_leaves_the_break() -> None:
    base = 0x5555_5600_0000
    pm = PageMap()
    pm.apply(brk(A, 0, base))
    pm.apply(brk(A, base + 2 * P, base + 2 * P))
    pm.apply(brk(B, base + 10**12, base + 2 * P))  # refused: the kernel returns the old break
    assert pm.live_by_site() == {A: 2 * P}
    assert pm.stats.brk_refused == 1


def test_brk_before_the_break_is_known_is_counted_not_charged() -> None:
    base = 0x5555_5600_0000
    pm = PageMap()
    pm.apply(brk(A, base + 8 * P, base + 8 * P))  # old break unknown
    assert pm.total == 0 and pm.stats.brk_unknown_base == 1
    pm.apply(brk(B, base + 10 * P, base + 10 * P))  # now known: 2 pages
    assert pm.live_by_site() == {B: 2 * P}


def test_brk_from_a_seeded_heap_shrinks_pre_existing_pages() -> None:
    heap = MapsEntry(0x5555_5600_0000, 0x5555_5600_0000 + 8 * P, "rw-p", 0, "00:00", 0, "[heap]")
    pm = PageMap.from_maps([heap])
    assert pm.brk_base == heap.start and pm.brk_top == heap.end
    pm.apply(brk(A, heap.start + 10 * P - 7, heap.start + 10 * P - 7))  # top -> 10 pages: A 2
    pm.apply(brk(B, heap.start + 5 * P, heap.start + 5 * P))  # top -> 5 pages: A's 2 and 3 seeded go
    assert pm.live_by_site() == {PRE_EXISTING_SITE: 5 * P}


def test_brk0_that_disagrees_resyncs_without_charging() -> None:
    heap = MapsEntry(0x5555_5600_0000, 0x5555_5600_0000 + 8 * P, "rw-p", 0, "00:00", 0, "[heap]")
    pm = PageMap.from_maps([heap])
    pm.apply(brk(A, 0, heap.start + 12 * P))
    assert pm.brk_top == heap.start + 12 * P and pm.stats.brk_resync == 1
    assert pm.live_by_site() == {PRE_EXISTING_SITE: 8 * P}


def test_start_brk_without_a_heap_line_gives_the_base() -> None:
    start_brk = 0x5555_5600_0000
    pm = PageMap.from_maps([], start_brk=start_brk)
    pm.apply(brk(A, start_brk + 3 * P, start_brk + 3 * P))
    assert pm.live_by_site() == {A: 3 * P}


# ----------------------------------------------------------------------------------------------------------
# Odd input, never a crash


def test_failed_unknown_invalid_and_out_of_order_events_are_counted() -> None:
    pm = PageMap()
    pm.apply(PageEvent("mmap", 1, 1, A, BASE, 4 * P))
    pm.apply(PageEvent("mmap", 50, 1, B, BASE + 10 * P, 4 * P, failed=True))
    pm.apply(PageEvent("munmap", 51, 1, B, BASE, 4 * P, failed=True))
    pm.apply(PageEvent("mprotect", 52, 1, B, BASE, 4 * P))
    pm.apply(PageEvent("munmap", 53, 1, B, BASE + 1, P))  # unaligned: EINVAL in the kernel
    pm.apply(PageEvent("mmap", 54, 1, B, BASE + 20 * P, 0))  # zero length: EINVAL
    pm.apply(PageEvent("mremap", 55, 1, B, BASE, 4 * P, new_addr=BASE, new_length=0))  # EINVAL
    pm.apply(PageEvent("mmap", 56, 1, B, (1 << 64) - P, 2 * P))  # past the address space
    assert pm.live_by_site() == {A: 4 * P}
    assert (pm.stats.failed, pm.stats.unknown_kind, pm.stats.invalid) == (2, 1, 4)
    pm.apply(PageEvent("mmap", 10, 1, C, BASE + 30 * P, P))  # time went back: counted, still applied
    assert pm.stats.out_of_order == 1
    assert pm.live_by_site() == {A: 4 * P, C: P}
    assert pm.stats.events == 9 and pm.stats.applied == 2


# ----------------------------------------------------------------------------------------------------------
# The exact peak


def test_peak_is_the_state_after_the_event_that_reached_it() -> None:
    pm = PageMap()
    pm.apply(mmap(A, BASE, 10 * P))  # 10
    pm.apply(mmap(B, BASE + 20 * P, 5 * P))  # 15
    peak_event = mmap(C, BASE + 40 * P, 3 * P)  # 18: the peak
    pm.apply(peak_event)
    pm.apply(munmap(A, BASE, 6 * P))  # 12 (A 4)
    pm.apply(mmap(A, BASE + 60 * P, 2 * P))  # 14 (A 6), B and C untouched since the peak
    pm.apply(munmap(C, BASE + 40 * P, 3 * P))  # 11
    pm.apply(mmap(B, BASE + 80 * P, 7 * P))  # 18 again: equal is not a new peak
    assert pm.peak_total == 18 * P and pm.peak_time_ns == peak_event.time_ns
    assert pm.peak_by_site() == {A: 10 * P, B: 5 * P, C: 3 * P}
    assert pm.live_by_site() == {A: 6 * P, B: 12 * P}
    pm.apply(mmap(C, BASE + 100 * P, P))  # 19: a new peak
    assert pm.peak_total == 19 * P
    assert pm.peak_by_site() == pm.live_by_site() == {A: 6 * P, B: 12 * P, C: P}


def test_peak_of_a_seeded_map_starts_at_the_seed() -> None:
    seed = [MapsEntry(BASE, BASE + 8 * P, "r-xp", 0, "08:01", 42, "/usr/lib/libc.so.6")]
    pm = PageMap.from_maps(seed)
    assert pm.peak_total == 8 * P and pm.peak_time_ns is None
    pm.apply(munmap(A, BASE, 2 * P))
    assert pm.peak_by_site() == {PRE_EXISTING_SITE: 8 * P}
    assert pm.live_by_site() == {PRE_EXISTING_SITE: 6 * P}


# ----------------------------------------------------------------------------------------------------------
# Property: the map agrees with a naive one-entry-per-page model


N_PAGES = 48
SITES = [0, A, B, C]


class NaivePages:
    """The same rules written page by page, as plainly as possible."""

    def __init__(self) -> None:
        self.pages: dict[int, int] = {}  # page index -> site
        self.top: int | None = None  # brk top, in pages
        self.peak = 0
        self.peak_sites: dict[int, int] = {}

    def by_site(self) -> dict[int, int]:
        out: dict[int, int] = {}
        for site in self.pages.values():
            out[site] = out.get(site, 0) + P
        return out

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "mmap":
            _, site, first, n = op
            for p in range(first, first + n):
                self.pages[p] = site
        elif kind == "munmap":
            _, first, n = op
            for p in range(first, first + n):
                self.pages.pop(p, None)
        elif kind == "mremap":
            _, site, old, old_n, new, new_n = op
            if new == old:
                for p in range(old + new_n, old + old_n):
                    self.pages.pop(p, None)
                for p in range(old + old_n, old + new_n):
                    self.pages[p] = site
            else:
                for p in range(old, old + old_n):
                    self.pages.pop(p, None)
                for p in range(new, new + new_n):
                    self.pages[p] = site
        elif kind == "brk":
            _, site, top = op
            if self.top is not None:
                for p in range(top, self.top):
                    self.pages.pop(p, None)
                for p in range(self.top, top):
                    self.pages[p] = site
            self.top = top
        total = len(self.pages) * P
        if total > self.peak:
            self.peak = total
            self.peak_sites = self.by_site()


# brk lives in pages [N_PAGES, 2 * N_PAGES), the mappings in [0, N_PAGES): as in a process, they never meet.
ops = st.one_of(
    st.tuples(st.just("mmap"), st.sampled_from(SITES), st.integers(0, N_PAGES - 1), st.integers(1, 12)),
    st.tuples(st.just("munmap"), st.integers(0, N_PAGES - 1), st.integers(1, 16)),
    st.tuples(
        st.just("mremap"),
        st.sampled_from(SITES),
        st.integers(0, N_PAGES - 1),
        st.integers(1, 8),
        st.integers(0, N_PAGES - 1),
        st.integers(1, 8),
    ),
    st.tuples(st.just("brk"), st.sampled_from(SITES), st.integers(N_PAGES, 2 * N_PAGES)),
)


def to_event(op: tuple, t: int) -> PageEvent:
    kind = op[0]
    if kind == "mmap":
        _, site, first, n = op
        return PageEvent("mmap", t, 1, site, BASE + first * P, n * P - 1, flags=MAP_FIXED)
    if kind == "munmap":
        _, first, n = op
        return PageEvent("munmap", t, 1, 0, BASE + first * P, n * P)
    if kind == "mremap":
        _, site, old, old_n, new, new_n = op
        return PageEvent(
            "mremap",
            t,
            1,
            site,
            BASE + old * P,
            old_n * P,
            new_addr=BASE + new * P,
            new_length=new_n * P,
            flags=MREMAP_MAYMOVE | (MREMAP_FIXED if new != old else 0),
        )
    _, site, top = op
    brk_value = BASE + top * P - (100 if top > N_PAGES else 0)  # an unaligned break, rounded up by the kernel
    return PageEvent("brk", t, 1, site, brk_value, 0, new_addr=brk_value)


def _kernel_valid(op: tuple) -> bool:
    # The kernel refuses a moving mremap whose old and new ranges overlap.
    if op[0] == "mremap":
        _, _, old, old_n, new, new_n = op
        return new == old or new + new_n <= old or old + old_n <= new
    return True


@settings(max_examples=300, deadline=None)
@given(st.lists(ops, max_size=60))
def test_property_map_agrees_with_a_page_by_page_model(seq: list[tuple]) -> None:
    pm = PageMap()
    naive = NaivePages()
    for t, op in enumerate(filter(_kernel_valid, seq), start=1):
        pm.apply(to_event(op, t))
        naive.apply(op)
        live = pm.live_by_site()
        assert pm.total == sum(live.values()) == len(naive.pages) * P
        assert live == naive.by_site()
        check_consistent(pm)
    assert pm.peak_total == naive.peak
    assert pm.peak_by_site() == naive.peak_sites
    check_consistent(pm)
    # The intervals cover exactly the naive pages, with the same site on each.
    covered = {(s - BASE) // P + i: site for s, e, site in pm.intervals() for i in range((e - s) // P)}
    assert covered == naive.pages


# ----------------------------------------------------------------------------------------------------------
# /proc/PID/maps


MAPS_TEXT = """\
55d1c4a00000-55d1c4a02000 r--p 00000000 08:01 1049 /usr/bin/my prog
55d1c4a02000-55d1c4a05000 r-xp 00002000 08:01 1049 /usr/bin/my prog
55d1c5000000-55d1c5021000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000100000 rw-p 00000000 00:00 0
7f0000100000-7f0000101000 ---p 00000000 00:00 0\x20   \x20
7f0000200000-7f0000204000 rw-s 00000000 00:05 77                         /memfd:buf (deleted)
7f0000300000-7f0000302000 rw-p 00000000 00:00 0                          [anon:arena]
not a maps line
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd000fe000-7ffd00102000 r--p 00000000 00:00 0                          [vvar]
7ffd00102000-7ffd00104000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""


def test_parse_maps_full_keeps_every_kind_of_line() -> None:
    entries = parse_maps_full(MAPS_TEXT)
    assert [e.path for e in entries] == [
        "/usr/bin/my prog",
        "/usr/bin/my prog",
        "[heap]",
        "[anon]",
        "[anon]",
        "/memfd:buf (deleted)",
        "[anon:arena]",
        "[stack]",
        "[vvar]",
        "[vdso]",
        "[vsyscall]",
    ]
    heap = entries[2]
    assert (heap.start, heap.end, heap.perms, heap.size) == (0x55D1C5000000, 0x55D1C5021000, "rw-p", 0x21000)
    assert entries[1].offset == 0x2000 and entries[1].inode == 1049 and entries[1].dev == "08:01"
    assert entries[1].is_file and not heap.is_file


def test_mapped_total_leaves_out_vsyscall_only() -> None:
    sizes = [0x2000, 0x3000, 0x21000, 0x100000, 0x1000, 0x4000, 0x2000, 0x21000, 0x4000, 0x2000]
    assert mapped_total(MAPS_TEXT) == sum(sizes)
    pm = PageMap.from_maps(parse_maps_full(MAPS_TEXT))
    assert pm.total == sum(sizes)
    assert pm.live_by_site() == {PRE_EXISTING_SITE: sum(sizes)}
    assert pm.site_at(0xFFFFFFFFFF600000) is None
    assert pm.brk_base == 0x55D1C5000000 and pm.brk_top == 0x55D1C5021000


def _stable_maps_and_vmsize() -> tuple[str, int]:
    # Reading the two files allocates, so read until two rounds agree.
    last: tuple[str, int] | None = None
    for _ in range(20):
        maps = Path("/proc/self/maps").read_text()
        status = Path("/proc/self/status").read_text()
        m = re.search(r"^VmSize:\s+(\d+) kB", status, re.M)
        assert m is not None
        cur = (maps, int(m.group(1)) * 1024)
        if cur == last:
            return cur
        last = cur
    raise AssertionError("/proc/self/maps kept changing")


def test_mapped_total_of_a_real_process_equals_its_vmsize() -> None:
    maps, vmsize = _stable_maps_and_vmsize()
    assert mapped_total(maps) == vmsize


def test_from_maps_on_real_proc_self_maps() -> None:
    maps = Path("/proc/self/maps").read_text()
    stat = Path("/proc/self/stat").read_text()
    entries = parse_maps_full(maps)
    assert len(entries) == len(maps.splitlines())  # every real line parses
    start_brk = parse_start_brk(stat)
    pm = PageMap.from_maps(entries, start_brk=start_brk)
    assert pm.total == mapped_total(maps)
    assert pm.live_by_site() == {PRE_EXISTING_SITE: pm.total}
    for e in entries:
        if e.path != "[vsyscall]":
            assert pm.site_at(e.start) == PRE_EXISTING_SITE and pm.site_at(e.end - 1) == PRE_EXISTING_SITE
    heaps = [e for e in entries if e.path == "[heap]"]
    assert start_brk is not None
    if heaps:  # the break region can be split in several [heap] lines (a part of it remapped): its top is the last's
        assert heaps[0].start <= start_brk < heaps[0].end and pm.brk_top == heaps[-1].end
    # A page unmapped after attaching comes off the pseudo-site and nothing else.
    first = entries[0]
    pm.apply(munmap(A, first.start, P))
    assert pm.live_by_site() == {PRE_EXISTING_SITE: mapped_total(maps) - P}


def test_parse_start_brk_reads_field_47_after_the_command_name() -> None:
    # comm may hold spaces and ')'. Fields 3.. follow the last ')'; start_brk is field 47.
    fields = [str(i) for i in range(3, 53)]
    fields[47 - 3] = str(0x55D1C5000000)
    assert parse_start_brk("1234 (a) b (c)) " + " ".join(fields) + "\n") == 0x55D1C5000000
    assert parse_start_brk("1234 (short) R 1 2") is None
    assert parse_start_brk("garbage") is None


def test_parse_start_stack_reads_field_28() -> None:
    fields = [str(i) for i in range(3, 53)]
    fields[28 - 3] = str(0x7FFD1C020F30)
    assert parse_start_stack("1234 (a) b (c)) " + " ".join(fields) + "\n") == 0x7FFD1C020F30
    assert parse_start_stack("1234 (short) R 1 2") is None


def test_page_up() -> None:
    assert [page_up(n) for n in (0, 1, P - 1, P, P + 1)] == [0, P, P, P, 2 * P]


# ----------------------------------------------------------------------------------------------------------
# Scale: the lazily kept peak equals a full copy taken at every new peak


def test_lazy_peak_equals_a_copy_at_every_new_peak_over_1000_sites() -> None:
    pm = PageMap()
    best = 0
    best_sites: dict[int, int] = {}
    for i in range(20_000):
        site = 1 + (i * 7) % 1000
        slot = BASE + (i % 3000) * 4 * P
        if i % 3 == 2:
            pm.apply(PageEvent("munmap", i, 1, site, slot - 4 * P * 5, 2 * P))
        else:
            pm.apply(PageEvent("mmap", i, 1, site, slot, 3 * P, flags=MAP_FIXED))
        if pm.total > best:
            best, best_sites = pm.total, pm.live_by_site()
    check_consistent(pm)
    assert pm.peak_total == best
    assert pm.peak_by_site() == best_sites
    assert len(best_sites) == 1000


# ----------------------------------------------------------------------------------------------------------
# A real process: its own syscalls (recorded by strace, no root needed) replayed into the map give exactly
# the pages of its /proc/self/maps.

REPLAY_C = r"""
#define _GNU_SOURCE
#include <fcntl.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>
#define P 4096
static char buf[1 << 20];
static void dump(const char *path) {
  int in = open("/proc/self/maps", O_RDONLY), out = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  ssize_t n;
  while ((n = read(in, buf, sizeof buf)) > 0) write(out, buf, n);
  close(in);
  close(out);
}
int main(int argc, char **argv) {
  (void)argc;
  dump(argv[1]);
  syscall(SYS_getppid); /* attach point */
  char *big = mmap(0, 64 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0); /* 1 */
  munmap(big + (32 << 20), 32 << 20);                                                        /* 2 */
  char *g = mmap(0, 10 * P, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);    /* 3 */
  munmap(g + 4 * P, 6 * P);                                                                 /* 4 */
  mremap(g, 4 * P, 6 * P, 0);                                                    /* 5: grow in place */
  char *blk = mmap(0, 3 * P, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);                /* 6 */
  char *m = mremap(blk, 3 * P, 300 * P, MREMAP_MAYMOVE);                         /* 7: grow, moving */
  mremap(m, 300 * P, 100 * P, 0);                                                /* 8: shrink */
  mmap(big + 8 * P, 5 * P - 10, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED, -1, 0); /* 9 */
  munmap(big + 4 * P, 2 * P + 1);                                                /* 10: pages 4-6 */
  sbrk(100000); sbrk(300000); sbrk(-250000);
  static void *volatile sink;
  for (int i = 0; i < 50; i++) { sink = malloc(200000 + i); free(sink); }
  char *r = malloc(300000); sink = r; r = realloc(r, 3 << 20); sink = r; r = realloc(r, 9 << 20); sink = r;
  dump(argv[2]);
  syscall(SYS_getppid); /* end */
  return 0;
}
"""

_STRACE_LINE = re.compile(r"^\d+\s+(\w+)\((.*)\)\s+= (-?\w+)")


def _events_from_strace(lines: list[str]) -> list[PageEvent]:
    out: list[PageEvent] = []
    for t, line in enumerate(lines, start=1):
        m = _STRACE_LINE.match(line)
        assert m is not None, line
        kind, args, res = m.group(1), [int(a, 0) for a in m.group(2).split(", ")], m.group(3)
        failed = res.startswith("-")
        r = 0 if failed else int(res, 0)
        if kind == "mmap":
            out.append(PageEvent("mmap", t, 1, t, r, args[1], flags=args[3], prot=args[2], failed=failed))
        elif kind == "munmap":
            out.append(PageEvent("munmap", t, 1, t, args[0], args[1], failed=failed))
        elif kind == "mremap":
            out.append(PageEvent("mremap", t, 1, t, args[0], args[1], new_addr=r, new_length=args[2], flags=args[3]))
        else:
            out.append(PageEvent("brk", t, 1, t, args[0], 0, new_addr=r))
    return out


@pytest.mark.needs("strace", "gcc")
def test_replay_of_a_real_process_gives_its_proc_maps_page_by_page(tmp_path: Path) -> None:
    (tmp_path / "replay.c").write_text(REPLAY_C)
    exe = tmp_path / "replay"
    subprocess.run(["gcc", "-O1", "-o", str(exe), str(tmp_path / "replay.c")], check=True)
    trace, before, after = tmp_path / "trace.txt", tmp_path / "m0.txt", tmp_path / "m1.txt"
    run = subprocess.run(
        ["strace", "-f", "-qq", "-o", str(trace), "-e", "trace=mmap,munmap,mremap,brk,getppid",
         "-e", "raw=mmap,munmap,mremap,brk", str(exe), str(before), str(after)],
        capture_output=True, text=True,
    )  # fmt: skip
    if run.returncode != 0:
        pytest.skip(f"strace could not trace: {run.stderr.strip()}")
    lines = trace.read_text().splitlines()
    marks = [i for i, line in enumerate(lines) if "getppid(" in line]
    events = _events_from_strace(lines[marks[0] + 1 : marks[-1]])

    seed_text = before.read_text()
    pm = PageMap.from_maps(parse_maps_full(seed_text))
    pm.apply_all(events)
    assert pm.stats.invalid == pm.stats.unknown_kind == pm.stats.replaced_without_fixed_bytes == 0

    # The kernel's own account: the same pages (the main stack did not grow between the two dumps).
    final_text = after.read_text()
    kernel_pages = {p for e in parse_maps_full(final_text) if e.path != "[vsyscall]" for p in range(e.start, e.end, P)}
    model_pages = {p for s, e, _ in pm.intervals() for p in range(s, e, P)}
    assert model_pages == kernel_pages
    assert pm.total == mapped_total(final_text)

    # The sites of the program's own calls (site = position in the trace, 1 = the 64 MiB mmap).
    live = pm.live_by_site()
    mib = 1 << 20
    assert live[1] == (64 * mib - 32 * mib) - 5 * P - 3 * P  # half unmapped, 5 pages MAP_FIXED, 3 unmapped
    assert live[3] == 4 * P and 4 not in live  # 10 pages, 6 unmapped by site 4
    if not events[4].failed:  # grown in place unless something was mapped there meanwhile
        assert live[5] == 2 * P
    assert 6 not in live and live[7] == 100 * P  # moved: all to the mover, then shrunk by site 8
    assert live[9] == 5 * P
    assert live[PRE_EXISTING_SITE] <= mapped_total(seed_text)
    # The peak is right after the 64 MiB mmap: nothing later maps as much.
    assert pm.peak_time_ns == events[0].time_ns
    assert pm.peak_by_site() == {PRE_EXISTING_SITE: mapped_total(seed_text), 1: 64 * mib}


# ----------------------------------------------------------------------------------------------------------
# PageAccount: the page map in the profile's terms


def test_account_site_counts_and_the_byte_clock() -> None:
    from agent.model.pages import PageAccount

    seed = [MapsEntry(BASE - 4 * P, BASE - 2 * P, "r--p", 0, "00:00", 0, ANON_PATH)]
    acc = PageAccount(PageMap.from_maps(seed))
    acc.apply([mmap(A, BASE, 3 * P), mmap(B, BASE + 8 * P, 5 * P), munmap(C, BASE + 8 * P, 2 * P)])
    counts = acc.site_counts()
    assert counts[PRE_EXISTING_SITE].cur_bytes == 2 * P
    assert counts[A].cur_bytes == counts[A].tot_bytes == counts[A].peak_bytes == 3 * P
    # B's peak was before C took two of its pages; C unmapped, mapped nothing: not a site of the tree.
    assert (counts[B].cur_bytes, counts[B].tot_bytes, counts[B].freed_bytes, counts[B].peak_bytes) == (
        3 * P,
        5 * P,
        2 * P,
        5 * P,
    )
    assert counts[B].cur_blocks == 3 and counts[B].freed_blocks == 2
    assert C not in counts
    # Massif's B clock: every page mapped or unmapped; the peak at 2 + 3 + 5 pages, after 8 pages of changes.
    assert acc.time_b == (3 + 5 + 2) * P
    assert acc.peak_time_b == 8 * P
    assert acc.peak_gen == 2
    assert acc.total == (2 + 3 + 3) * P


def test_account_peak_does_not_move_when_the_total_only_returns_to_it() -> None:
    from agent.model.pages import PageAccount

    acc = PageAccount(PageMap())
    acc.apply([mmap(A, BASE, 4 * P), munmap(A, BASE, 4 * P), mmap(B, BASE, 4 * P)])
    assert acc.map.peak_total == 4 * P
    assert acc.peak_gen == 1 and acc.peak_time_b == 4 * P
    assert acc.site_counts()[A].peak_bytes == 4 * P
    assert B not in {s for s, c in acc.site_counts().items() if c.peak_bytes}
