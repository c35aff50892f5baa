"""Sampled mode's analysis at the idle scheduling policy (--analysis-priority).

An attached sampled target's profile thread (its looks: the schedule's points, the sampler's counts, new stacks'
symbols, the history's samples) runs at SCHED_IDLE: a thread of the machine that wakes takes the CPU from it at
once. The probes and the sampler run in the target as before; only heapscope's reading of them waits. Under ab,
apache2 prefork's workers wait on the load's connections with a quarter of the machine idle, and the daemon's few
percent of a core cost the service most where it held a CPU a worker had just woken for: 0.96-0.98x untraced at
the normal policy, 0.99-1.00x with the daemon at idle, the same CPU either way (docs/benchmarks.md). A nice level
is not that (19 measured no better): only the idle policy gives way at every wake-up.

Idle is not starved for good. A thread that waited runnable for STARVED_AT or more of a CHECK_EVERY window (a
machine that leaves it no CPU) is raised back to its normal policy, and stays there until a window at normal shows
the machine has room again, RAISED_FOR at least (longer at each raise); each raise is counted (the summary says
it). Exact mode and `run` keep the normal policy: exact mode's points are exact only if read in time, and `run`'s
kernel stops the target until the daemon has read (HS_STOP_EVENTS). The thread must be able to leave the idle
policy again (CAP_SYS_NICE, or RLIMIT_NICE room); without that right it is not made idle at all.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable

CHECK_EVERY = 0.5  # seconds between two reads of the thread's run delay
STARVED_AT = 0.1  # the share of a window spent waiting for a CPU from which the thread counts as starved
RAISED_FOR = 10.0  # seconds a raised thread stays at the normal policy at least, doubled at each raise up to 32x
CAP_SYS_NICE = 23  # linux/capability.h
_said = {"no_cap": False}


class StarvationWatch:
    """The decision, from the thread's run delay (ns waited runnable, /proc/thread-self/schedstat's second field)
    read at `now`: "raise" when an idle thread starved over the last window, "idle" when a raised one may go back,
    None otherwise. Pure: the times come from the caller."""

    def __init__(self) -> None:
        self._at: float | None = None
        self._delay_ns = 0
        self.raised = False
        self._until = 0.0
        self.raises = 0

    def due(self, now: float) -> bool:
        return self._at is None or now - self._at >= CHECK_EVERY

    def observe(self, now: float, delay_ns: int) -> str | None:
        if self._at is None or now <= self._at:
            self._at, self._delay_ns = now, delay_ns
            return None
        starved = (delay_ns - self._delay_ns) / 1e9 >= STARVED_AT * (now - self._at)
        self._at, self._delay_ns = now, delay_ns
        if not self.raised:
            if not starved:
                return None
            # A machine that starves the thread again and again keeps it raised longer each time.
            self.raised, self._until = True, now + RAISED_FOR * 2 ** min(self.raises, 5)
            self.raises += 1
            return "raise"
        if starved:
            self._until = max(self._until, now + CHECK_EVERY)  # still short of CPU at normal: stays raised
            return None
        if now < self._until:
            return None
        self.raised = False
        return "idle"


def can_leave_idle() -> bool:
    """Whether this thread could go back from SCHED_IDLE to SCHED_OTHER (sched(7)): CAP_SYS_NICE, or a nice level
    within RLIMIT_NICE."""
    try:
        with open("/proc/thread-self/status") as f:
            caps = next((int(line.split()[1], 16) for line in f if line.startswith("CapEff:")), 0)
    except OSError:
        caps = 0
    if caps >> CAP_SYS_NICE & 1:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    return soft == resource.RLIM_INFINITY or 20 - os.getpriority(os.PRIO_PROCESS, 0) <= soft


class AnalysisPriority:
    """The calling thread at SCHED_IDLE while in the `with` block (when `idle` and the thread may leave it again),
    raised to its normal policy while starved (StarvationWatch). turn() is called at each turn of the profile's
    loop: one clock read, and a read of schedstat every CHECK_EVERY."""

    def __init__(self, idle: bool, say: Callable[[str], None]) -> None:
        self.wanted = idle
        self.say = say
        self.active = False  # the idle policy is in use (entered, not refused)
        self.watch = StarvationWatch()
        self._normal = os.SCHED_OTHER
        self._stat: int | None = None

    @property
    def label(self) -> str:
        return "idle" if self.active else "normal"

    def __enter__(self) -> AnalysisPriority:
        if not self.wanted:
            return self
        policy = os.sched_getscheduler(0)
        if policy not in (os.SCHED_OTHER, os.SCHED_BATCH):
            return self  # started at idle or real time on purpose: left as it is
        if not can_leave_idle():
            if not _said["no_cap"]:  # once a daemon: the same for every target
                _said["no_cap"] = True
                self.say("analysis at the normal policy: without CAP_SYS_NICE heapscope could not raise it back "
                         "from idle on a busy machine")
            return self
        try:
            self._stat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        except OSError as exc:
            self.say(f"analysis at the normal policy: {exc.strerror}")
            self._close()
            return self
        self._normal, self.active = policy, True
        return self

    def turn(self) -> None:
        if not self.active or self._stat is None:
            return
        now = time.monotonic()
        if not self.watch.due(now):
            return
        try:
            delay_ns = int(os.pread(self._stat, 128, 0).split()[1])
        except (OSError, IndexError, ValueError):
            return
        change = self.watch.observe(now, delay_ns)
        if change is not None:
            self._set(self._normal if change == "raise" else os.SCHED_IDLE)
            if change == "raise" and self.watch.raises == 1:
                self.say(f"the machine left heapscope's idle analysis no CPU for {CHECK_EVERY:g} s: raised to the "
                         f"normal policy while so (raises are counted in the summary)")

    def _set(self, policy: int) -> None:
        try:
            os.sched_setscheduler(0, policy, os.sched_param(0))
        except OSError as exc:
            self.say(f"cannot change the analysis' scheduling policy: {exc.strerror}")

    def _close(self) -> None:
        if self._stat is not None:
            os.close(self._stat)
            self._stat = None

    def __exit__(self, *exc: object) -> None:
        if self.active:
            self._set(self._normal)  # the end's files and the detach at normal
        self._close()
