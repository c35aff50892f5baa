"""The one profile pipeline that `run`, `attach` and every daemon target go through:

    settings -> probes -> session and its recorders -> outputs

ProfileSettings holds what a profile is run with (Massif's options, heapscope's own, the output files).
Profile takes one target process through the pipeline: it attaches the probes, samples until the target exits or
is let go, detaches, keeps the last state readable, and renders and writes the outputs of the registry
(agent.export.registry). The CLI and the daemon only build these and say where the lines and files go.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import psutil

from agent.errors import HeapscopeError, TargetConflict
from agent.export.pprof import PprofContext
from agent.export.registry import BY_NAME, FORMATS, MaltDocument, OutputFormat
from agent.kernel.abi import DAEMON_PAGE_RING_BYTES, PAGE_RING_BYTES, SAMPLED_PAGE_RING_BYTES
from agent.kernel.arrays import SharedRows
from agent.kernel.frozen import FrozenProbes
from agent.kernel.interface import ProbeSettings
from agent.kernel.probes import HeapProbes
from agent.model.counters import Counters
from agent.model.malt import check_consistency
from agent.model.memline import MemoryLine, MemoryPoint
from agent.model.options import MAX_WALKED_FRAMES, MassifOptions
from agent.model.pages import PageTotals
from agent.model.sampling import DAEMON_EXACT_STACKS, ProfileMode
from agent.model.snapshot import Snapshot, SnapshotKind
from agent.model.stack import SiteCounts, Stack
from agent.model.stored import StoreStatus
from agent.model.summary import ProfileSummary, SamplingSummary
from agent.model.target import ProfileHeader, SiteTotal, TargetState, top_sites
from agent.process.discovery import HOOK_KINDS, ProbePoint
from agent.process.inject import preflight_sampled
from agent.process.procinfo import ResidentReader
from agent.process.target import TargetProcess, launch
from agent.session.pprof_context import pprof_context
from agent.session.sampled import SamplerLink, launch_sampled
from agent.session.session import Session, SessionInfo
from agent.session.storerec import StoreRecorder, StoreSettings, store_meta
from agent.store import StoreWriteError


def _quiet(line: str) -> None:
    pass


def prepare_shared_rows() -> None:
    """A daemon's start: the unwind rows table that all its targets share is made now, before the first target,
    so it is never counted as that target's leftover (SharedRows.prepare)."""
    SharedRows.prepare()


