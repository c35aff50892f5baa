"""What the API needs from the daemon (agent.daemon.manager.TargetManager and Target implement it). The API depends
on these ports and on the model, never on the daemon's internals; unit tests give it a fake that implements the
same protocol."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from agent.model.counters import Counters
from agent.model.fleet import FleetStatus, SelectorStatus, TargetOrigin
from agent.model.growth import GrowthReport
from agent.model.memline import MemoryPoint
from agent.model.pages import PageTotals
from agent.model.sampling import ProfileMode
from agent.model.snapshot import Snapshot
from agent.model.stack import SiteCounts, Stack
from agent.model.stored import StoredDiff, StoredSeries, StoreStatus
from agent.model.target import MonitorResult, ProfileHeader, SiteTotal, TargetStatus


class TargetPort(Protocol):
    pid: int
    command: str
    allocator: str
    origin: TargetOrigin
    mode: str  # exact, or sampled (estimates)
    sample_rate: int  # 1 in exact mode

    @property
    def state(self) -> str: ...

    def header(self) -> ProfileHeader: ...

    def status(self) -> TargetStatus: ...

    def counters(self) -> Counters: ...

    def rate_in_force(self) -> tuple[int, int] | None:
        """Sampled mode: the rate the sampler samples at now and the budget's moves of it; None in exact mode."""
        ...

    def sample_budget(self) -> int | None:
        """Sampled mode: the samples a second the sampler may take now (0: no budget); None in exact mode."""
        ...

    def snapshot(self, detailed: bool) -> Snapshot: ...

    def snapshots(self) -> list[Snapshot]: ...

    def xtree_sites(self) -> dict[Stack, SiteCounts]: ...

    def top_sites(self, n: int) -> tuple[list[SiteTotal], SiteTotal]: ...

    def page_totals(self) -> PageTotals | None: ...

    def render(self, name: str, variant: str | None = None) -> str | bytes:
        """The output format `name` of agent.export.registry, rendered now."""
        ...

    def memory_line(self) -> Sequence[MemoryPoint]: ...

    # The stored history (times as the command line takes them: ISO 8601, 09:00, now, -30m). A bad time is a
    # UsageError, a moment or range the store does not hold NotInHistory, a target without a store
    # TargetConflict.

    def stored_snapshot(self, at: str, detailed: bool) -> Snapshot:
        """The last stored snapshot at or before `at`."""
        ...

    def stored_snapshots(self, start: str | None, end: str | None) -> StoredSeries:
        """Massif's series over a stored range (either end open), culled as Massif culls."""
        ...

    def stored_diff(self, start: str, end: str, threshold: float) -> StoredDiff:
        """What grew and shrank between two stored moments (`heapscope diff`)."""
        ...

    def stored_growth(self, since: str | None, window_s: float | None, top: int) -> GrowthReport:
        """What is growing over a window of the stored history (`heapscope growth`): from `since`, or `window_s`
        seconds back from the last stored snapshot (both None: the whole run); `top` sites listed (0: all)."""
        ...

    def store_status(self) -> StoreStatus:
        """The store writer's counts (cheap: for every scrape)."""
        ...

    def history_status(self) -> StoreStatus:
        """store_status() and what the target's directory holds (reads the store's indexes)."""
        ...


class ManagerPort(Protocol):
    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def targets(self) -> Sequence[TargetPort]: ...

    def not_profiled(self) -> Sequence[TargetStatus]: ...

    def get(self, pid: int | None) -> TargetPort: ...

    def attach(self, pid: int, mode: ProfileMode | None = None) -> TargetPort: ...

    def switch_mode(self, pid: int, mode: ProfileMode) -> TargetPort: ...

    def detach(self, pid: int) -> TargetStatus: ...

    def monitor(self, pid: int | None, command: str) -> MonitorResult: ...

    def add_selector(
        self, comm: str | None, cmdline: str | None, cgroup: str | None, follow_children: bool = True
    ) -> SelectorStatus: ...

    def remove_selector(self, id: int) -> SelectorStatus: ...

    def selectors(self) -> Sequence[SelectorStatus]: ...

    def fleet_status(self) -> FleetStatus: ...
