"""The daemon's targets: several processes profiled at once, each a Profile (agent.session.pipeline) run by its
own sampling thread.

Used by the CLI (`heapscope serve`, `run/attach --http`) and, through api.ports, by the HTTP API; it knows nothing
of HTTP. Contract: nothing here stops or pauses a target. A reader (an HTTP request) reads the BPF maps from the
daemon's own thread with syscalls; the target's probes only ever update maps in the kernel. A detach removes the
uprobes and lets the target run on. A target that exits (or is detached) stays queryable: the pipeline keeps a
copy of its last maps.
"""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from agent.daemon import history
from agent.daemon.monitor import run_monitor
from agent.daemon.share import SampleShare
from agent.errors import HeapscopeError, NoSuchTarget, TargetConflict, UsageError
from agent.export.massif import render_snapshot
from agent.model.fleet import TargetOrigin
from agent.model.growth import GrowthReport
from agent.model.sampling import ProfileMode
from agent.model.snapshot import Snapshot
from agent.model.stored import StoredDiff, StoredSeries, StoreStatus
from agent.model.target import PID_MAX, MonitorResult, TargetStatus
from agent.process.procinfo import limit_malloc_arenas
from agent.process.target import TargetProcess, attach_to
from agent.session.pipeline import Profile, ProfileSettings, prepare_shared_rows
from agent.session.sampled import SamplerLink

# How long an attach may take (compiling the BPF program, reading symbols) before it is given up.
ATTACH_TIMEOUT = 120.0


def failure_said(exc: BaseException) -> str:
    """An error in one line: its message; for one of heapscope's own bugs (not a HeapscopeError, or one with no
    message) also its type and the line that raised it, so that a log names the fault."""
    if isinstance(exc, HeapscopeError) and str(exc):
        return str(exc)
    tb = traceback.extract_tb(exc.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(exc).__name__}{where}: {exc}" if str(exc) else f"{type(exc).__name__}{where}"


class Target(Profile):
    """One profiled process: its profile, the thread that runs it, and the files written at its end."""

    def __init__(self, settings: ProfileSettings, process: TargetProcess, say: Callable[[str], None]) -> None:
        super().__init__(settings, process, say)
        self.files: tuple[str, ...] = ()
        self.error: BaseException | None = None
        self.stop = threading.Event()  # ask the sampling thread to end
        self.ready = threading.Event()  # probes attached (or failed: see error)
        self.done = threading.Event()  # the sampling thread has ended and written the files
        self.thread: threading.Thread | None = None
        self._xt_seq = 0
        self.origin = TargetOrigin()  # identity, cgroup, selector: set by agent.daemon.fleet

    def status(self) -> TargetStatus:
        return TargetStatus(
            pid=self.pid,
            command=self.command,
            cmdline=self.cmdline,
            allocator=self.allocator,
            state=self.state,
            started_at=self.started_at,
            ended_at=self.ended_at,
            files=self.files,
            counters=self.counters(),
            pages=self.page_totals(),
            origin=self.origin,
            mode=self.mode,
            sample_rate=self.sample_rate,
            error=None if self.error is None else str(self.error),
            sampler=self.sampler_info(),
        )

    def snapshot_text(self, detailed: bool) -> str:
        h = self.header()
        snap = self.snapshot(detailed)
        return render_snapshot(snap, desc=h.desc, cmd=h.cmd, time_unit=h.time_unit, threshold=h.threshold)

    def next_xtmemory_seq(self) -> int:
        self._xt_seq += 1
        return self._xt_seq

    # ---- the stored history: read from the store's files at each call, none of it kept in memory ----

    def _store_dir(self) -> Path:
        store = self.settings.store
        if store is None:
            raise TargetConflict(
                "no history is kept for this target: `serve` keeps one unless --no-store, `run` and `attach` "
                "with --store DIR"
            )
        return store.directory(self.pid)

    def stored_snapshot(self, at: str, detailed: bool) -> Snapshot:
        return history.snapshot_at(self._store_dir(), at, detailed)

    def stored_snapshots(self, start: str | None, end: str | None) -> StoredSeries:
        o = self.settings.opts
        return history.series(self._store_dir(), start, end, max_snapshots=o.max_snapshots,
                              detailed_freq=o.detailed_freq)

    def stored_diff(self, start: str, end: str, threshold: float) -> StoredDiff:
        return history.diff(self._store_dir(), start, end, threshold)

    def stored_growth(self, since: str | None, window_s: float | None, top: int) -> GrowthReport:
        return history.growth(self._store_dir(), since, window_s, top)

    def history_status(self) -> StoreStatus:
        """The store's writer statistics and what the target's directory holds."""
        if self.settings.store is None:
            return StoreStatus()
        directory = self._store_dir()
        status = self.store_status()
        if status.directory is None:  # its writer is not open yet
            status = StoreStatus(directory=str(directory))
        return history.held(directory, status)


