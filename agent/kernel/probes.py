"""The BPF layer: the only module that imports bcc.

It compiles probes/heap.bpf.c with the settings as -D defines, attaches the uprobes chosen by discovery,
reads the maps, and detaches, all behind a context manager. It hands out plain values (agent.model types and
the dataclasses below), never bcc objects.
"""

from __future__ import annotations

import abc
import array
import atexit
import contextlib
import ctypes
import mmap
import os
import re
import signal
import struct
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, fields
from importlib import resources
from pathlib import Path
from types import TracebackType
from typing import Any, ClassVar, cast

from agent.contract import HEAP_H
from agent.errors import EnvironmentProblem, HeapscopeError
from agent.kernel.rowspace import RowSpace
from agent.model.counters import Counters, PageCounters
from agent.model.pages import PageEvent
from agent.model.stack import SiteCounts
from agent.process.discovery import ProbePoint

# Every value shared with heap.bpf.c comes from probes/heap.h (agent.contract).
_CONTROL = HEAP_H.enum("hs_control")
CTL_ARMED = _CONTROL["HS_CTL_ARMED"]
CTL_STOPPED = _CONTROL["HS_CTL_STOPPED"]
CTL_UMAPS = _CONTROL["HS_CTL_UMAPS"]
CTL_STACK_EPOCH = _CONTROL["HS_CTL_STACK_EPOCH"]
CTL_STACK_END = _CONTROL["HS_CTL_STACK_END"]
CTL_PAGES_DRAINED = _CONTROL["HS_CTL_PAGES_DRAINED"]
CTL_SNAP_DRAINED = _CONTROL["HS_CTL_SNAP_DRAINED"]
# Events, and why a `run` target is stopped (enum hs_event).
_EVENTS = HEAP_H.enum("hs_event")
EV_EXEC = _EVENTS["HS_EV_EXEC"]
EV_LOADER = _EVENTS["HS_EV_LOADER"]
EV_EXIT = _EVENTS["HS_EV_EXIT"]
EV_PAGES = _EVENTS["HS_EV_PAGES"]  # the page events' ring is half full
EV_SNAP_LOG = _EVENTS["HS_EV_SNAP_LOG"]  # the snapshot log's ring is half full
EV_SITES = _EVENTS["HS_EV_SITES"]  # --ignore-fn: a realloc waits for its sites' flags
SITE_COUNTED = HEAP_H.enum("hs_site_flag")["HS_SITE_COUNTED"]
SITE_IGNORED = HEAP_H.enum("hs_site_flag")["HS_SITE_IGNORED"]
MAX_UMAPS = HEAP_H.value("HS_MAX_UMAPS")
# control[CTL_UMAPS] = generation << UMAPS_GEN_SHIFT | first index << 32 | count
UMAPS_GEN_SHIFT = HEAP_H.value("HS_UMAPS_GEN_SHIFT")
RULE_CACHE = HEAP_H.value("HS_RULE_CACHE")
# enum hs_page_kind, by agent.model.pages' names (HS_PG_MMAP -> mmap).
PAGE_KINDS = {v: k.removeprefix("HS_PG_").lower() for k, v in HEAP_H.enum("hs_page_kind").items()}
# enum hs_fn: the kind of each allocation call (agent.model.functions), by number (HS_MALLOC -> malloc).
FN_KINDS = {v: k.removeprefix("HS_").lower() for k, v in HEAP_H.enum("hs_fn").items() if k != "HS_FN_COUNT"}
FN_COUNT = HEAP_H.enum("hs_fn")["HS_FN_COUNT"]
LOG2_BINS = HEAP_H.value("HS_LOG2_BINS")
SMALL_SIZES = HEAP_H.value("HS_SMALL_SIZES")
THREAD_SLOTS = HEAP_H.value("HS_THREAD_SLOTS")
PAGE_COUNTER_COUNT = HEAP_H.enum("hs_page_counter")["HS_PGC_COUNT"]
# The snapshot schedule (enum hs_control's HS_CTL_SCHED_*, HS_EV_SCHEDULE, struct hs_sched_point).
CTL_SCHED_DUE = _CONTROL["HS_CTL_SCHED_DUE"]
CTL_SCHED_PEAK_LEVEL = _CONTROL["HS_CTL_SCHED_PEAK_LEVEL"]
CTL_SCHED_DUE_JIFFIES = _CONTROL["HS_CTL_SCHED_DUE_JIFFIES"]
CTL_SCHED_INTERVAL = _CONTROL["HS_CTL_SCHED_INTERVAL"]
CTL_SCHED_CULL_AT = _CONTROL["HS_CTL_SCHED_CULL_AT"]
CTL_SCHED_ORIGIN = _CONTROL["HS_CTL_SCHED_ORIGIN"]
CTL_SCHED_MAX = _CONTROL["HS_CTL_SCHED_MAX"]
CTL_SCHED_PEAK_PPM = _CONTROL["HS_CTL_SCHED_PEAK_PPM"]
CTL_SCHED_JIFFY_NS = _CONTROL["HS_CTL_SCHED_JIFFY_NS"]
EV_SCHEDULE = _EVENTS["HS_EV_SCHEDULE"]
SCHED_PEAK = HEAP_H.enum("hs_sched_kind")["HS_SCHED_PEAK"]  # a point of Massif's peak snapshots
_SCHED_POINT = struct.Struct("<5Q")  # struct hs_sched_point: time, heap, extra, kind, epoch
SCHED_RING_BYTES = 64 << 10  # the points' ring buffer (HS_SCHED_RING_PAGES): 1,300 points between two drains
_SNAP_RECORD = struct.Struct("<2Q2qQ")  # struct hs_snap_record: site, epoch, bytes, extra, allocs
# The snapshot log's ring buffer (HS_SNAP_RING_PAGES): 21,000 records, a site's first change after each point;
# the kernel wakes user space at half full. Sampled mode changes sites at its samples only (~2 a MiB allocated at
# the default rate): 1,300 records, as its daemon holds one ring per target.
SNAP_RING_BYTES = 1 << 20
SAMPLED_SNAP_RING_BYTES = 64 << 10
SNAP_DRAIN_TRIES = 100  # a record another CPU has reserved and not yet submitted: wait for it, 0.1 ms at a time


# struct hs_page_event (probes/heap.h): time_ns, site, addr, length, new_addr, new_length, flags, prot, ret,
# tid, kind.
_PAGE_EVENT = struct.Struct("<8Qq2I")
PAGE_RING_BYTES = 4 << 20  # the page events' ring buffer (passed to probes/heap.h as HS_PAGE_RING_PAGES)
SAMPLED_PAGE_RING_BYTES = 512 << 10  # the same in sampled mode: ~6,000 events, woken at half full
PENDING_SLOTS = HEAP_H.value("HS_PENDING_SLOTS")  # per-thread call slots of exact mode's entry and return probes
MAX_SIZES = HEAP_H.value("HS_MAX_SIZES")  # MALT's request sizes and realloc jumps
SAMPLED_MAX_SIZES = 16384  # sampled mode: MALT's request sizes of 4 KiB and more (smaller ones have an array)
MAX_THREADS = HEAP_H.value("HS_MAX_THREADS")


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
        self._names = [name for _, _, name in placed]

    def decode(self, raw: bytes) -> Counters:
        return Counters(**dict(zip(self._names, self._struct.unpack_from(raw), strict=True)))