@dataclass(frozen=True)
class ProfileSettings:
    """What every profile of one command is run with."""

    opts: MassifOptions
    desc: tuple[str, ...] = ()  # the Massif options as the user wrote them (massif.out's desc:)
    files: Mapping[str, str] = field(default_factory=dict)  # output format name -> file name template (%p)
    variants: Mapping[str, str] = field(default_factory=dict)  # output format name -> its variant (MALT's version)
    sample_interval: float = 0.05  # seconds between samples of the kernel's counters
    unwind: str = "cfi"  # cfi: .eh_frame tables; fp: frame pointers only
    verbose: int = 0  # -v: each probe's placement too
    max_blocks: int | None = None  # None: the mode's (ProfileMode.max_blocks)
    max_stacks: int | None = None  # None: the mode's (ProfileMode.max_stacks)
    # serve's targets share the program and the node's tables: the shared block table holds node_blocks live blocks
    # for all of them, and each exact-mode target keeps smaller tables of its own (DAEMON_EXACT_STACKS sites, a
    # page ring of DAEMON_PAGE_RING_BYTES): 50 of them within 1 GiB of kernel memory. 0: a command's one target.
    node_blocks: int = 0
    keep_programs: float = 0.0  # serve's: seconds a program shape stays loaded without targets (ProbeSettings)
    malt: bool = False  # keep MALT's statistics in the kernel (GET /malt, --malt-out-file)
    mode: ProfileMode = field(default_factory=ProfileMode)  # exact, or sampled (agent.session.sampled)
    page_calls: bool = False  # sampled mode: trace the page syscalls too (--page-calls=yes); exact mode always does
    store: StoreSettings | None = None  # keep every sample's history on disk (--store), None: not kept

    def probe_settings(self, pid: int, launched: bool) -> ProbeSettings:
        o = self.opts
        return ProbeSettings(
            sampled=self.mode.sampled,
            sample_rate=self.mode.rate,
            target_tgid=pid,
            arm_on_exec=launched,
            stop_events=launched,
            unwind=self.unwind == "cfi",
            free_stacks=o.xtree_memory == "full",
            malt=self.malt,
            heap_admin=o.heap_admin,
            alignment=o.alignment,
            max_depth=o.walked_frames,
            max_blocks=self.mode.max_blocks if self.max_blocks is None else self.max_blocks,
            max_stacks=self._max_stacks(),
            node_blocks=self.node_blocks,
            keep_programs=self.keep_programs,
            pages=self.traces_page_calls,  # page syscalls: the pages-as-heap tree, or the mapped total's every move
            page_stacks=o.pages_as_heap or self.malt,  # a page call's site: its tree, MALT's mmap statistics
            # Sampled mode (the daemon's default) keeps a smaller ring of page events: the kernel holds it and the
            # daemon maps it for every target, however quiet. The kernel wakes the daemon when a ring is a quarter full.
            page_ring_bytes=self._page_ring_bytes(),
            stacks=o.stacks,
            schedule_ns=o.time_unit == "ms",  # the snapshot schedule's clock
            ignore=bool(o.ignore_fns) and not self.mode.sampled,  # exact mode's reallocs of ignored blocks
        )

    @property
    def store_interval(self) -> float:
        """Seconds between the history's samples; infinite when no history is kept."""
        return self.store.interval if self.store is not None else math.inf

    @property
    def traces_page_calls(self) -> bool:
        """Whether the kernel follows the target's mmap, munmap, mremap and brk calls. Exact mode always does (the
        page map, --pages-as-heap). Sampled mode only with --page-calls=yes: a syscall tracepoint sends every system
        call of every process on the machine through the kernel's slower path and runs a program at every page call
        of any process (apache2 under ab: 1.6 µs of BPF a request, docs/benchmarks.md); without it the
        mapped total is read from /proc/PID/statm at each look, and MALT's profile has no mmap statistics."""
        return not self.mode.sampled or self.page_calls

    def _max_stacks(self) -> int:
        if self.max_stacks is not None:
            return self.max_stacks
        if self.node_blocks and not self.mode.sampled:
            return min(self.mode.max_stacks, DAEMON_EXACT_STACKS)
        return self.mode.max_stacks

    def _page_ring_bytes(self) -> int:
        if self.mode.sampled:
            return SAMPLED_PAGE_RING_BYTES
        # A daemon's target is never stopped for its ring: the kernel wakes the daemon from a quarter full instead.
        return DAEMON_PAGE_RING_BYTES if self.node_blocks else PAGE_RING_BYTES

    def outputs(self) -> list[tuple[OutputFormat, str]]:
        """The formats written at the end, with their file name templates."""
        return [(f, self.files[f.name]) for f in FORMATS if f.name in self.files and f.written_if(self.opts)]

    def preflight(self, pid: int) -> None:
        """Refuse, with one line and before anything is changed or said, a running process this mode cannot
        profile safely (sampled: agent.process.inject's refusals)."""
        if self.mode.sampled:
            preflight_sampled(pid)

    def launch(self, argv: list[str]) -> TargetProcess:
        """A program started held before its exec (`run`); in sampled mode with the sampler preloaded."""
        return launch_sampled(argv) if self.mode.sampled else launch(argv)


