"""The daemon in a fleet: it finds its targets by selectors, follows their forks and execs, keeps exited ones for a
while, and holds to its limits.

FleetManager is the TargetManager `heapscope serve` runs. On top of attaching the PIDs it is given, it
- chooses processes by selectors (agent.model.selector): at start, and whenever one is added, by a scan of /proc;
  then from the kernel's exec events (agent.kernel.procevents: one small BPF program for the whole daemon), with a
  /proc scan again when the kernel lost events and every --rescan-interval seconds, in case;
- follows the children a selected process forks (prefork workers: the kernel reports the forks of the processes it
  profiles), as long as they run the parent's program;
- follows an exec of a selected target: its profile ends there (as for any attached target), and the new program
  is profiled from its start if it matches a selector on its own;
- keeps an ended target in /targets for --keep-exited seconds, marked with why and when it ended, then forgets it;
- refuses a new target at a limit (targets, sites, memory: agent.model.fleet.Limits) with TargetRefused (HTTP 429)
  and counts it by reason; exited targets kept for reading are forgotten first, oldest first, to make room.

Attaching takes seconds (compiling the BPF program), so selected processes wait in a queue served by a few
worker threads; the event thread never attaches itself. A process is known by (PID, start time): a PID reused by
another process is a new process, and a restarted daemon finds the same identities again.
"""

from __future__ import annotations

import gc
import math
import os
import queue
import threading
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Literal

from agent.daemon.manager import ATTACH_TIMEOUT, DaemonConfig, Target, TargetManager
from agent.daemon.outputs import output_names, sweep_outputs
from agent.errors import (
    EnvironmentProblem,
    HeapscopeError,
    NoSafePoint,
    NoSuchTarget,
    TargetConflict,
    TargetRefused,
)
from agent.kernel.procevents import ProcEvent, ProcEvents
from agent.log import LOG
from agent.model.cgroup import placement_of
from agent.model.counters import Counters
from agent.model.fleet import (
    FORGET_REASONS,
    REFUSAL_REASONS,
    FleetStatus,
    Limits,
    Refusal,
    SelectorStatus,
    TargetOrigin,
)
from agent.model.sampling import ProfileMode
from agent.model.selector import ProcessFacts, Selector, first_match
from agent.model.target import TargetState, TargetStatus
from agent.process.procinfo import (
    cgroup_of,
    children_of,
    process_ids,
    read_facts,
    release_free_memory,
    resident_bytes,
    start_time,
)
from agent.store.retention import sweep_ended

# Without the tracepoints, how often /proc is scanned instead.
POLL_INTERVAL = 2.0
# How long the event loop sleeps at most: the housekeeping (expiry of exited targets) runs at least this often.
TICK = 1.0
# How often what is kept of processes no longer profiled (their store histories, their output files) is checked
# against --store-max-age and --output-max-age.
SWEEP_INTERVAL = 600.0
# The full collection after targets are let go, at most this often: each is a pass over the whole daemon's heap
# (a tenth of a second at 300 MB), and a fleet that detaches a target a second paid one a detach; one in 10 s was
# still 1% of a core.
TRIM_INTERVAL = 30.0
# The same when only --max-exited let targets go: a server that replaces a worker a second forgets one a second, and a
# pass every 30 s over a heap of 256 ended profiles took some 5 ms of CPU a second (apache2 under ab). What they
# leave in cycles (some 180 KB a target there: 28 MB in two minutes) waits this long instead.
CHURN_TRIM_INTERVAL = 120.0
MAX_SELECTORS = 256

Identity = tuple[int, int]  # (pid, start time)


@dataclass(frozen=True)
class FleetConfig:
    selectors: tuple[Selector, ...] = ()
    limits: Limits = field(default_factory=Limits)
    keep_exited: float = 3600.0  # seconds an ended target stays in /targets
    max_exited: int | None = 256  # ended targets kept in /targets at most, the oldest forgotten first; None: no limit
    output_max_age: float = 7 * 86400.0  # seconds an ended target's output files stay; 0: for good
    rescan_interval: float = 60.0  # /proc scans besides the kernel's events
    attach_workers: int = 2
    use_events: bool = True  # the kernel's exec/fork/exit events; False: /proc scans every POLL_INTERVAL only


