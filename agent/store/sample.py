"""What goes into the store and what comes back out: plain model objects."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from agent.model.stack import SiteCounts, Stack


@dataclass(frozen=True)
class PeakState:
    """The exact peak so far (heap + extra + stacks): when it was and its totals. Its tree is the sites'
    peak_bytes (and peak_extra) in the same snapshot."""

    time: int  # in the profile's time unit
    heap_B: int
    extra_B: int
    stacks_B: int = 0
    wall_ns: int | None = None  # wall clock of the peak, when known

    @property
    def total_B(self) -> int:
        return self.heap_B + self.extra_B + self.stacks_B


@dataclass
class StoreSample:
    """One sample of a target, as the session takes it.

    `sites` maps a site id (the kernel's stack key) to its counters now; a site left out keeps the counters it
    had in the previous sample. Every site id must have had its stack given in `new_stacks` (raw, symbolized,
    innermost frame first; trimming is left to the reader) in this sample or an earlier one.
    """

    wall_ns: int  # time.time_ns() when the sample was taken
    time: int  # the profile's time (ms since start, or bytes with --time-unit=B)
    heap_B: int
    extra_B: int
    stacks_B: int
    sites: Mapping[int, SiteCounts]
    new_stacks: Mapping[int, Stack] = field(default_factory=dict)
    mapped_B: int | None = None  # total mapped bytes (page map), when traced
    rss_B: int | None = None
    peak: PeakState | None = None
    rate: int | None = None  # sampled mode: the rate in force (bytes between samples) at this sample


@dataclass(frozen=True)
class StoreMeta:
    """A target's description, written at the start of every segment."""

    pid: int
    cmd: str
    time_unit: str = "ms"
    desc: tuple[str, ...] = ()  # the profiler's arguments, as massif.out's desc: line shows them
    root_label: str = "(heap allocation functions) malloc/new/new[], --alloc-fns, etc."
    options: Mapping[str, object] = field(default_factory=dict)  # MassifOptions as a dict (alloc_fns, depth...)
    start_wall_ns: int = 0  # when the profile started

    def to_json(self) -> dict[str, object]:
        return {
            "pid": self.pid,
            "cmd": self.cmd,
            "time_unit": self.time_unit,
            "desc": list(self.desc),
            "root_label": self.root_label,
            "options": dict(self.options),
            "start_wall_ns": self.start_wall_ns,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, object]) -> StoreMeta:
        desc = obj.get("desc", [])
        options = obj.get("options", {})
        return cls(
            pid=int(obj.get("pid", 0)),  # type: ignore[call-overload]
            cmd=str(obj.get("cmd", "")),
            time_unit=str(obj.get("time_unit", "ms")),
            desc=tuple(str(d) for d in desc) if isinstance(desc, list) else (),
            root_label=str(obj.get("root_label", StoreMeta.root_label)),
            options=dict(options) if isinstance(options, dict) else {},
            start_wall_ns=int(obj.get("start_wall_ns", 0)),  # type: ignore[call-overload]
        )