def _no_say(line: str) -> None:
    pass


@dataclass
class DaemonConfig:
    profile: ProfileSettings
    output_dir: Path
    # Output file names from their templates (the CLI's expand_filename: %p, %q{VAR}).
    expand: Callable[[str, int], str]
    say: Callable[[str], None] = field(default=_no_say)
    summary_file: str | None = None  # each target's end-of-run summary as JSON (--summary-file)
    total_samples: int = 0  # samples a second all sampled targets take together (--total-samples; 0: no total)


class TargetManager:
    """Attach, query and detach targets at run time. Thread-safe."""

    def __init__(self, config: DaemonConfig, proc: str = "/proc") -> None:
        self.config = config
        self.proc = proc
        self._lock = threading.Lock()
        self._attached = threading.Condition(self._lock)  # notified when an attach ends, well or not
        self._targets: dict[int, Target] = {}
        self._attaching: set[int] = set()
        self.share = SampleShare(config.total_samples, config.say)
        self._share_stop = threading.Event()

    # ---- life cycle ----

    def start(self) -> None:
        try:
            self.config.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HeapscopeError(f"cannot create the output directory {self.config.output_dir}: {exc}") from exc
        limit_malloc_arenas()  # before the targets' threads: each would otherwise keep an arena of its own
        prepare_shared_rows()  # the unwind rows every target shares: there from the start, never a target's leftover
        if self.config.total_samples:
            threading.Thread(target=self.share.run, args=(self._sampler_links, self._share_stop),
                             name="heapscope-share", daemon=True).start()

    def _sampler_links(self) -> list[SamplerLink]:
        """The samplers of the targets profiled now (the total's share is theirs)."""
        links = (t.sampler_link() for t in self.targets() if t.ended_at is None)
        return [link for link in links if link is not None]

    def shutdown(self, timeout: float = 60.0) -> None:
        """End every profile and write every target's files (SIGTERM comes here)."""
        self._share_stop.set()
        targets = self.targets()
        for t in targets:
            t.stop.set()
        deadline = time.monotonic() + timeout
        for t in targets:
            if t.thread is not None:
                t.thread.join(max(0.0, deadline - time.monotonic()))

    # ---- lookup ----

    def targets(self) -> list[Target]:
        with self._lock:
            return sorted(self._targets.values(), key=lambda t: t.pid)

    def not_profiled(self) -> list[TargetStatus]:
        """Processes chosen but not profiled (the fleet's: waiting for a safe point, or refused); none here."""
        return []

    def get(self, pid: int | None) -> Target:
        with self._lock:
            if pid is not None:
                t = self._targets.get(pid)
                if t is None:
                    raise NoSuchTarget(f"no target with PID {pid}")
                return t
            if len(self._targets) == 1:
                return next(iter(self._targets.values()))
            if not self._targets:
                raise NoSuchTarget("no target is profiled: attach one with POST /targets {\"pid\": N}")
            pids = ", ".join(str(p) for p in sorted(self._targets))
            raise UsageError(f"{len(self._targets)} targets ({pids}): pick one with ?pid=")

    # ---- attach, launch, detach ----

    def attach(self, pid: int, mode: ProfileMode | None = None) -> Target:
        """Profile a running process from now on, in `mode` (default: the daemon's). Returns once the probes are
        attached."""
        if pid == os.getpid():
            raise UsageError("heapscope cannot profile itself")
        if not 1 <= pid <= PID_MAX:
            raise UsageError(f"{pid} is not a PID")
        settings = self._settings(mode)
        self._reserve(pid)
        try:
            process = attach_to(pid, self.proc)
            settings.preflight(pid)
            return self._start(process, settings)
        finally:
            self._release_reservation(pid)

    def switch_mode(self, pid: int, mode: ProfileMode) -> Target:
        """Profile `pid` in `mode` from now on: the current profile is detached (its files written) and the
        other attached, its history continuing the first's (Profile.continue_from). Should the new mode fail to
        attach, the old one is attached again, so the target stays profiled, and the error is raised."""
        old = self.get(pid)
        if old.state != "profiling":
            raise TargetConflict(f"target {pid} is {old.state}: attach it again with POST /targets")
        if old.settings.mode == mode:
            return old
        self._settings(mode).preflight(pid)  # refusals (ptrace, seccomp, allocator) before anything changes
        with self._lock:
            if pid in self._attaching:
                raise TargetConflict(f"process {pid} is already being attached")
            self._attaching.add(pid)
        try:
            old.stop.set()
            if old.thread is not None:
                old.thread.join(ATTACH_TIMEOUT)
            try:
                new = self._start(attach_to(pid, self.proc), self._settings(mode), before=old)
            except HeapscopeError:
                if old.process.alive():
                    self._start(attach_to(pid, self.proc), old.settings, before=old).origin = old.origin
                raise
            new.origin = old.origin  # the same process, chosen the same way
            return new
        finally:
            self._release_reservation(pid)

    def _settings(self, mode: ProfileMode | None) -> ProfileSettings:
        base = self.config.profile
        if mode is not None:  # a request names the mode and rate; the sampling budget is the daemon's own
            mode = replace(mode, max_samples=base.mode.max_samples)
        return base if mode is None or mode == base.mode else replace(base, mode=mode)

    def launch(self, argv: Sequence[str]) -> Target:
        """Start a program held before exec, attach, then let it run (`heapscope run --http`)."""
        process = self.config.profile.launch(list(argv))
        try:
            self._reserve(process.pid)
        except BaseException:
            process.abandon()
            raise
        try:
            return self._start(process)
        finally:
            self._release_reservation(process.pid)

    def detach(self, pid: int) -> TargetStatus:
        """Stop profiling `pid` (the process runs on, untouched), write its files, and forget it. A process being
        attached is detached once its attach ends (NoSuchTarget if that failed)."""
        self.wait_attached(pid)
        t = self.get(pid)
        t.stop.set()
        if t.thread is not None:
            t.thread.join(ATTACH_TIMEOUT)
        with self._lock:
            if self._targets.get(pid) is t:
                del self._targets[pid]
        return t.status()

    def _reserve(self, pid: int) -> None:
        with self._lock:
            old = self._targets.get(pid)
            if pid in self._attaching or (old is not None and old.state == "profiling"):
                raise TargetConflict(f"process {pid} is already being profiled")
            self._attaching.add(pid)

    def _release_reservation(self, pid: int) -> None:
        with self._lock:
            self._attaching.discard(pid)
            self._attached.notify_all()

    def wait_attached(self, pid: int) -> None:
        """Until `pid` is not being attached (ATTACH_TIMEOUT at most)."""
        with self._lock:
            self._attached.wait_for(lambda: pid not in self._attaching, ATTACH_TIMEOUT)

    def _start(self, process: TargetProcess, settings: ProfileSettings | None = None,
               before: Target | None = None) -> Target:
        t = Target(settings or self.config.profile, process, self.config.say)
        if before is not None:
            t.continue_from(before)
        t.thread = threading.Thread(target=self._profile, args=(t,), name=f"heapscope-{t.pid}", daemon=True)
        t.thread.start()
        if not t.ready.wait(ATTACH_TIMEOUT):
            t.stop.set()
            raise HeapscopeError(f"attaching to {t.pid} took more than {ATTACH_TIMEOUT:.0f} s; given up")
        if t.error is not None:
            if isinstance(t.error, HeapscopeError):
                raise t.error
            raise HeapscopeError(f"cannot profile {t.pid}: {t.error}") from t.error
        with self._lock:
            self._targets[t.pid] = t
        return t

    def _profile(self, t: Target) -> None:
        """The target's sampling thread: the pipeline, then the files. Never kills the daemon."""
        say = self.config.say
        try:
            t.run(t.stop, ready=t.ready.set)
            say(f"target {t.pid} {t.state}; its profile stays queryable")
            t.files = t.write_outputs(self.config.output_dir, self.config.expand, strict=False)
            summary = t.summary()
            for line in summary.lines():
                say(f"{t.pid}: {line}")
            if self.config.summary_file is not None:
                path = self.config.output_dir / self.config.expand(self.config.summary_file, t.pid)
                path.write_text(json.dumps(summary.to_json(), indent=1) + "\n")
        except BaseException as exc:  # reported to the attacher, or logged
            t.error = exc
            if t.ready.is_set():
                say(f"profiling {t.pid} failed: {failure_said(exc)}")
        finally:
            t.ready.set()
            t.done.set()

    # ---- monitor commands ----

    def monitor(self, pid: int | None, command: str) -> MonitorResult:
        return run_monitor(self.get, self.config.output_dir, pid, command)
