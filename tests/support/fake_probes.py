"""A fake kernel for the session's unit tests: FakeProbes implements LiveProbes (and so SiteReader) in pure Python,
for a target the test drives call by call, so that a real Session and the real MALT recorder run without root,
BPF or bcc.

What it models, after probes/heap.bpf.c and with agent.kernel.abi's numbers, for exact mode:
- the allocator calls the test makes (malloc and its kinds, free, realloc) as the probes account them: the live
  blocks, Massif's extra bytes (slop + --heap-admin), the global counters (struct hs_global), the sites (one id
  per distinct stack, from 1, site 0 for calls whose stack was not stored: empty, or the ids used up) and their
  counters (struct hs_site), the exact peak with its lazily copied per-site values, the --time-unit=B clock;
- the snapshot schedule: its control words, the points at the events that reach the due time and the peak points
  before a free (or a shrinking realloc) from a new high, the guessed interval from the culling point on, the
  wake-up (EV_SCHEDULE, which stops a `run` target with time in B), and the snapshot log (site_touch);
- MALT's statistics (settings.malt): per-site sizes, frees, lifetimes and reallocs, sizeMap, reallocJump, the
  per-thread counts, the log2 histograms and the heap's window between samples;
- the target's life: armed at load (attach) or at its first exec (run), disarmed by a later exec, the events
  EV_EXEC, EV_LOADER and EV_EXIT, held at them with settings.stop_events until resume(); a target held at its
  exit() is gone once resumed.

What it does not: the page syscalls (no page events: tests set settings.pages off), thread stacks (--stacks),
--ignore-fn's site flags (recorded, never applied), sampled mode, the unwind tables (recorded only: stacks are
given whole, cut at settings.max_depth), the capacity of the block table and of the rings (nothing is dropped or
lost, so no EV_PAGES or EV_SNAP_LOG), failed allocations, nested calls, and the races between CPUs.

Its clock (`clock_ns`) moves only when the test moves it (advance): the probes' bpf_ktime_get_ns. Tests that want
the session's own clock to agree patch time.monotonic_ns with it (the same clock as bpf_ktime_get_ns).
"""

from __future__ import annotations

import os
import time
from array import array
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import fields, replace

from agent.contract import HEAP_H
from agent.kernel.abi import (
    CTL_SCHED_CULL_AT,
    CTL_SCHED_DUE,
    CTL_SCHED_INTERVAL,
    CTL_SCHED_MAX,
    CTL_SCHED_ORIGIN,
    CTL_SCHED_PEAK_LEVEL,
    CTL_SCHED_PEAK_PPM,
    CTL_STACK_END,
    CTL_STOPPED,
    EV_EXEC,
    EV_EXIT,
    EV_LOADER,
    EV_SCHEDULE,
    FN_KINDS,
    LOG2_BINS,
    SCHED_PEAK,
    SCHED_SAMPLED_SLACK,
    SCHED_WAKE_PENDING,
)
from agent.kernel.interface import LiveProbes, ProbeSettings, SiteArray, UnwindMapping
from agent.model.counters import Counters, PageCounters
from agent.model.maps import Mapping as ProcMapping
from agent.model.options import MassifOptions, massif_slop, valgrind_alignment
from agent.model.pages import PageEvent
from agent.model.stack import Frame
from agent.process.discovery import ProbePoint
from agent.session.pipeline import ProfileSettings
from agent.session.session import Session, SessionInfo
from agent.symbols.symbolizer import Symbolizer

# struct hs_site, field by field: its word in an entry, and whether it is signed.
SITE_FIELDS = {f.name: (i, f.type.startswith("__s")) for i, f in enumerate(HEAP_H.struct_fields("hs_site"))}
FN = {name: number for number, name in FN_KINDS.items()}  # "malloc" -> HS_MALLOC ...
SCHED_NORMAL = HEAP_H.enum("hs_sched_kind")["HS_SCHED_NORMAL"]
# A path under which no process can be found: the session then reads no mappings (nothing to symbolize from).
NO_PROC = "/dev/null"
_WORD = (1 << 64) - 1

Site = dict[str, int]


def log2_bin(value: int) -> int:
    """probes/heap.bpf.c log2_bin: floor(log2(value)), 0 for 0 and 1."""
    return max(value, 1).bit_length() - 1


