"""The ABI shared with probes/heap.bpf.c: its control words, events and enums, the sizes of its tables and ring
buffers, and the layouts of the records it sends; what probes/heap.h declares is read from it (agent.contract)."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from agent.contract import HEAP_H

# Every value shared with heap.bpf.c comes from probes/heap.h (agent.contract).
_CONTROL = HEAP_H.enum("hs_control")
CTL_COUNT = _CONTROL["HS_CTL_COUNT"]  # control words a target (its slot's run of the control map)
CTL_ARMED = _CONTROL["HS_CTL_ARMED"]
CTL_STOPPED = _CONTROL["HS_CTL_STOPPED"]
CTL_UMAPS = _CONTROL["HS_CTL_UMAPS"]
CTL_STACK_EPOCH = _CONTROL["HS_CTL_STACK_EPOCH"]
CTL_STACK_END = _CONTROL["HS_CTL_STACK_END"]
CTL_PAGES_DRAINED = _CONTROL["HS_CTL_PAGES_DRAINED"]
CTL_SNAP_DRAINED = _CONTROL["HS_CTL_SNAP_DRAINED"]
CTL_MAPPED_NOW = _CONTROL["HS_CTL_MAPPED_NOW"]  # sampled mode: the mapped bytes as the last page call left them
CTL_MAPPED_HIGH = _CONTROL["HS_CTL_MAPPED_HIGH"]  # sampled mode: the most since user space zeroed it
# Events, and why a `run` target is stopped (enum hs_event).
_EVENTS = HEAP_H.enum("hs_event")
EV_EXEC = _EVENTS["HS_EV_EXEC"]
EV_LOADER = _EVENTS["HS_EV_LOADER"]
EV_EXIT = _EVENTS["HS_EV_EXIT"]
EV_PAGES = _EVENTS["HS_EV_PAGES"]  # the page events' ring is a quarter full
EV_SNAP_LOG = _EVENTS["HS_EV_SNAP_LOG"]  # the snapshot log's ring is half full
EV_SITES = _EVENTS["HS_EV_SITES"]  # --ignore-fn: a realloc waits for its sites' flags
SITE_COUNTED = HEAP_H.enum("hs_site_flag")["HS_SITE_COUNTED"]
SITE_IGNORED = HEAP_H.enum("hs_site_flag")["HS_SITE_IGNORED"]
MAX_UMAPS = HEAP_H.value("HS_MAX_UMAPS")
# control[CTL_UMAPS] = identity << UMAPS_ID_SHIFT | half << UMAPS_HALF_SHIFT | count (umaps_word)
UMAPS_HALF_SHIFT = HEAP_H.value("HS_UMAPS_HALF_SHIFT")
UMAPS_ID_SHIFT = HEAP_H.value("HS_UMAPS_ID_SHIFT")
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
SCHED_POINT = struct.Struct("<5Q")  # struct hs_sched_point: time, heap, extra, kind, epoch
SCHED_RING_BYTES = 64 << 10  # the points' ring buffer (HS_SCHED_RING_PAGES): 1,365 points between two drains
# Sampled mode's wake-up: that many points past a cull at most, and no more than HS_SCHED_WAKE_PENDING with them
SCHED_SAMPLED_SLACK = HEAP_H.value("HS_SCHED_SAMPLED_SLACK")
SCHED_WAKE_PENDING = HEAP_H.value("HS_SCHED_WAKE_PENDING")
SNAP_RECORD = struct.Struct("<2Q2qQ")  # struct hs_snap_record: site, epoch, bytes, extra, allocs
# The snapshot log's ring buffer (HS_SNAP_RING_PAGES): 21,000 records, a site's first change after each point;
# the kernel wakes user space at half full. Sampled mode changes sites at its samples only (~2 a MiB allocated at
# the default rate): 1,300 records, as its daemon holds one ring per target.
SNAP_RING_BYTES = 1 << 20
SAMPLED_SNAP_RING_BYTES = 64 << 10


# struct hs_page_event (probes/heap.h): time_ns, site, addr, length, new_addr, new_length, flags, prot, ret,
# tid, kind.
PAGE_EVENT = struct.Struct("<8Qq2I")
PAGE_RING_BYTES = 4 << 20  # the page events' ring buffer (passed to probes/heap.h as HS_PAGE_RING_PAGES)
DAEMON_PAGE_RING_BYTES = 1 << 20  # the same for a daemon's exact-mode targets (never stopped: woken from 1/4 full)
SAMPLED_PAGE_RING_BYTES = 512 << 10  # the same in sampled mode: ~6,000 events, woken from a quarter full
PENDING_SLOTS = HEAP_H.value("HS_PENDING_SLOTS")  # per-thread call slots of exact mode's entry and return probes
MAX_SIZES = HEAP_H.value("HS_MAX_SIZES")  # MALT's request sizes and realloc jumps
SAMPLED_MAX_SIZES = 16384  # sampled mode: MALT's request sizes of 4 KiB and more (smaller ones have an array)
MAX_THREADS = HEAP_H.value("HS_MAX_THREADS")


def umaps_word(mappings: Sequence[tuple[int, int, int, str]], half: int) -> int:
    """control[CTL_UMAPS] for the published mappings (start, end, bias, object key), in the order published, in
    `half` of the target's run. The kernel caches the rules it finds under the set's identity, a hash of the
    mappings: two targets with the same objects at the same places (a prefork server's workers) share them, and a
    rule found in one set is never taken for another (a slot's next target, a library mapped again elsewhere)."""
    identity = 0
    if mappings:
        digest = hashlib.blake2b(repr(tuple(mappings)).encode(), digest_size=8).digest()
        identity = (int.from_bytes(digest, "little") >> UMAPS_ID_SHIFT) or 1  # 0: no mappings
    return identity << UMAPS_ID_SHIFT | half << UMAPS_HALF_SHIFT | len(mappings)
