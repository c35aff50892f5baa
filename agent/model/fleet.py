"""The daemon's fleet as plain values: where each target came from, the limits on what the daemon holds, and what
the fleet has seen and refused (for /targets, /selectors and /metrics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from agent.model.cgroup import CgroupPlacement

RefusalReason = Literal["targets", "sites", "memory"]
REFUSAL_REASONS: tuple[RefusalReason, ...] = ("targets", "sites", "memory")
# Why an ended target left /targets: --keep-exited's time, --max-exited's count, or room made at a limit.
FORGET_REASONS: tuple[str, ...] = ("age", "count", "room")
EndReason = Literal["", "exited", "exec", "detached"]


@dataclass(frozen=True)
class TargetOrigin:
    """Who a target is and why it is profiled. (pid, start_time) is its identity: it stays the same across the
    daemon's restarts and tells a process from a later one that got the same PID."""

    start_time: int = 0  # clock ticks after boot (/proc/PID/stat field 22); 0 when unknown
    placement: CgroupPlacement = field(default_factory=CgroupPlacement)
    selector: int | None = None  # the selector that chose it; None for a PID given by the user
    parent: int | None = None  # the profiled parent it was followed from (a fork), if any
    end_reason: EndReason = ""  # why its profile ended: it exited, it exec'ed another program, or was detached
    expires_at: float | None = None  # Unix time it leaves /targets (--keep-exited), once its profile ended


@dataclass(frozen=True)
class Refusal:
    reason: RefusalReason
    message: str


@dataclass(frozen=True)
class Limits:
    """What the daemon may hold at once. None: no limit."""

    max_targets: int | None = None  # processes profiled at once (exited ones kept for reading do not count)
    max_sites: int | None = None  # allocation sites held by all targets, exited ones included
    max_memory: int | None = None  # the daemon's resident memory, bytes

    def refusal(self, targets: int, sites: int, rss: int) -> Refusal | None:
        """Why one more target cannot be taken now, given what is held; None when it can."""
        if self.max_targets is not None and targets >= self.max_targets:
            return Refusal("targets", f"the daemon profiles {targets} processes, its limit (--max-targets)")
        if self.max_sites is not None and sites >= self.max_sites:
            return Refusal(
                "sites", f"the targets hold {sites} allocation sites, at or above the limit of {self.max_sites} "
                "(--max-sites)"
            )
        if self.max_memory is not None and rss >= self.max_memory:
            return Refusal(
                "memory", f"the daemon uses {rss >> 20} MiB, at or above its limit of {self.max_memory >> 20} MiB "
                "(--max-memory)"
            )
        return None


@dataclass(frozen=True)
class SelectorStatus:
    id: int
    comm: str | None
    cmdline: str | None
    cgroup: str | None
    follow_children: bool
    origin: str
    matched: int  # processes it chose since it was added
    targets: tuple[int, ...]  # PIDs profiled now because of it


@dataclass(frozen=True)
class FleetStatus:
    selectors: tuple[SelectorStatus, ...] = ()
    limits: Limits = field(default_factory=Limits)
    refused: dict[str, int] = field(default_factory=dict)  # RefusalReason -> count since start
    attach_failures: int = 0  # selected processes that could not be attached (gone, no allocator found, ...)
    events: int = 0  # exec/fork/exit events received from the kernel
    events_lost: int = 0  # events the kernel could not deliver (each loss triggers a /proc scan)
    scans: int = 0  # /proc scans (at start, after a loss, and periodically)
    event_source: str = "none"  # "tracepoints", "/proc scans" (no BPF), or "none" (no selector yet)
    profiling: int = 0  # targets profiled now
    waiting: int = 0  # processes waiting for a safe point (sampled mode), tried again
    sites: int = 0  # allocation sites held by all targets
    rss: int = 0  # the daemon's resident memory, bytes
    expired_segments: int = 0  # history segments of processes no longer profiled, deleted at --store-max-age
    expired_histories: int = 0  # such processes' directories, deleted once empty
    expired_outputs: int = 0  # output files of processes no longer profiled, deleted at --output-max-age
    forgotten: dict[str, int] = field(default_factory=dict)  # FORGET_REASONS -> ended targets forgotten since start
    total_samples: int = 0  # samples a second all sampled targets may take together (--total-samples; 0: none)
    sample_demand: float = 0.0  # what they would take at their asked rates, samples a second, as last estimated
    sample_share: int = 0  # the most each may take while their demand exceeds the total (0: nobody held back)
    log_lines_lost: int = 0  # lines of the daemon's log that could not be written (a closed pipe, a full disk)