class FakeProbes(LiveProbes):
    """The kernel's side of one target, driven by the test: call malloc, free, realloc, exec, exit on it (or hand
    it the target as a generator: start), then read it through LiveProbes as the session does."""

    MAX_IDLE_WAITS = 2000  # wait_events with nothing to do: the session waits for a target that will never act

    def __init__(self, settings: ProbeSettings, points: Sequence[ProbePoint] = ()) -> None:
        super().__init__()
        self.settings = settings
        self.points = tuple(points)
        self.clock_ns = 1_000_000_000  # bpf_ktime_get_ns
        self.g: dict[str, int] = {f.name: 0 for f in fields(Counters)}  # struct hs_global
        self.control: dict[int, int] = {}  # enum hs_control
        self.armed = not settings.arm_on_exec
        self.alive = True  # the target process exists
        self._exiting = False
        self._sites: list[Site] = [self._new_site(0)]  # site 0: the overflow site
        self._stack_of: dict[int, tuple[int, ...]] = {}  # site_stacks
        self._ids: dict[tuple[int, ...], int] = {}  # stack_ids
        self._blocks: dict[int, tuple[int, int, int, int]] = {}  # address -> size, slop, site, alloc_ns
        self._next_address = 0x5555_0000_0000
        self._events: list[int] = []
        self._points: list[tuple[int, int, int, int, int]] = []  # sched_points, not yet read
        self._snap_log: list[tuple[int, int, int, int, int]] = []  # snap_log, not yet read
        self._target: Iterator[None] | None = None
        self._idle_waits = 0
        # MALT (settings.malt)
        self._sizes: dict[int, int] = {}
        self._jumps: dict[tuple[int, int], int] = {}
        self._threads: dict[tuple[int, int], tuple[int, int, int]] = {}
        self._size_hist = [0] * LOG2_BINS
        self._life_hist = [0] * (LOG2_BINS * LOG2_BINS)
        self._window = (0, 0)  # struct hs_window: max_heap, site
        # What user space handed down, for the tests to look at.
        self.unwind: list[UnwindMapping] = []
        self.site_flags: dict[int, bool] = {}

    # ---- the target: what the test makes it do ------------------------------------------------------

    def start(self, target: Iterator[None]) -> None:
        """The target's program: wait_events runs it up to its next `yield` each time it is called while the
        target is not held at an event (it runs while the session waits). End it with exit()."""
        self._target = target

    def advance(self, ns: int) -> None:
        """Time passes."""
        self.clock_ns += ns

    def malloc(
        self, stack: Sequence[int], size: int, *, fn: str = "malloc", tid: int = 1, align: int | None = None,
        inside_ns: int = 0,
    ) -> int:
        """An allocation call of kind `fn` (agent.model.functions' kinds) from `stack` (return addresses, innermost
        first: the caller's first), asking for `size` bytes (what the kernel reads: calloc's product, pvalloc's
        rounded size); returns the new block's address. `align`: the alignment memalign and the like ask for (else
        settings.alignment). `inside_ns`: the time the call spent in the allocator (MALT's thread time)."""
        address = self._new_address(size)
        if not self.armed:
            return address
        site = self._site(stack, FN[fn])
        if self.settings.malt:
            self._thread_stat(tid, FN[fn], size, inside_ns)
        alignment = self.settings.alignment if align is None else valgrind_alignment(align)
        self._record_alloc(address, size, alignment, site, self.clock_ns)
        return address

    def free(self, address: int, stack: Sequence[int] = (), *, tid: int = 1) -> None:
        """free(address) from `stack` (its site holds MALT's free statistics, and with xtree full the freed bytes)."""
        if not self.armed or not address:
            return
        free_site = self._site(stack, FN["free"]) if self.settings.free_stacks or self.settings.malt else 0
        size = self._record_free(address, free_site, self.clock_ns)
        if self.settings.malt:
            self._thread_stat(tid, FN["free"], size, 0)

    def realloc(self, address: int, stack: Sequence[int], size: int, *, tid: int = 1, inside_ns: int = 0) -> int:
        """realloc(address, size) from `stack`; returns the new block's address (0 for realloc(p, 0), a free)."""
        new = self._new_address(size) if size else 0
        if not self.armed:
            return new
        site = self._site(stack, FN["realloc"])
        now = self.clock_ns
        if self.settings.malt:
            self._thread_stat(tid, FN["realloc"], size, inside_ns)
        if address and size == 0:
            self._record_free(address, site, now)
        elif address:
            self._record_realloc(address, new, size, site, now)
        else:
            self._record_alloc(new, size, self.settings.alignment, site, now)
        return new

    def exec(self) -> None:
        """The target exec's a program: `run` arms at the first, any other disarms."""
        self.g["execs"] += 1
        self.armed = self.g["execs"] == int(self.settings.arm_on_exec)
        if self.armed:
            self._signal_event(EV_EXEC, self.settings.stop_events)

    def loader(self) -> None:
        """The dynamic loader changed the list of loaded objects."""
        if self.armed:
            self._signal_event(EV_LOADER, self.settings.stop_events)

    def exit(self) -> None:
        """The target calls exit(): held there (settings.stop_events) until resumed, then gone; else gone now."""
        if self.armed:
            self._signal_event(EV_EXIT, self.settings.stop_events)
        if self.stopped() == EV_EXIT:
            self._exiting = True
        else:
            self.alive = False

    # ---- the probes' accounting (probes/heap.bpf.c) --------------------------------------------------

    def _new_address(self, size: int) -> int:
        address = self._next_address
        self._next_address += (max(size, 1) + 15) // 16 * 16 + 16
        return address

    @staticmethod
    def _new_site(fn: int, peak_gen: int = 0) -> Site:
        site = dict.fromkeys(SITE_FIELDS, 0)
        site["fn"], site["peak_gen"] = fn, peak_gen
        return site

    def _site(self, stack: Sequence[int], fn: int) -> int:
        """capture_stack_at: the site id of a stack, made at its first call."""
        ips = tuple(stack)[: self.settings.max_depth]
        if not ips:
            return 0
        known = self._ids.get(ips)
        if known is not None:
            return known
        g = self.g
        g["n_sites"] += 1
        sid = g["n_sites"]
        if sid >= self.settings.max_stacks:
            g["dropped_stacks"] += 1
            return 0
        self._stack_of[sid] = ips
        self._sites.append(self._new_site(fn, g["peak_gen"]))
        self._ids[ips] = sid
        return sid

    def _touch(self, sid: int, s: Site) -> None:
        """site_touch: before a site's live bytes change."""
        g = self.g
        if s["peak_gen"] != g["peak_gen"]:
            s["peak_bytes"], s["peak_extra"], s["peak_gen"] = s["cur_bytes"], s["cur_extra"], g["peak_gen"]
        epoch = g["sched_points"]
        if s["snap_epoch"] != epoch:
            s["snap_epoch"] = epoch
            self._snap_log.append((sid, epoch, s["cur_bytes"], s["cur_extra"], s["tot_blocks"]))
            g["snap_records"] += 1

    def _live(self, sid: int, s: Site, block: int, nbytes: int, extra: int) -> None:
        """A block comes to a site (`block` 1: an allocation) or leaves it (-1), after site_touch."""
        self._touch(sid, s)
        s["cur_bytes"] += block * nbytes
        s["cur_extra"] += block * extra
        s["cur_blocks"] += block
        if block > 0:
            s["tot_bytes"] += nbytes
            s["tot_blocks"] += 1

    def _advance_time(self, delta: int) -> int:
        self.g["time_b"] += abs(delta)
        return self.g["time_b"]

    def _record_alloc(self, address: int, size: int, alignment: int, sid: int, now: int) -> None:
        slop = massif_slop(size, alignment)
        self._blocks[address] = (size, slop, sid, now)
        extra = slop + self.settings.heap_admin
        s = self._sites[sid]
        self._live(sid, s, 1, size, extra)
        g = self.g
        g["heap"] += size
        g["extra"] += extra
        g["blocks"] += 1
        g["n_allocs"] += 1
        g["alloc_bytes"] += size
        time_b = self._advance_time(size + extra)
        self._check_peak(s, None)
        if self.settings.malt:
            self._malt_alloc(s, sid, size)
        self._schedule_check(time_b)

    def _record_free(self, address: int, free_site: int, now: int) -> int:
        block = self._blocks.pop(address, None)
        if block is None:
            self.g["untracked_frees"] += 1
            return 0
        self._account_free(block, free_site, now)
        return block[0]

    def _account_free(self, block: tuple[int, int, int, int], free_site: int, now: int) -> None:
        self._schedule_peak_check()
        size, slop, sid, alloc_ns = block
        extra = slop + self.settings.heap_admin
        s = self._sites[sid]
        self._live(sid, s, -1, size, extra)
        self._charge_freed(s, free_site, size)
        if self.settings.malt:
            self._malt_free(s, self._sites[free_site] if free_site else None, size, now - alloc_ns)
        g = self.g
        g["heap"] -= size
        g["extra"] -= extra
        g["blocks"] -= 1
        g["n_frees"] += 1
        g["freed_bytes"] += size
        self._schedule_check(self._advance_time(size + extra))

    def _charge_freed(self, alloc_site: Site, free_site: int, size: int) -> None:
        s = self._sites[free_site] if self.settings.free_stacks and free_site else alloc_site
        s["freed_bytes"] += size
        s["freed_blocks"] += 1

    def _record_realloc(self, old: int, address: int, size: int, sid: int, now: int) -> None:
        """Massif's realloc: the bytes move from the old block's site to realloc's."""
        block = self._blocks.pop(old, None)
        if block is None:
            self.g["untracked_frees"] += 1
            self._record_alloc(address, size, self.settings.alignment, sid, now)
            return
        old_size, old_slop, old_sid, alloc_ns = block
        slop = old_slop + old_size - size if size <= old_size + old_slop else massif_slop(size, self.settings.alignment)
        self._blocks[address] = (size, slop, sid, now)
        if size < old_size:
            self._schedule_peak_check()
        admin = self.settings.heap_admin
        os_, ns = self._sites[old_sid], self._sites[sid]
        self._live(old_sid, os_, -1, old_size, old_slop + admin)
        self._charge_freed(os_, sid, old_size)
        self._live(sid, ns, 1, size, slop + admin)
        g = self.g
        dheap, dextra = size - old_size, slop - old_slop
        g["heap"] += dheap
        g["extra"] += dextra
        g["n_reallocs"] += 1
        g["alloc_bytes"] += size
        g["freed_bytes"] += old_size
        time_b = self._advance_time(dheap + dextra)
        if dheap + dextra > 0:
            self._check_peak(ns, os_)
        if self.settings.malt:
            self._malt_free(os_, None, old_size, now - alloc_ns)
            self._malt_alloc(ns, sid, size)
            ns["realloc_count"] += 1
            ns["realloc_delta"] += dheap
            self._jumps[(old_size, size)] = self._jumps.get((old_size, size), 0) + 1
        self._schedule_check(time_b)

    def _check_peak(self, a: Site, b: Site | None) -> None:
        g = self.g
        total = g["heap"] + g["extra"]
        if total <= g["peak_total"]:
            return
        g["peak_total"], g["peak_heap"], g["peak_extra"] = total, g["heap"], g["extra"]
        g["peak_time_b"], g["peak_ns"] = g["time_b"], self.clock_ns
        g["peak_gen"] += 1
        for s in (a, b):
            if s is not None:
                s["peak_bytes"], s["peak_extra"], s["peak_gen"] = s["cur_bytes"], s["cur_extra"], g["peak_gen"]

    # ---- MALT's statistics ---------------------------------------------------------------------------

    @staticmethod
    def _min_max(s: Site, low: str, high: str, value: int) -> None:
        if s[low] == 0 or value < s[low]:
            s[low] = value
        s[high] = max(s[high], value)

    def _malt_alloc(self, s: Site, sid: int, size: int) -> None:
        if size == 0:
            self.g["zero_allocs"] += 1
            s["count_zeros"] += 1
        else:
            self._min_max(s, "alloc_min", "alloc_max", size)
        s["max_alive"] = max(s["max_alive"], s["cur_bytes"])
        self._sizes[size] = self._sizes.get(size, 0) + 1
        self._size_hist[log2_bin(size)] += 1
        if self.g["heap"] > self._window[0]:
            self._window = (self.g["heap"], sid)

    def _malt_free(self, alloc_site: Site, free_site: Site | None, size: int, life: int) -> None:
        if free_site is not None:
            free_site["free_count"] += 1
            free_site["free_sum"] += size
            self._min_max(free_site, "free_min", "free_max", size)
        if life:
            alloc_site["life_count"] += 1
            alloc_site["life_sum"] += life
            self._min_max(alloc_site, "life_min", "life_max", life)
        self._life_hist[log2_bin(size) * LOG2_BINS + log2_bin(life)] += 1

    def _thread_stat(self, tid: int, fn: int, size: int, ns: int) -> None:
        count, nbytes, total_ns = self._threads.get((tid, fn), (0, 0, 0))
        self._threads[(tid, fn)] = (count + 1, nbytes + size, total_ns + ns)

    # ---- the snapshot schedule -----------------------------------------------------------------------

    def _ctl(self, index: int) -> int:
        return self.control.get(index, 0)

    def _event_time(self, time_b: int) -> int:
        return self.clock_ns if self.settings.schedule_ns else time_b

    def _due_after(self, t: int) -> int:
        """schedule_next with schedule_interval: the due time after a point at `t`."""
        ns = self.settings.schedule_ns
        origin = self._ctl(CTL_SCHED_ORIGIN)
        unit_time = max(t - origin, 0) // 1_000_000 if ns else t
        interval, cull_at = self._ctl(CTL_SCHED_INTERVAL), self._ctl(CTL_SCHED_CULL_AT)
        if cull_at and self.g["sched_points"] + 1 >= cull_at:  # the series culls: the interval is guessed
            most = self._ctl(CTL_SCHED_MAX)
            guess = unit_time // most if most else 0
            interval = max(interval, max(guess, 1) if ns else guess)
        return origin + (unit_time + interval) * 1_000_000 if ns else t + interval

    def _send_point(self, t: int, kind: int) -> None:
        g = self.g
        self._points.append((t, g["heap"], g["extra"], kind, g["sched_points"]))
        g["sched_points"] += 1
        cull_at, s = self._ctl(CTL_SCHED_CULL_AT), self.settings
        slack = min(SCHED_SAMPLED_SLACK, max(0, SCHED_WAKE_PENDING - self._ctl(CTL_SCHED_MAX)))
        wake_at = cull_at + (slack if s.sampled else 0)
        if cull_at and g["sched_points"] >= wake_at and g["sched_signalled"] != cull_at:  # schedule_signal
            g["sched_signalled"] = cull_at
            g["sched_wakes"] += 1
            self._signal_event(EV_SCHEDULE, s.stop_events and not s.schedule_ns and not s.sampled)

    def _schedule_check(self, time_b: int) -> None:
        t = self._event_time(time_b)
        if t >= self._ctl(CTL_SCHED_DUE):
            self.control[CTL_SCHED_DUE] = self._due_after(t)
            self._send_point(t, SCHED_NORMAL)

    def _schedule_peak_check(self) -> None:
        total = self.g["heap"] + self.g["extra"]
        if total <= self._ctl(CTL_SCHED_PEAK_LEVEL):
            return
        self.control[CTL_SCHED_PEAK_LEVEL] = total + total * self._ctl(CTL_SCHED_PEAK_PPM) // 1_000_000
        t = self._event_time(self.g["time_b"])
        self.control[CTL_SCHED_DUE] = self._due_after(t)
        self._send_point(t, SCHED_PEAK)

    def _signal_event(self, event: int, stop: bool) -> None:
        if stop:
            self.control[CTL_STOPPED] = event
        self._events.append(event)

    # ---- LiveProbes: events and stops ----------------------------------------------------------------

    def wait_events(self, timeout: float) -> list[int]:
        if self._target is not None and not self.stopped():
            try:
                next(self._target)
            except StopIteration:
                self._target = None
            self._idle_waits = 0
        elif not self._events:
            self._idle_waits += 1
            if self._idle_waits > self.MAX_IDLE_WAITS:
                raise AssertionError(f"the session waits for a target that does nothing (held at {self.stopped()})")
            time.sleep(min(timeout, 0.001))
        events, self._events = self._events, []
        return events

    def stopped(self) -> int:
        return self._ctl(CTL_STOPPED)

    def resume(self) -> None:
        self.control[CTL_STOPPED] = 0
        if self._exiting:
            self.alive = False

    def activity(self) -> bytes:
        return repr(tuple(self.g.values())).encode()

    def mapping_calls(self) -> int | None:
        return None  # page syscalls are not traced

    def page_events(self) -> list[PageEvent]:
        return []

    def stack_bytes(self) -> int:
        return 0

    # ---- LiveProbes: the snapshot schedule -----------------------------------------------------------

    def start_schedule(self, origin_ns: int, max_snapshots: int, peak_inaccuracy: float) -> None:
        self.control[CTL_SCHED_ORIGIN] = origin_ns
        self.control[CTL_SCHED_MAX] = max_snapshots
        self.control[CTL_SCHED_PEAK_PPM] = round(peak_inaccuracy * 10_000)
        self.control[CTL_SCHED_CULL_AT] = max_snapshots - 1

    def set_schedule(self, interval: int, cull_at: int, due: int | None) -> None:
        self.control[CTL_SCHED_CULL_AT] = cull_at
        self.control[CTL_SCHED_INTERVAL] = interval
        if due is not None:
            self.control[CTL_SCHED_DUE] = due

    def schedule_points(self) -> list[tuple[int, int, int, int, int]]:
        points, self._points = self._points, []
        return points

    def snapshot_log(self) -> list[tuple[int, int, int, int, int]]:
        records, self._snap_log = self._snap_log, []
        return records

    # ---- LiveProbes: what user space hands down ------------------------------------------------------

    def set_stack_end(self, end: int) -> None:
        self.control[CTL_STACK_END] = end

    def publish_unwind(self, mappings: Sequence[UnwindMapping]) -> None:
        self.unwind = list(mappings)

    def set_site_flags(self, flags: Mapping[int, bool]) -> None:
        self.site_flags.update(flags)

    # ---- LiveProbes: MALT's statistics ---------------------------------------------------------------

    def size_map(self) -> dict[int, int]:
        return {size: n for size, n in self._sizes.items() if n}

    def realloc_jumps(self) -> dict[tuple[int, int], int]:
        return dict(self._jumps)

    def thread_stats(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        return dict(self._threads)

    def size_histogram(self) -> list[int]:
        return list(self._size_hist)

    def life_histogram(self) -> list[int]:
        return list(self._life_hist)

    def take_window(self, heap_now: int) -> tuple[int, int]:
        window, self._window = self._window, (heap_now, 0)
        return window

    # ---- SiteReader ----------------------------------------------------------------------------------

    def counters(self) -> Counters:
        return Counters(**self.g)

    def page_counters(self) -> PageCounters:
        return PageCounters()

    def _site_view(self, count: int) -> SiteArray:
        sites = self._sites[:count]
        words = array("Q", (s[name] & _WORD for s in sites for name in SITE_FIELDS))
        return SiteArray(bytearray(words.tobytes()), len(SITE_FIELDS), SITE_FIELDS, len(sites))

    def _read_stack(self, key: int) -> tuple[int, ...]:
        return self._stack_of.get(key, ())


class FakeCode:
    """A fake program's functions, by name: each gets 256 bytes of code from 0x401000 on, in the order first named,
    with one call site 0x10 into it. `stack` gives a call stack's return addresses as the kernel's walk hands them
    (innermost first), `symbolizer` names them back."""

    BASE = 0x401000
    SIZE = 0x100

    def __init__(self) -> None:
        self._starts: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def address(self, name: str) -> int:
        """The return address of the call made from `name`."""
        start = self._starts.get(name)
        if start is None:
            start = self._starts[name] = self.BASE + self.SIZE * len(self._starts)
            self._names[start] = name
        return start + 0x10

    def stack(self, *names: str) -> tuple[int, ...]:
        return tuple(self.address(name) for name in names)

    def name_of(self, address: int) -> str | None:
        return self._names.get(address - (address - self.BASE) % self.SIZE)

    def symbolizer(self) -> Symbolizer:
        return _CodeSymbolizer(self)


class _CodeSymbolizer(Symbolizer):
    """Names the addresses of a FakeCode, as the symbolizer would name a real program's (without files or lines)."""

    def __init__(self, code: FakeCode) -> None:
        super().__init__()
        self.code = code

    def symbolize(
        self, mappings: Sequence[ProcMapping], address: int, *, is_return_address: bool = True
    ) -> list[Frame]:
        look = address - 1 if is_return_address else address
        return [Frame(address=look, function=self.code.name_of(look))]


def probe_settings(
    opts: MassifOptions, *, run: bool = False, malt: bool = False, max_stacks: int = 1024
) -> ProbeSettings:
    """The probes' settings the pipeline gives a profile with these options (`run`: a launched target, else an
    attach), but for the page syscalls, which the fake does not trace."""
    settings = ProfileSettings(opts, malt=malt, max_stacks=max_stacks).probe_settings(os.getpid(), launched=run)
    return replace(settings, pages=False)


def fake_session(probes: FakeProbes, code: FakeCode, opts: MassifOptions, cmd: str = "./prog") -> Session:
    """A real Session over the fake, as the pipeline makes it (a `run` target: its first exec ends nothing)."""
    info = SessionInfo(probes.settings.target_tgid, cmd, [], "glibc")
    exec_limit = int(probes.settings.arm_on_exec)
    return Session(opts, probes, info, symbolizer=code.symbolizer(), proc=NO_PROC, exec_limit=exec_limit)
