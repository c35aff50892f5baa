"""Sampled mode's part of a profile: the in-process sampler (probes/sampler) brought into the target, its probe
points, arming it once the kernel's probes are live, its exact call counts, and letting it go.

- `attach` (and a daemon's target): the library is injected with ptrace (agent.process.inject, heapscope's own
  code: it picks the thread and the moment, see there) and armed.
- `run`: the program starts with the library preloaded (LD_PRELOAD). Its constructor holds the program before
  main() until heapscope has armed it (HEAPSCOPE_SAMPLER_HOLD), and puts the environment back first, so the
  program's children see what they would have seen without heapscope.

A single-threaded process (kept so: its libc's single-threaded fast paths), and one that can start no thread
(haproxy's worker sets its RLIMIT_NPROC to 0), get the sampler threadless: its
requests are calls at safe points (agent.process.inject.call_sampler), and the objects it loads while armed are
patched by such a call too, when its maps show a new file's code (the control thread's own poll elsewhere).

Order: the probes on hs_sample_alloc/hs_sample_free are live before the sampler is armed, and it is disarmed
before they are removed, so no sample is taken without its probe. A failure after arming never leaves the
sampler armed: disarm() runs on every way out, and the lease makes it disarm itself if heapscope dies.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from agent.errors import HeapscopeError, SamplingRefused, TargetError
from agent.kernel.interface import SiteReader
from agent.model.callcounts import ThreadCalls
from agent.model.maps import is_code_line
from agent.model.sampling import ProfileMode
from agent.process.discovery import ProbePoint
from agent.process.inject import call_sampler, inject, needs_folder, revive
from agent.process.procinfo import children_of, thread_limit
from agent.process.sampler import (
    COUNTS,
    FORKED_ARMED,
    LEASES,
    REQ_DISARM,
    ControlState,
    SamplerControl,
    build_sampler,
    calls_total_of,
    libc_of_program,
    library_range,
    loaded_file,
    mapped_base,
    mend_probe_code,
    probe_points,
    read_map_lines,
    thread_calls_of,
)
from agent.process.target import TargetProcess, launch

HOLD_MS = 10_000  # run: how long the preloaded sampler holds the program for heapscope to arm it
ARM_WAIT = 10.0  # run: seconds to wait for the program to map the preloaded library
# The per-thread counts are read again at most this often by the profile's tick: its looks (the sampler's poll,
# MALT's figures) share one read; a table of more than COUNTS_MANY_SLOTS threads (128 bytes each) once a second,
# for readers too (a thread-per-request server's 16,384 slots are 2 MiB a read).
COUNTS_FRESH = 0.02
COUNTS_MANY_SLOTS = 1024
LARGE_COUNTS_FRESH = 1.0
# Threadless: its maps' code looked at this often for objects loaded since the last scan; a scan that left lazy
# slots unbound is made again after twice as long each time, up to LAZY_RESCAN_MAX (each is a call at a safe
# point: a thread of the program held for a millisecond or two).
NEW_CODE_EVERY = 2.0
LAZY_RESCAN_MAX = 64.0

_HOLD_ENV = "HEAPSCOPE_SAMPLER_HOLD"
_PRELOAD_ENV = "HEAPSCOPE_SAMPLER_LD_PRELOAD"


def _refuse_static(process: TargetProcess, exe: str) -> None:
    if os.path.realpath(process.allocator.path) == os.path.realpath(exe):
        raise SamplingRefused(
            f"the allocator of {exe} ({process.allocator.family}) is linked into the executable: its calls do not "
            "go through the GOT and cannot be sampled; use --mode=exact"
        )


def launch_sampled(argv: Sequence[str]) -> TargetProcess:
    """`run --mode=sampled`: the program started held before its exec, with the sampler preloaded."""
    library = build_sampler(libc=libc_of_program(shutil.which(argv[0]) or argv[0]))
    env = dict(os.environ)
    given = env.get("LD_PRELOAD")
    if given is not None:
        env[_PRELOAD_ENV] = given
    env["LD_PRELOAD"] = f"{library}:{given}" if given else str(library)
    env[_HOLD_ENV] = str(HOLD_MS)
    process = launch(argv, env=env)
    assert process.child is not None
    try:
        _refuse_static(process, process.child.path)
    except BaseException:
        process.abandon()
        raise
    return process


def _sampler_state(pid: int, library: Path) -> ControlState:
    """The control block of the sampler loaded in `pid`, read once."""
    control = SamplerControl(pid, library)
    try:
        return control.read()
    finally:
        control.close()


class SamplerLink:
    """The sampler of one target, from loading to letting go."""

    def __init__(self, process: TargetProcess, mode: ProfileMode, say: Callable[[str], None]) -> None:
        self.process = process
        self.pid = process.pid
        self.mode = mode
        self.rate = mode.rate
        self.max_samples = mode.max_samples
        # The budget in force (samples a second, 0: none): the profile's, an inherited lower one (a forked child),
        # or a daemon's share of its total (set_budget).
        self.budget = mode.max_samples
        self._budget_said = False  # the first move of the rate in force is said; the rest show in the summary
        self.say = say
        self.libc = process.allocator.family if process.allocator.family == "musl" else "glibc"
        self.library = build_sampler(libc=self.libc)  # the build for the target's libc
        if self.libc == "glibc" and not process.launched and needs_folder(self.pid, self.library):
            self.libc = "glibc-bare"  # a bare chroot's loader can load nothing more than it has
            self.library = build_sampler(libc=self.libc)
        self.control: SamplerControl | None = None
        self._last_table: bytes | None = None  # the per-thread counts as last read (SamplerControl.count_table)
        self._read_at = 0.0  # when (time.monotonic)
        self._last_stats: dict[str, int] = {}
        self._stats_at = 0.0  # when they were read (time.monotonic)
        self._lock = threading.Lock()
        self.arm_error: BaseException | None = None
        self.disarmed_itself: str | None = None  # why the sampler disarmed without being asked, once it has
        self.read_error: str | None = None  # the first read of the sampler that failed while its process lived
        self.delivery = "preloaded"  # how the library reached the target, for /targets
        self._code: frozenset[tuple[int, int]] = frozenset()  # threadless: the code mappings at its last scan
        # Threadless: the profile's maps version (Session.maps, read again at the loader's events and when a walk
        # meets unread code); while it stands, no object was loaded and the maps are not read again for a scan.
        self.code_version: Callable[[], int] | None = None
        self._code_version_seen: int | None = None
        self._next_look = self._next_lazy = 0.0  # threadless: when its maps, and its lazy slots, are due (monotonic)
        self._lazy_wait = NEW_CODE_EVERY
        self._rescan_failed = False  # said once
        self._calls = threading.Lock()  # threadless: its requests, made one at a time
        if not process.launched:
            injection = inject(self.pid, self.library, allocator=process.allocator.path)
            forked = self._forked_child() if injection.reused else None
            if forked == "armed":
                self.delivery = "inherited armed from its parent"
                say(f"sampler inherited armed by {self.pid} from the process it was forked from: sampled since its "
                    "fork, with no stop")
            elif forked == "revived":
                self.delivery = "inherited from its parent, started again"
                say(f"sampler inherited by {self.pid} from the process it was forked from: started again")
            elif injection.reused:
                self.delivery = "already loaded, reused"
                say(f"sampler already loaded in {self.pid}: reused")
            else:
                self.delivery = ("memfd" if injection.memfd else "folder handed over" if injection.folder
                                 else "dlopen by path")
                how = (" (handed over in a memfd: it cannot see the library's path)" if injection.memfd
                       else " (from its folder, handed over: it sees neither the library nor a /proc)"
                       if injection.folder else "")
                say(f"sampler ({self.libc} build) loaded into {self.pid} by thread {injection.tid} in "
                    f"{injection.seconds * 1000:.0f} ms{how}")
            for line in injection.warnings:
                say(line)
            if injection.reused:
                self._mend_probe_code()
        loaded_as = None if process.launched else loaded_file(self.pid, self.library)
        self.points: list[ProbePoint] = probe_points(self.library, loaded_as)

    def _forked_child(self) -> str | None:
        """A forked child's copy of the library (a prefork worker, a backend): "armed" when it was forked while its
        parent was armed under this heapscope's lease (it samples since its fork: arm() takes a share of the
        lease, nothing stops it); "revived" when it was forked while not armed, and is started again; None when it
        is neither."""
        st = _sampler_state(self.pid, self.library)
        if st.state == "armed" and st["forked_armed"] and LEASES.holds(st["lease_ino"]):
            return "armed"
        if st.state == "broken" and revive(self.pid, self.library, allocator=self.process.allocator.path):
            return "revived"
        return None

    def _mend_probe_code(self) -> None:
        """A copy of the library it already had (forked with it, or left by an earlier heapscope) may hold another
        process's uprobe in its probe functions (agent.process.sampler.stale_probe_code): put back before this
        heapscope's probes go on, while no thread runs them (disarmed, or armed since its fork and unclaimed)."""
        st = _sampler_state(self.pid, self.library)
        if st.state == "armed" and st["forked_armed"] != FORKED_ARMED:
            return  # sampling now: its probe functions run, and are left as they are
        mended = mend_probe_code(self.pid, self.library)
        if mended:
            self.say(f"sampler in {self.pid}: {' and '.join(mended)} put back as its library has them (they held "
                     "the uprobe of the process it was forked from, which the kernel does not carry into a child)")

    @property
    def rate_in_force(self) -> int:
        """The rate the sampler samples at, as last read: the asked rate, or the budget's (never below it)."""
        return max(self._last_stats.get("rate_in_force", self.rate), self.rate)

    @property
    def rate_changes(self) -> int:
        """How often the budget has moved the rate, as last read."""
        return self._last_stats.get("rate_changes", 0)

    def describe(self) -> str:
        """Which build of the sampler the target got, and how: "glibc build, memfd"; and the rate in force when
        the budget has moved it (as last read)."""
        in_force = self.rate_in_force
        shared = f" ({self.budget} samples a second, its share of the daemon's total)" if (
            self.budget != self.max_samples) else ""
        moved = f"; over its budget{shared}, one sample per {in_force} bytes now" if in_force > self.rate else ""
        return f"{self.libc} build, {self.delivery}{moved}"

    # ---- arming ----------------------------------------------------------------------------------------

    def arm(self, probes: SiteReader) -> None:
        """Arm the sampler (the probes are live). `run`: first wait for the program to map the library."""
        deadline = time.monotonic() + ARM_WAIT
        while mapped_base(self.pid, self.library) is None:
            if not self.process.alive():
                raise TargetError(f"process {self.pid} exited before its sampler could be armed")
            if time.monotonic() > deadline:
                raise TargetError(f"process {self.pid} did not load the sampler library within {ARM_WAIT:.0f} s")
            time.sleep(0.001)
        span = library_range(self.pid, self.library)
        if span is not None:
            probes.lead_trim = (span,)  # the hooks' frames lead every sampled stack: not the program's
        control = SamplerControl(self.pid, self.library, call=self._call)
        try:
            st = control.arm(self.rate, self.max_samples)
        except BaseException:
            control.close()
            raise
        if control.threadless:
            self._code = self._code_read()
            self._next_look = self._next_lazy = time.monotonic() + NEW_CODE_EVERY
            self.delivery += ", threadless"
            if control.inherited:
                # Its parent's control thread bound and patched its slots before the fork: lazy ones left are
                # looked at again only in a child that lives long (each look holds one of its threads).
                self._lazy_wait = LAZY_RESCAN_MAX
                self._next_lazy = time.monotonic() + LAZY_RESCAN_MAX
            else:
                why = thread_limit(self.pid) or (
                    "it was single-threaded and is kept so: its libc keeps its single-threaded fast paths"
                    if control.kept_single() else "it could start none")
                self.say(f"sampler in {self.pid} runs without a thread of its own ({why}): it is armed, disarmed and "
                         "rescanned by calls at safe points, and its hooks watch heapscope's lease")
        with self._lock:
            self.control = control
            self.budget = st["max_samples"]
        since = " since its fork (its parent's lease; disarmed and rescanned by calls)" if control.inherited else ""
        self.say(
            f"sampler armed in {self.pid}{since}: one sample per {self.rate} bytes on average"
            f"{self.mode.budget_text()}; "
            f"{st['slots_patched']} allocation slots patched in {st['objects_scanned']} objects"
        )

    def _call(self, request: int, arg: int) -> int:
        # One call at a time: the profile's tick (a rescan) and a detach (the disarm) may come from two threads,
        # and a thread of the target is seized by one tracer only.
        with self._calls:
            return call_sampler(self.pid, self.library, request, arg, allocator=self.process.allocator.path)

    def _code_now(self) -> frozenset[tuple[int, int]]:
        """The process's code mappings of files (the objects a scan patches), by where they start and their inode.
        Anonymous code is left out: the kernel's uprobe trampoline appears at a probe's first optimized hit, and a
        rescan for it would stop the process for nothing."""
        return frozenset((m.start, m.inode) for m in read_map_lines(self.pid, keep=is_code_line) if m.inode)

    def _code_read(self) -> frozenset[tuple[int, int]]:
        """_code_now, noting the maps version it goes with (taken first: a load in between moves it again)."""
        self._code_version_seen = self.code_version() if self.code_version is not None else None
        return self._code_now()

    def _rescan_if_due(self, control: SamplerControl) -> None:
        """Threadless: patch what was loaded since the last scan (new code in its maps), and slots left lazy
        (looked at again after twice as long each time)."""
        now = time.monotonic()
        if now < self._next_look:
            return
        self._next_look = now + NEW_CODE_EVERY
        lazy_due = self._last_stats.get("lazy_skipped", 0) > 0 and now >= self._next_lazy
        seen = self._code_version_seen
        if not lazy_due and seen is not None and self.code_version is not None and self.code_version() == seen:
            return  # nothing loaded since the last read (a read of a postgres backend's maps: some 0.1 ms for nothing)
        code = self._code_read()
        if code == self._code and not lazy_due:
            return
        # New code starts the lazy slots' wait over; lazy slots alone double it.
        self._lazy_wait = NEW_CODE_EVERY if code != self._code else min(LAZY_RESCAN_MAX, self._lazy_wait * 2)
        self._next_lazy = now + self._lazy_wait
        self._code = code
        control.rescan()

    def arm_in_background(self, probes: SiteReader) -> threading.Thread:
        """`run`: arm from another thread, while the session lets the program go past its exec and loader
        stops up to the library's constructor, which waits there. A failure is kept in arm_error."""

        def body() -> None:
            try:
                self.arm(probes)
            except BaseException as exc:  # reported by the pipeline
                self.arm_error = exc
                self.say(f"the sampler could not be armed in {self.pid}: {exc}")

        thread = threading.Thread(target=body, name=f"heapscope-arm-{self.pid}", daemon=True)
        thread.start()
        return thread

    # ---- reading ---------------------------------------------------------------------------------------

    def poll(self) -> None:
        """Read the counts and the statistics, while the target is there (they stay readable after); a
        threadless sampler is rescanned when due."""
        self._count_table(tick=True)
        self.statistics()
        control = self.control
        if control is not None and control.threadless and self.disarmed_itself is None:
            try:
                self._rescan_if_due(control)
            except HeapscopeError as exc:  # no safe point now, or the target gone: tried again at the next look
                self._code, self._code_version_seen = frozenset(), None
                if self.process.alive() and not self._rescan_failed:
                    self._rescan_failed = True
                    self.say(f"sampler in {self.pid}: rescan for new objects not made now, tried again every "
                             f"{NEW_CODE_EVERY:.0f} s ({exc})")

    def _count_table(self, tick: bool = False, now: bool = False) -> bytes | None:
        """The per-thread counts: read now for a reader, as read up to COUNTS_FRESH seconds ago for the profile's
        own tick (its looks share one read); a table of more than COUNTS_MANY_SLOTS threads as read up to
        LARGE_COUNTS_FRESH ago for both (a server that starts a thread a request fills 16,384 slots, 2 MiB a read);
        `now`: read now. The last ones read once the sampler is disarmed or the target gone; None before arming.
        Kept as read, parsed only by what needs the threads (MALT's figures)."""
        with self._lock:
            if self.control is None:
                return self._last_table
            table = self._last_table
            if table is not None and not now:
                many = len(table) > COUNTS_MANY_SLOTS * COUNTS.size
                fresh = LARGE_COUNTS_FRESH if many else COUNTS_FRESH if tick else 0.0
                if time.monotonic() - self._read_at < fresh:
                    return table
            try:
                self._last_table = self.control.count_table()
                self._read_at = time.monotonic()
            except (OSError, HeapscopeError) as exc:  # the target exited: its last counts stand
                self._read_failed(exc)
            return self._last_table

    def thread_calls(self) -> list[ThreadCalls] | None:
        """Exact counts since arming, per thread slot (calls per function: ThreadCalls.by_kind); the last ones
        read once the sampler is disarmed or the target gone; None before arming."""
        table = self._count_table(tick=True)  # MALT's figures, read at the profile's ticks
        return None if table is None else thread_calls_of(table)

    def _read_failed(self, exc: BaseException) -> None:
        """A read of the sampler that failed while its process lives is said once: its counts stand still."""
        if self.read_error is None and self.process.alive():
            self.read_error = str(exc)
            fds = self.control.descriptors() if self.control is not None else ""
            self.say(f"cannot read the sampler in {self.pid} ({exc}; {fds}): its counts stay as last read")

    def counts(self) -> dict[str, int] | None:
        """Exact counts since arming (allocs and frees, reallocs included; alloc_bytes; reallocs and the old
        blocks they gave up, realloc_frees), all threads together; None before arming."""
        table = self._count_table()
        if table is None:
            return None
        t = calls_total_of(table)
        return {"allocs": t.allocs, "frees": t.frees, "alloc_bytes": t.alloc_bytes, "reallocs": t.realloc,
                "realloc_frees": t.realloc_frees}  # fmt: skip

    _STATS = ("samples", "sampled_frees", "set_full", "slots_patched", "lazy_skipped", "rate_in_force",
              "rate_changes")

    def statistics(self) -> dict[str, int]:
        """The sampler's own figures since arming (samples, sampled frees, samples whose free cannot be seen...);
        the last ones read once it is disarmed."""
        with self._lock:
            if self.control is not None:
                try:
                    st = self.control.read()
                except (OSError, HeapscopeError) as exc:
                    self._read_failed(exc)
                else:
                    self._last_stats = {k: st[k] for k in self._STATS}
                    self._stats_at = time.monotonic()
                    # Its own budget said; a daemon's share of its total is said once by the daemon.
                    if st["rate_changes"] and not self._budget_said and self.budget == self.max_samples:
                        self._budget_said = True
                        self.say(f"sampler in {self.pid}: over its budget of {self.max_samples} samples a second, "
                                 f"its rate in force is now one sample per {st['rate_in_force']} bytes (the "
                                 "estimates stay unbiased, from fewer samples)")
                    if st.state != "armed" and self.disarmed_itself is None:
                        # Its lease seen closed or lost: from here no allocation is sampled. Said, never silent.
                        self.disarmed_itself = st.disarm_reason
                        self.say(f"sampler in {self.pid} disarmed itself ({st.disarm_reason}, armed "
                                 f"{st['arm_count']} times): its allocations are no longer sampled")
            return dict(self._last_stats)

    def sampling(self) -> tuple[float, int, int] | None:
        """(when, samples since arming, rate in force) as the profile's looks last read them (once a second), for a
        daemon that shares its total; None unless armed and read."""
        with self._lock:
            if self.control is None or not self._last_stats:
                return None
            stats, at = self._last_stats, self._stats_at
        return at, stats["samples"], max(stats["rate_in_force"], self.rate)

    def set_budget(self, max_samples: int) -> None:
        """Move the armed sampler's budget (SamplerControl.set_budget); a gone target is left as it was."""
        with self._lock:
            if self.control is None:
                return
            try:
                self.control.set_budget(max_samples)
            except OSError:
                return  # gone: its end is the profile's to see
            self.budget = max_samples

    # ---- letting go ------------------------------------------------------------------------------------

    def disarm(self) -> None:
        """Restore every patched slot (the target runs on at full speed); keep the last counts. The library
        stays loaded (never dlclosed); attaching again reuses it."""
        self._count_table(now=True)
        self.statistics()
        with self._lock:
            control, self.control = self.control, None
        if control is None:
            return
        lease_ino = control.lease_ino
        try:
            st = control.disarm()
            if st["set_full"]:
                self.say(
                    f"sampler: {st['set_full']} samples did not fit its address set: their frees were not seen "
                    "(those blocks stay in the estimate)"
                )
        except (OSError, HeapscopeError) as exc:
            # Gone, or not answering: closing the lease makes a live sampler disarm itself within 50 ms.
            control.close()
            if self.process.alive():
                self.say(f"sampler in {self.pid} did not answer the disarm ({exc}); its lease is closed")
        if lease_ino:
            self._disarm_unclaimed_children(lease_ino)

    def _disarm_unclaimed_children(self, lease_ino: int) -> None:
        """Children forked while this process was armed that no profile claimed (forked as it was let go, or not
        followed) are armed on its lease since their fork. Without a thread of their own they would notice the
        lease gone only at their next sample, which an idle worker may never take, and stay armed meanwhile: each
        is disarmed now, by a call (no stop of this process; one of the child, at a safe point)."""
        for child in children_of(self.pid) or ():
            try:
                st = _sampler_state(child, self.library)
            except (OSError, HeapscopeError):
                continue  # gone, or without this library (exec'ed another program)
            if st.state != "armed" or st["forked_armed"] != FORKED_ARMED or st["lease_ino"] != lease_ino:
                continue  # claimed (its own profile lets it go), disarmed, or on another lease
            try:
                result = call_sampler(child, self.library, REQ_DISARM, 0, allocator=self.process.allocator.path)
            except (OSError, HeapscopeError) as exc:
                self.say(f"sampler in {child}, forked armed by {self.pid} and not profiled, did not answer the "
                         f"disarm ({exc}): it lets go at its next sample")
                continue
            if result == 0:
                self.say(f"sampler in {child}, forked armed by {self.pid} and not profiled: disarmed with it")
