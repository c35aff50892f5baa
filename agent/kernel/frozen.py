"""A target's last state: its maps copied before the BPF program is unloaded, so its profile stays queryable."""

from __future__ import annotations

from agent.kernel.interface import LiveProbes, SiteArray, SiteReader
from agent.model.counters import Counters, PageCounters


class FrozenProbes(SiteReader):
    """A copy of a target's maps taken before its BPF program is unloaded: the Session reads it as it read the
    live maps, and MALT's final profile (`malt`: its tables copied too) is built from it when first asked."""

    def __init__(self, live: LiveProbes, counters: Counters, *, malt: bool = False) -> None:
        super().__init__()
        self.settings = live.settings
        self._counters = counters
        count = min(counters.n_sites + 1, live.settings.max_stacks)
        self._frozen_sites = live.copy_sites(count)
        # Every site's stack, those of sites that only made page syscalls too (used_sites() leaves them out).
        self._stacks = {k: ips for k, ips in live.stacks(range(count)).items() if ips}
        self._page_counters = live.page_counters()
        # What the end-of-run summary says of the live probes.
        self.rows_used, self.rows_dropped, self.rows_shared = live.rows_used, live.rows_dropped, live.rows_shared
        # MALT's tables besides the sites' own columns (a few reads; their profile's objects are made on demand).
        self._size_map = live.size_map() if malt else {}
        self._realloc_jumps = live.realloc_jumps() if malt else {}
        self._thread_stats = live.thread_stats() if malt else {}
        self._life_histogram = live.life_histogram() if malt else []

    def counters(self) -> Counters:
        return self._counters

    def page_counters(self) -> PageCounters:
        return self._page_counters

    def _site_view(self, count: int) -> SiteArray:
        return self._frozen_sites

    def _read_stack(self, key: int) -> tuple[int, ...]:
        return ()  # every stack was copied

    def size_map(self) -> dict[int, int]:
        return self._size_map

    def realloc_jumps(self) -> dict[tuple[int, int], int]:
        return self._realloc_jumps

    def thread_stats(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        return self._thread_stats

    def life_histogram(self) -> list[int]:
        return self._life_histogram
