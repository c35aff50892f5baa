"""A profile's allocation sites: their symbolized stacks, numbered once, and the heap trees built from them.

The kernel hands out site ids (one per distinct raw stack). Here each site is symbolized once, trimmed as Massif
trims (allocation functions, --depth, below main) and numbered in a StackIndex, so a snapshot's tree is one pass
over the sites' counters. Sites whose trimmed stacks are equal add up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from agent.kernel.interface import SiteReader
from agent.model.options import MassifOptions
from agent.model.pages import PRE_EXISTING_SITE
from agent.model.stack import Frame, SiteCounts, Stack, trim_stack
from agent.model.tree import IndexedTree, StackIndex
from agent.process.maps import MapsRecorder
from agent.symbols.symbolizer import Symbolizer

# Shown for allocations whose stack the kernel did not store (its stack table was full, or the walk was
# overtaken on a preemptible kernel).
OVERFLOW_FRAME = Frame(address=0, function="[stack not recorded]")
# Sites outside the heap tree (SiteTrees._site_stack): made by an --ignore-fn function, or with no frame left once
# trimmed (HeapTree leaves those out too).
_IGNORED = -1
_NO_FRAME = -2
_COUNTER_NAMES = ("cur_bytes", "cur_blocks", "tot_bytes", "tot_blocks", "freed_bytes", "freed_blocks")


@dataclass
class Ignored:
    """Bytes of --ignore-fn allocations, taken off the snapshot totals (and their live blocks, when read)."""

    heap: int = 0
    extra: int = 0
    blocks: int = 0


class SiteTrees:
    """Symbolize, number and add up one target's sites. Callers hold the session's lock."""

    def __init__(
        self,
        opts: MassifOptions,
        maps: MapsRecorder,
        symbolizer: Symbolizer,
        root_label: str,
        pre_existing: Frame,
    ) -> None:
        self.opts = opts
        self.maps = maps
        self.symbolizer = symbolizer
        self._pre_existing_frame = pre_existing  # the page map's site for mappings made before the profile
        self._frames: dict[int, list[Frame]] = {}  # site -> symbolized raw stack
        self._trimmed: dict[int, Stack] = {}  # site -> Massif's trimmed stack
        self._alloc_fns = opts.all_alloc_fns
        self._ignore_fns = frozenset(opts.ignore_fns)
        # The heap tree's stacks, numbered once: a snapshot's tree is then one pass over the sites' counters.
        self._index = StackIndex(root_label)
        self._site_stack: dict[int, int] = {}  # site -> its trimmed stack's number in _index, or _IGNORED/_NO_FRAME
        self._first_keys: list[int] = []  # by stack number: the first site found with that stack
        self._more_keys: list[tuple[int, int]] = []  # (site, stack number) of the other sites in the tree
        self._ignored_keys: list[int] = []  # sites of --ignore-fn functions
        self._waiting: list[int] = [0]  # site ids not in the tree yet: unused so far, or only frees charged
        self._ids_taken = 1  # site ids 0.._ids_taken-1 are in one of the lists above (0 is in _waiting)
        # --pages-as-heap=yes: the page map's sites (a dict, with PRE_EXISTING_SITE) have an index of their own
        self._page_index = StackIndex(root_label)
        self._page_stack: dict[int, int] = {}  # page site -> its stack's number in _page_index, or _IGNORED/_NO_FRAME
        # --ignore-fn: the kernel's flags (new_flags): ids from 1 up are flagged below this, but those waiting
        self._flag_next = 1
        self._flag_waiting: list[int] = []  # ids handed out whose stack the kernel had not stored yet

    # ---- symbols ----------------------------------------------------------------------------------

    def symbolize_new(self, probes: SiteReader, keys: Sequence[int]) -> None:
        """Symbolize stacks not seen before, while the target's mappings are still readable."""
        new = [k for k in keys if k not in self._frames]
        if not new:
            return
        raw = probes.stacks(new)
        if any(ip and not self._mapped(ip) for ips in raw.values() for ip in ips[:1]):
            self.maps.refresh()
        self.maps.hold_files_if_gone()  # a container's process that has ended: its files through its root held
        for key in new:
            ips = raw.get(key, ())
            if key == PRE_EXISTING_SITE:
                self._frames[key] = [self._pre_existing_frame]
            elif not ips:
                self._frames[key] = [OVERFLOW_FRAME]
            else:
                self._frames[key] = self.symbolizer.symbolize_stack(self.maps.mappings, ips)

    def frames_of(self, key: int) -> list[Frame]:
        """The symbolized raw stack of a site (symbolize_new first)."""
        return self._frames.get(key, [])

    def _mapped(self, ip: int) -> bool:
        return any(m.start <= ip < m.end for m in self.maps.mappings)

    def trimmed(self, key: int) -> Stack:
        stack = self._trimmed.get(key)
        if stack is None:
            stack = trim_stack(self._frames[key], self._alloc_fns, self.opts.depth)
            self._trimmed[key] = stack
        return stack

    def _ignored(self, stack: Stack) -> bool:
        """--ignore-fn: the allocation was made directly in an ignored function."""
        return bool(stack) and stack[0].function in self._ignore_fns if self._ignore_fns else False

    def new_flags(self, probes: SiteReader) -> dict[int, bool]:
        """--ignore-fn: whether each site not flagged yet is ignored, for the kernel's reallocs (Massif's rule
        needs it at the call: probes/heap.bpf.c record_realloc). A site whose stack the kernel has not stored yet
        (another thread is still walking it) waits for the next call."""
        n = probes.site_count()
        candidates = self._flag_waiting + list(range(self._flag_next, n))
        self._flag_next = max(self._flag_next, n)
        if not candidates:
            return {}
        raw = probes.stacks(candidates)
        ready = [k for k in candidates if raw.get(k)]
        self._flag_waiting = [k for k in candidates if not raw.get(k)]
        self.symbolize_new(probes, ready)
        return {k: self._ignored(self.trimmed(k)) for k in ready}

    # ---- the heap tree ----------------------------------------------------------------------------

    def _take_sites(self, probes: SiteReader, count: int) -> None:
        """Put sites 0..count-1 that have allocations into the tree's lists (symbolizing them), once each."""
        fresh = range(self._ids_taken, count)
        if not fresh and not self._waiting:
            return
        tot_blocks = probes.site_column("tot_blocks", count)
        candidates = self._waiting + list(fresh)
        self._ids_taken = max(self._ids_taken, count)
        # Sites with only frees charged (xtree full, MALT) are no allocation sites: they wait, as do ids not
        # used yet.
        take = [k for k in candidates if k < len(tot_blocks) and tot_blocks[k]]
        if not take:
            self._waiting = candidates
            return
        taken = set(take)
        self._waiting = [k for k in candidates if k not in taken]
        self.symbolize_new(probes, take)
        for key in take:
            number = self._stack_number(key)
            if number == len(self._first_keys):
                self._first_keys.append(key)
            elif number >= 0:
                self._more_keys.append((key, number))
            elif number == _IGNORED:
                self._ignored_keys.append(key)

    def _stack_number(self, key: int) -> int:
        number = self._site_stack.get(key)
        if number is None:
            number = self._site_stack[key] = self._number_in(self._index, self.trimmed(key))
        return number

    def _number_in(self, index: StackIndex, stack: Stack) -> int:
        if self._ignored(stack):
            return _IGNORED
        if not stack:
            return _NO_FRAME
        return index.add(stack)

    def site_tree(
        self,
        probes: SiteReader,
        count: int,
        nbytes: list[int],
        extra: Callable[[], list[int]],
        blocks: Callable[[], list[int]] | None = None,
        allocated: list[int] | None = None,
    ) -> tuple[IndexedTree, Ignored]:
        """The heap tree of `nbytes` per site (sites whose trimmed stacks are equal add up), and what
        --ignore-fn left out of it (`extra` gives the sites' extra bytes, `blocks` their live blocks).
        `allocated`: the sites' allocation counts at the tree's instant, for a tree of an earlier one: the stacks
        no site had allocated from by then are left out (else every site taken so far has)."""
        self._take_sites(probes, count)
        # Mostly one site per stack: a C-speed gather, then the few sites that share a stack.
        per_stack = list(map(nbytes.__getitem__, self._first_keys))
        for key, number in self._more_keys:
            per_stack[number] += nbytes[key]
        present = None
        if allocated is not None:
            present = [allocated[k] != 0 for k in self._first_keys]
            for key, number in self._more_keys:
                present[number] = present[number] or allocated[key] != 0
        ignored = Ignored()
        if self._ignored_keys:
            extras = extra()
            ignored.heap = sum(nbytes[k] for k in self._ignored_keys)
            ignored.extra = sum(extras[k] for k in self._ignored_keys)
            if blocks is not None:
                live = blocks()
                ignored.blocks = sum(live[k] for k in self._ignored_keys)
        return self._index.tree(per_stack, present), ignored

    # The trees read byte counts as signed: a count seen below zero by a racy read counts as 0, as in HeapTree.

    def live_tree(self, probes: SiteReader) -> tuple[IndexedTree, Ignored]:
        """The tree of the live bytes now."""
        n = probes.site_count()
        return self.site_tree(
            probes,
            n,
            probes.site_column("cur_bytes", n, signed=True),
            lambda: probes.site_column("cur_extra", n, signed=True),
            lambda: probes.site_column("cur_blocks", n, signed=True),
        )

    def peak_tree(self, probes: SiteReader, peak_gen: int) -> tuple[IndexedTree, Ignored]:
        """The tree at the global peak numbered `peak_gen`."""
        n = probes.site_count()
        return self.site_tree(
            probes,
            n,
            probes.peak_column("peak_bytes", "cur_bytes", n, peak_gen, signed=True),
            lambda: probes.peak_column("peak_extra", "cur_extra", n, peak_gen, signed=True),
        )

    def page_tree(self, probes: SiteReader, sites: dict[int, SiteCounts], at_peak: bool) -> tuple[IndexedTree, Ignored]:
        """--pages-as-heap=yes: the tree of the page map's sites (a few mmap/brk call sites, so a loop)."""
        self.symbolize_new(probes, list(sites))
        numbers = []
        for key, s in sites.items():
            if s.tot_blocks == 0:
                continue
            number = self._page_stack.get(key)
            if number is None:
                number = self._page_stack[key] = self._number_in(self._page_index, self.trimmed(key))
            numbers.append((number, s.peak_bytes if at_peak else s.cur_bytes))
        per_stack = [0] * self._page_index.n_stacks
        ignored = Ignored()
        for number, nbytes in numbers:
            if number >= 0:
                per_stack[number] += nbytes
            elif number == _IGNORED:
                ignored.heap += nbytes
        return self._page_index.tree(per_stack), ignored

    def merged(self, sites: dict[int, SiteCounts], massif_trim: bool) -> dict[Stack, SiteCounts]:
        """Counters per stack, merged over sites whose stacks are equal once trimmed: with Massif's trimming
        (alloc-fns, --depth) when `massif_trim`, else the xtree's (all Massif captured, cut below main). Symbolize
        first."""
        merged: dict[Stack, SiteCounts] = {}
        for key, s in sites.items():
            stack = (
                self.trimmed(key)
                if massif_trim
                else trim_stack(self._frames[key], frozenset(), self.opts.xtree_frames)
            )
            m = merged.setdefault(stack, SiteCounts())
            for name in _COUNTER_NAMES:
                setattr(m, name, getattr(m, name) + getattr(s, name))
        return merged
