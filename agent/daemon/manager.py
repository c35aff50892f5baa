"""The daemon's targets: several processes profiled at once, each with its own probes, session and sampling thread.

Used by the CLI (`heapscope serve`, `run/attach --http`) and, through api.ports, by the HTTP API; it knows nothing
of HTTP. Contract: nothing here stops or pauses a target. A reader (an HTTP request) reads the BPF maps from the
daemon's own thread with syscalls; the target's probes only ever update maps in the kernel. A detach removes the
uprobes and lets the target run on.

A target that exits (or is detached) stays queryable: its last map contents are copied into memory
(FrozenProbes) before the BPF program is unloaded, so the same Session keeps answering.
"""

from __future__ import annotations

import io
import os
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal, Protocol

import psutil

from agent.errors import HeapscopeError, TargetError, UsageError
from agent.export.massif import render_snapshot
from agent.kernel.probes import Counters, HeapProbes, PageCounters, ProbeSettings, SiteArray, UnwindMapping
from agent.model.options import MassifOptions
from agent.model.pages import PageTotals
from agent.model.profile import SiteCounts, Snapshot, SnapshotKind, Stack
from agent.process.discovery import Allocator, ProbePoint, allocator_of_process, allocator_of_program, read_process
from agent.process.launch import HeldChild
from agent.session.session import Session, SessionInfo

if TYPE_CHECKING:
    from agent.export.malt import MaltProfile

TargetState = Literal["profiling", "exited", "detached"]
XtreeKind = Literal["allocs", "full"]

# Linux's PID_MAX_LIMIT: no PID is larger.
PID_MAX = 4_194_304
# How long an attach may take (compiling the BPF program, reading symbols) before it is given up.
ATTACH_TIMEOUT = 120.0


# ---- errors, with the HTTP status the API gives them ----------------------------------------------------


class NoSuchTarget(TargetError):
    """The daemon profiles no process with that PID (or none at all)."""

    http_status = 404


class TargetConflict(HeapscopeError):
    """The PID is already being profiled, or being attached."""

    http_status = 409


class UnsafePath(UsageError):
    """A monitor file name that would leave the output directory."""


# ---- monitor commands (Massif's, as gdbserver's `monitor` takes them) ------------------------------------

MONITOR_DEFAULT_FILE = "massif.vgdb.out"
XTMEMORY_DEFAULT_FILE = "xtmemory.kcg.%p.%n"
MONITOR_VERBS = ("snapshot", "detailed_snapshot", "all_snapshots", "xtmemory", "help")
MONITOR_HELP = """\
massif monitor commands (POST /monitor {"command": "..."}):
  snapshot [<filename>]
  detailed_snapshot [<filename>]
      take a snapshot (detailed: with the heap tree) now and write it to <filename>
      (default massif.vgdb.out)
  all_snapshots [<filename>]
      write every snapshot recorded so far to <filename> (default massif.vgdb.out)
  xtmemory [<filename>]
      write the xtree heap memory report to <filename> (default xtmemory.kcg.%p.%n)
  help
      this text
File names are relative to the daemon's output directory; %p is the target's PID, %n a sequence number.
Absolute names, `..` and symbolic links are refused.
"""


@dataclass(frozen=True)
class MonitorCommand:
    verb: str
    filename: str | None = None


def parse_monitor(text: str) -> MonitorCommand:
    words = text.split()
    if not words:
        raise UsageError("empty monitor command; try `help`")
    verb, args = words[0], words[1:]
    if verb not in MONITOR_VERBS:
        raise UsageError(f"unknown monitor command {verb!r}; known: {', '.join(MONITOR_VERBS)}")
    if verb == "help" and args:
        raise UsageError("help takes no argument")
    if len(args) > 1:
        raise UsageError(f"{verb} takes at most one file name, got {len(args)} arguments")
    return MonitorCommand(verb, args[0] if args else None)


