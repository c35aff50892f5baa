"""pprof heap profiles: gzipped profile.proto, as `go tool pprof`, Pyroscope and Parca read them.

The profile is shaped like Go's own heap profile (runtime/pprof's writeHeapProto), so every pprof consumer reads
it as a heap profile:
- four sample types, in Go's order: alloc_objects/count, alloc_space/bytes, inuse_objects/count, inuse_space/bytes;
  the default is inuse_space;
- period_type space/bytes, and `period` the sampling rate in bytes (1: every allocation was seen);
- one sample per stack, with a `bytes` label holding the stack's mean block size, as Go writes it;
- the leaf location first; inlined calls are several lines of one location, innermost first;
- mapping[0] is the main executable; mappings carry GNU build ids, so a consumer can find the binaries again.

The message classes are built at first use (protobuf is imported then: the commands that write no pprof start
without it), from this module's own declaration of the fields it writes
(field numbers as pprof's proto/profile.proto defines them): no copy of that file and no code generated from it.
protobuf encodes; nothing here reads the target or the disk. Pure: model objects in, bytes out.
"""

from __future__ import annotations

import functools
import gzip
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agent.model.maps import Mapping as MemoryMapping
from agent.model.stack import Frame, SiteCounts, Stack, ip_groups

SAMPLE_TYPES: tuple[tuple[str, str], ...] = (
    ("alloc_objects", "count"),
    ("alloc_space", "bytes"),
    ("inuse_objects", "count"),
    ("inuse_space", "bytes"),
)
DEFAULT_SAMPLE_TYPE = "inuse_space"
PERIOD_TYPE = ("space", "bytes")

# ---- the message classes ----------------------------------------------------------------------------------

_PACKAGE = "perftools.profiles"

# (message, [(field, number, type, repeated, message type)]). Only the fields heapscope writes.
_MESSAGES: tuple[tuple[str, tuple[tuple[str, int, str, bool, str], ...]], ...] = (
    (
        "Profile",
        (
            ("sample_type", 1, "TYPE_MESSAGE", True, "ValueType"),
            ("sample", 2, "TYPE_MESSAGE", True, "Sample"),
            ("mapping", 3, "TYPE_MESSAGE", True, "Mapping"),
            ("location", 4, "TYPE_MESSAGE", True, "Location"),
            ("function", 5, "TYPE_MESSAGE", True, "Function"),
            ("string_table", 6, "TYPE_STRING", True, ""),
            ("time_nanos", 9, "TYPE_INT64", False, ""),
            ("duration_nanos", 10, "TYPE_INT64", False, ""),
            ("period_type", 11, "TYPE_MESSAGE", False, "ValueType"),
            ("period", 12, "TYPE_INT64", False, ""),
            ("comment", 13, "TYPE_INT64", True, ""),
            ("default_sample_type", 14, "TYPE_INT64", False, ""),
        ),
    ),
    ("ValueType", (("type", 1, "TYPE_INT64", False, ""), ("unit", 2, "TYPE_INT64", False, ""))),
    (
        "Sample",
        (
            ("location_id", 1, "TYPE_UINT64", True, ""),
            ("value", 2, "TYPE_INT64", True, ""),
            ("label", 3, "TYPE_MESSAGE", True, "Label"),
        ),
    ),
    (
        "Label",
        (
            ("key", 1, "TYPE_INT64", False, ""),
            ("str", 2, "TYPE_INT64", False, ""),
            ("num", 3, "TYPE_INT64", False, ""),
            ("num_unit", 4, "TYPE_INT64", False, ""),
        ),
    ),
    (
        "Mapping",
        (
            ("id", 1, "TYPE_UINT64", False, ""),
            ("memory_start", 2, "TYPE_UINT64", False, ""),
            ("memory_limit", 3, "TYPE_UINT64", False, ""),
            ("file_offset", 4, "TYPE_UINT64", False, ""),
            ("filename", 5, "TYPE_INT64", False, ""),
            ("build_id", 6, "TYPE_INT64", False, ""),
            ("has_functions", 7, "TYPE_BOOL", False, ""),
            ("has_filenames", 8, "TYPE_BOOL", False, ""),
            ("has_line_numbers", 9, "TYPE_BOOL", False, ""),
            ("has_inline_frames", 10, "TYPE_BOOL", False, ""),
        ),
    ),
    (
        "Location",
        (
            ("id", 1, "TYPE_UINT64", False, ""),
            ("mapping_id", 2, "TYPE_UINT64", False, ""),
            ("address", 3, "TYPE_UINT64", False, ""),
            ("line", 4, "TYPE_MESSAGE", True, "Line"),
        ),
    ),
    ("Line", (("function_id", 1, "TYPE_UINT64", False, ""), ("line", 2, "TYPE_INT64", False, ""))),
    (
        "Function",
        (
            ("id", 1, "TYPE_UINT64", False, ""),
            ("name", 2, "TYPE_INT64", False, ""),
            ("system_name", 3, "TYPE_INT64", False, ""),
            ("filename", 4, "TYPE_INT64", False, ""),
            ("start_line", 5, "TYPE_INT64", False, ""),
        ),
    ),
)


