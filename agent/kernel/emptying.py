"""A detached target's maps made empty again for the next target of its slot, as if just created: a target's
twenty maps (10 MiB of kernel memory, most of it the sites array and two rings) cost the daemon more to create,
put in the arrays of maps and free at every attach than to empty, and a fleet's churn attaches all the time.

Each kind as the kernel allows: a hash map's entries deleted in batches; an mmapable array zeroed in place
through a mapping (only the rows in use, where the caller knows them); a per-CPU array overwritten with zeros in
one batch; a ring buffer's unread records skipped (consumer position set to the producer's); a perf event array
is emptied by its readers' close already."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import threading

from agent.errors import EnvironmentProblem
from agent.kernel.arrays import mapping_length
from agent.kernel.links import bpf_syscall

_BPF_MAP_LOOKUP_AND_DELETE_BATCH = 25
_BPF_MAP_UPDATE_BATCH = 26
_BPF_OBJ_GET_INFO_BY_FD = 15
# enum bpf_map_type (include/uapi/linux/bpf.h)
MAP_HASH = 1
MAP_ARRAY = 2
MAP_PERF_EVENT_ARRAY = 4
MAP_PERCPU_ARRAY = 6
MAP_RINGBUF = 27
BPF_F_MMAPABLE = 1 << 10
_BATCH_BYTES = 1 << 18  # room for the keys and values of one batch


class MapInfo(ctypes.Structure):
    """The head of struct bpf_map_info (include/uapi/linux/bpf.h): what a copy of a map, or its emptying, needs."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
    ]


class _InfoAttr(ctypes.Structure):
    _fields_ = [("bpf_fd", ctypes.c_uint32), ("info_len", ctypes.c_uint32), ("info", ctypes.c_uint64)]


class _BatchAttr(ctypes.Structure):
    """union bpf_attr as the BPF_MAP_*_BATCH commands read it."""

    _fields_ = [
        ("in_batch", ctypes.c_uint64),
        ("out_batch", ctypes.c_uint64),
        ("keys", ctypes.c_uint64),
        ("values", ctypes.c_uint64),
        ("count", ctypes.c_uint32),
        ("map_fd", ctypes.c_uint32),
        ("elem_flags", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


def map_info(fd: int) -> MapInfo:
    info = MapInfo()
    got = bpf_syscall(_BPF_OBJ_GET_INFO_BY_FD, _InfoAttr(fd, ctypes.sizeof(info), ctypes.addressof(info)))
    if got < 0:
        raise EnvironmentProblem(f"cannot read a BPF map's description: {os.strerror(-got)}")
    return info


def _possible_cpus() -> int:
    """The CPUs a per-CPU map holds a value for (the kernel's num_possible_cpus)."""
    with open("/sys/devices/system/cpu/possible") as f:
        return max(int(part.split("-")[-1]) for part in f.read().strip().split(",")) + 1


def _empty_hash(fd: int, info: MapInfo) -> None:
    """Delete every entry, a batch per call (a call per entry for a target's thousands of stacks would cost more
    than a new map)."""
    per = max(1, min(info.max_entries, _BATCH_BYTES // max(info.key_size + info.value_size, 1)))
    keys = _scratch(per * (info.key_size + info.value_size))
    values = ctypes.addressof(keys) + per * info.key_size
    token = ctypes.c_uint64(0)  # where the next batch starts (a bucket index for a hash map)
    start = 0
    while True:
        attr = _BatchAttr(start, ctypes.addressof(token), ctypes.addressof(keys), values, per, fd)
        got = bpf_syscall(_BPF_MAP_LOOKUP_AND_DELETE_BATCH, attr)
        if got == -errno.ENOENT:  # the last batch (its entries deleted too)
            return
        if got < 0:
            raise EnvironmentProblem(f"cannot empty the map {info.name.decode()}: {os.strerror(-got)}")
        start = ctypes.addressof(token)


_scratches = threading.local()


def _scratch(size: int) -> ctypes.Array[ctypes.c_char]:
    """A buffer of at least `size` bytes for the deleted entries, kept by the thread: one of 256 KiB made for each
    map of each slot taken (a fleet's every new process) cost its page faults every time. What the kernel writes
    there is never read."""
    buf: ctypes.Array[ctypes.c_char] | None = getattr(_scratches, "buf", None)
    if buf is None or len(buf) < size:
        buf = _scratches.buf = ctypes.create_string_buffer(max(size, _BATCH_BYTES))
    return buf


def _zero_mapped(fd: int, info: MapInfo, rows: int) -> None:
    """Zero the first `rows` values of an mmapable array through a mapping of them (values are laid out from offset
    0, each rounded up to 8 bytes)."""
    size = rows * ((info.value_size + 7) & ~7)
    if not size:
        return
    with mmap.mmap(fd, mapping_length(size), flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE) as mem:
        values = (ctypes.c_char * size).from_buffer(mem)
        ctypes.memset(values, 0, size)
        del values  # the mapping closes only once nothing points into it


def _zero_by_batch(fd: int, info: MapInfo, rows: int, cpus: int) -> None:
    """Overwrite the first `rows` values of an array (per-CPU: each CPU's) with zeros, in one call."""
    value_bytes = ((info.value_size + 7) & ~7) * cpus if info.type == MAP_PERCPU_ARRAY else info.value_size
    keys = (ctypes.c_uint32 * rows)(*range(rows))
    values = ctypes.create_string_buffer(rows * value_bytes)
    attr = _BatchAttr(0, 0, ctypes.addressof(keys), ctypes.addressof(values), rows, fd)
    got = bpf_syscall(_BPF_MAP_UPDATE_BATCH, attr)
    if got < 0 or attr.count != rows:
        reason = os.strerror(-got) if got < 0 else f"{attr.count} of {rows} written"
        raise EnvironmentProblem(f"cannot zero the map {info.name.decode()}: {reason}")


def _skip_unread(fd: int, info: MapInfo) -> None:
    """A ring buffer's records not read yet are dropped: its consumer position moved to the producer's. Only
    while nothing produces into it (the slot has no target)."""
    page = mmap.PAGESIZE
    with (
        mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE, offset=0) as consumer,
        mmap.mmap(fd, page, mmap.MAP_SHARED, mmap.PROT_READ, offset=page) as producer,
    ):
        cons, prod = memoryview(consumer).cast("Q"), memoryview(producer).cast("Q")
        cons[0] = prod[0]  # one aligned 8-byte store (see agent.kernel.rings)
        cons.release()
        prod.release()


def empty_map(fd: int, info: MapInfo, rows: int | None = None) -> None:
    """Make the map at fd as empty as a new one; for an array, `rows` limits the zeroing to its first rows (those a
    target can have written; None: all). Raises EnvironmentProblem when the kernel refuses."""
    count = info.max_entries if rows is None else max(0, min(rows, info.max_entries))
    if info.type == MAP_HASH:
        _empty_hash(fd, info)
    elif info.type == MAP_ARRAY and info.map_flags & BPF_F_MMAPABLE:
        _zero_mapped(fd, info, count)
    elif info.type in (MAP_ARRAY, MAP_PERCPU_ARRAY):
        if count:
            _zero_by_batch(fd, info, count, _possible_cpus() if info.type == MAP_PERCPU_ARRAY else 1)
    elif info.type == MAP_RINGBUF:
        _skip_unread(fd, info)
    elif info.type != MAP_PERF_EVENT_ARRAY:
        raise EnvironmentProblem(f"cannot empty the map {info.name.decode()}: map type {info.type}")