@dataclass(frozen=True)
class _Job:
    pid: int
    kind: Literal["match", "fork", "exec", "asked"]  # asked: POST /targets or --pid, tried again (waiting)
    selector: int | None = None  # match: the selector that chose it; fork: the parent's
    parent: int | None = None  # fork: the profiled parent
    start_time: int | None = None  # the identity seen when the job was made (None: read at attach)
    after: Target | None = None  # exec: the profile that ends at the exec
    mode: ProfileMode | None = None  # asked: the mode asked for


@dataclass(frozen=True)
class _InAttach:
    """A process being attached (FleetManager.attach): shown in /targets as attaching until its attach ends."""

    selector: int | None
    parent: int | None
    mode: ProfileMode | None
    since: float


@dataclass
class _Waiting:
    """A process that had no thread at a safe point for sampled mode's injection (NoSafePoint): shown in
    /targets as waiting, and tried again after RETRY_FIRST, then twice as long each time, up to RETRY_MAX."""

    status: TargetStatus
    tries: int
    job: _Job


RETRY_FIRST = 2.0  # seconds before the first retry of a waiting process
RETRY_MAX = 30.0


class FleetManager(TargetManager):
    def __init__(self, config: DaemonConfig, fleet: FleetConfig | None = None, proc: str = "/proc") -> None:
        super().__init__(config, proc)
        self.fleet = fleet or FleetConfig()
        self._flock = threading.Lock()  # selectors, the queue's bookkeeping, the counters
        self._admit = threading.Lock()  # one admission decision at a time
        self._selectors: dict[int, Selector] = {}
        self._matched: Counter[int] = Counter()  # selector id -> processes it chose
        self._next_id = 1
        for s in self.fleet.selectors:
            self._add(s)
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._queued: set[int] = set()  # PIDs with a job waiting or running
        self._recheck: set[int] = set()  # PIDs that exec'ed while their job ran
        self._inflight = 0  # admitted and attaching
        self._refused: Counter[str] = Counter()
        self._refusal_said: set[tuple[Identity, str]] = set()
        # selected processes that could not be attached, not retried: in /targets as refused, with why
        self._failed: dict[Identity, TargetStatus] = {}
        self._waiting: dict[Identity, _Waiting] = {}  # no safe point yet: tried again later (NoSafePoint)
        # detached by the user -> the id the next selector gets: not chosen again while it runs by the selectors
        # there were then; one POSTed since chooses it (the user asked again)
        self._released: dict[Identity, int] = {}
        self._in_attach: dict[int, _InAttach] = {}  # chosen or asked for, being attached now: listed as attaching
        self._failures = 0
        self._events = 0
        self._lost = 0
        self._scans = 0
        self._source = "none"
        self._rescan = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []
        self._ev: ProcEvents | None = None
        self._watched: set[int] = set()
        self._trim = False  # targets were let go: a collection is due (TRIM_INTERVAL)
        self._trim_churn = False  # only --max-exited let them go (CHURN_TRIM_INTERVAL)
        self._trimmed_at = -math.inf
        self._next_sweep = 0.0  # monotonic time of the next sweep of ended histories and files (at the first chores)
        self._expired_segments = 0
        self._expired_histories = 0
        self._expired_outputs = 0
        self._forgotten = dict.fromkeys(FORGET_REASONS, 0)
        self._max_exited_said = False

    # ---- life cycle ----

    def start(self) -> None:
        super().start()
        if self._threads:
            return
        self._rescan.set()  # the first scan: what already runs (also what a restarted daemon re-attaches)
        loop = threading.Thread(target=self._loop, name="heapscope-fleet", daemon=True)
        workers = [
            threading.Thread(target=self._work, name=f"heapscope-attach-{i}", daemon=True)
            for i in range(max(1, self.fleet.attach_workers))
        ]
        self._threads = [loop, *workers]
        for t in self._threads:
            t.start()

    def shutdown(self, timeout: float = 60.0) -> None:
        self._stopping.set()
        for _ in self._threads[1:]:
            self._queue.put(None)
        deadline = time.monotonic() + min(timeout, 10.0)  # an attach under way is not waited for long
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads = []
        super().shutdown(timeout)

    # ---- selectors ----

    def _add(self, selector: Selector) -> Selector:
        with self._flock:
            if len(self._selectors) >= MAX_SELECTORS:
                raise TargetRefused(f"the daemon has {MAX_SELECTORS} selectors already")
            s = selector.with_id(self._next_id)
            self._next_id += 1
            self._selectors[s.id] = s
        return s

    def add_selector(
        self, comm: str | None, cmdline: str | None, cgroup: str | None, follow_children: bool = True
    ) -> SelectorStatus:
        """A new selector (POST /targets): what it matches is attached from now on, what runs already included."""
        s = self._add(Selector.make(comm, cmdline, cgroup, follow_children, origin="api"))
        self.config.say(f"{s.describe()} added")
        self._rescan.set()
        return self._selector_status(s)

    def remove_selector(self, id: int) -> SelectorStatus:
        """Stop choosing processes by selector `id`; the targets it chose stay profiled."""
        with self._flock:
            s = self._selectors.pop(id, None)
        if s is None:
            raise NoSuchTarget(f"no selector {id}")
        with self._flock:  # what it chose and still waits for a safe point is no longer wanted
            for identity in [k for k, w in self._waiting.items() if w.status.origin.selector == id]:
                del self._waiting[identity]
        self.config.say(f"{s.describe()} removed")
        return self._selector_status(s)

    def selectors(self) -> list[SelectorStatus]:
        with self._flock:
            chosen = list(self._selectors.values())
        return [self._selector_status(s) for s in chosen]

    def _selector_status(self, s: Selector) -> SelectorStatus:
        pids = tuple(t.pid for t in self.targets() if t.origin.selector == s.id and t.state == "profiling")
        return SelectorStatus(
            id=s.id,
            comm=s.comm,
            cmdline=s.cmdline,
            cgroup=s.cgroup,
            follow_children=s.follow_children,
            origin=s.origin,
            matched=self._matched[s.id],
            targets=pids,
        )

    def fleet_status(self) -> FleetStatus:
        selectors = tuple(self.selectors())
        held = self.targets()
        profiling = sum(1 for t in held if t.state == "profiling")
        sites = sum(_sites(t) for t in held)
        with self._flock:
            return FleetStatus(
                selectors=selectors,
                limits=self.fleet.limits,
                refused={r: self._refused[r] for r in REFUSAL_REASONS},
                attach_failures=self._failures,
                events=self._events,
                events_lost=self._lost,
                scans=self._scans,
                event_source=self._source,
                profiling=profiling,
                waiting=len(self._waiting),
                sites=sites,
                rss=resident_bytes(),
                expired_segments=self._expired_segments,
                expired_histories=self._expired_histories,
                expired_outputs=self._expired_outputs,
                forgotten=dict(self._forgotten),
                log_lines_lost=LOG.lost,
                total_samples=self.share.total,
                sample_demand=round(self.share.demand, 1),
                sample_share=self.share.held_level(),
            )

    def _current_selectors(self) -> list[Selector]:
        with self._flock:
            return list(self._selectors.values())

    # ---- attaching, within the limits ----

    def attach(
        self,
        pid: int,
        mode: ProfileMode | None = None,
        selector: int | None = None,
        parent: int | None = None,
        identity: int | None = None,
    ) -> Target:
        """Attach `pid` (POST /targets, --pid, or a selector's choice) if the limits allow; TargetRefused if not.
        `identity`: the start time the process was chosen with; a different one means the PID was reused."""
        with self._admit:
            refusal = self._refusal()
            if refusal is not None:
                with self._flock:
                    self._refused[refusal.reason] += 1
                raise TargetRefused(f"not profiling process {pid}: {refusal.message}")
            self._inflight += 1
        mine = _InAttach(selector, parent, mode, time.time())
        with self._flock:
            self._in_attach.setdefault(pid, mine)
        try:
            started = start_time(pid, self.proc)
            if identity is not None and started != identity:
                raise NoSuchTarget(f"process {pid} went away before it could be attached")
            if identity is None:  # asked for by the user (POST /targets, --pid): what they let go before is wanted
                with self._flock:
                    self._released.pop((pid, started or 0), None)
            placement = placement_of(cgroup_of(pid, self.proc))
            try:
                t = super().attach(pid, mode)
            except NoSafePoint as exc:
                facts = read_facts(pid, self.proc)
                if identity is None and facts is not None:  # asked for: it waits, and is tried again
                    self._wait(_Job(pid, "asked", mode=mode), facts, None, None, exc)
                raise
        finally:
            with self._admit:
                self._inflight -= 1
            with self._flock:
                if self._in_attach.get(pid) is mine:  # (a second attach of it, refused, leaves the first's)
                    del self._in_attach[pid]
        t.origin = TargetOrigin(start_time=started or 0, placement=placement, selector=selector, parent=parent)
        with self._flock:
            gone = selector is not None and selector not in self._selectors
        if gone:  # its selector was removed while it was being attached: not wanted any more
            super().detach(pid)
            raise TargetConflict(f"selector {selector} was removed while process {pid} was being attached")
        if selector is not None:
            self._watch(pid)
            chosen_by = self._selectors.get(selector)
            if chosen_by is not None and chosen_by.follow_children:
                self._adopt_children(t)
        return t

    def detach(self, pid: int) -> TargetStatus:
        self.wait_attached(pid)  # a process being attached is detached once attached
        waited = self._stop_waiting(pid)
        if waited is not None:  # not attached yet: it is no longer tried, nor chosen again while it runs
            self._release((pid, waited.status.origin.start_time))
            return replace(waited.status, state="detached", ended_at=time.time())
        t = self.get(pid)
        if t.origin.start_time:
            self._release((pid, t.origin.start_time))  # the user let it go: not chosen again
        status = super().detach(pid)
        self._unwatch(pid)
        self._trim = True
        return status

    def _release(self, identity: Identity) -> None:
        with self._flock:
            self._released[identity] = self._next_id

    def _released_for(self, identity: Identity, selector: int | None) -> bool:
        """The user detached it, and `selector` (None: the process was asked for before) was there then."""
        with self._flock:
            since = self._released.get(identity)
        return since is not None and (selector is None or selector < since)

    def _refusal(self) -> Refusal | None:
        """Why one more target cannot be taken now (agent.model.fleet.Refusal), after forgetting exited targets
        if that makes room."""
        limits = self.fleet.limits
        while True:
            held = self.targets()
            live = sum(1 for t in held if t.state == "profiling") + self._inflight
            sites = sum(_sites(t) for t in held) if limits.max_sites is not None else 0
            rss = resident_bytes() if limits.max_memory is not None else 0
            refusal = limits.refusal(live, sites, rss)
            if refusal is None or refusal.reason == "targets":
                return refusal
            ended = sorted((t for t in held if t.state != "profiling"), key=lambda t: t.ended_at or 0.0)
            if not ended:
                return refusal
            self._forget(ended[0], "room", f"to make room ({refusal.reason})")

    def _forget(self, t: Target, reason: str, why: str | None) -> None:
        """Drop an ended target from /targets (its files and history stay); `why` is said, None: counted only."""
        with self._lock:
            if self._targets.get(t.pid) is not t:
                return
            del self._targets[t.pid]
        with self._flock:
            self._forgotten[reason] += 1
        if why is not None:
            self.config.say(f"forgot ended target {t.pid} ({t.command}) {why}")
        if reason == "count":
            self._trim_churn = True
        else:
            self._trim = True

    def _forget_beyond_max_exited(self, ended: list[Target]) -> None:
        """--max-exited: a prefork server that replaces a worker a second would otherwise have the daemon hold
        thousands of ended profiles (some 270 KB each) for --keep-exited. The oldest go first, said once, counted."""
        limit = self.fleet.max_exited
        if limit is None or len(ended) <= limit:
            return
        ended.sort(key=lambda t: t.ended_at or 0.0)
        if not self._max_exited_said:
            self._max_exited_said = True
            self.config.say(f"more than {limit} ended targets: the oldest are forgotten as others end (--max-exited; "
                            "their files and histories stay, counted in heapscope_targets_forgotten_total)")
        for t in ended[: len(ended) - limit]:
            self._forget(t, "count", None)

    # ---- the queue of selected processes ----

    def _enqueue(self, job: _Job) -> None:
        with self._flock:
            if job.pid in self._queued and job.kind != "exec":
                return
            self._queued.add(job.pid)
        self._queue.put(job)

    def _work(self) -> None:
        while True:
            job = self._queue.get()
            if job is None or self._stopping.is_set():
                return
            try:
                self._do(job)
            except Exception as exc:  # never let a worker die: say it, count it
                self._failures += 1
                # A process that ends during its attach fails wherever its files vanished first (its /proc/PID/root).
                gone = " (it exited meanwhile)" if read_facts(job.pid, self.proc) is None else ""
                self.config.say(f"attaching process {job.pid} failed{gone}: {type(exc).__name__}: {exc}")
            finally:
                with self._flock:
                    self._queued.discard(job.pid)
                    again = job.pid in self._recheck
                    self._recheck.discard(job.pid)
                if again:  # it exec'ed while it was being attached
                    t = self._live(job.pid)
                    self._enqueue(_Job(job.pid, "exec", after=t) if t is not None else _Job(job.pid, "match"))

    def _do(self, job: _Job) -> None:
        if job.after is not None:  # an exec: the old profile ends by itself first (the kernel disarmed it)
            job.after.done.wait(ATTACH_TIMEOUT)
            job.after.origin = replace(job.after.origin, end_reason="exec")
        facts = read_facts(job.pid, self.proc)
        if facts is None or self._stopping.is_set():
            self._stop_waiting(job.pid)
            return
        if job.kind == "asked":
            if not self._released_for((facts.pid, facts.start_time), None):  # DELETE'd while its retry was queued
                self._attach_waiting(job, facts, None, None)
            return
        selector, parent = job.selector, job.parent
        if job.kind == "fork" and not self._same_program(job.pid, job.parent):
            selector, parent = None, None  # the child runs another program: it stands on its own
        if job.kind != "fork" or selector is None:
            found = first_match(self._current_selectors(), facts)
            if found is not None:
                selector, parent = found.id, None
            else:  # a chosen process's child that exec'ed its parent's program again is still followed
                selector, parent = self._followed_parent(facts), facts.ppid
                if selector is None:
                    self._stop_waiting(job.pid)  # its selector went away while it waited
                    return
        else:
            followed = self._selectors.get(selector)
            if followed is None or not followed.follow_children:
                self._stop_waiting(job.pid)
                return  # the parent's selector was removed meanwhile, or follows no children
        identity = (facts.pid, facts.start_time)
        if identity in self._failed or self._released_for(identity, selector) or self._profiling(facts):
            self._stop_waiting(job.pid)
            return
        self._attach_waiting(job, facts, selector, parent)

    def _attach_waiting(self, job: _Job, facts: ProcessFacts, selector: int | None, parent: int | None) -> None:
        """Attach a chosen (or asked-for) process; one with no thread at a safe point yet waits and is tried
        again; any other failure is said and counted, and not tried again."""
        identity = (facts.pid, facts.start_time)
        try:
            t = self.attach(facts.pid, job.mode, selector=selector, parent=parent, identity=facts.start_time)
        except NoSafePoint as exc:
            self._wait(job, facts, selector, parent, exc)
            return
        except TargetConflict:
            self._stop_waiting(facts.pid)
            return  # attached meanwhile by another way (POST /targets, another job)
        except TargetRefused as exc:
            if (identity, str(exc)) not in self._refusal_said:
                self._refusal_said.add((identity, str(exc)))
                self.config.say(f"selector {selector}: {exc}")
            return
        except HeapscopeError as exc:
            refused = self._unprofiled(facts, selector, parent, job.mode, "refused", str(exc))
            with self._flock:
                self._failures += 1
                self._failed[identity] = refused
            if read_facts(facts.pid, self.proc) is not None:  # one gone meanwhile is not worth a line
                self.config.say(f"selector {selector}: cannot profile {facts.pid} ({facts.comm}): {exc}")
            return
        waited = self._stop_waiting(facts.pid)
        with self._flock:
            if selector is not None:
                self._matched[selector] += 1
        how = f"child of {parent}" if parent is not None else f"selector {selector}" if selector else "asked for"
        after = f", after {waited.tries + 1} tries" if waited is not None else ""
        self.config.say(f"profiling {t.pid} ({t.command}, {how}{after})")

    # ---- processes waiting for a safe point ----

    def _wait(self, job: _Job, facts: ProcessFacts, selector: int | None, parent: int | None,
              exc: NoSafePoint) -> None:
        identity = (facts.pid, facts.start_time)
        with self._flock:
            before = self._waiting.get(identity)
            tries = before.tries + 1 if before is not None else 1
            delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (tries - 1))
            status = self._unprofiled(facts, selector, parent, job.mode, "waiting",
                                      f"{exc}; tried {tries} times, next in {delay:.0f} s",
                                      before.status.started_at if before is not None else None)
            self._waiting[identity] = _Waiting(status, tries, replace(job, start_time=facts.start_time))
        if before is None:  # one line when it starts waiting, one when it is profiled
            self.config.say(f"waiting for a safe point in {facts.pid} ({facts.comm}), trying again from {delay:.0f} s "
                            f"on: {exc}")
        timer = threading.Timer(delay, self._retry, (identity,))
        timer.daemon = True
        timer.start()

    def _retry(self, identity: Identity) -> None:
        with self._flock:
            w = self._waiting.get(identity)
        if w is not None and not self._stopping.is_set():
            self._enqueue(w.job)

    def _stop_waiting(self, pid: int) -> _Waiting | None:
        with self._flock:
            for identity in [k for k in self._waiting if k[0] == pid]:
                return self._waiting.pop(identity)
        return None

    def _unprofiled(self, facts: ProcessFacts, selector: int | None, parent: int | None, mode: ProfileMode | None,
                    state: TargetState, error: str | None, since: float | None = None) -> TargetStatus:
        """How /targets shows a chosen process that is not profiled: attaching, waiting (tried again) or refused."""
        mode = mode or self.config.profile.mode
        return TargetStatus(
            pid=facts.pid, command=facts.comm, cmdline=facts.cmdline or facts.comm, allocator="", state=state,
            started_at=since if since is not None else time.time(), ended_at=None, files=(), counters=Counters(),
            origin=TargetOrigin(start_time=facts.start_time, placement=placement_of(facts.cgroup),
                                selector=selector, parent=parent),
            mode=mode.mode, sample_rate=mode.period, error=error,
        )

    def not_profiled(self) -> list[TargetStatus]:
        """Processes chosen but not profiled: being attached now, waiting for a safe point (tried again; `error`
        says where each thread was), or refused (not tried again while the process runs; `error` says why)."""
        with self._flock:
            retried = {pid for pid, _ in self._waiting}  # tried again now: listed once, as waiting
            in_attach = sorted((pid, a) for pid, a in self._in_attach.items() if pid not in retried)
            waiting = [w.status for _, w in sorted(self._waiting.items())]
            failed = [s for _, s in sorted(self._failed.items())]
        attaching = []
        for pid, a in in_attach:
            facts = read_facts(pid, self.proc)
            if facts is not None:
                attaching.append(self._unprofiled(facts, a.selector, a.parent, a.mode, "attaching", None, a.since))
        return attaching + waiting + failed

    def _profiling(self, facts: ProcessFacts) -> bool:
        with self._lock:
            t = self._targets.get(facts.pid)
            attaching = facts.pid in self._attaching
        return attaching or (t is not None and t.state == "profiling")

    def _followed_parent(self, facts: ProcessFacts) -> int | None:
        """The selector of `facts`' parent, if the parent is profiled for a selector that follows children and
        the process runs the parent's program."""
        parent = self._live(facts.ppid)
        if parent is None or parent.origin.selector is None:
            return None
        s = self._selectors.get(parent.origin.selector)
        if s is None or not s.follow_children or not self._same_program(facts.pid, facts.ppid):
            return None
        return s.id

    def _same_program(self, pid: int, parent: int | None) -> bool:
        if parent is None:
            return False
        try:
            return os.readlink(f"{self.proc}/{pid}/exe") == os.readlink(f"{self.proc}/{parent}/exe")
        except OSError:
            return False

    def _adopt_children(self, t: Target) -> None:
        """Children the target forked before its forks were watched (a prefork server found running)."""
        children = children_of(t.pid, self.proc)
        for pid in children if children is not None else process_ids(self.proc):
            facts = read_facts(pid, self.proc, cmdline=False, cgroup=False)
            if facts is not None and facts.ppid == t.pid:
                self._enqueue(_Job(pid, "fork", t.origin.selector, t.pid, facts.start_time))

    # ---- choosing: the /proc scan and the kernel's events ----

    def _scan(self) -> None:
        """Every process now: those a selector matches, and the children of those (same program) for selectors
        that follow children."""
        selectors = self._current_selectors()
        with self._flock:
            self._scans += 1
        if not selectors:
            return
        need_cmdline = any(s.needs_cmdline for s in selectors)
        need_cgroup = any(s.needs_cgroup for s in selectors)
        me = os.getpid()
        chosen: dict[int, Selector] = {}
        by_parent: dict[int, list[ProcessFacts]] = {}
        for pid in process_ids(self.proc):
            if pid == me:
                continue
            facts = read_facts(pid, self.proc, cmdline=need_cmdline, cgroup=need_cgroup)
            if facts is None:
                continue
            found = first_match(selectors, facts)
            if found is not None:
                chosen[pid] = found
                self._enqueue(_Job(pid, "match", found.id, None, facts.start_time))
            else:
                by_parent.setdefault(facts.ppid, []).append(facts)
        # Descendants of chosen processes, breadth first.
        frontier = [p for p, s in chosen.items() if s.follow_children]
        while frontier:
            parent = frontier.pop()
            for child in by_parent.get(parent, ()):
                if child.pid not in chosen and child.cmdline:
                    chosen[child.pid] = chosen[parent]
                    self._enqueue(_Job(child.pid, "fork", chosen[parent].id, parent, child.start_time))
                    frontier.append(child.pid)

    def _on_event(self, e: ProcEvent) -> None:
        if e.kind == "exit":
            self._unwatch(e.pid)
            return
        if e.kind == "fork":
            parent = self._live(e.parent)
            if parent is not None and parent.origin.selector is not None:
                s = self._selectors.get(parent.origin.selector)
                if s is not None and s.follow_children:
                    self._enqueue(_Job(e.pid, "fork", s.id, e.parent))
            return
        old = self._live(e.pid)
        if old is not None:  # a target's exec: its profile ends there (the kernel disarmed its probes)
            old.origin = replace(old.origin, end_reason="exec")
            if old.origin.selector is not None:
                self._enqueue(_Job(e.pid, "exec", after=old))
            return
        with self._flock:
            if e.pid in self._queued:  # being attached as the program it was: look again once that is done
                self._recheck.add(e.pid)
                return
        selectors = self._current_selectors()
        if not selectors:
            return
        # The name is in the event: selectors on the name alone need no read of /proc for most execs.
        names_only = all(s.cmdline is None and s.cgroup is None for s in selectors)
        if names_only and first_match(selectors, ProcessFacts(e.pid, 0, 0, e.comm, e.comm, "")) is None:
            return
        facts = read_facts(
            e.pid,
            self.proc,
            cmdline=any(s.needs_cmdline for s in selectors),
            cgroup=any(s.needs_cgroup for s in selectors),
        )
        found = None if facts is None else first_match(selectors, facts)
        if facts is not None and found is not None:
            self._enqueue(_Job(e.pid, "match", found.id, None, facts.start_time))

    def _live(self, pid: int) -> Target | None:
        with self._lock:
            t = self._targets.get(pid)
        return t if t is not None and t.state == "profiling" else None

    def _watch(self, pid: int) -> None:
        ev = self._ev
        if ev is not None:
            ev.watch(pid)
            self._watched.add(pid)

    def _unwatch(self, pid: int) -> None:
        ev = self._ev
        if ev is not None and pid in self._watched:
            ev.unwatch(pid)
            self._watched.discard(pid)

    def _open_events(self) -> ProcEvents | None:
        try:
            ev = ProcEvents().__enter__()
        except EnvironmentProblem as exc:
            self.config.say(f"{exc}; scanning /proc every {POLL_INTERVAL:.0f} s instead")
            self._source = "/proc scans"
            return None
        self._source = "tracepoints"
        self._ev = ev
        for t in self.targets():
            if t.state == "profiling" and t.origin.selector is not None:
                self._watch(t.pid)
        return ev

    def _loop(self) -> None:
        ev: ProcEvents | None = None
        next_scan = next_chores = 0.0
        try:
            while not self._stopping.is_set():
                have = bool(self._current_selectors())
                if have and ev is None and self._source == "none":
                    if self.fleet.use_events:
                        ev = self._open_events()
                        self._rescan.set()  # scan once the events flow: nothing slips in between
                    else:
                        self._source = "/proc scans"
                now = time.monotonic()
                if self._rescan.is_set() or now >= next_scan:
                    self._rescan.clear()
                    if have:
                        self._scan()
                    next_scan = now + (self.fleet.rescan_interval if ev is not None else POLL_INTERVAL)
                if ev is not None:
                    events = ev.poll(TICK)
                    with self._flock:
                        self._events += len(events)
                    for e in events:
                        self._on_event(e)
                    lost = ev.lost()
                    if lost:
                        with self._flock:
                            self._lost += lost
                        self.config.say(f"the kernel lost {lost} process events; scanning /proc")
                        self._rescan.set()
                else:
                    self._rescan.wait(TICK)
                if time.monotonic() >= next_chores:
                    next_chores = time.monotonic() + TICK
                    self._housekeeping()
        except Exception as exc:  # the fleet thread must not die silently
            self.config.say(f"the selector thread stopped: {type(exc).__name__}: {exc}")
        finally:
            self._ev = None
            if ev is not None:
                ev.close()

    def _housekeeping(self) -> None:
        """Ended targets: say why they ended and until when they stay; forget them at that time. Identities of
        processes that are gone are dropped from the remembered sets."""
        now = time.time()
        since = time.monotonic() - self._trimmed_at
        if (self._trim and since >= TRIM_INTERVAL) or (self._trim_churn and since >= CHURN_TRIM_INTERVAL):
            self._trim = self._trim_churn = False  # targets were let go: give their memory back
            self._trimmed_at = time.monotonic()
            # Sessions freeze the collector's objects at every sample (agent.session.session: full passes over a big
            # profile stalled requests); an ended target's cycles (its symbolizer's DWARF, its trees) were frozen
            # with the rest and would never be collected. One full pass per forgotten batch of targets.
            gc.unfreeze()
            gc.collect()
            gc.freeze()
            release_free_memory()
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + SWEEP_INTERVAL
            self._sweep()
        kept = []
        for t in self.targets():
            if t.state == "profiling" or not t.done.is_set():
                continue
            o = t.origin
            if o.expires_at is None:
                reason = o.end_reason or ("exited" if t.state == "exited" else "detached")
                t.origin = replace(o, end_reason=reason, expires_at=(t.ended_at or now) + self.fleet.keep_exited)
                self._unwatch(t.pid)
                kept.append(t)
            elif now >= o.expires_at:
                self._forget(t, "age", f"{self.fleet.keep_exited:.0f} s after it ended (--keep-exited)")
            else:
                kept.append(t)
        self._forget_beyond_max_exited(kept)
        if self._failed or self._released or self._refusal_said or self._waiting:
            alive = {(pid, st) for pid, st in ((i[0], start_time(i[0], self.proc)) for i in self._identities())}
            with self._flock:
                self._failed = {k: v for k, v in self._failed.items() if k in alive}
                self._released = {k: v for k, v in self._released.items() if k in alive}
                self._refusal_said = {k for k in self._refusal_said if k[0] in alive}
                self._waiting = {k: v for k, v in self._waiting.items() if k in alive}

    def _sweep(self) -> None:
        with self._flock:
            held = set(self._queued)
        held |= {t.pid for t in self.targets()}
        self._sweep_store(held)
        self._sweep_outputs(held)

    def _sweep_store(self, held: set[int]) -> None:
        """--store-max-age for the histories of processes no longer held: each writer keeps its own directory
        within the retention, but an ended process's directory has no writer left to do it."""
        store = self.config.profile.store
        if store is None:
            return
        swept = sweep_ended(store.root, store.retention.max_age_s, {str(pid) for pid in held})
        with self._flock:
            self._expired_segments += swept.segments_deleted
            self._expired_histories += swept.directories_removed
        if swept.segments_deleted:
            self.config.say(f"store: deleted {swept.segments_deleted} segments older than --store-max-age of "
                            f"processes no longer profiled ({swept.directories_removed} histories gone whole)")
        self._say_first(swept.errors)

    def _sweep_outputs(self, held: set[int]) -> None:
        """--output-max-age for the files that ended targets left in the output directory."""
        max_age = self.fleet.output_max_age
        if not max_age:
            return
        templates = [*self.config.profile.files.values(), *filter(None, [self.config.summary_file])]
        swept = sweep_outputs(self.config.output_dir, output_names(templates, self.config.expand), max_age, held)
        with self._flock:
            self._expired_outputs += swept.files_deleted
        if swept.files_deleted:
            self.config.say(f"deleted {swept.files_deleted} output files older than --output-max-age of processes "
                            "no longer profiled")
        self._say_first(swept.errors)

    def _say_first(self, errors: list[str]) -> None:
        if errors:
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            self.config.say(errors[0] + more)

    def _identities(self) -> set[Identity]:
        with self._flock:
            return set(self._failed) | set(self._released) | {k[0] for k in self._refusal_said} | set(self._waiting)


def _sites(t: Target) -> int:
    try:
        return t.counters().n_sites
    except HeapscopeError:
        return 0  # not attached yet