@functools.cache
def _message_classes() -> dict[str, Any]:
    """Message classes for the declaration above, in a pool of their own (proto3: repeated numbers are packed,
    as Go writes them)."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    t = descriptor_pb2.FieldDescriptorProto
    file = descriptor_pb2.FileDescriptorProto(name="heapscope/pprof_profile.proto", package=_PACKAGE, syntax="proto3")
    for name, fields in _MESSAGES:
        msg = file.message_type.add(name=name)
        for field_name, number, ftype, repeated, type_name in fields:
            f = msg.field.add(
                name=field_name,
                number=number,
                type=getattr(t, ftype),
                label=t.LABEL_REPEATED if repeated else t.LABEL_OPTIONAL,
            )
            if type_name:
                f.type_name = f".{_PACKAGE}.{type_name}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{_PACKAGE}.{name}")) for name, _ in _MESSAGES
    }



# ---- scaling --------------------------------------------------------------------------------------------


def scale_heap_sample(count: int, size: int, rate: int) -> tuple[int, int]:
    """Estimate the unsampled blocks and bytes of `count` samples of `size` bytes in all, taken by a Poisson
    process with a mean of `rate` bytes between samples: a block of s bytes is sampled with probability
    1 - exp(-s/rate), so each sample stands for 1 / (1 - exp(-s/rate)) blocks (Go's scaleHeapSample, with the
    mean size of the samples as s). A rate of 1 or less means every allocation was seen."""
    if count <= 0 or size <= 0:
        return 0, 0
    if rate <= 1:
        return count, size
    scale = 1 / (1 - math.exp(-(size / count) / rate))
    return int(count * scale), int(size * scale)


# ---- the profile ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PprofContext:
    """What a profile needs besides its stacks and counters (render_pprof's keyword arguments)."""

    mappings: Sequence[MemoryMapping] = ()
    build_ids: Mapping[str, str] = field(default_factory=dict)
    main_path: str | None = None
    sample_rate: int = 1
    prescaled: bool = False
    time_ns: int = 0
    duration_ns: int = 0
    comments: Sequence[str] = ()


class _Strings:
    def __init__(self) -> None:
        self.table: list[str] = [""]
        self._index: dict[str, int] = {"": 0}

    def __call__(self, text: str) -> int:
        i = self._index.get(text)
        if i is None:
            i = self._index[text] = len(self.table)
            self.table.append(text)
        return i


def _values(counts: SiteCounts, rate: int, prescaled: bool) -> list[int]:
    """alloc_objects, alloc_space, inuse_objects, inuse_space (negative counters from racy reads count as 0)."""
    tot_blocks, tot_bytes = max(counts.tot_blocks, 0), max(counts.tot_bytes, 0)
    cur_blocks, cur_bytes = max(counts.cur_blocks, 0), max(counts.cur_bytes, 0)
    if prescaled or rate <= 1:
        return [tot_blocks, tot_bytes, cur_blocks, cur_bytes]
    return [*scale_heap_sample(tot_blocks, tot_bytes, rate), *scale_heap_sample(cur_blocks, cur_bytes, rate)]


def _pick_mappings(mappings: Iterable[MemoryMapping], main_path: str | None) -> list[MemoryMapping]:
    """The executable mappings, once each, main executable first, then by address. Recorded mappings may
    overlap (a library unloaded and another loaded in its place): both stay, and a location goes to the mapping
    of the object its frames were symbolized in."""
    seen: set[tuple[int, int, int, str]] = set()
    chosen: list[MemoryMapping] = []
    for m in mappings:
        key = (m.start, m.end, m.offset, m.path)
        if "x" not in m.perms or key in seen:
            continue
        seen.add(key)
        chosen.append(m)
    if main_path is None and chosen:
        main_path = min(chosen, key=lambda m: m.start).path
    return sorted(chosen, key=lambda m: (m.path != main_path, m.start))


def render_pprof(
    sites: Mapping[Stack, SiteCounts],
    mappings: Sequence[MemoryMapping] = (),
    *,
    build_ids: Mapping[str, str] | None = None,
    main_path: str | None = None,
    sample_rate: int = 1,
    prescaled: bool = False,
    time_ns: int = 0,
    duration_ns: int = 0,
    comments: Sequence[str] = (),
    default_sample_type: str = DEFAULT_SAMPLE_TYPE,
) -> bytes:
    """The gzipped profile.proto of `sites` (stack -> counters, innermost frame first).

    - `mappings`: the target's recorded mappings (its executable ones become the profile's); `build_ids` maps
      an object's path to its GNU build id where the mapping itself has none recorded. `main_path` is the
      executable (default: the object mapped lowest, which it is for a normal process).
    - `sample_rate`: the mean bytes between samples of a sampled profile; 1 for an exact one. A sampled profile's
      counters are scaled to estimates with Go's formula, unless `prescaled` (the counters already hold each
      sample's weight). Either way `period` is the rate.
    - `time_ns`: when the profile was taken (Unix time, ns); `duration_ns`: how long it covers.
    """
    if sample_rate < 1:
        raise ValueError(f"sample_rate must be at least 1, got {sample_rate}")
    if default_sample_type not in {name for name, _ in SAMPLE_TYPES}:
        raise ValueError(f"unknown sample type {default_sample_type!r}")
    c = _message_classes()
    strings = _Strings()
    prof = c["Profile"]()
    for name, unit in SAMPLE_TYPES:
        prof.sample_type.append(c["ValueType"](type=strings(name), unit=strings(unit)))
    prof.period_type.type, prof.period_type.unit = strings(PERIOD_TYPE[0]), strings(PERIOD_TYPE[1])
    prof.period = sample_rate
    prof.default_sample_type = strings(default_sample_type)
    prof.time_nanos = time_ns
    prof.duration_nanos = duration_ns
    for text in comments:
        prof.comment.append(strings(text))

    chosen = _pick_mappings(mappings, main_path)
    mapping_msgs = []
    for i, m in enumerate(chosen, start=1):
        build_id = m.build_id or (build_ids or {}).get(m.path) or ""
        mapping_msgs.append(
            c["Mapping"](
                id=i,
                memory_start=m.start,
                memory_limit=m.end,
                file_offset=m.offset,
                filename=strings(m.name),  # as the process names it (a container's, inside it)
                build_id=strings(build_id),
            )
        )
    # Per mapping: whether every location in it has function names, file names, lines (pprof then trusts them
    # and does not symbolize again).
    resolution: dict[int, list[bool]] = {}

    def mapping_of(ip: Stack) -> int:
        """The mapping holding the address; of the frame's object when the symbolizer named it (a range may
        have held another object before)."""
        address, obj = ip[0].address, ip[-1].obj
        for i, m in enumerate(chosen, start=1):
            if m.start <= address < m.end and (obj is None or m.name == obj):
                return i
        return 0

    functions: dict[tuple[str, str], int] = {}
    # A location per instruction pointer: its address, object and frames' names and lines (plain values hash
    # several times faster than the frames themselves, which matters at 10,000 stacks of 20 frames).
    locations: dict[tuple[object, ...], int] = {}

    def function_id(frame: Frame) -> int:
        name = frame.function or "???"
        filename = frame.path or frame.file or ""
        key = (name, filename)
        fid = functions.get(key)
        if fid is None:
            fid = functions[key] = len(functions) + 1
            prof.function.append(
                c["Function"](id=fid, name=strings(name), system_name=strings(name), filename=strings(filename))
            )
        return fid

    def new_location(ip: Stack, key: tuple[object, ...]) -> int:
        lid = locations[key] = len(locations) + 1
        mid = mapping_of(ip)
        loc = c["Location"](id=lid, mapping_id=mid, address=ip[0].address)
        for frame in ip:  # innermost inlined call first, the real function last: pprof's order
            if frame.function is None and not frame.line:
                continue
            loc.line.append(c["Line"](function_id=function_id(frame), line=frame.line or 0))
        if mid:
            known = resolution.setdefault(mid, [True, True, True])
            known[0] &= bool(loc.line) and all(f.function is not None for f in ip)
            known[1] &= all(bool(f.file) for f in ip)
            known[2] &= all(bool(f.line) for f in ip)
        prof.location.append(loc)
        return lid

    def location_ids(stack: Stack) -> list[int]:
        """The stack's locations, leaf first: one per instruction pointer, its inlined calls with it (ip_groups;
        a recursion from one line is one location per call)."""
        ids = []
        for ip in ip_groups(stack):
            f = ip[0]
            if len(ip) == 1:
                key: tuple[object, ...] = (f.address, f.obj, f.function, f.line, f.path or f.file)
            else:
                key = (f.address, f.obj, *((g.function, g.line, g.path or g.file) for g in ip))
            lid = locations.get(key)
            ids.append(lid if lid is not None else new_location(ip, key))
        return ids

    bytes_key = strings("bytes")
    for stack, counts in sites.items():
        values = _values(counts, sample_rate, prescaled)
        if not any(values):
            continue
        sample = prof.sample.add()
        sample.location_id.extend(location_ids(stack))
        sample.value.extend(values)  # a stack with no frame (none is expected) stays, with no location
        if counts.tot_blocks > 0 and counts.tot_bytes > 0:
            sample.label.append(
                c["Label"](key=bytes_key, num=counts.tot_bytes // counts.tot_blocks, num_unit=bytes_key)
            )

    for mid, msg in enumerate(mapping_msgs, start=1):
        funcs, files, lines = resolution.get(mid, [False, False, False])
        msg.has_functions, msg.has_filenames, msg.has_line_numbers = funcs, files, lines
        msg.has_inline_frames = funcs  # the symbolizer resolves inlined calls wherever it names functions
    prof.mapping.extend(mapping_msgs)
    prof.string_table.extend(strings.table)
    # The fastest compression, as Go writes its profiles (10,000 stacks: 4% larger than at level 9).
    return gzip.compress(prof.SerializeToString(), compresslevel=1, mtime=0)


def parse_pprof(data: bytes) -> Any:
    """A profile written by render_pprof (gzipped or not) as a message, for tests and tools."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    prof = _message_classes()["Profile"]()
    prof.ParseFromString(data)
    return prof