class Profile:
    """One target's profile, from the probes to the outputs. Readers (HTTP requests) may call the methods below
    from any thread while run() samples; the target itself is never stopped by a read."""

    def __init__(self, settings: ProfileSettings, process: TargetProcess, say: Callable[[str], None] = _quiet) -> None:
        self.settings = settings
        self.process = process
        self.pid = process.pid
        self.command = process.name
        self.cmdline = process.cmdline
        self.allocator = process.allocator.family
        self.say = say
        o = settings.opts
        self.mode: str = settings.mode.mode  # what /targets and the web page say
        self.sample_rate = settings.mode.period
        self._sampler: SamplerLink | None = None
        self._header = ProfileHeader(
            desc=(*settings.desc, *settings.mode.desc()),
            cmd=process.cmdline,
            pid=process.pid,
            time_unit=o.time_unit,
            threshold=o.threshold,
            xtree_kind="full" if o.xtree_memory == "full" else "allocs",
            mode=settings.mode.mode,
            sample_rate=settings.mode.period,
        )
        self.state: TargetState = "profiling"
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.session: Session | None = None
        # Held by readers and by the swap to the frozen copy, so no read meets a half-closed BPF object.
        self.lock = threading.Lock()
        self._malt_final: MaltDocument | None = None  # MALT's profile of the end, built when first asked
        self._alloc_points: Sequence[ProbePoint] | None = None  # the allocator's probe points, once ended
        self.memory = MemoryLine()  # mapped bytes and RSS beside the snapshots, for the web page's lines
        self.store: StoreRecorder | None = None  # the history store's writer, while the profile runs
        self._store_status = StoreStatus()  # what it did, kept once it is closed
        self._store_start_ns: int | None = None  # the stored run's start (wall clock)
        self._history: list[Snapshot] = []  # snapshots of an earlier profile this one continues
        self._clock: tuple[int, int] | None = None  # (session start_ns, B offset) to continue from

    def sampler_info(self) -> str | None:
        """Sampled mode: which build of the sampler the target got and how (SamplerLink.describe)."""
        link = self._sampler
        return link.describe() if link is not None else None

    def sampler_link(self) -> SamplerLink | None:
        """Sampled mode: the target's sampler (a daemon shares its total through it); None in exact mode."""
        return self._sampler

    def sample_budget(self) -> int | None:
        """Sampled mode: the samples a second the sampler may take now (0: no budget); None in exact mode."""
        link = self._sampler
        return link.budget if link is not None else None

    def rate_in_force(self) -> tuple[int, int] | None:
        """Sampled mode: the sampler's rate in force and how often its budget has moved it, as last read at the
        profile's looks; None in exact mode."""
        link = self._sampler
        return (link.rate_in_force, link.rate_changes) if link is not None else None

    def continue_from(self, before: Profile) -> None:
        """Continue the history of an earlier profile of the same process (the daemon switching its mode): its
        snapshots come first, the clock goes on from its start, and the memory line goes on. The new profile
        counts from 0: blocks allocated before it are not in its figures, as for any attach. The earlier
        peak stays as a detailed snapshot (massif.out has one peak)."""
        earlier = before.snapshots() if before.session is not None else []
        self._history = [
            Snapshot(x.time, x.heap_B, x.heap_extra_B, x.stacks_B, x.tree, SnapshotKind.DETAILED)
            if x.kind is SnapshotKind.PEAK else x
            for x in earlier
        ]
        start_ns = before.session.start_ns if before.session is not None else time.monotonic_ns()
        self._clock = (start_ns, earlier[-1].time if earlier else 0)
        self.started_at = before.started_at
        self.memory = before.memory
        self._store_start_ns = before._store_start_ns  # one run in the store, too

    # ---- the pipeline -----------------------------------------------------------------------------

    def run(self, stop: threading.Event, ready: Callable[[], None] = lambda: None) -> None:
        """Attach, let a held target go, sample until it exits or `stop` is set, detach, and keep the last state.
        `ready` is called once the probes are live."""
        s, p = self.settings, self.process
        lines = p.allocator.describe()
        for line in lines if s.verbose and not s.mode.sampled else lines[:1]:  # sampled: no function probed
            self.say(line)
        if s.opts.depth + 12 > MAX_WALKED_FRAMES:
            self.say(f"stacks are walked to {MAX_WALKED_FRAMES} frames at most (the BPF verifier's limit)")
        alloc_points = p.allocator.points(p.launched, heap=not s.opts.pages_as_heap)
        points = alloc_points
        tables = None
        if s.unwind == "cfi":
            from agent.symbols.unwind import load_table

            tables = load_table
        try:
            link = None
            if s.mode.sampled:
                self.say(s.mode.label())
                # attach: injected now, before the probes; run: preloaded, armed once the program maps it
                link = self._sampler = SamplerLink(p, s.mode, self.say)
                points = link.points + [pt for pt in alloc_points if pt.kind in HOOK_KINDS]
            resident = ResidentReader(p.pid)  # the memory line's and MALT's statm, read through one descriptor
            with contextlib.closing(resident), HeapProbes(s.probe_settings(p.pid, p.launched), points) as probes:
                session = Session(
                    s.opts,
                    probes,
                    SessionInfo(p.pid, p.cmdline, list(self._header.desc), p.allocator.family),
                    tables=tables,
                    exec_limit=int(p.launched),
                )
                if self._clock is not None:
                    session.start_ns, session.time_offset_b = self._clock
                if link is not None:
                    session.before_exit = link.poll  # the sampler's exact counts at the target's exit()
                    maps = session.maps  # a threadless sampler's scans for new code go by the session's maps
                    link.code_version = lambda: maps.version
                if s.malt:
                    from agent.session.maltrec import MaltRecorder

                    session.recorder = MaltRecorder(
                        probes,
                        p.pid,
                        mode=s.mode,
                        exact_calls=link.thread_calls if link is not None else None,
                        resident=resident,
                    )
                if not p.launched:
                    session.prepare_attach()
                try:
                    if link is not None and not p.launched:
                        link.arm(probes)  # after prepare_attach: the sampler's unwind table is published
                    # Said once recording: a script that starts its workload at this line misses nothing.
                    self.say(f"probes attached to {p.pid} ({probes.attached_through})")
                    p.release()
                    if link is not None and p.launched:
                        link.arm_in_background(probes)
                    self.session = session
                    ready()
                    self._open_store(session)
                    # A history asked for more often than sampled mode's pace looks gets a look at each of its samples.
                    session.run(self._alive_and_recording(session, resident), stop, s.sample_interval,
                                s.store_interval)
                finally:
                    if link is not None:
                        link.disarm()  # before the probes go: no sample without its probe
                    probes.detach()  # the target runs on untouched from here
                    if session.exec_ended():
                        self.say(f"process {p.pid} exec'ed another program: its profile ends there")
                    try:
                        session.finish()
                    finally:
                        self._close_store(session)  # the history's files are closed whatever happens
                    assert session.end_counters is not None
                    # MALT's tables copied too: its final profile is built from them when first asked.
                    frozen = FrozenProbes(probes, session.end_counters, malt=session.recorder is not None)
                    with self.lock:
                        self._alloc_points = alloc_points
                        session.freeze(frozen)
        finally:
            p.abandon()  # a held program that never ran is ended; one released runs on
        self.state = "detached" if p.alive() else "exited"
        self.ended_at = time.time()

    def _alive_and_recording(self, session: Session, resident: ResidentReader) -> Callable[[], bool]:
        """The target's `alive`, which the session's loop asks at every turn, also recording the memory line
        (mapped bytes and RSS) at most once per sampling interval: the session's own samples carry the heap."""
        interval = self.settings.sample_interval
        store_every = self.settings.store_interval  # used only while a history is kept (self.store)
        next_at = next_store = 0.0

        def check() -> bool:
            nonlocal next_at, next_store
            now = time.monotonic()
            # Due a quarter of its interval early: sampled mode's looks come on a shared grid, each a little later
            # or earlier in the line of the process's looks (Session.run), and a record due just after one would
            # wait a whole look.
            if now >= next_at - interval / 4:
                next_at = now + interval
                rss = self._record_memory(session, resident)
                if self.store is not None and now >= next_store - store_every / 4:
                    # Behind after a slow write: the next sample is due an interval from now, none is crowded in.
                    next_store = max(next_store + store_every, now) if next_store else now + store_every
                    live = session.live
                    token = live.activity() if live is not None else None  # unchanged: a quiet target, not stored
                    self.store.record(session.store_columns, rss, token, session.time_now, self._stored_rate())
                if self._sampler is not None:
                    self._sampler.poll()  # its last counts stand should the target exit unheld
            return self.process.alive()

        return check

    def _record_memory(self, session: Session, resident: ResidentReader) -> int | None:
        sizes = resident.sizes()  # (resident, mapped): one read of statm for both
        rss = sizes[0] if sizes is not None else None
        # Untraced page calls (sampled mode's default): statm's total now, also for a target idle since the last tick
        pages = session.pages if session.traces_page_calls else session.update_pages(sizes[1] if sizes else 0)
        self.memory.add(MemoryPoint(session.time_now(), pages.total if pages else None, rss))
        return rss

    # ---- the history store ------------------------------------------------------------------------

    def _open_store(self, session: Session) -> None:
        """The target's store writer (STORE/<pid>), when the settings keep one. A store that cannot be opened is
        said and counted; the profile goes on without it."""
        s = self.settings
        if s.store is None:
            return
        if self._store_start_ns is None:  # a profile that continues another (a mode switch) continues its run
            self._store_start_ns = time.time_ns() - (time.monotonic_ns() - session.start_ns)
        meta = store_meta(self.pid, self.cmdline, s.opts, tuple(self._header.desc), self._store_start_ns)
        try:
            self.store = StoreRecorder.open(s.store, meta, s.opts, self.say)
        except StoreWriteError as exc:
            self.say(f"{exc}; the profile goes on without its history")
            self._store_status = StoreStatus(str(s.store.directory(self.pid)), write_errors=1, last_error=str(exc))
            return
        self.say(f"keeping the history in {self.store.writer.directory}")

    def _close_store(self, session: Session) -> None:
        """The final state goes in as the last sample; then the files are closed (and synced)."""
        rec = self.store
        if rec is None:
            return
        rss = None
        with contextlib.suppress(psutil.Error):
            rss = psutil.Process(self.pid).memory_info().rss
        rec.record(session.store_columns, rss, rate=self._stored_rate())
        rec.close()
        self._store_status = rec.status()
        self.store = None

    def _stored_rate(self) -> int | None:
        """Sampled mode's rate in force, stored with each sample of the history (the growth analysis counts
        samples at it)."""
        return self._sampler.rate_in_force if self._sampler is not None else None

    def store_status(self) -> StoreStatus:
        """What the history store has done so far (all zero when no store is kept)."""
        rec = self.store
        return rec.status() if rec is not None else self._store_status

    def memory_line(self) -> list[MemoryPoint]:
        """Mapped bytes and RSS sampled over the profile's time (the web page draws them beside the heap)."""
        return self.memory.points()

    def write_outputs(self, output_dir: Path, expand: Callable[[str, int], str], strict: bool) -> tuple[str, ...]:
        """Write every output the settings ask for under `output_dir` (file names from their templates). A file
        that cannot be written raises when `strict` (the CLI), and is reported and skipped otherwise (a daemon
        keeps serving)."""
        written = []
        for fmt, template in self.settings.outputs():
            path = output_dir / expand(template, self.pid)
            try:
                data = self.render(fmt.name)
                if isinstance(data, bytes):
                    path.write_bytes(data)
                else:
                    path.write_text(data)
            except (OSError, HeapscopeError) as exc:
                if strict:
                    raise HeapscopeError(f"cannot write the {fmt.name} profile: {exc}") from exc
                self.say(f"cannot write {path}: {exc}")
                continue
            written.append(str(path))
            self.say(f"wrote {path}")
        return tuple(written)

    # ---- what readers read ------------------------------------------------------------------------

    def _session(self) -> Session:
        if self.session is None:
            raise TargetConflict(f"target {self.pid} is not attached yet")
        return self.session

    def header(self) -> ProfileHeader:
        return self._header

    def render(self, name: str, variant: str | None = None) -> str | bytes:
        fmt = BY_NAME[name]
        if variant is None:
            variant = self.settings.variants.get(name, fmt.variant.default if fmt.variant else "")
        return fmt.render(self, variant)

    def counters(self) -> Counters:
        s = self._session()
        with self.lock:
            c = s.end_counters or s.counters()
        return self._exact_counts(c)

    def _exact_counts(self, c: Counters) -> Counters:
        """Sampled mode: the call counts and bytes asked for are the sampler's own, exact, split as exact mode
        splits them (a realloc is neither an allocation nor a free); the rest stays the samples' estimate (the
        kernel's weighted sums, which MALT's statistics keep to add up)."""
        counts = self._sampler.counts() if self._sampler is not None else None
        if counts is None:
            return c
        return replace(c, n_allocs=counts["allocs"] - counts["reallocs"], n_reallocs=counts["reallocs"],
                       n_frees=counts["frees"] - counts["realloc_frees"], alloc_bytes=counts["alloc_bytes"])

    def page_totals(self) -> PageTotals | None:
        s = self._session()
        with self.lock:
            return s.page_totals()

    def snapshot(self, detailed: bool) -> Snapshot:
        """A snapshot taken now; for a target that is no longer profiled, its final state."""
        s = self._session()
        with self.lock:
            return s.snapshot_model(detailed)

    def snapshots(self) -> list[Snapshot]:
        s = self._session()
        with self.lock:
            return self._history + s.snapshot_list()

    def xtree_sites(self) -> dict[Stack, SiteCounts]:
        s = self._session()
        with self.lock:
            return s.merged_sites(massif_trim=False)

    def pprof_context(self) -> PprofContext:
        """The mappings with their build ids, and the times, of a pprof profile of now (of the end, once ended)."""
        s = self._session()
        with self.lock:
            return pprof_context(s, self.started_at, self.ended_at, self.settings.mode)

    def top_sites(self, n: int) -> tuple[list[SiteTotal], SiteTotal]:
        s = self._session()
        with self.lock:
            merged = s.merged_sites(massif_trim=True)
        return top_sites(merged, n)

    def malt_document(self) -> MaltDocument:
        """MALT's whole profile: of now, or of the end for a target no longer profiled."""
        s = self._session()
        if s.recorder is None:
            raise TargetConflict("MALT statistics are off for this target (the daemon runs with --malt=no)")
        with self.lock:
            if self._malt_final is not None:
                return self._malt_final
            ended = self._alloc_points
            points = ended if ended is not None else s.live.points if s.live is not None else ()
            profile = s.malt_profile(points, self.process.allocator.path)
            doc = MaltDocument(profile, s.symbolizer.resolver(s.maps.mappings))
            if ended is not None:  # the end's profile, once: the kernel no longer moves it
                self._malt_final = doc
                for problem in check_consistency(profile):
                    self.say(f"MALT profile inconsistent (concurrent updates in the kernel?): {problem}")
        return doc

    def summary(self) -> ProfileSummary:
        s = self._session()
        with self.lock:
            summary = s.summary()
        store = self.store_status()
        if store.enabled:  # what the history kept, and what it skipped: said with the rest
            summary = replace(summary, store=store)
        link = self._sampler
        if link is None:
            return summary
        st = link.statistics()
        sampling = SamplingSummary(link.rate, st.get("samples", 0), st.get("sampled_frees", 0), st.get("set_full", 0),
                                   link.budget, link.rate_in_force, link.rate_changes)  # a daemon's share, if so
        return replace(summary, counters=self._exact_counts(summary.counters), sampling=sampling)
