"""HeapProbes: one target's heap probes. It takes a slot in the loaded program of its settings' shape
(agent.kernel.shapes: probes/heap.bpf.c compiled with the settings as -D defines, once for every target of the
shape), attaches the uprobes chosen by discovery with its slot as their cookie, reads its maps, and detaches, all
behind a context manager. It hands out plain values (agent.model types and agent.kernel.interface's dataclasses),
never bcc objects.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import functools
import math
import mmap
import operator
import os
import re
import signal
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields
from importlib import resources
from types import TracebackType
from typing import Any, ClassVar, cast

import numpy as np

from agent.errors import EnvironmentProblem, HeapscopeError
from agent.kernel.abi import (
    CTL_ARMED,
    CTL_COUNT,
    CTL_MAPPED_HIGH,
    CTL_MAPPED_NOW,
    CTL_PAGES_DRAINED,
    CTL_SCHED_CULL_AT,
    CTL_SCHED_DUE,
    CTL_SCHED_DUE_JIFFIES,
    CTL_SCHED_INTERVAL,
    CTL_SCHED_JIFFY_NS,
    CTL_SCHED_MAX,
    CTL_SCHED_ORIGIN,
    CTL_SCHED_PEAK_PPM,
    CTL_SNAP_DRAINED,
    CTL_STACK_END,
    CTL_STACK_EPOCH,
    CTL_STOPPED,
    CTL_UMAPS,
    FN_COUNT,
    LOG2_BINS,
    MAX_UMAPS,
    PAGE_COUNTER_COUNT,
    PAGE_EVENT,
    PAGE_KINDS,
    SAMPLED_SNAP_RING_BYTES,
    SCHED_POINT,
    SCHED_RING_BYTES,
    SITE_COUNTED,
    SITE_IGNORED,
    SMALL_SIZES,
    SNAP_RECORD,
    SNAP_RING_BYTES,
    THREAD_SLOTS,
    umaps_word,
)
from agent.kernel.arrays import MappedArray, MappedWords, SharedRows, mapped_prefix
from agent.kernel.btf import kernel_offset
from agent.kernel.interface import LiveProbes, ProbeSettings, SiteArray, UnwindMapping, table_sizes
from agent.kernel.links import UPROBE_LINKS_ENV, link_uprobe, uprobe_links_supported
from agent.kernel.loader import BCC_LOCK, load_bcc, program_text
from agent.kernel.rings import RingReader
from agent.kernel.shapes import ProgramShape, TargetMaps
from agent.kernel.waits import side_by_side
from agent.model.counters import Counters, PageCounters
from agent.model.pages import PageEvent
from agent.process.discovery import ProbePoint

MAX_TARGETS = 64  # targets one loaded program serves at once (probes/heap.h HS_TARGETS)
SNAP_DRAIN_TRIES = 100  # a record another CPU has reserved and not yet submitted: wait for it, 0.1 ms at a time


class _CountersCodec:
    """Counters from the raw bytes of struct hs_global, by the field offsets of bcc's ctypes Leaf: one
    struct.unpack, where reading the Leaf's attributes one by one took a sampling loop's largest share."""

    _FORMATS: ClassVar[dict[int, str]] = {1: "B", 2: "H", 4: "I", 8: "Q"}

    def __init__(self, leaf: Any) -> None:
        placed = sorted((getattr(leaf, f.name).offset, getattr(leaf, f.name).size, f.name) for f in fields(Counters))
        fmt, at = "<", 0
        for offset, size, _ in placed:
            fmt += "x" * (offset - at) + self._FORMATS[size]
            at = offset + size
        self._struct = struct.Struct(fmt)
        at_field = {name: i for i, (_, _, name) in enumerate(placed)}
        self._in_field_order = operator.itemgetter(*(at_field[f.name] for f in fields(Counters)))

    def decode(self, raw: bytes) -> Counters:
        return Counters(*self._in_field_order(self._struct.unpack_from(raw)))


# Kernel tick rates (CONFIG_HZ) Linux offers; a measured rate is rounded to the nearest.
_HZ_CHOICES = (100, 250, 300, 1000)


def jiffy_ns(proc: str = "/proc", seconds: float = 0.05) -> int:
    """Nanoseconds a jiffy (the kernel's tick count), from two readings of /proc/timer_list `seconds` apart;
    0 when it cannot be read (the schedule then reads the clock at every event)."""

    def reading() -> tuple[int, int] | None:
        try:
            with open(f"{proc}/timer_list") as f:
                text = f.read(4096)
        except OSError:
            return None
        ns = re.search(r"now at (\d+) nsecs", text)
        jiffies = re.search(r"^jiffies: (\d+)", text, re.M)
        return (int(ns.group(1)), int(jiffies.group(1))) if ns and jiffies else None

    first = reading()
    time.sleep(seconds)
    second = reading()
    if first is None or second is None or second[0] <= first[0]:
        return 0
    hz = (second[1] - first[1]) * 1e9 / (second[0] - first[0])
    return 1_000_000_000 // min(_HZ_CHOICES, key=lambda choice: abs(choice - hz))


@functools.cache
def node_jiffy_ns() -> int:
    """jiffy_ns of this machine, measured once: its tick rate is fixed at the kernel's build (CONFIG_HZ), and a
    measure costs 50 ms on the way to every further target's first recorded call."""
    return jiffy_ns()


def shape_cflags(s: ProbeSettings, max_rows: int, snap_ring_bytes: int) -> list[str]:
    """The -D defines of a program's shape: every setting that changes its code or its maps' sizes. The target
    is none of them: one loaded program serves every target of its shape, each in a slot of its own."""
    return [
        f"-DHS_TARGETS={MAX_TARGETS}",
        f"-DHS_ARM_ON_EXEC={1 if s.arm_on_exec else 0}",
        f"-DHS_HEAP_ADMIN={s.heap_admin}",
        f"-DHS_ALIGNMENT={s.alignment}",
        f"-DHS_MAX_DEPTH={s.max_depth}",
        *(f"-D{name}={value}" for name, value in table_sizes(s).items()),
        f"-DHS_STOP_EVENTS={int(s.stop_events)}",
        f"-DHS_UNWIND={int(s.unwind)}",
        f"-DHS_MAX_ROWS={max_rows}",
        f"-DHS_FREE_STACKS={int(s.free_stacks)}",
        f"-DHS_MALT={int(s.malt)}",
        f"-DHS_PAGES={int(s.pages)}",
        f"-DHS_STACKS={int(s.stacks)}",
        f"-DHS_SCHED_NS={int(s.schedule_ns)}",
        f"-DHS_SCHED_RING_PAGES={SCHED_RING_BYTES // mmap.PAGESIZE}",
        f"-DHS_SNAP_RING_PAGES={snap_ring_bytes // mmap.PAGESIZE}",
        f"-DHS_SAMPLE_RATE={s.sample_rate}ULL",
        f"-DHS_SAMPLED={int(s.sampled)}",
        *_task_offsets(s),
        f"-DHS_IGNORE={int(s.ignore)}",
    ]


def _task_offsets(s: ProbeSettings) -> list[str]:
    """Sampled mode's page calls read the process's mapped total in its mm_struct: the running kernel's offsets."""
    if not (s.sampled and s.pages):
        return []
    return [
        f"-DHS_TASK_MM={kernel_offset('task_struct', 'mm')}",
        f"-DHS_MM_TOTAL_VM={kernel_offset('mm_struct', 'total_vm')}",
    ]


def _int(value: object) -> int:
    """A map key as an int: batch lookups give ints, per-entry lookups give ctypes values."""
    return int(getattr(value, "value", value))  # type: ignore[call-overload]


class HeapProbes(LiveProbes):
    """Compiled and attached heap probes for one target. Use as a context manager."""

    def __init__(self, settings: ProbeSettings, points: Sequence[ProbePoint]) -> None:
        super().__init__()
        self.settings = settings
        self.points = tuple(points)
        self._shape: ProgramShape | None = None
        self._maps: TargetMaps | None = None  # this target's maps; None once closed
        self.slot = 0  # the target's slot in its shape's program (the cookie of its links)
        self._readers: ctypes.Array[ctypes.c_void_p] | None = None  # its events' perf readers, for perf_reader_poll
        self._fds: list[int] = []  # perf events of the uprobes (bcc closes them)
        self._links: list[int] = []  # uprobe_multi links (closed with os.close)
        self._use_links = uprobe_links_supported()
        self._sites: MappedArray | None = None  # struct hs_site by site id
        self._events: list[int] = []
        self._page_ring: RingReader | None = None
        self._shared_rows: SharedRows | None = None
        self._objects: dict[str, tuple[int, int]] = {}  # object key -> (first row, row count) in the shared rows
        self._sched_ring: RingReader | None = None
        self._snap_ring: RingReader | None = None
        self._umap_half = 0
        self.detach_seconds = 0.0  # each uprobe's removal waits for an RCU grace period
        # struct hs_global and the control words, the shape's, read in place at this target's slot, and this
        # target's own page counters: views of their mappings, None while not loaded (a reader takes the view
        # first; a view still held keeps its mapping after the close).
        self._globals_view: memoryview | None = None
        self._globals_stride = 0
        self._globals_size = 0  # activity(), counters(): bytes of struct hs_global; 0 while not loaded
        self._control_words: memoryview | None = None
        self._page_counters: MappedWords | None = None
        self._page_counter_words: memoryview | None = None
        # The size histogram, read at every sample: in place (mapping it for each read cost some 1% of a core for a
        # database's dozen targets). None where it cannot be mapped: read by lookup then.
        self._size_hist: MappedWords | None = None
        self._size_hist_words: memoryview | None = None
        self._counters_codec: _CountersCodec | None = None
        # The raw globals last decoded, and what they decoded to: one tuple, replaced whole, as the sampling
        # thread and HTTP threads read the counters at once.
        self._counters_cache: tuple[bytes, Counters] | None = None
        self._steered: tuple[int, int] | None = None  # the (cull_at, interval) written last (the kernel reads them)

    # ---- life cycle -------------------------------------------------------------------------------

    def __enter__(self) -> HeapProbes:
        s = self.settings
        probes_dir = str(resources.files("probes"))
        self._shared_rows = SharedRows.get(s.max_rows, probes_dir)
        cflags = [f"-I{probes_dir}", *shape_cflags(s, self._shared_rows.max_rows, self._snap_ring_bytes())]
        # The program is shared with every other target of this shape; through perf events a program cannot tell
        # its targets apart (no cookie), so each target then has one of its own.
        key = (*cflags, f"page_stacks={s.page_stacks}", "links" if self._use_links else f"own={id(self)}")
        # One source in every mode, heap.bpf.c with its parts written in: the HS_* defines above choose the parts
        # that count (sampled mode's programs, the page calls, thread stacks: probes/heap.bpf.c). Read only for a
        # shape not loaded yet.
        source = functools.partial(program_text, os.path.join(probes_dir, "heap.bpf.c"))
        # A daemon's shape loads every program, for the targets to come; a command's, what its one target needs.
        only = None if s.node_blocks else self._program_names()
        shape = self._shape = ProgramShape.acquire(key, source, cflags, MAX_TARGETS, self._use_links, only)
        try:
            maps = self._maps = shape.take_slot(s.target_tgid)
            self.slot = maps.slot
            self._control_words = shape.control.words
            try:
                self._sites = MappedArray(maps["sites"], s.max_stacks)
            except (OSError, ValueError) as exc:
                raise EnvironmentProblem(f"cannot map the sites array (BPF_F_MMAPABLE, Linux 5.5+): {exc}") from exc
            shape.install_walkers(self._walkers())
            for point in self.points:
                self._attach(point)
            # Armed only now: an entry seen before its return probe existed would never see its return.
            if not s.arm_on_exec:
                self._set_armed(True)
            events = maps["events"]
            events.open_perf_buffer(self._on_event, page_cnt=8)
            readers = [shape.bpf.perf_buffers[(id(events), cpu)] for cpu in events._open_key_fds]
            self._readers = (ctypes.c_void_p * len(readers))(*readers)
            if s.pages:
                self._page_ring = RingReader(maps["page_events"].map_fd, s.page_ring_bytes, PAGE_EVENT)
                self._page_counters = MappedWords(maps["page_counters"], PAGE_COUNTER_COUNT)
                self._page_counter_words = self._page_counters.words
            with contextlib.suppress(OSError, ValueError):
                self._size_hist = MappedWords(maps["size_hist"], LOG2_BINS)
                self._size_hist_words = self._size_hist.words
            self._sched_ring = RingReader(maps["sched_points"].map_fd, SCHED_RING_BYTES, SCHED_POINT)
            self._snap_ring = RingReader(maps["snap_log"].map_fd, self._snap_ring_bytes(), SNAP_RECORD)
            self._open_globals()
        except BaseException:
            self.close()
            raise
        # No malloc_trim here: the compile's memory is given back where it is freed (ProgramShape.acquire), and a
        # daemon gives its targets' back every TRIM_INTERVAL; a trim per attach cost a fleet's churn hundreds of
        # madvise calls an attach, and the faults that fill the pages again.
        return self

    def _blocks_left(self) -> int:
        """The live blocks the target leaves in the shared block table (how soon they must be forgotten: see
        ProgramShape.give_back); unknown counts as many."""
        if not self._globals_size:
            return 1 << 62
        try:
            return self.counters().blocks
        except HeapscopeError:
            return 1 << 62

    def _open_globals(self) -> None:
        """The reader of struct hs_global, made once here: made lazily at the first read, a sampling thread and an
        HTTP thread reading at once could each see it half made (a codec not set yet failed a profile in the fleet
        soak)."""
        assert self._maps is not None
        assert self._shape is not None
        table = self._maps["globals"]
        self._counters_codec = _CountersCodec(table.Leaf)
        self._globals_view, self._globals_stride = self._shape.globals.bytes, self._shape.globals.stride
        self._globals_size = ctypes.sizeof(table.Leaf)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def detach(self) -> None:
        """Remove the uprobes: the target runs on untouched. The maps stay readable until close()."""
        if self._maps is None:
            return
        if self._fds or self._links:
            self._set_armed(False)
        lib = load_bcc().libbcc.lib
        started = time.monotonic()
        # A perf event's removal waits for an RCU grace period in the kernel (~0.1 s here), a link's for far
        # less: side by side, the waits overlap.
        closes: list[Callable[[], object]] = [functools.partial(lib.bpf_close_perf_event_fd, fd) for fd in self._fds]
        closes += [functools.partial(os.close, fd) for fd in self._links]
        side_by_side(lambda close: close(), closes)
        self.detach_seconds = time.monotonic() - started
        self._fds.clear()
        self._links.clear()

    def close(self) -> None:
        if self._maps is not None and self.stopped():
            self.resume()  # never leave the target held at an event, whatever went wrong
        blocks_left = self._blocks_left()
        self.detach()
        self._unmap()
        for ring in (self._page_ring, self._sched_ring, self._snap_ring):
            if ring is not None:
                ring.close()
        self._page_ring = self._sched_ring = self._snap_ring = None
        self._globals_size = 0
        self._globals_view = self._control_words = self._page_counter_words = self._size_hist_words = None
        for words in (self._page_counters, self._size_hist):
            if words is not None:
                words.close()
        self._page_counters = self._size_hist = None
        maps, shape = self._maps, self._shape
        self._maps = self._shape = None
        self._readers = None
        try:
            if maps is not None and shape is not None:
                events = maps["events"]
                with BCC_LOCK:
                    for cpu in list(events._open_key_fds):
                        del events[cpu]  # its perf reader, and its entry
                shape.give_back(maps, self.settings.target_tgid, blocks_left)
        finally:  # whatever failed in the give-back, the program is not held for good
            if shape is not None:
                shape.release(keep=self.settings.keep_programs)
            if self._shared_rows is not None:  # the program is gone: its objects' rows may be reused
                self._shared_rows.release(key for key, (_, count) in self._objects.items() if count)
                self._objects.clear()

    def _unmap(self) -> None:
        if self._sites is not None:
            self._sites.close()
        self._sites = None

    def _walkers(self) -> list[tuple[str, bytes]]:
        """(program array, program) of the shared copies of the stack walk the probes tail-call."""
        walkers = []
        if self.settings.sampled:  # a sample's accounting, after its walk (probes/bpf/sampled.h)
            walkers.append(("sample_accounting", b"sample_alloc_account"))
        else:  # sampled mode probes no allocation function: no call tail-calls alloc_enter
            walkers.append(("alloc_walker", b"alloc_enter"))
        if self.settings.pages and self.settings.page_stacks:
            walkers.append(("page_walker", b"page_enter_walk"))
        return walkers

    def _program_names(self) -> set[bytes]:
        """The programs this target's probes and walkers need."""
        names = {name for _, name in self._walkers()}
        for point in self.points:
            names.add(f"{point.kind}_enter".encode())
            if point.needs_return:
                names.add(b"alloc_return")
        return names

    @property
    def attached_through(self) -> str:
        """How the uprobes are attached, for the user: "uprobe_multi links" or "perf events"."""
        return "uprobe_multi links" if self._use_links else "perf events"

    def _attach(self, point: ProbePoint) -> None:
        assert self._shape is not None
        kind = point.kind
        self._attach_one(point, self._shape.program(f"{kind}_enter".encode()), is_return=False)
        if point.needs_return:
            # A return probe at the same emulated instruction: the kernel takes the return address from
            # [rsp], which is still the caller's there (placement keeps %rsp untouched).
            self._attach_one(point, self._shape.program(b"alloc_return"), is_return=True)

    def _attach_one(self, point: ProbePoint, program: Any, is_return: bool) -> None:
        path = point.path.encode()
        pid = self.settings.target_tgid
        what = "uretprobe" if is_return else "uprobe"
        if self._use_links:
            fd = link_uprobe(program.fd, path, point.file_offset, is_return, pid, cookie=self.slot)
            if fd < 0:
                raise EnvironmentProblem(
                    f"cannot attach a {what} link to {point.symbol} in {point.path}: {os.strerror(-fd)} "
                    f"({UPROBE_LINKS_ENV}=0 attaches through perf events instead)"
                )
            self._links.append(fd)
            return
        lib = load_bcc().libbcc.lib
        ev = f"{'r' if is_return else 'p'}_hs_{pid}_{os.getpid()}_{point.file_offset:x}".encode()
        fd = lib.bpf_attach_uprobe(program.fd, int(is_return), ev, path, point.file_offset, pid)
        if fd < 0:
            raise EnvironmentProblem(f"cannot attach a {what} to {point.symbol} in {point.path}")
        self._fds.append(fd)

    def _set_armed(self, armed: bool) -> None:
        self._set_control(CTL_ARMED, int(armed))

    # ---- events and stops -------------------------------------------------------------------------

    def _on_event(self, cpu: int, data: int, size: int) -> None:
        self._events.append(ctypes.cast(data, ctypes.POINTER(ctypes.c_uint64)).contents.value)

    def page_events(self) -> list[PageEvent]:
        """The page syscalls completed since the last call, in the order they completed (settings.pages)."""
        if self._page_ring is None:
            return []
        out = []
        for record in self._page_ring.drain():
            time_ns, site, addr, length, new_addr, new_length, flags, prot, ret, tid, kind_id = record
            kind = PAGE_KINDS.get(kind_id, "")
            failed = ret < 0 and kind != "brk"  # brk reports failure by leaving the break where it was
            if kind == "mmap" and failed:
                addr = 0
            out.append(PageEvent(kind, time_ns, tid, site, addr, length, new_addr, new_length, flags, prot, failed))
        if out:  # the kernel wakes us when the ring holds a quarter of its room again (probes/bpf/pages.h page_exit)
            self._set_control(CTL_PAGES_DRAINED, self._page_ring.taken)
        return out

    def mapped_fold(self) -> tuple[int, int] | None:
        """Sampled mode: the process's mapped bytes as the last page call left them, and the most since the last
        call (probes/bpf/pages.h fold_mapped); None when no page call came since."""
        if self._maps is None or not self.settings.sampled:
            return None
        high = self._control(CTL_MAPPED_HIGH)  # 0: no call since the last look
        if not high:
            return None
        self._set_control(CTL_MAPPED_HIGH, 0)  # a call landing in between raises it again
        now = self._control(CTL_MAPPED_NOW)
        return now, max(high, now)

    def schedule_points(self) -> list[tuple[int, int, int, int, int]]:
        """The snapshot schedule's points (time, heap, extra, kind, epoch) sent since the last call, in time
        order; time is in B, or bpf_ktime_get_ns with settings.schedule_ns; kind is SCHED_PEAK for a peak point,
        else 0; epoch numbers the points from 0 (the snapshot log's epochs)."""
        if self._sched_ring is None:
            return []
        return cast(list[tuple[int, int, int, int, int]], self._sched_ring.drain())

    def snapshot_log(self) -> list[tuple[int, int, int, int, int]]:
        """The snapshot log's records (site, epoch, bytes, extra, allocs) sent since the last call, in the order
        they were reserved: each a site's live bytes, extra bytes and allocations so far right before its first
        change once `epoch` points had been sent (probes/heap.bpf.c site_touch). Read the sites before: every
        change that read saw has its record here, also one another CPU was still submitting (waited for, a
        little; agent.model.schedule.SiteLog)."""
        ring = self._snap_ring
        if ring is None:
            return []
        target = ring.produced()
        out = ring.drain()
        for _ in range(SNAP_DRAIN_TRIES):
            if ring.consumed() >= target:
                break
            time.sleep(0.0001)
            out += ring.drain()
        self._set_control(CTL_SNAP_DRAINED, ring.taken)
        return cast(list[tuple[int, int, int, int, int]], out)

    def _snap_ring_bytes(self) -> int:
        return SAMPLED_SNAP_RING_BYTES if self.settings.sampled else SNAP_RING_BYTES

    def set_schedule(self, interval: int, cull_at: int, due: int | None) -> None:
        """The series' minimum interval between snapshots (B or ms), the point count at which it culls next, and
        (unless None) the time from which the next event is a point (B, or ns with settings.schedule_ns)."""
        if self._maps is None:  # unloaded (or a frozen copy): no schedule to steer
            return
        if self._steered != (cull_at, interval):  # steered at every tick, and they seldom change: two syscalls
            self._set_control(CTL_SCHED_CULL_AT, cull_at)
            self._set_control(CTL_SCHED_INTERVAL, interval)
            self._steered = (cull_at, interval)
        if due is not None:
            self._set_control(CTL_SCHED_DUE_JIFFIES, 0)  # read the clock until the kernel's next point
            self._set_control(CTL_SCHED_DUE, due)

    def start_schedule(self, origin_ns: int, max_snapshots: int, peak_inaccuracy: float) -> None:
        """Time 0 of the snapshots (settings.schedule_ns), --max-snapshots and --peak-inaccuracy (percent); until
        the first set_schedule, the interval is guessed from the first culling on (the first snapshot, taken at
        a tick, makes one)."""
        if self._maps is None:
            return
        self._set_control(CTL_SCHED_ORIGIN, origin_ns)
        self._set_control(CTL_SCHED_MAX, max_snapshots)
        self._set_control(CTL_SCHED_PEAK_PPM, round(peak_inaccuracy * 10_000))
        self._set_control(CTL_SCHED_CULL_AT, max_snapshots - 1)
        self._steered = None
        if self.settings.schedule_ns:
            self._set_control(CTL_SCHED_JIFFY_NS, node_jiffy_ns())

    def page_counters(self) -> PageCounters:
        """The kernel side's counts of page events sent and not sent (settings.pages)."""
        words = self._page_counter_words
        if words is None:
            return PageCounters()
        return PageCounters(*words[:PAGE_COUNTER_COUNT])

    def stack_bytes(self) -> int:
        """--stacks=yes: the bytes of every live thread's stack, from its top to the lowest stack pointer seen
        since the last call; starts a new low-water mark."""
        if self._maps is None or not self.settings.stacks:
            return 0
        epoch = self._control(CTL_STACK_EPOCH)
        total = 0
        for _, t in self._items("thread_stacks"):
            low = int(t.low) if int(t.epoch) == epoch else int(t.last)
            total += max(0, int(t.top) - low)
        self._set_control(CTL_STACK_EPOCH, epoch + 1)
        return total

    def _globals_raw(self) -> bytes:
        """struct hs_global as bytes: one copy out of its mapping, no syscall, no Python object per field."""
        view, size = self._globals_view, self._globals_size
        if view is None or not size:
            raise HeapscopeError("probes are not loaded")
        at = self.slot * self._globals_stride
        return bytes(view[at : at + size])

    def mapping_calls(self) -> int | None:
        """A count that moves with every call that can map new code (mmap with PROT_EXEC, mremap), or None when page
        calls are not traced: while it stands still, no code was mapped since the mappings were read (data mappings,
        brk and munmap leave the stack walk's and the symbols' view as it was). The page calls the kernel could not
        report are added: they may have been such calls."""
        if self._page_ring is None:
            return None
        counted = self.page_counters()
        return counted.code_maps + counted.dropped

    def code_outside(self) -> int | None:
        if not self.settings.unwind:
            return None
        return self.counters().unwind_fp

    def activity(self) -> bytes:
        """A token that changes whenever the target does something the profile records: the global counters
        (every allocation call moves them) and the page events' producer position. Read with one map lookup
        and no Python objects per field, so that a sleeping target's sampling loop costs next to nothing."""
        raw = self._globals_raw()
        ring = self._page_ring.produced() if self._page_ring is not None else 0
        return raw + ring.to_bytes(8, "little")

    def wait_events(self, timeout: float) -> list[int]:
        """Events (EV_*) that came within `timeout` seconds; returns at the first one."""
        assert self._maps is not None and self._readers is not None
        # Rounded up: a wait cut short by the rounding would come back for the rest of a millisecond, a second
        # wake-up every tick.
        wait_ms = max(1, math.ceil(timeout * 1000))
        load_bcc().libbcc.lib.perf_reader_poll(len(self._readers), self._readers, wait_ms)
        events, self._events = self._events, []
        return events

    def set_stack_end(self, end: int) -> None:
        """Where the main thread's stack ends for the stack walk (above argc): it reads no further."""
        self._set_control(CTL_STACK_END, end)

    def set_site_flags(self, flags: Mapping[int, bool]) -> None:
        """--ignore-fn: whether each site is ignored (its trimmed stack starts in an ignored function), for the
        kernel's realloc (probes/heap.bpf.c record_realloc). A site is flagged once."""
        if self._maps is None or not self.settings.ignore:
            return
        table = self._maps["site_flags"]
        for site, ignored in flags.items():
            table[ctypes.c_int(site)] = ctypes.c_uint8(SITE_IGNORED if ignored else SITE_COUNTED)

    def stopped(self) -> int:
        """The event the target is stopped at (stop_events), or 0."""
        return self._control(CTL_STOPPED)

    def resume(self) -> None:
        """Let a target stopped at an event go on."""
        self._set_control(CTL_STOPPED, 0)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.settings.target_tgid, signal.SIGCONT)

    # ---- unwind tables ----------------------------------------------------------------------------

    def publish_unwind(self, mappings: Sequence[UnwindMapping]) -> None:
        """Make these mappings (all of the target's, not just new ones) the ones the stack walk uses.

        Each object's rows are written once, into free space of the process's shared unwind_rows (SharedRows);
        the mapping index is written into the half the kernel is not reading, then one control word flips to it."""
        assert self._maps is not None and self._shared_rows is not None
        entries = []
        for m in sorted(mappings, key=lambda m: m.start):
            placed = self._objects.get(m.key)
            if placed is None:
                if m.n_rows:
                    got = self._shared_rows.acquire(m.key, m.rows, m.n_rows)
                    if got is None:
                        self.rows_dropped += m.n_rows
                        continue
                    placed = got[:2]
                    if not got[2]:
                        self.rows_shared += m.n_rows
                else:
                    placed = (0, 0)
                self.rows_used += m.n_rows
                self._objects[m.key] = placed
            if placed[1]:
                entries.append((m, placed))
        entries = entries[:MAX_UMAPS]
        umaps = self._maps["unwind_maps"]
        half = 1 - self._umap_half
        first = half * MAX_UMAPS
        published = []
        for i, (m, (row_begin, row_count)) in enumerate(entries):
            bias = m.bias & 0xFFFFFFFFFFFFFFFF
            leaf = umaps.Leaf(m.start, m.end, bias, row_begin, row_count)
            umaps[ctypes.c_int(self.slot * 2 * MAX_UMAPS + first + i)] = leaf  # the target's run of the table
            published.append((m.start, m.end, bias, m.key))
        self._set_control(CTL_UMAPS, umaps_word(published, half))
        self._umap_half = half

    def _control(self, index: int) -> int:
        words = self._control_words
        return words[self.slot * CTL_COUNT + index] if words is not None else 0

    def _set_control(self, index: int, value: int) -> None:
        assert self._maps is not None
        table = self._maps["control"]
        table[ctypes.c_int(self.slot * CTL_COUNT + index)] = ctypes.c_uint64(value)

    # ---- reading ----------------------------------------------------------------------------------

    def counters(self) -> Counters:
        if self._maps is None:
            raise HeapscopeError("probes are not loaded")
        raw = self._globals_raw()
        cached = self._counters_cache
        if cached is None or cached[0] != raw:  # a quiet target's loop asks again and again: decoded once per change
            assert self._counters_codec is not None
            cached = self._counters_cache = (raw, self._counters_codec.decode(raw))
        return cached[1]

    def _site_view(self, count: int) -> SiteArray:
        if self._sites is None:
            raise HeapscopeError("probes are not loaded")
        return self._sites.view(count)

    def size_map(self) -> dict[int, int]:
        """Request size -> allocations: small sizes from their array, the others from the hash map."""
        _, raw, count = self._array_prefix_raw("small_sizes", SMALL_SIZES)
        small = array.array("Q")
        small.frombytes(raw)
        out = {size: n for size, n in enumerate(small[:count]) if n}
        out.update({_int(k): _int(v) for k, v in self._items("size_map")})
        return out

    def realloc_jumps(self) -> dict[tuple[int, int], int]:
        return {(int(k.old_size), int(k.new_size)): _int(v) for k, v in self._items("realloc_jump")}

    def thread_stats(self) -> dict[tuple[int, int], tuple[int, int, int]]:
        """(tid, enum hs_fn) -> (count, bytes, ns inside the function)."""
        out: dict[tuple[int, int], tuple[int, int, int]] = {}
        _, raw, _ = self._array_prefix_raw("thread_slots", THREAD_SLOTS * FN_COUNT)
        slots = np.frombuffer(raw, dtype=np.uint64).reshape(-1, 4)  # struct hs_thread_slot: tid, count, bytes, ns
        for i in np.flatnonzero(slots[:, 0]).tolist():  # the few slots a thread holds, of 9,216
            tid, n, nbytes, ns = slots[i].tolist()
            out[(tid, i % FN_COUNT)] = (n, nbytes, ns)
        for k, v in self._items("thread_stats"):  # threads whose slot another thread held
            key = _int(k)
            c, b, t = out.get((key >> 8, key & 0xFF), (0, 0, 0))
            out[(key >> 8, key & 0xFF)] = (c + int(v.count), b + int(v.bytes), t + int(v.ns))
        return out

    def size_histogram(self) -> list[int]:
        """Cumulative allocations per log2(size): 64 counters, read at every sample."""
        words = self._size_hist_words
        if words is not None:
            return words[:LOG2_BINS].tolist()
        return self._u64_prefix("size_hist", LOG2_BINS)

    def life_histogram(self) -> list[int]:
        """Frees per (log2 size, log2 lifetime), flattened: 4,096 counters, read once, for the MALT profile."""
        return self._u64_prefix("life_hist", LOG2_BINS * LOG2_BINS)

    def _u64_prefix(self, name: str, count: int) -> list[int]:
        """Entries 0..count-1 of an array of u64, as ints: one batch read, no ctypes object per entry."""
        _, raw, _ = self._array_prefix_raw(name, count)
        words = array.array("Q")
        words.frombytes(raw)
        return words.tolist()

    def take_window(self, heap_now: int) -> tuple[int, int]:
        """The heap's maximum since the last call and the site that set it; starts a new window."""
        assert self._maps is not None
        table = self._maps["window"]
        w = table[ctypes.c_int(0)]
        result = (int(w.max_heap), int(w.site))
        w.max_heap, w.site = heap_now, 0
        table[ctypes.c_int(0)] = w
        return result

    def _read_stack(self, key: int) -> tuple[int, ...]:
        if self._maps is None or not 0 <= key < self.settings.max_stacks:
            return ()
        table = self._maps["site_stacks"]
        value = table.Leaf()
        lib = load_bcc().libbcc.lib
        if lib.bpf_lookup_elem(table.map_fd, ctypes.byref(ctypes.c_uint32(key)), ctypes.byref(value)) != 0:
            return ()  # a site without a stored stack (overtaken, or no memory for it): counted by the kernel
        ips = array.array("Q", bytes(value)).tolist()
        return tuple(ips[: ips.index(0)] if 0 in ips else ips)

    def _array_prefix_raw(self, name: str, count: int) -> tuple[type, bytes, int]:
        """Entries 0..count-1 of an array map as raw bytes: (value type, bytes, entries read)."""
        assert self._maps is not None
        table = self._maps[name]
        if count <= 0:
            return table.Leaf, b"", 0
        raw = mapped_prefix(table, count)
        if raw is not None:
            return table.Leaf, raw, count
        keys = (table.Key * count)()
        values = (table.Leaf * count)()
        n = ctypes.c_uint32(count)
        lib = load_bcc().libbcc.lib
        if lib.bpf_lookup_batch(table.map_fd, None, ctypes.byref(ctypes.c_uint32()), keys, values, ctypes.byref(n)) in (
            0,
            -2,  # ENOENT: the end of the map came first
        ):
            return table.Leaf, bytes(memoryview(values))[: n.value * ctypes.sizeof(table.Leaf)], n.value
        for i in range(count):
            values[i] = table[table.Key(i)]
        return table.Leaf, bytes(memoryview(values)), count

    def _items(self, name: str) -> list:  # type: ignore[type-arg]
        assert self._maps is not None
        table = self._maps[name]
        try:
            return list(table.items_lookup_batch())
        except Exception:  # kernels without batch lookups: one syscall per entry
            return list(table.items())