class _RingReader:
    """A BPF ring buffer read in place, as libbpf does it, without a callback per record: the consumer position
    is a shared page we write, the producer position and the data (mapped twice, so a record never wraps)
    pages we read. x86 keeps loads in order, so reading the producer position before the records suffices."""

    _BUSY = 1 << 31  # a record reserved and not yet submitted: stop there
    _DISCARD = 1 << 30
    _U64 = struct.Struct("<Q")
    _HEADER = struct.Struct("<II")  # length (with the two bits above), page offset

    def __init__(self, map_fd: int, size: int, record: struct.Struct) -> None:
        page = mmap.PAGESIZE
        self.size = size
        self.record = record
        self._consumer = mmap.mmap(map_fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0)
        # The data once, not twice as libbpf maps it: the kernel maps every page of a ring mapping at once, so
        # the second copy would be `size` more bytes of the daemon's RSS for every target. A record that wraps
        # is read in two pieces.
        self._producer = mmap.mmap(map_fd, page + size, mmap.MAP_SHARED, mmap.PROT_READ, offset=page)
        self._data = memoryview(self._producer)[page:]
        self.taken = 0  # records consumed so far

    def drain(self) -> list[tuple[Any, ...]]:
        """Every submitted record, unpacked, in order; frees their space for the kernel."""
        u64, header, record, data = self._U64, self._HEADER, self.record, self._data
        cons = u64.unpack_from(self._consumer, 0)[0]
        prod = u64.unpack_from(self._producer, 0)[0]
        mask = self.size - 1
        out = []
        while cons < prod:
            length, _ = header.unpack_from(data, cons & mask)
            if length & self._BUSY:
                break
            if not length & self._DISCARD:
                at = (cons & mask) + 8  # headers are 8-byte aligned: only a record's body can wrap
                if at + record.size <= self.size:
                    out.append(record.unpack_from(data, at))
                else:
                    out.append(record.unpack(bytes(data[at:]) + bytes(data[: at + record.size - self.size])))
            cons += ((length & ~(self._BUSY | self._DISCARD)) + 8 + 7) & ~7
            self.taken += 1
        u64.pack_into(self._consumer, 0, cons)
        return out

    def produced(self) -> int:
        """The producer position: it moves with every record the kernel reserves."""
        return int(self._U64.unpack_from(self._producer, 0)[0])

    def consumed(self) -> int:
        """The consumer position: how far drain() has read (it stops at a record not yet submitted)."""
        return int(self._U64.unpack_from(self._consumer, 0)[0])

    def close(self) -> None:
        self._data.release()
        self._producer.close()
        self._consumer.close()


@dataclass(frozen=True)
class UnwindMapping:
    """An executable mapping of the target and the unwind table of its object."""

    start: int
    end: int
    bias: int  # runtime address = ELF virtual address + bias
    key: str  # the object's identity (build-id or path): its rows are loaded once
    rows: bytes  # agent.symbols.unwind ROW-packed, sorted
    n_rows: int


@dataclass(frozen=True)
class MaltSiteFields:
    """MALT's statistics of one site (probes/heap.h struct hs_site, HS_MALT fields)."""

    fn: int = 0  # enum hs_fn (FN_KINDS)
    tot_bytes: int = 0
    tot_blocks: int = 0
    cur_bytes: int = 0
    cur_blocks: int = 0
    peak_bytes: int = 0
    peak_gen: int = 0
    alloc_min: int = 0
    alloc_max: int = 0
    count_zeros: int = 0
    max_alive: int = 0
    free_count: int = 0
    free_min: int = 0
    free_max: int = 0
    free_sum: int = 0
    life_count: int = 0
    life_min: int = 0
    life_max: int = 0
    life_sum: int = 0
    realloc_count: int = 0
    realloc_delta: int = 0


@dataclass(frozen=True)
class ProbeSettings:
    target_tgid: int
    arm_on_exec: bool  # run: count from the target's exec on; attach: count from now on
    stop_events: bool = False  # run: stop the target at exec, loader changes and exit() for user space
    unwind: bool = True  # walk stacks with .eh_frame tables; False: frame pointers only
    max_rows: int = 1 << 21  # unwind table rows, all objects together
    free_stacks: bool = False  # charge freed bytes to the stack of the free call (xtree full)
    malt: bool = False  # keep MALT's statistics too (sizes, lifetimes, threads, scatter)
    heap_admin: int = 8
    alignment: int = 16
    max_depth: int = 40
    max_blocks: int = 1 << 20
    max_stacks: int = 1 << 16
    pages: bool = False  # trace mmap/munmap/mremap/brk: one PageEvent per call (page_events())
    # Walk the stack of each page call (its site: the pages-as-heap tree, MALT's mmap statistics). Without it the
    # page walker is not loaded, which saves its verification (~0.8 s of an attach), and every call has site 0.
    page_stacks: bool = True
    stacks: bool = False  # keep each thread's stack extent (--stacks=yes: stack_bytes())
    sampled: bool = False  # also compile probes/sampled.bpf.c (points of kind sample_alloc / sample_free)
    schedule_ns: bool = False  # the snapshot schedule's points are timed in ns (--time-unit=ms), else in B
    sample_rate: int = 524288  # sampled: the sampler's mean bytes between samples (its weights' rate)
    page_ring_bytes: int = PAGE_RING_BYTES  # the page events' ring buffer (pages): a power of two of pages
    ignore: bool = False  # --ignore-fn: reallocs follow Massif's rule by the sites' flags (set_site_flags)


