"""A typed fake of the daemon for the API's pure-logic tests: targets with synthetic profiles built from the real
model, rendered by the real writers. Calls the API should never make (attach of an unknown PID, ...) fail loudly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from agent.daemon import history
from agent.daemon.monitor import run_monitor
from agent.errors import NoSuchTarget, TargetConflict, UsageError
from agent.export.massif import render_snapshot
from agent.export.pprof import PprofContext
from agent.export.registry import BY_NAME, MaltDocument
from agent.model.counters import Counters
from agent.model.fleet import FleetStatus, SelectorStatus, TargetOrigin
from agent.model.growth import GrowthReport
from agent.model.maps import Mapping
from agent.model.memline import MemoryPoint
from agent.model.pages import PageTotals
from agent.model.sampling import ProfileMode
from agent.model.selector import Selector
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import Frame, SiteCounts, Stack
from agent.model.stored import StoredDiff, StoredSeries, StoreStatus
from agent.model.target import MonitorResult, ProfileHeader, SiteTotal, TargetStatus, top_sites
from agent.model.tree import HeapTree

# The fake program's code: every frame address of sample_sites() lies in it.
PROG_MAPPING = Mapping(0x400000, 0x403000, 0, "/bin/prog", "r-xp", build_id="0123456789abcdef")


def frame(address: int, function: str, line: int, file: str = "prog.c") -> Frame:
    return Frame(address=address, function=function, file=file, line=line, path=f"/src/{file}")


def stack(*frames: Frame) -> Stack:
    return tuple(frames)


MAIN = frame(0x401000, "main", 40)


def sample_sites(n_small: int = 3) -> dict[Stack, SiteCounts]:
    """A big site, a medium one, and `n_small` tiny ones (below Massif's 1% threshold)."""
    sites = {
        stack(frame(0x401100, "make_big", 10), MAIN): SiteCounts(
            cur_bytes=60_000, cur_blocks=6, tot_bytes=80_000, tot_blocks=8, freed_bytes=20_000, freed_blocks=2
        ),
        stack(frame(0x401200, "make_medium", 20), MAIN): SiteCounts(
            cur_bytes=30_000, cur_blocks=3, tot_bytes=30_000, tot_blocks=3
        ),
    }
    for i in range(n_small):
        sites[stack(frame(0x402000 + 16 * i, f"tiny{i}", 100 + i), MAIN)] = SiteCounts(
            cur_bytes=10 + i, cur_blocks=1, tot_bytes=10 + i, tot_blocks=1
        )
    return sites


@dataclass
class FakeTarget:
    pid: int
    command: str = "prog"
    allocator: str = "glibc"
    mode: str = "exact"
    sample_rate: int = 1
    state: str = "profiling"
    sites: dict[Stack, SiteCounts] = field(default_factory=sample_sites)
    time: int = 1234
    fail_with: BaseException | None = None  # raised by every read: an unexpected error in the daemon
    history: list[Snapshot] | None = None  # the kept snapshots, when a test gives them (else three made up)
    memory: list[MemoryPoint] = field(default_factory=list)  # the mapped/RSS line
    store_dir: Path | None = None  # the target's directory of a history store, when it keeps one
    origin: TargetOrigin = field(default_factory=TargetOrigin)  # identity, cgroup, selector
    error: str | None = None  # why its profiling failed once attached
    in_force: tuple[int, int] | None = None  # sampled: the rate in force and the budget's moves (else the asked)
    budget: int = 500  # sampled: the samples a second its sampler may take now
    _xt_seq: int = 0

    def header(self) -> ProfileHeader:
        return ProfileHeader(
            desc=("--threshold=1.0",), cmd=f"/bin/{self.command} --serve", pid=self.pid, time_unit="ms",
            threshold=1.0, xtree_kind="full",
        )

    def _check(self) -> None:
        if self.fail_with is not None:
            raise self.fail_with

    def counters(self) -> Counters:
        self._check()
        heap = sum(s.cur_bytes for s in self.sites.values())
        blocks = sum(s.cur_blocks for s in self.sites.values())
        return Counters(
            heap=heap, extra=8 * blocks, blocks=blocks, peak_heap=heap + 5000, peak_extra=8 * blocks + 8,
            n_allocs=sum(s.tot_blocks for s in self.sites.values()),
            n_frees=sum(s.freed_blocks for s in self.sites.values()),
            alloc_bytes=sum(s.tot_bytes for s in self.sites.values()),
            freed_bytes=sum(s.freed_bytes for s in self.sites.values()),
            n_reallocs=3, untracked_frees=2, dropped_blocks=1, dropped_sizes=3,
        )

    def rate_in_force(self) -> tuple[int, int] | None:
        if self.mode != "sampled":
            return None
        return self.in_force if self.in_force is not None else (self.sample_rate, 0)

    def sample_budget(self) -> int | None:
        return self.budget if self.mode == "sampled" else None

    def page_totals(self) -> PageTotals | None:
        self._check()
        heap = sum(s.cur_bytes for s in self.sites.values())
        mib = 1024 * 1024
        return PageTotals(mapped=heap + 4 * mib, peak_mapped=heap + 8 * mib, syscalls=42, dropped=0, stacks=0)

    def status(self) -> TargetStatus:
        return TargetStatus(
            pid=self.pid, command=self.command, cmdline=f"/bin/{self.command} --serve", allocator=self.allocator,
            state=self.state, started_at=1_700_000_000.0,
            ended_at=None if self.state == "profiling" else 1_700_000_060.0, files=(), counters=self.counters(),
            origin=self.origin,
            mode=self.mode, sample_rate=self.sample_rate, error=self.error,
        )

    def _tree(self) -> HeapTree:
        return HeapTree.from_stacks({s: c.cur_bytes for s, c in self.sites.items()})

    def snapshot(self, detailed: bool) -> Snapshot:
        self._check()
        c = self.counters()
        if detailed:
            return Snapshot(self.time, c.heap, c.extra, 0, self._tree(), SnapshotKind.DETAILED)
        return Snapshot(self.time, c.heap, c.extra, 0, None, SnapshotKind.NORMAL)

    def snapshot_text(self, detailed: bool) -> str:
        h = self.header()
        return render_snapshot(
            self.snapshot(detailed), desc=h.desc, cmd=h.cmd, time_unit=h.time_unit, threshold=h.threshold
        )

    def snapshots(self) -> list[Snapshot]:
        self._check()
        if self.history is not None:
            return list(self.history)
        c = self.counters()
        return [
            Snapshot(0, 0, 0, 0, None, SnapshotKind.NORMAL),
            Snapshot(500, c.heap // 2, c.extra // 2, 0, None, SnapshotKind.NORMAL),
            Snapshot(self.time, c.heap, c.extra, 0, self._tree(), SnapshotKind.PEAK),
        ]

    def xtree_sites(self) -> dict[Stack, SiteCounts]:
        self._check()
        return dict(self.sites)

    def render(self, name: str, variant: str | None = None) -> str | bytes:
        fmt = BY_NAME[name]  # the real renderers, over this fake's data
        return fmt.render(self, variant if variant is not None else (fmt.variant.default if fmt.variant else ""))

    def top_sites(self, n: int) -> tuple[list[SiteTotal], SiteTotal]:
        self._check()
        return top_sites(self.sites, n)

    def malt_document(self) -> MaltDocument:
        self._check()
        raise TargetConflict("MALT statistics are off in this fake daemon")

    def pprof_context(self) -> PprofContext:
        self._check()
        return PprofContext(mappings=(PROG_MAPPING,), time_ns=1_700_000_060 * 10**9, duration_ns=60 * 10**9)

    # The stored history: read from `store_dir` (a real store) by the daemon's own code, or none kept.

    def store_status(self) -> StoreStatus:
        self._check()
        return StoreStatus() if self.store_dir is None else StoreStatus(directory=str(self.store_dir), quiet_skipped=3)

    def history_status(self) -> StoreStatus:
        status = self.store_status()
        return status if self.store_dir is None else history.held(self.store_dir, status)

    def _store(self) -> Path:
        self._check()
        if self.store_dir is None:
            raise TargetConflict("no history is kept for this target (--no-store)")
        return self.store_dir

    def stored_snapshot(self, at: str, detailed: bool) -> Snapshot:
        return history.snapshot_at(self._store(), at, detailed)

    def stored_snapshots(self, start: str | None, end: str | None) -> StoredSeries:
        return history.series(self._store(), start, end, max_snapshots=100, detailed_freq=10)

    def stored_diff(self, start: str, end: str, threshold: float) -> StoredDiff:
        return history.diff(self._store(), start, end, threshold)

    def stored_growth(self, since: str | None, window_s: float | None, top: int) -> GrowthReport:
        return history.growth(self._store(), since, window_s, top)

    def next_xtmemory_seq(self) -> int:
        self._xt_seq += 1
        return self._xt_seq

    def memory_line(self) -> list[MemoryPoint]:
        self._check()
        return list(self.memory)


class FakeManager:
    """The ManagerPort, over FakeTargets. Records life-cycle calls."""

    def __init__(self, targets: Sequence[FakeTarget] = (), output_dir: Path | None = None) -> None:
        self.output_dir = output_dir
        self.by_pid = {t.pid: t for t in targets}
        self.attachable: dict[int, FakeTarget] = {}  # what attach(pid) may find
        self.calls: list[str] = []
        self.chosen: dict[int, Selector] = {}  # the selectors added, by id
        self.refused: dict[str, int] = {}  # what fleet_status() reports as refused, by reason

    def start(self) -> None:
        self.calls.append("start")

    def shutdown(self) -> None:
        self.calls.append("shutdown")

    def not_profiled(self) -> list[TargetStatus]:
        return []

    def targets(self) -> list[FakeTarget]:
        return sorted(self.by_pid.values(), key=lambda t: t.pid)

    def get(self, pid: int | None) -> FakeTarget:
        if pid is not None:
            if pid not in self.by_pid:
                raise NoSuchTarget(f"no target with PID {pid}")
            return self.by_pid[pid]
        if len(self.by_pid) == 1:
            return next(iter(self.by_pid.values()))
        if not self.by_pid:
            raise NoSuchTarget("no target is profiled")
        raise UsageError("several targets: pick one with ?pid=")

    def attach(self, pid: int, mode: ProfileMode | None = None) -> FakeTarget:
        if pid in self.by_pid:
            raise TargetConflict(f"process {pid} is already being profiled")
        if pid not in self.attachable:
            raise NoSuchTarget(f"no process with PID {pid}")
        t = self.by_pid[pid] = self.attachable.pop(pid)
        if mode is not None:
            t.mode, t.sample_rate = mode.mode, mode.period
        self.calls.append(f"attach {pid} {t.mode}")
        return t

    def switch_mode(self, pid: int, mode: ProfileMode) -> FakeTarget:
        t = self.get(pid)
        t.mode, t.sample_rate = mode.mode, mode.period
        self.calls.append(f"switch {pid} {mode.mode} {mode.period}")
        return t

    def detach(self, pid: int) -> TargetStatus:
        t = self.get(pid)
        del self.by_pid[pid]
        t.state = "detached"
        return t.status()

    def monitor(self, pid: int | None, command: str) -> MonitorResult:
        assert self.output_dir is not None, "give the fake an output_dir to run monitor commands"
        return run_monitor(self.get, self.output_dir, pid, command)  # the daemon's own logic

    def add_selector(
        self, comm: str | None, cmdline: str | None, cgroup: str | None, follow_children: bool = True
    ) -> SelectorStatus:
        s = Selector.make(comm, cmdline, cgroup, follow_children, id=len(self.chosen) + 1, origin="api")  # checks
        self.chosen[s.id] = s
        return self._status(s)

    def remove_selector(self, id: int) -> SelectorStatus:
        if id not in self.chosen:
            raise NoSuchTarget(f"no selector {id}")
        return self._status(self.chosen.pop(id))

    def selectors(self) -> list[SelectorStatus]:
        return [self._status(s) for s in self.chosen.values()]

    def _status(self, s: Selector) -> SelectorStatus:
        pids = tuple(t.pid for t in self.targets() if t.origin.selector == s.id)
        return SelectorStatus(s.id, s.comm, s.cmdline, s.cgroup, s.follow_children, s.origin, len(pids), pids)

    def fleet_status(self) -> FleetStatus:
        return FleetStatus(selectors=tuple(self.selectors()), refused=dict(self.refused),
                           profiling=sum(1 for t in self.by_pid.values() if t.state == "profiling"))