def expand_monitor_name(name: str, pid: int, seq: int) -> str:
    """%p (PID), %n (a sequence number) and %%. Nothing else: %q{VAR} would read the daemon's environment."""
    out = []
    i = 0
    while i < len(name):
        ch = name[i]
        if ch != "%":
            out.append(ch)
            i += 1
            continue
        nxt = name[i + 1 : i + 2]
        if nxt == "p":
            out.append(str(pid))
        elif nxt == "n":
            out.append(str(seq))
        elif nxt == "%":
            out.append("%")
        else:
            raise UsageError(f"bad file name {name!r}: only %p, %n and %% are understood")
        i += 2
    return "".join(out)


def check_relative_name(name: str) -> list[str]:
    """The components of a file name that stays under a directory: relative, no `..`. Symbolic links are
    checked when the file is opened (write_under)."""
    if not name or "\0" in name:
        raise UsageError("empty or invalid file name")
    if name.startswith("/"):
        raise UnsafePath(f"{name!r} is absolute: monitor files go under the daemon's output directory")
    parts = name.split("/")
    if ".." in parts:
        raise UnsafePath(f"{name!r} contains `..`: monitor files go under the daemon's output directory")
    parts = [p for p in parts if p not in ("", ".")]
    if not parts:
        raise UsageError(f"{name!r} names no file")
    return parts