def table_sizes(s: ProbeSettings) -> dict[str, int]:
    """The sizes of the kernel's tables (probes/heap.h HS_* defines) for these settings. Each target holds its
    tables in the kernel for as long as it is profiled, busy or not: what the mode does not use is compiled at
    its smallest (sampled mode attaches no allocation function, so exact mode's block table and call slots go
    unused, and sampled calls never reach MALT's realloc jumps; without MALT its size tables go unused)."""
    return {
        "HS_BLOCK_SLOTS": 2 if s.sampled else block_slots(s.max_blocks),
        "HS_MAX_BLOCKS": 16 if s.sampled else max(s.max_blocks // 2, 16),
        "HS_MAX_SAMPLED_BLOCKS": s.max_blocks,  # sampled_blocks (probes/sampled.bpf.c, sampled mode only)
        "HS_PENDING_SLOTS": 1 if s.sampled else PENDING_SLOTS,
        "HS_MAX_PENDING": 16 if s.sampled else MAX_THREADS,
        "HS_MAX_STACKS": s.max_stacks,
        "HS_MAX_SIZES": (SAMPLED_MAX_SIZES if s.sampled else MAX_SIZES) if s.malt else 1,
        "HS_MAX_JUMPS": MAX_SIZES if s.malt and not s.sampled else 1,
        "HS_PAGE_RING_PAGES": s.page_ring_bytes // mmap.PAGESIZE,
    }


# bpf(2) uprobe_multi links: include/uapi/linux/bpf.h.
_SYS_BPF = 321  # x86-64
_BPF_LINK_CREATE = 28
_BPF_TRACE_UPROBE_MULTI = 48
_BPF_F_UPROBE_MULTI_RETURN = 1
_UPROBE_LINKS_ENV = "HEAPSCOPE_UPROBE_LINKS"  # "0": attach through perf events even where links exist


class _UprobeMultiAttr(ctypes.Structure):
    """union bpf_attr as BPF_LINK_CREATE reads it for a uprobe_multi link."""

    _fields_ = [
        ("prog_fd", ctypes.c_uint32),
        ("target_fd", ctypes.c_uint32),
        ("attach_type", ctypes.c_uint32),
        ("flags", ctypes.c_uint32),
        ("path", ctypes.c_uint64),
        ("offsets", ctypes.c_uint64),
        ("ref_ctr_offsets", ctypes.c_uint64),
        ("cookies", ctypes.c_uint64),
        ("cnt", ctypes.c_uint32),
        ("multi_flags", ctypes.c_uint32),
        ("pid", ctypes.c_uint32),
    ]


def uprobe_links_supported() -> bool:
    """Whether uprobes are attached as BPF uprobe_multi links (Linux 6.10+), not through perf events.

    A link runs its program straight from the uprobe; a perf event goes through the trace_uprobe layer
    (its dispatcher, filter lock and perf hooks) first: ~0.14 us less per malloc/free pair on the
    development VM. Links came in 6.6, but until 6.10 their pid filter kept one thread, not the process,
    so other threads' calls would go unseen. HEAPSCOPE_UPROBE_LINKS=0 keeps the perf events."""
    if os.environ.get(_UPROBE_LINKS_ENV, "1") == "0":
        return False
    try:
        major, minor = (int(part) for part in os.uname().release.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (6, 10)


def _link_uprobe(prog_fd: int, path: bytes, offset: int, is_return: bool, pid: int) -> int:
    """A uprobe_multi link of one program at one file offset, for the process pid only; returns its fd
    (closing it removes the probe), or -errno."""
    offsets = (ctypes.c_uint64 * 1)(offset)
    name = ctypes.create_string_buffer(path)
    attr = _UprobeMultiAttr(
        prog_fd=prog_fd,
        attach_type=_BPF_TRACE_UPROBE_MULTI,
        path=ctypes.addressof(name),
        offsets=ctypes.addressof(offsets),
        cnt=1,
        multi_flags=_BPF_F_UPROBE_MULTI_RETURN if is_return else 0,
        pid=pid,
    )
    libc = ctypes.CDLL(None, use_errno=True)
    fd = int(libc.syscall(_SYS_BPF, _BPF_LINK_CREATE, ctypes.byref(attr), ctypes.sizeof(attr)))
    return fd if fd >= 0 else -ctypes.get_errno()


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


def block_slots(max_blocks: int) -> int:
    """Slots of the kernel's block table for --max-blocks: a power of two, at least 2 (one bucket). Blocks
    whose bucket is full go to an overflow hash of half as many entries."""
    return max(2, 1 << (max_blocks - 1).bit_length())


@contextlib.contextmanager
def _captured_stderr() -> Iterator[Callable[[], list[str]]]:
    """Hold what clang and libbpf write to fd 2 while compiling, so errors reach the user as one line."""
    with contextlib.suppress(OSError, ValueError):  # a log that cannot be written (agent.log) is no error here
        sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield lambda: (tmp.seek(0), tmp.read().decode(errors="replace").splitlines())[1]
        finally:
            os.dup2(saved, 2)
            os.close(saved)


def _trim_heap() -> None:
    """Give the C heap's free memory back to the system. Compiling with clang allocates and frees some 40 MB,
    in the malloc arena of the thread that compiles (a daemon compiles in each target's own thread); glibc
    keeps such freed memory in the arena, so without this every target would add its compile's peak to the
    daemon's RSS for good."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


MALLOC_ARENAS = 2  # a daemon's C heap: arenas its threads share (mallopt M_ARENA_MAX)
_M_ARENA_MAX = -8  # glibc's malloc.h


def limit_malloc_arenas(arenas: int = MALLOC_ARENAS) -> None:
    """Let a daemon's threads share a few malloc arenas instead of one each (glibc's default is up to 8 a CPU).
    Each target's thread compiles its program, and clang's tens of MB, freed, leave a fragmented arena that
    malloc_trim cannot give back whole: with an arena per target thread that stayed with each target (~4 MiB of
    RSS a target on this VM), with shared arenas the next compile reuses it. Call before the threads start;
    the threads hold the GIL for most of their work, so sharing costs them little."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).mallopt(_M_ARENA_MAX, arenas)


def _int(value: object) -> int:
    """A map key as an int: batch lookups give ints, per-entry lookups give ctypes values."""
    return int(getattr(value, "value", value))  # type: ignore[call-overload]


class SiteArray:
    """Entries of an array map whose fields are all 64 bits, read as columns: the kernel's array mapped
    read-only (BPF_F_MMAPABLE), so a read is neither a syscall nor a copy of the whole array; or a copy of it.

    `fields` gives each field's offset in words and whether it is signed."""

    def __init__(self, buf: Any, stride: int, fields: dict[str, tuple[int, bool]], entries: int) -> None:
        self._buf = buf
        self._words = memoryview(buf).cast("B").cast("Q")
        self._signed = memoryview(buf).cast("B").cast("q")
        self.stride = stride  # words per entry
        self.fields = fields
        self.entries = entries  # entries readable

    @classmethod
    def of_leaf(cls, buf: Any, leaf: Any, entries: int) -> SiteArray:
        """Over `buf`, holding entries of the ctypes struct `leaf` (bcc's description of the map's value)."""
        stride = ctypes.sizeof(leaf) // 8
        fields = {
            name: (getattr(leaf, name).offset // 8, getattr(kind, "_type_", "Q") in ("q", "l"))
            for name, kind in leaf._fields_
        }
        return cls(buf, stride, fields, entries)

    def column(self, name: str, count: int, signed: bool | None = None) -> list[int]:
        """Field `name` of entries 0..count-1, signed as declared unless `signed` says otherwise."""
        offset, declared = self.fields[name]
        count = min(count, self.entries)
        words = self._signed if (declared if signed is None else signed) else self._words
        return words[offset : offset + count * self.stride : self.stride].tolist()

    def entry(self, index: int) -> list[int]:
        """All words of one entry."""
        return self._words[index * self.stride : (index + 1) * self.stride].tolist()

    def copy(self, count: int) -> SiteArray:
        """Entries 0..count-1, copied: readable after the map is gone."""
        count = min(count, self.entries)
        return SiteArray(bytearray(self._words[: count * self.stride]), self.stride, self.fields, count)

    def release(self) -> None:
        self._words.release()
        self._signed.release()


class MappedArray:
    """An mmapable array map (BPF_F_MMAPABLE), mapped read-only as far as it is read: the kernel maps every
    page of a mapping at once, so mapping all of a 65,536-entry array would count its tens of MB in the
    daemon's RSS. The mapping doubles when a read goes past it; earlier ones stay until close(), as a reader
    in another thread may still be using one."""

    FIRST = 1024  # entries mapped at first

    def __init__(self, table: Any, max_entries: int) -> None:
        self._table = table
        self._max = max_entries
        self._lock = threading.Lock()
        self._mappings: list[tuple[mmap.mmap, SiteArray]] = []
        self._view: SiteArray | None = None
        self.view(1)  # fail at load, not at the first read, where mmapable arrays are missing

    def view(self, count: int) -> SiteArray:
        """A view holding at least entries 0..count-1 (all there are, if fewer)."""
        v = self._view
        if v is not None and (count <= v.entries or v.entries >= self._max):
            return v
        with self._lock:
            v = self._view
            if v is None or (count > v.entries and v.entries < self._max):
                entries = min(self._max, max(self.FIRST, 1 << (count - 1).bit_length()))
                # The kernel lays the values out from offset 0 of the mapping, each rounded up to 8 bytes.
                size = entries * ctypes.sizeof(self._table.Leaf)
                length = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE * mmap.PAGESIZE
                mapping = mmap.mmap(self._table.map_fd, length, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
                v = SiteArray.of_leaf(mapping, self._table.Leaf, entries)
                self._mappings.append((mapping, v))
                self._view = v
            return v

    def close(self) -> None:
        self._view = None
        for mapping, v in self._mappings:
            v.release()
            with contextlib.suppress(BufferError):  # a view still exported: the mapping goes with it
                mapping.close()
        self._mappings.clear()


# libbcc keeps every loaded program's tables in one process-wide map, unguarded: two threads loading, unloading or
# looking up tables at once crashed a daemon with several targets (in ebpf::TableStorage). Every load and cleanup
# holds this lock, and each program's tables are looked up once, under it, at the load (_cache_tables).
BCC_LOCK = threading.RLock()


def _cache_tables(bpf: Any) -> None:
    """Look every table of a freshly loaded program up once (bcc caches the objects), so that later reads never
    search libbcc's shared table map while another thread changes it. Call with BCC_LOCK held."""
    lib = _load_bcc().libbcc.lib
    lib.bpf_num_tables.restype = ctypes.c_size_t
    lib.bpf_num_tables.argtypes = [ctypes.c_void_p]
    lib.bpf_table_name.restype = ctypes.c_char_p
    lib.bpf_table_name.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    for i in range(lib.bpf_num_tables(bpf.module)):
        name = lib.bpf_table_name(bpf.module, i)
        if name:
            with warnings.catch_warnings():  # bcc warns of str names, but the code reads tables by them: cache those
                warnings.simplefilter("ignore", DeprecationWarning)
                bpf[name.decode()]


def _unload(bpf: Any) -> None:
    """Unload a program and let its Python objects go: bcc registers every BPF object's cleanup with atexit, which
    would keep each one, its tables and their ctypes types alive for the life of a daemon (megabytes a target)."""
    with BCC_LOCK:
        bpf.cleanup()
    atexit.unregister(bpf.cleanup)
    bpf.tables.clear()


def _load_bcc():  # type: ignore[no-untyped-def]
    try:
        import bcc
    except ImportError as exc:
        raise EnvironmentProblem("the bcc Python module is not available (python3-bpfcc; run `make setup`)") from exc
    return bcc


class SharedRows:
    """The unwind rows of every target of this process, in one BPF array (probes/heap.bpf.c unwind_rows). A
    small holder program declares it as a shared table and is kept for the process's life; each target's
    program refers to it as an extern table. An object's rows are written once whichever targets map it (libc's
    28,000 rows once, not once a target), and the space of an object no target uses any more is reused. Its
    size is fixed by the first target (max_rows). It is never unloaded: libbcc's shared table entry shares the
    holder's descriptor, which must stay valid."""

    _instance: SharedRows | None = None
    _create_lock = threading.Lock()

    def __init__(self, max_rows: int, probes_dir: str) -> None:
        bcc = _load_bcc()
        source = '#include "heap.h"\nBPF_TABLE_SHARED("array", int, struct hs_row, unwind_rows, HS_MAX_ROWS);\n'
        with BCC_LOCK, _captured_stderr() as messages:
            try:
                self._holder = bcc.BPF(text=source.encode(), cflags=[f"-I{probes_dir}", f"-DHS_MAX_ROWS={max_rows}"])
            except Exception as exc:
                first = next((ln for ln in messages() if "error" in ln.lower()), str(exc))
                raise EnvironmentProblem(f"cannot create the unwind rows table: {first.strip()}") from exc
            self.table = self._holder["unwind_rows"]
        self.max_rows = max_rows
        self.space = RowSpace(max_rows)
        self.lock = threading.Lock()

    @classmethod
    def prepare(cls) -> None:
        """Create the table now (a daemon at its start), so that it is there before the first target and not
        counted as something that target left behind; best effort: the first target reports any problem."""
        with contextlib.suppress(HeapscopeError):
            cls.get(ProbeSettings.max_rows, str(resources.files("probes")))

    @classmethod
    def get(cls, max_rows: int, probes_dir: str) -> SharedRows:
        with cls._create_lock:
            if cls._instance is None:
                cls._instance = SharedRows(max_rows, probes_dir)
            return cls._instance

    def acquire(self, key: str, rows: bytes, n_rows: int) -> tuple[int, int, bool] | None:
        """(first row, rows, new) of the object, its rows written if it is new here (new: no other target of
        this process has the object's identity, its build id); None when they do not fit."""
        with self.lock:
            got = self.space.acquire(key, n_rows)
            if got is None:
                return None
            placed, new = got
            if new and n_rows:
                table = self.table
                keys = (table.Key * n_rows)(*range(placed.first, placed.first + n_rows))
                values = (table.Leaf * n_rows).from_buffer_copy(rows)
                table.items_update_batch(keys, values)
            return placed.first, placed.count, new

    def release(self, keys: Iterable[str]) -> None:
        """A target's probes are gone: it uses these objects no more."""
        with self.lock:
            for key in keys:
                self.space.release(key)


def _drop_leading(ips: tuple[int, ...], ranges: tuple[tuple[int, int], ...]) -> tuple[int, ...]:
    """`ips` without its leading addresses that lie in one of `ranges` ([lo, hi))."""
    i = 0
    while i < len(ips) and any(lo <= ips[i] < hi for lo, hi in ranges):
        i += 1
    return ips[i:]


class SiteReader(abc.ABC):
    """Reads a profile's counters: the global counters, the sites' counters and their stacks. The live probes
    (HeapProbes) read the kernel's maps in place; FrozenProbes reads a copy taken before the program is unloaded,
    so an exited target's profile can still be queried."""

    settings: ProbeSettings
    rows_used = 0  # unwind rows loaded into the kernel, all objects together
    rows_dropped = 0  # rows that did not fit in the table (their objects fall back to frame pointers)
    rows_shared = 0  # of rows_used, those another target had placed already (one image's pods: written once)

    def __init__(self) -> None:
        self._stacks: dict[int, tuple[int, ...]] = {}  # site id -> return addresses, read once per site
        # Address ranges whose frames are dropped from the start of every stack: sampled mode's stacks begin
        # inside the sampler library (its hooks), which stand where exact mode's probe sees the caller.
        self.lead_trim: tuple[tuple[int, int], ...] = ()

    @abc.abstractmethod
    def counters(self) -> Counters: ...

    @abc.abstractmethod
    def page_counters(self) -> PageCounters: ...

    @abc.abstractmethod
    def _site_view(self, count: int) -> SiteArray: ...

    @abc.abstractmethod
    def _read_stack(self, key: int) -> tuple[int, ...]: ...

    def site_count(self) -> int:
        """Site ids in use so far, the overflow site 0 included: read columns of this many sites."""
        return min(self.counters().n_sites + 1, self.settings.max_stacks)

    def site_column(self, name: str, count: int, signed: bool | None = None) -> list[int]:
        """One counter of struct hs_site (probes/heap.h), for sites 0..count-1, read in place. `signed`: read
        an unsigned counter as signed (a live count a racy read saw below zero comes out negative)."""
        return self._site_view(count).column(name, count, signed)

    def copy_sites(self, count: int) -> SiteArray:
        """The counters of sites 0..count-1, copied (they stay readable once the program is unloaded)."""
        return self._site_view(count).copy(count)

    def used_sites(self, count: int) -> list[int]:
        """Site ids among 0..count-1 with an allocation or a free charged to them; the others were handed out
        but never used (another CPU published the same stack first), or their first call is still running."""
        used = zip(
            self.site_column("tot_blocks", count),
            self.site_column("freed_blocks", count),
            self.site_column("free_count", count),
            strict=True,
        )
        return [key for key, (a, f, n) in enumerate(used) if a or f or n]

    def sites(self, peak_gen: int) -> dict[int, SiteCounts]:
        """Counters per used site, with the peak values resolved against the global peak numbered `peak_gen`."""
        n = self.site_count()
        plain = ("cur_bytes", "cur_blocks", "tot_bytes", "tot_blocks", "freed_bytes", "freed_blocks", "cur_extra")
        columns = [self.site_column(name, n) for name in plain]
        peak_bytes = self.peak_column("peak_bytes", "cur_bytes", n, peak_gen)
        peak_extra = self.peak_column("peak_extra", "cur_extra", n, peak_gen)
        return {
            key: SiteCounts(
                **{name: column[key] for name, column in zip(plain, columns, strict=True)},
                peak_bytes=peak_bytes[key],
                peak_extra=peak_extra[key],
            )
            for key in self.used_sites(n)
        }

    def peak_column(self, name: str, live: str, count: int, peak_gen: int, signed: bool | None = None) -> list[int]:
        """A site's value at the global peak numbered `peak_gen` (peak_bytes, peak_extra): a site untouched
        since that peak still holds it in its live counter (`live`), as the kernel copies it lazily."""
        at_peak = self.site_column(name, count, signed)
        now = self.site_column(live, count, signed)
        gens = self.site_column("peak_gen", count)
        return [p if g == peak_gen else c for p, c, g in zip(at_peak, now, gens, strict=True)]

    def stacks(self, keys: Iterable[int]) -> dict[int, tuple[int, ...]]:
        """Return addresses behind site keys (innermost first). Read from the kernel once per site: they are
        written before the site's id is published, and never change."""
        out = {}
        for key in keys:
            ips = self._stacks.get(key)
            if ips is None:
                ips = self._read_stack(key)
                if ips and self.lead_trim:
                    ips = _drop_leading(ips, self.lead_trim)
                if ips:
                    self._stacks[key] = ips
            out[key] = ips
        return out


class HeapProbes(SiteReader):
    """Compiled and attached heap probes for one target. Use as a context manager."""

    def __init__(self, settings: ProbeSettings, points: Sequence[ProbePoint]) -> None:
        super().__init__()
        self.settings = settings
        self.points = tuple(points)
        self._bpf = None
        self._fds: list[int] = []  # perf events of the uprobes (bcc closes them)
        self._links: list[int] = []  # uprobe_multi links (closed with os.close)
        self._use_links = uprobe_links_supported()
        self._sites: MappedArray | None = None  # struct hs_site by site id
        self._events: list[int] = []
        self._page_ring: _RingReader | None = None
        self._shared_rows: SharedRows | None = None
        self._objects: dict[str, tuple[int, int]] = {}  # object key -> (first row, row count) in the shared rows
        self._sched_ring: _RingReader | None = None
        self._snap_ring: _RingReader | None = None
        self._umap_half = 0
        self._umap_gen = 0  # publications so far, modulo the bits the control word has for them
        self.detach_seconds = 0.0  # each uprobe's removal waits for an RCU grace period
        self._zero_key = ctypes.c_int(0)
        self._map_fds: list[int] = []  # the maps' own descriptors once bcc's module is freed (_release_compiler)
        self._globals_fd = -1
        self._globals_size = 0  # activity(), counters(): bytes of struct hs_global; 0 while not loaded
        self._counters_codec: _CountersCodec | None = None
        # The raw globals last decoded, and what they decoded to: one tuple, replaced whole, as the sampling
        # thread and HTTP threads read the counters at once.
        self._counters_cache: tuple[bytes, Counters] | None = None

    # ---- life cycle -------------------------------------------------------------------------------

    def __enter__(self) -> HeapProbes:
        bcc = _load_bcc()
        s = self.settings
        probes_dir = str(resources.files("probes"))
        self._shared_rows = SharedRows.get(s.max_rows, probes_dir)
        cflags = [
            f"-I{probes_dir}",
            f"-DHS_TARGET_TGID={s.target_tgid}",
            f"-DHS_ARM_ON_EXEC={1 if s.arm_on_exec else 0}",
            f"-DHS_HEAP_ADMIN={s.heap_admin}",
            f"-DHS_ALIGNMENT={s.alignment}",
            f"-DHS_MAX_DEPTH={s.max_depth}",
            *(f"-D{name}={value}" for name, value in table_sizes(s).items()),
            f"-DHS_STOP_EVENTS={int(s.stop_events)}",
            f"-DHS_UNWIND={int(s.unwind)}",
            f"-DHS_MAX_ROWS={self._shared_rows.max_rows}",
            f"-DHS_FREE_STACKS={int(s.free_stacks)}",
            f"-DHS_MALT={int(s.malt)}",
            f"-DHS_PAGES={int(s.pages)}",
            f"-DHS_STACKS={int(s.stacks)}",
            f"-DHS_SCHED_NS={int(s.schedule_ns)}",
            f"-DHS_SCHED_RING_PAGES={SCHED_RING_BYTES // mmap.PAGESIZE}",
            f"-DHS_SNAP_RING_PAGES={self._snap_ring_bytes() // mmap.PAGESIZE}",
            f"-DHS_SAMPLE_RATE={s.sample_rate}ULL",
            f"-DHS_SAMPLED={int(s.sampled)}",
            f"-DHS_IGNORE={int(s.ignore)}",
        ]
        with BCC_LOCK, _captured_stderr() as messages:
            try:
                if s.sampled:  # sampled.bpf.c uses heap.bpf.c's helpers: one translation unit
                    source = "".join(
                        Path(probes_dir, name).read_text() for name in ("heap.bpf.c", "sampled.bpf.c")
                    )
                    bpf = self._bpf = bcc.BPF(text=source.encode(), cflags=cflags)
                else:
                    bpf = self._bpf = bcc.BPF(src_file=os.path.join(probes_dir, "heap.bpf.c").encode(), cflags=cflags)
            except Exception as exc:  # bcc raises bare Exception for compile and load failures
                first = next((ln for ln in messages() if "error" in ln.lower()), str(exc))
                raise EnvironmentProblem(f"cannot compile or load the BPF program: {first.strip()}") from exc
            _cache_tables(bpf)
        try:
            try:
                self._sites = MappedArray(bpf["sites"], s.max_stacks)
            except (OSError, ValueError) as exc:
                raise EnvironmentProblem(f"cannot map the sites array (BPF_F_MMAPABLE, Linux 5.5+): {exc}") from exc
            self._load_programs()
            self._install_walkers()
            for point in self.points:
                self._attach(point)
            # Armed only now: an entry seen before its return probe existed would never see its return.
            if not s.arm_on_exec:
                self._set_armed(True)
            bpf["events"].open_perf_buffer(self._on_event, page_cnt=8)
            if s.pages:
                self._page_ring = _RingReader(bpf["page_events"].map_fd, s.page_ring_bytes, _PAGE_EVENT)
            self._sched_ring = _RingReader(bpf["sched_points"].map_fd, SCHED_RING_BYTES, _SCHED_POINT)
            self._snap_ring = _RingReader(bpf["snap_log"].map_fd, self._snap_ring_bytes(), _SNAP_RECORD)
            self._release_compiler()
            self._open_globals()
        except BaseException:
            self.close()
            raise
        _trim_heap()
        return self

    def _open_globals(self) -> None:
        """The reader of struct hs_global, made once here, on the map's own descriptor (after
        _release_compiler): made lazily at the first read, a sampling thread and an HTTP thread reading at once
        could each see it half made (a codec not set yet failed a profile in the fleet soak)."""
        assert self._bpf is not None
        table = self._bpf["globals"]
        self._counters_codec = _CountersCodec(table.Leaf)
        self._globals_size = ctypes.sizeof(table.Leaf)
        self._globals_fd = table.map_fd

    def _release_compiler(self) -> None:
        """Free what bcc keeps of the compilation once everything is loaded: its module holds clang's LLVM
        context, the optimized IR, the JIT's objects and the rewritten source of every function, ~8 MB a
        target for as long as the BPF object lives. The maps' descriptors are owned by that module, so each
        table (all were looked up at the load: _cache_tables) gets a descriptor of its own first."""
        lib = _load_bcc().libbcc.lib
        assert self._bpf is not None
        bpf = self._bpf
        with BCC_LOCK:  # the module's tables leave libbcc's process-wide table map
            for table in bpf.tables.values():
                table.map_fd = os.dup(table.map_fd)
                self._map_fds.append(table.map_fd)
            lib.bpf_module_destroy(bpf.module)
            bpf.module = None

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def detach(self) -> None:
        """Remove the uprobes: the target runs on untouched. The maps stay readable until close()."""
        if self._bpf is None:
            return
        if self._fds or self._links:
            self._set_armed(False)
        lib = _load_bcc().libbcc.lib
        started = time.monotonic()
        # A perf event's removal waits for an RCU grace period in the kernel (~0.1 s here), a link's for far
        # less: one thread a probe, so the waits overlap (ctypes and os.close let go of the GIL meanwhile).
        closers = [threading.Thread(target=lib.bpf_close_perf_event_fd, args=(fd,)) for fd in self._fds]
        closers += [threading.Thread(target=os.close, args=(fd,)) for fd in self._links]
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        self.detach_seconds = time.monotonic() - started
        self._fds.clear()
        self._links.clear()

    def close(self) -> None:
        if self._bpf is not None and self.stopped():
            self.resume()  # never leave the target held at an event, whatever went wrong
        self.detach()
        self._unmap()
        for ring in (self._page_ring, self._sched_ring, self._snap_ring):
            if ring is not None:
                ring.close()
        self._page_ring = self._sched_ring = self._snap_ring = None
        self._globals_size = 0  # its descriptor is closed below
        if self._bpf is not None:
            _unload(self._bpf)
            self._bpf = None
        for fd in self._map_fds:
            os.close(fd)
        self._map_fds.clear()
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
        if not self.settings.sampled:  # sampled mode probes no allocation function: no call tail-calls it
            walkers.append(("alloc_walker", b"alloc_enter"))
        if self.settings.pages and self.settings.page_stacks:
            walkers.append(("page_walker", b"page_enter_walk"))
        return walkers

    def _load_programs(self) -> None:
        """Load the uprobes' programs and the walkers two at a time: the kernel verifies each load on the calling
        thread and ctypes lets go of the GIL meanwhile, so on two CPUs the three programs that walk stacks (~0.8 s
        of verification each) take half as long. bcc keeps each loaded program (load_func gives it again)."""
        names = {name for _, name in self._walkers()}
        for point in self.points:
            names.add(f"{point.kind}_enter".encode())
            if point.needs_return:
                names.add(b"alloc_return")
        with ThreadPoolExecutor(max_workers=2, thread_name_prefix="bpf-load") as pool:
            list(pool.map(self._load_program, sorted(names)))

    def _load_program(self, name: bytes) -> Any:
        if name == b"page_enter_walk":
            assert self._bpf is not None
            return self._bpf.load_func(name, _load_bcc().BPF.TRACEPOINT)
        return self._load_uprobe_program(name)

    def _install_walkers(self) -> None:
        """The programs that hold the shared copies of the stack walk, in the program arrays the probes
        tail-call (probes/heap.bpf.c alloc_walker, page_walker): before any probe can fire. Without the page
        walker (page_stacks off) a page call is kept without its stack (probes/heap.bpf.c page_enter)."""
        assert self._bpf is not None
        for table, name in self._walkers():
            self._bpf[table][ctypes.c_int(0)] = ctypes.c_int(self._load_program(name).fd)

    @property
    def attached_through(self) -> str:
        """How the uprobes are attached, for the user: "uprobe_multi links" or "perf events"."""
        return "uprobe_multi links" if self._use_links else "perf events"

    def _load_uprobe_program(self, name: bytes) -> Any:
        """A program that runs at a uprobe (or is tail-called from one): loaded for the kind of attachment
        used, since a uprobe_multi link takes only programs loaded for it (and a tail call only programs
        loaded like its caller)."""
        bcc = _load_bcc()
        assert self._bpf is not None
        try:
            if self._use_links:
                return self._bpf.load_func(name, bcc.BPF.KPROBE, attach_type=_BPF_TRACE_UPROBE_MULTI)
            return self._bpf.load_func(name, bcc.BPF.KPROBE)
        except Exception as exc:  # bcc raises bare Exception when the verifier refuses a program
            raise EnvironmentProblem(f"the kernel refused the BPF program {name.decode()}: {exc}") from exc

    def _attach(self, point: ProbePoint) -> None:
        kind = point.kind
        self._attach_one(point, self._load_uprobe_program(f"{kind}_enter".encode()), is_return=False)
        if point.needs_return:
            # A return probe at the same emulated instruction: the kernel takes the return address from
            # [rsp], which is still the caller's there (placement keeps %rsp untouched).
            self._attach_one(point, self._load_uprobe_program(b"alloc_return"), is_return=True)

    def _attach_one(self, point: ProbePoint, program: Any, is_return: bool) -> None:
        path = point.path.encode()
        pid = self.settings.target_tgid
        what = "uretprobe" if is_return else "uprobe"
        if self._use_links:
            fd = _link_uprobe(program.fd, path, point.file_offset, is_return, pid)
            if fd < 0:
                raise EnvironmentProblem(
                    f"cannot attach a {what} link to {point.symbol} in {point.path}: {os.strerror(-fd)} "
                    f"({_UPROBE_LINKS_ENV}=0 attaches through perf events instead)"
                )
            self._links.append(fd)
            return
        lib = _load_bcc().libbcc.lib
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
        if out:  # the kernel wakes us when the ring holds half its room again (probes/heap.bpf.c page_exit)
            self._set_control(CTL_PAGES_DRAINED, self._page_ring.taken)
        return out

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
        if self._bpf is None:  # unloaded (or a frozen copy): no schedule to steer
            return
        self._set_control(CTL_SCHED_CULL_AT, cull_at)
        self._set_control(CTL_SCHED_INTERVAL, interval)
        if due is not None:
            self._set_control(CTL_SCHED_DUE_JIFFIES, 0)  # read the clock until the kernel's next point
            self._set_control(CTL_SCHED_DUE, due)

    def start_schedule(self, origin_ns: int, max_snapshots: int, peak_inaccuracy: float) -> None:
        """Time 0 of the snapshots (settings.schedule_ns), --max-snapshots and --peak-inaccuracy (percent); until
        the first set_schedule, the interval is guessed from the first culling on (the first snapshot, taken at
        a tick, makes one)."""
        if self._bpf is None:
            return
        self._set_control(CTL_SCHED_ORIGIN, origin_ns)
        self._set_control(CTL_SCHED_MAX, max_snapshots)
        self._set_control(CTL_SCHED_PEAK_PPM, round(peak_inaccuracy * 10_000))
        self._set_control(CTL_SCHED_CULL_AT, max_snapshots - 1)
        if self.settings.schedule_ns:
            self._set_control(CTL_SCHED_JIFFY_NS, jiffy_ns())

    def page_counters(self) -> PageCounters:
        """The kernel side's counts of page events sent and not sent (settings.pages)."""
        if self._bpf is None or not self.settings.pages:
            return PageCounters()
        values = [_int(v) for v in self._array_prefix("page_counters", PAGE_COUNTER_COUNT)]
        return PageCounters(*values)

    def stack_bytes(self) -> int:
        """--stacks=yes: the bytes of every live thread's stack, from its top to the lowest stack pointer seen
        since the last call; starts a new low-water mark."""
        if self._bpf is None or not self.settings.stacks:
            return 0
        epoch = self._control(CTL_STACK_EPOCH)
        total = 0
        for _, t in self._items("thread_stacks"):
            low = int(t.low) if int(t.epoch) == epoch else int(t.last)
            total += max(0, int(t.top) - low)
        self._set_control(CTL_STACK_EPOCH, epoch + 1)
        return total

    def _globals_raw(self) -> bytes:
        """struct hs_global as bytes: one map lookup, no Python object per field."""
        if not self._globals_size:
            raise HeapscopeError("probes are not loaded")
        lib = _load_bcc().libbcc.lib
        # One buffer per read: a shared one could be filled by one thread while another copies it out.
        buf = ctypes.create_string_buffer(self._globals_size)
        if lib.bpf_lookup_elem(self._globals_fd, ctypes.byref(self._zero_key), buf) != 0:
            # Never the last figures again as if they were now: a failed read is an error, said by the caller.
            raise HeapscopeError("cannot read the probes' counters: the lookup in their map failed")
        return buf.raw

    def mapping_calls(self) -> int | None:
        """A position that moves with every mmap, munmap, mremap and brk the target makes (the page events'
        producer), or None when they are not traced: while it stands still, the target's mappings have not
        changed since it was read. The events lost to a full ring or call table are added: the producer stands
        still while they are lost."""
        if self._page_ring is None:
            return None
        return self._page_ring.produced() + self.page_counters().dropped

    def activity(self) -> bytes:
        """A token that changes whenever the target does something the profile records: the global counters
        (every allocation call moves them) and the page events' producer position. Read with one map lookup
        and no Python objects per field, so that a sleeping target's sampling loop costs next to nothing."""
        raw = self._globals_raw()
        ring = self._page_ring.produced() if self._page_ring is not None else 0
        return raw + ring.to_bytes(8, "little")

    def wait_events(self, timeout: float) -> list[int]:
        """Events (EV_*) that came within `timeout` seconds; returns at the first one."""
        assert self._bpf is not None
        self._bpf.perf_buffer_poll(timeout=max(1, int(timeout * 1000)))
        events, self._events = self._events, []
        return events

    def set_stack_end(self, end: int) -> None:
        """Where the main thread's stack ends for the stack walk (above argc): it reads no further."""
        self._set_control(CTL_STACK_END, end)

    def set_site_flags(self, flags: Mapping[int, bool]) -> None:
        """--ignore-fn: whether each site is ignored (its trimmed stack starts in an ignored function), for the
        kernel's realloc (probes/heap.bpf.c record_realloc). A site is flagged once."""
        if self._bpf is None or not self.settings.ignore:
            return
        table = self._bpf["site_flags"]
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
        assert self._bpf is not None and self._shared_rows is not None
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
        umaps = self._bpf["unwind_maps"]
        half = 1 - self._umap_half
        first = half * MAX_UMAPS
        for i, (m, (row_begin, row_count)) in enumerate(entries):
            leaf = umaps.Leaf(m.start, m.end, m.bias & 0xFFFFFFFFFFFFFFFF, row_begin, row_count)
            umaps[ctypes.c_int(first + i)] = leaf
        gen = (self._umap_gen + 1) % (1 << (64 - UMAPS_GEN_SHIFT))
        if gen % (1 << (63 - UMAPS_GEN_SHIFT)) == 0:
            # The generation wraps: rules the kernel cached under a word that comes again must go first.
            # Twice a cycle, so that a rule a probe stamped with a word just before one clearing is gone
            # at the next, long before its word returns.
            cache = self._bpf["rule_cache"]
            for i in range(RULE_CACHE):
                cache.clearitem(ctypes.c_int(i))
        self._set_control(CTL_UMAPS, (gen << UMAPS_GEN_SHIFT) | (first << 32) | len(entries))
        self._umap_half = half
        self._umap_gen = gen

    def _control(self, index: int) -> int:
        if self._bpf is None:
            return 0
        return int(self._bpf["control"][ctypes.c_int(index)].value)

    def _set_control(self, index: int, value: int) -> None:
        assert self._bpf is not None
        table = self._bpf["control"]
        table[ctypes.c_int(index)] = ctypes.c_uint64(value)

    # ---- reading ----------------------------------------------------------------------------------

    def counters(self) -> Counters:
        if self._bpf is None:
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

    def malt_sites(self) -> dict[int, MaltSiteFields]:
        """MALT's per-stack statistics (settings.malt), by site id."""
        n = self.site_count()
        names = [f.name for f in fields(MaltSiteFields)]
        columns = [self.site_column(name, n) for name in names]
        tot_n, free_count = self.site_column("tot_blocks", n), self.site_column("free_count", n)
        out = {}
        for key in range(n):
            if tot_n[key] == 0 and free_count[key] == 0:
                continue
            out[key] = MaltSiteFields(**{name: column[key] for name, column in zip(names, columns, strict=True)})
        return out

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
        _, raw, count = self._array_prefix_raw("thread_slots", THREAD_SLOTS * FN_COUNT)
        words = array.array("Q")
        words.frombytes(raw)
        for i in range(count):  # struct hs_thread_slot: tid, count, bytes, ns
            tid, n, nbytes, ns = words[4 * i : 4 * i + 4]
            if tid:
                out[(tid, i % FN_COUNT)] = (n, nbytes, ns)
        for k, v in self._items("thread_stats"):  # threads whose slot another thread held
            key = _int(k)
            c, b, t = out.get((key >> 8, key & 0xFF), (0, 0, 0))
            out[(key >> 8, key & 0xFF)] = (c + int(v.count), b + int(v.bytes), t + int(v.ns))
        return out

    def log2_histograms(self) -> tuple[list[int], list[int]]:
        """Cumulative allocations per log2(size), and frees per (log2 size, log2 lifetime) flattened."""
        return (
            [_int(v) for v in self._array_prefix("size_hist", LOG2_BINS)],
            [_int(v) for v in self._array_prefix("life_hist", LOG2_BINS * LOG2_BINS)],
        )

    def take_window(self, heap_now: int) -> tuple[int, int]:
        """The heap's maximum since the last call and the site that set it; starts a new window."""
        assert self._bpf is not None
        table = self._bpf["window"]
        w = table[ctypes.c_int(0)]
        result = (int(w.max_heap), int(w.site))
        w.max_heap, w.site = heap_now, 0
        table[ctypes.c_int(0)] = w
        return result

    def _read_stack(self, key: int) -> tuple[int, ...]:
        if self._bpf is None or not 0 <= key < self.settings.max_stacks:
            return ()
        table = self._bpf["site_stacks"]
        value = table.Leaf()
        lib = _load_bcc().libbcc.lib
        if lib.bpf_lookup_elem(table.map_fd, ctypes.byref(ctypes.c_uint32(key)), ctypes.byref(value)) != 0:
            return ()  # a site without a stored stack (overtaken, or no memory for it): counted by the kernel
        ips = array.array("Q", bytes(value)).tolist()
        return tuple(ips[: ips.index(0)] if 0 in ips else ips)

    def _array_prefix_raw(self, name: str, count: int) -> tuple[type, bytes, int]:
        """Entries 0..count-1 of an array map as raw bytes: (value type, bytes, entries read)."""
        assert self._bpf is not None
        table = self._bpf[name]
        if count <= 0:
            return table.Leaf, b"", 0
        keys = (table.Key * count)()
        values = (table.Leaf * count)()
        n = ctypes.c_uint32(count)
        lib = _load_bcc().libbcc.lib
        if lib.bpf_lookup_batch(table.map_fd, None, ctypes.byref(ctypes.c_uint32()), keys, values, ctypes.byref(n)) in (
            0,
            -2,  # ENOENT: the end of the map came first
        ):
            return table.Leaf, bytes(memoryview(values))[: n.value * ctypes.sizeof(table.Leaf)], n.value
        for i in range(count):
            values[i] = table[table.Key(i)]
        return table.Leaf, bytes(memoryview(values)), count

    def _array_prefix(self, name: str, count: int) -> list:  # type: ignore[type-arg]
        """Entries 0..count-1 of an array map, as ctypes values."""
        leaf, raw, n = self._array_prefix_raw(name, count)
        array_type: Any = cast(Any, leaf) * n  # a ctypes array type
        return list(array_type.from_buffer_copy(raw)) if n else []

    def _items(self, name: str) -> list:  # type: ignore[type-arg]
        assert self._bpf is not None
        table = self._bpf[name]
        try:
            return list(table.items_lookup_batch())
        except Exception:  # kernels without batch lookups: one syscall per entry
            return list(table.items())