def write_under(root: Path, name: str, text: str) -> Path:
    """Write `text` to `root/name`, never outside `root`: each directory is opened relative to the last with
    O_NOFOLLOW, so no symbolic link is followed (no check-then-open race); the file must be a regular file
    with one link."""
    parts = check_relative_name(name)
    flags_dir = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
    try:
        dfd = os.open(root, flags_dir)
    except OSError as exc:
        raise HeapscopeError(f"output directory {root} is not usable: {exc.strerror}") from exc
    try:
        for part in parts[:-1]:
            try:
                nfd = os.open(part, flags_dir | os.O_NOFOLLOW, dir_fd=dfd)
            except OSError as exc:
                if _is_symlink(dfd, part):
                    raise UnsafePath(f"{name!r} goes through a symbolic link: refused") from exc
                raise UsageError(f"{name!r}: {part}: {exc.strerror}") from exc
            os.close(dfd)
            dfd = nfd
        try:
            # O_NONBLOCK: a FIFO planted under the name fails at once instead of hanging the daemon.
            fd = os.open(
                parts[-1],
                os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                0o644,
                dir_fd=dfd,
            )
        except OSError as exc:
            if _is_symlink(dfd, parts[-1]):
                raise UnsafePath(f"{name!r} is a symbolic link: refused") from exc
            raise UsageError(f"cannot write {name!r}: {exc.strerror}") from exc
        with os.fdopen(fd, "wb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
                raise UnsafePath(f"{name!r} is not a plain file: refused")
            f.truncate(0)
            f.write(text.encode())
    finally:
        os.close(dfd)
    return root.joinpath(*parts)


def _is_symlink(dfd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dfd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@dataclass(frozen=True)
class MonitorResult:
    command: str
    pid: int | None
    file: str | None  # the file written, when the command writes one
    bytes: int
    output: str  # what the monitor command says on the terminal


# ---- a target's last state ------------------------------------------------------------------------------


class FrozenProbes(HeapProbes):
    """A copy of a target's maps taken before its BPF program is unloaded: the Session reads it as it read the
    live maps, so an exited target's profile can still be queried."""

    def __init__(self, live: HeapProbes, counters: Counters) -> None:
        super().__init__(live.settings, live.points)
        self._counters = counters
        count = min(counters.n_sites + 1, live.settings.max_stacks)
        self._frozen_sites = live.copy_sites(count)
        # Every site's stack, those of sites that only made page syscalls too (used_sites() leaves them out).
        self._stacks = {k: ips for k, ips in live.stacks(range(count)).items() if ips}
        self._page_counters = live.page_counters()
        # What the end-of-run summary says of the live probes.
        self.rows_used, self.rows_dropped = live.rows_used, live.rows_dropped
        self.detach_seconds = live.detach_seconds

    def __enter__(self) -> HeapProbes:
        return self

    def close(self) -> None:
        pass

    def detach(self) -> None:
        pass

    def counters(self) -> Counters:
        return self._counters

    def _site_view(self, count: int) -> SiteArray:
        return self._frozen_sites

    def page_counters(self) -> PageCounters:
        return self._page_counters

    def wait_events(self, timeout: float) -> list[int]:
        return []

    def stopped(self) -> int:
        return 0

    def resume(self) -> None:
        pass

    def publish_unwind(self, mappings: Sequence[UnwindMapping]) -> None:
        pass


# ---- one target -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProfileHeader:
    """What the files say about their profile, besides the data."""

    desc: tuple[str, ...]
    cmd: str
    pid: int
    time_unit: str
    threshold: float
    xtree_kind: XtreeKind


@dataclass(frozen=True)
class TargetStatus:
    pid: int
    command: str  # the process name (comm): short, for metric labels
    cmdline: str
    allocator: str
    state: TargetState
    started_at: float  # Unix time the probes were attached
    ended_at: float | None  # when profiling ended (exit or detach)
    files: tuple[str, ...]  # the files written when profiling ended
    counters: Counters
    pages: PageTotals | None = None  # mapped memory (None until the page map is seeded)


@dataclass(frozen=True)
class SiteTotal:
    """Live bytes and blocks of one allocation site (the innermost frame Massif keeps)."""

    site: str
    bytes: int
    blocks: int


def site_name(stack: Stack) -> str:
    """A site as a short, address-free text: `fn (file:line)`, `fn (in /obj)` or `???`."""
    if not stack:
        return "(no frame)"
    f = stack[0]
    fn = f.function or "???"
    if f.file and f.line:
        return f"{fn} ({f.file}:{f.line})"
    if f.obj:
        return f"{fn} (in {f.obj})"
    return fn


def top_sites(merged: dict[Stack, SiteCounts], n: int) -> tuple[list[SiteTotal], SiteTotal]:
    """The `n` sites with the most live bytes (stacks merged by site name), and the rest summed up."""
    by_site: dict[str, list[int]] = {}
    for stack, s in merged.items():
        if s.cur_blocks <= 0 and s.cur_bytes <= 0:
            continue
        acc = by_site.setdefault(site_name(stack), [0, 0])
        acc[0] += max(s.cur_bytes, 0)
        acc[1] += max(s.cur_blocks, 0)
    ranked = sorted(by_site.items(), key=lambda kv: (-kv[1][0], kv[0]))
    top = [SiteTotal(name, b, k) for name, (b, k) in ranked[:n]]
    rest = ranked[n:]
    other = SiteTotal("(other sites)", sum(v[0] for _, v in rest), sum(v[1] for _, v in rest))
    return top, other


class Target:
    """One profiled process. Built by TargetManager; readers use the methods below from any thread."""

    def __init__(self, pid: int, command: str, cmdline: str, allocator: str, header: ProfileHeader) -> None:
        self.pid = pid
        self.command = command
        self.cmdline = cmdline
        self.allocator = allocator
        self._header = header
        self.state: TargetState = "profiling"
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.files: tuple[str, ...] = ()
        self.session: Session | None = None
        self.error: BaseException | None = None
        self.stop = threading.Event()  # ask the sampling thread to end
        self.ready = threading.Event()  # probes attached (or failed: see error)
        self.done = threading.Event()  # the sampling thread has ended and written the files
        self.thread: threading.Thread | None = None
        # Held by readers and by the swap to FrozenProbes, so no read meets a half-closed BPF object.
        self.lock = threading.Lock()
        self._xt_seq = 0
        self.malt_source: tuple[tuple[ProbePoint, ...], str] | None = None  # probes and allocator, with MALT on
        self.malt_final: MaltProfile | None = None  # MALT's profile at the end, once the probes are closed

    # ---- what the API reads ----

    def header(self) -> ProfileHeader:
        return self._header

    def _session(self) -> Session:
        if self.session is None:
            raise TargetConflict(f"target {self.pid} is not attached yet")
        return self.session

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
        )

    def counters(self) -> Counters:
        s = self._session()
        with self.lock:
            return s.end_counters or s.counters()

    def page_totals(self) -> PageTotals | None:
        s = self._session()
        with self.lock:
            return s.page_totals()

    def snapshot(self, detailed: bool) -> Snapshot:
        """A snapshot taken now; for a target that is no longer profiled, its final state."""
        s = self._session()
        with self.lock:
            if s.series.finished:
                last = s.snapshot_list()[-1]
                if detailed:
                    return Snapshot(last.time, last.heap_B, last.heap_extra_B, last.stacks_B, last.tree, last.kind)
                return Snapshot(last.time, last.heap_B, last.heap_extra_B, last.stacks_B, None, SnapshotKind.NORMAL)
            return s.snapshot_model(detailed)

    def snapshot_text(self, detailed: bool) -> str:
        h = self._header
        snap = self.snapshot(detailed)
        return render_snapshot(snap, desc=h.desc, cmd=h.cmd, time_unit=h.time_unit, threshold=h.threshold)

    def snapshots(self) -> list[Snapshot]:
        s = self._session()
        with self.lock:
            return s.snapshot_list()

    def massif_text(self) -> str:
        s = self._session()
        with self.lock:
            return s.massif_text()

    def xtree_text(self) -> str:
        s = self._session()
        with self.lock:
            return s.xtree_text()

    def xtree_sites(self) -> dict[Stack, SiteCounts]:
        s = self._session()
        with self.lock:
            return s.merged_sites(massif_trim=False)

    def top_sites(self, n: int) -> tuple[list[SiteTotal], SiteTotal]:
        s = self._session()
        with self.lock:
            merged = s.merged_sites(massif_trim=True)
        return top_sites(merged, n)

    def malt_json(self, format_version: Literal["1.1", "1.6"]) -> str:
        """MALT's whole profile as JSON: of now, or of the end for a target no longer profiled."""
        from agent.export.malt import symbolizer_resolver, write_malt

        s = self._session()
        if self.malt_source is None:  # set with the recorder
            raise TargetConflict("MALT statistics are off in this daemon (started with --malt=no)")
        points, allocator = self.malt_source
        with self.lock:
            profile = self.malt_final or s.malt_profile(points, allocator)
        out = io.StringIO()
        resolve = symbolizer_resolver(s.symbolizer, s.maps.mappings)
        write_malt(out, profile, format_version=format_version, resolve=resolve)
        return out.getvalue()

    def next_xtmemory_seq(self) -> int:
        self._xt_seq += 1
        return self._xt_seq


# ---- the manager ----------------------------------------------------------------------------------------


def _no_say(line: str) -> None:
    pass


@dataclass
class DaemonConfig:
    opts: MassifOptions
    desc: Sequence[str]
    output_dir: Path
    # Output file names from --massif-out-file / --xtree-memory-file templates (the CLI's expand_filename).
    expand: Callable[[str, int], str]
    sample_interval: float = 0.05
    unwind: str = "fp"  # --unwind: fp (frame pointers) or cfi (.eh_frame tables)
    max_blocks: int = 1 << 20
    max_stacks: int = 1 << 16
    malt: bool = True  # keep MALT's statistics, for GET /malt
    say: Callable[[str], None] = field(default=_no_say)


class TargetManager:
    """Attach, query and detach targets at run time. Thread-safe."""

    def __init__(self, config: DaemonConfig, proc: str = "/proc") -> None:
        self.config = config
        self.proc = proc
        self._lock = threading.Lock()
        self._targets: dict[int, Target] = {}
        self._attaching: set[int] = set()

    # ---- life cycle ----

    def start(self) -> None:
        try:
            self.config.output_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise HeapscopeError(f"cannot create the output directory {self.config.output_dir}: {exc}") from exc

    def shutdown(self, timeout: float = 60.0) -> None:
        """End every profile and write every target's files (SIGTERM comes here)."""
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

    def attach(self, pid: int) -> Target:
        """Profile a running process from now on. Returns once the probes are attached."""
        if pid == os.getpid():
            raise UsageError("heapscope cannot profile itself")
        if not 1 <= pid <= PID_MAX:
            raise UsageError(f"{pid} is not a PID")
        self._reserve(pid)
        try:
            info = read_process(pid, self.proc)
            allocator = allocator_of_process(pid, self.proc)
            try:
                proc = psutil.Process(pid)
                name = proc.name()
            except psutil.Error as exc:
                raise TargetError(f"process {pid} went away: {exc}") from exc

            def alive() -> bool:
                try:
                    return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
                except psutil.Error:
                    return False

            t = self._new_target(pid, name, " ".join(info.cmdline), allocator)
            self._start(t, allocator, run=False, alive=alive, started=lambda: None)
        finally:
            with self._lock:
                self._attaching.discard(pid)
        return t

    def launch(self, argv: Sequence[str]) -> tuple[Target, HeldChild]:
        """Start a program held before exec, attach, then let it run (`heapscope run --http`)."""
        child = HeldChild(argv)
        try:
            allocator = allocator_of_program(child.path, child.env)
            self._reserve(child.pid)
        except BaseException:
            child.abandon()
            raise
        released = False

        def release() -> None:
            nonlocal released
            child.release()
            released = True

        try:
            t = self._new_target(child.pid, os.path.basename(argv[0])[:15], " ".join(argv), allocator)
            self._start(t, allocator, run=True, alive=lambda: child.poll() is None, started=release)
        except BaseException:
            if not released:
                child.abandon()
            raise
        finally:
            with self._lock:
                self._attaching.discard(child.pid)
        return t, child

    def detach(self, pid: int) -> TargetStatus:
        """Stop profiling `pid` (the process runs on, untouched), write its files, and forget it."""
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

    def _new_target(self, pid: int, name: str, cmdline: str, allocator: Allocator) -> Target:
        o = self.config.opts
        header = ProfileHeader(
            desc=tuple(self.config.desc),
            cmd=cmdline,
            pid=pid,
            time_unit=o.time_unit,
            threshold=o.threshold,
            xtree_kind="full" if o.xtree_memory == "full" else "allocs",
        )
        return Target(pid, name, cmdline, allocator.family, header)

    def _start(
        self, t: Target, allocator: Allocator, run: bool, alive: Callable[[], bool], started: Callable[[], None]
    ) -> None:
        t.thread = threading.Thread(
            target=self._profile, args=(t, allocator, run, alive, started), name=f"heapscope-{t.pid}", daemon=True
        )
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

    def _settings(self, pid: int, run: bool) -> ProbeSettings:
        o = self.config.opts
        return ProbeSettings(
            target_tgid=pid,
            arm_on_exec=run,
            stop_events=run,
            unwind=self.config.unwind == "cfi",
            free_stacks=o.xtree_memory == "full",
            heap_admin=o.heap_admin,
            alignment=o.alignment,
            max_depth=o.walked_frames,
            max_blocks=self.config.max_blocks,
            max_stacks=self.config.max_stacks,
            malt=self.config.malt,
            pages=True,  # page syscalls: the pages-as-heap tree, or the mapped total next to the heap
            stacks=o.stacks,
            schedule_ns=o.time_unit == "ms",  # the snapshot schedule's clock
        )

    def _profile(
        self, t: Target, allocator: Allocator, run: bool, alive: Callable[[], bool], started: Callable[[], None]
    ) -> None:
        """The target's sampling thread: attach, sample until exit or stop, keep the last state, write files."""
        say = self.config.say
        try:
            points = allocator.points(run, heap=not self.config.opts.pages_as_heap)
            tables = None
            if self.config.unwind == "cfi":
                from agent.symbols.unwind import load_table

                tables = load_table
            with HeapProbes(self._settings(t.pid, run), points) as probes:
                session = Session(
                    self.config.opts,
                    probes,
                    SessionInfo(t.pid, t.cmdline, list(self.config.desc), allocator.family),
                    tables=tables,
                    exec_limit=int(run),
                )
                if self.config.malt:
                    from agent.session.maltrec import MaltRecorder

                    session.recorder = MaltRecorder(probes, t.pid)
                    t.malt_source = (tuple(points), allocator.path)
                if not run:
                    session.prepare_attach()
                started()
                t.session = session
                say(f"probes attached to {t.pid} ({t.cmdline}; {probes.attached_through})")
                t.ready.set()
                try:
                    session.run(alive, t.stop, self.config.sample_interval)
                finally:
                    probes.detach()  # the target runs on untouched from here
                    if session.exec_ended():
                        say(f"process {t.pid} exec'ed another program: its profile ends there")
                    session.finish()
                    assert session.end_counters is not None
                    if t.malt_source is not None:  # built while the maps are open: queryable after the end
                        t.malt_final = session.malt_profile(*t.malt_source)
                    frozen = FrozenProbes(probes, session.end_counters)
                    with t.lock:
                        session.probes = frozen
            t.state = "detached" if alive() else "exited"
            t.ended_at = time.time()
            say(f"target {t.pid} {t.state}; its profile stays queryable")
            t.files = self._write_outputs(t, session)
        except BaseException as exc:  # reported to the attacher, or logged: never kills the daemon
            t.error = exc
            if t.ready.is_set():
                say(f"profiling {t.pid} failed: {exc}")
        finally:
            t.ready.set()
            t.done.set()

    def _write_outputs(self, t: Target, session: Session) -> tuple[str, ...]:
        o = self.config.opts
        outputs = [(o.massif_out_file, session.massif_text)]
        if o.xtree_memory != "none":
            outputs.append((o.xtree_memory_file, session.xtree_text))
        written = []
        for template, render in outputs:
            path = self.config.output_dir / self.config.expand(template, t.pid)
            try:
                path.write_text(render())
            except (OSError, HeapscopeError) as exc:
                self.config.say(f"cannot write {path}: {exc}")
                continue
            written.append(str(path))
            self.config.say(f"wrote {path}")
        for line in session.summary():
            self.config.say(f"{t.pid}: {line}")
        return tuple(written)

    # ---- monitor commands ----

    def monitor(self, pid: int | None, command: str) -> MonitorResult:
        return run_monitor(self.get, self.config.output_dir, pid, command)


class MonitorTarget(Protocol):
    pid: int

    def snapshot_text(self, detailed: bool) -> str: ...

    def massif_text(self) -> str: ...

    def xtree_text(self) -> str: ...

    def next_xtmemory_seq(self) -> int: ...


def run_monitor(
    get: Callable[[int | None], MonitorTarget], output_dir: Path, pid: int | None, command: str
) -> MonitorResult:
    """Run a Massif monitor command on the target `get(pid)`; its file goes under `output_dir`, nowhere else."""
    cmd = parse_monitor(command)
    if cmd.verb == "help":
        return MonitorResult(command=command.strip(), pid=None, file=None, bytes=0, output=MONITOR_HELP)
    if cmd.filename is not None:
        check_relative_name(cmd.filename)  # refuse before doing any work
    t = get(pid)
    if cmd.verb == "xtmemory":
        name = expand_monitor_name(cmd.filename or XTMEMORY_DEFAULT_FILE, t.pid, t.next_xtmemory_seq())
        text = t.xtree_text()
    else:
        name = expand_monitor_name(cmd.filename or MONITOR_DEFAULT_FILE, t.pid, 0)
        if cmd.verb == "all_snapshots":
            text = t.massif_text()
        else:
            text = t.snapshot_text(detailed=cmd.verb == "detailed_snapshot")
    path = write_under(output_dir, name, text)
    return MonitorResult(
        command=command.strip(), pid=t.pid, file=str(path), bytes=len(text.encode()), output=f"wrote {path}\n"
    )
