"""heapscope's command line: wires discovery, the probes, the session and the exporters together.

    heapscope run [options] -- PROG [ARGS]    launch PROG held until the probes are attached
    heapscope attach PID [options]            profile a running process until Ctrl-C, SIGTERM or its exit
    heapscope serve [--pid PID]... [options]  the daemon: targets, monitor commands and metrics over HTTP
    heapscope report / diff / growth STORE    read a stored history (agent.offline.commands)
    (run and attach take --http HOST:PORT to serve their one profile over HTTP while it runs)

Every error the user can act on is a HeapscopeError: main() prints it as one line and exits with its code.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, NoReturn

from agent import __version__
from agent.argtypes import byte_size, int_at_least, int_between, percent, positive_seconds, yes_no
from agent.daemon.fleetopts import add_fleet_options, fleet_config_from
from agent.errors import EnvironmentProblem, HeapscopeError, UnsafePath, UsageError
from agent.export.registry import FORMATS
from agent.log import LOG, PROG
from agent.model.options import MassifOptions
from agent.model.sampling import DEFAULT_CAPACITY, DEFAULT_SAMPLE_RATE, MAX_SAMPLE_RATE, MODES, Mode, ProfileMode
from agent.model.summary import ProfileSummary
from agent.offline import commands as offline_commands
from agent.offline import view
from agent.offline.timespec import parse_duration, parse_thin_rules
from agent.store import Retention, SyncPolicy

if TYPE_CHECKING:  # imported where used: `report`, `diff`, `growth` and `view` need none of the profiling side
    from agent.process.target import TargetProcess
    from agent.session.pipeline import Profile, ProfileSettings
    from agent.session.storerec import StoreSettings


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as a HeapscopeError (one line, exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        """An @FILE line is one argument; blank lines and lines starting with # are left out."""
        line = arg_line.strip()
        return [] if not line or line.startswith("#") else [line]


# Massif's options: (name, argparse keyword arguments). Their text as given goes into desc:. The two file
# options among Massif's come from the output registry (agent.export.registry).
_MASSIF_OPTIONS: list[tuple[str, dict]] = [  # type: ignore[type-arg]
    ("--heap", {"type": yes_no, "default": True, "metavar": "yes|no", "help": "profile the heap (default yes)"}),
    (
        "--heap-admin",
        {"type": int_at_least(0), "default": 8, "help": "admin bytes per block, in mem_heap_extra_B (default 8)"},
    ),
    (
        "--alignment",
        {
            "type": int_at_least(8),
            "default": 16,
            "help": "minimum alignment of blocks, a power of two: the slop in mem_heap_extra_B (default 16)",
        },
    ),
    (
        "--stacks",
        {"type": yes_no, "default": False, "metavar": "yes|no", "help": "profile the threads' stacks (default no)"},
    ),
    (
        "--pages-as-heap",
        {
            "type": yes_no,
            "default": False,
            "metavar": "yes|no",
            "help": "profile mapped pages (mmap, brk) instead of malloc's blocks (default no)",
        },
    ),
    (
        "--depth",
        {"type": int_at_least(1), "default": 30, "help": "frames kept below the allocation functions (default 30)"},
    ),
    (
        "--alloc-fn",
        {
            "action": "append",
            "default": [],
            "dest": "alloc_fns",
            "metavar": "NAME",
            "help": "one more allocation function, trimmed from the top of stacks like malloc (repeatable)",
        },
    ),
    (
        "--ignore-fn",
        {
            "action": "append",
            "default": [],
            "dest": "ignore_fns",
            "metavar": "NAME",
            "help": "leave out allocations made directly in NAME (repeatable)",
        },
    ),
    (
        "--threshold",
        {
            "type": percent,
            "default": 1.0,
            "help": "percent of the total below which tree nodes are merged (default 1.0)",
        },
    ),
    (
        "--peak-inaccuracy",
        {
            "type": percent,
            "default": 1.0,
            "help": "accepted for compatibility: heapscope's peak is always exact (default 1.0)",
        },
    ),
    (
        "--time-unit",
        {
            "choices": ("i", "ms", "B"),
            "default": "ms",
            "help": "ms: milliseconds since the start (default); B: bytes allocated and freed; "
            "i (instructions) is refused: it needs hardware counters",
        },
    ),
    (
        "--detailed-freq",
        {"type": int_at_least(1), "default": 10, "help": "every Nth snapshot is detailed (default 10)"},
    ),
    (
        "--max-snapshots",
        {
            "type": int_at_least(10),
            "default": 100,
            "help": "snapshots kept; culled to between N/2 and N (default 100)",
        },
    ),
    (
        "--xtree-memory",
        {
            "choices": ("none", "allocs", "full"),
            "default": "none",
            "help": "write the xtree memory report: allocs (live bytes) or full (allocated and freed too)",
        },
    ),
]
_MASSIF_NAMES = {name for name, _ in _MASSIF_OPTIONS} | {f.file_option for f in FORMATS if f.massif_option}


def _add_mode_options(p: argparse.ArgumentParser, default: Mode) -> None:
    m = p.add_argument_group("mode")
    m.add_argument(
        "--mode",
        choices=MODES,
        default=default,
        help="exact: every allocation call, as Massif counts (three uprobes a malloc+free pair); sampled: an "
        "in-process sampler reports one allocation per --sample-rate bytes on average, and the heap figures are "
        f"estimates (default {default})",
    )
    m.add_argument(
        "--sample-rate",
        type=int_between(1, MAX_SAMPLE_RATE),
        default=None,
        metavar="BYTES",
        help=f"sampled mode: the mean bytes between samples, Poisson by bytes (default {DEFAULT_SAMPLE_RATE})",
    )


def _add_profile_options(p: argparse.ArgumentParser, mode: Mode = "exact") -> None:
    _add_mode_options(p, mode)
    g = p.add_argument_group("Massif options (Valgrind's names, defaults and meanings)")
    for name, kwargs in _MASSIF_OPTIONS:
        g.add_argument(name, **kwargs)
    o = p.add_argument_group("output files (%p: the PID, %q{VAR}: an environment variable)")
    for fmt in FORMATS:
        group = g if fmt.massif_option else o
        default = f" (default {fmt.default_file})" if fmt.default_file else "; off by default"
        group.add_argument(
            fmt.file_option,
            default=fmt.default_file,
            metavar="FILE",
            help=f"{fmt.summary}{default}".replace("%", "%%"),
        )
        if fmt.variant is not None:
            v = fmt.variant
            group.add_argument(v.option, choices=v.choices, default=v.default, help=v.help)
    o.add_argument(
        "--summary-file",
        default=None,
        metavar="FILE",
        help="write the end-of-run summary there as JSON (%%p: the PID); off by default",
    )
    h = p.add_argument_group("heapscope options")
    h.add_argument(
        "--sample-interval",
        type=positive_seconds,
        default=0.05,
        metavar="SECONDS",
        help="how often the kernel's counters are sampled for snapshots (default 0.05)",
    )
    h.add_argument(
        "--max-blocks",
        type=int_at_least(1024),
        default=None,
        help="live blocks the kernel can track (sampled mode: live sampled blocks); more are counted as dropped "
        f"and reported (default {DEFAULT_CAPACITY['exact'][0]} exact, {DEFAULT_CAPACITY['sampled'][0]} sampled)",
    )
    h.add_argument(
        "--max-stacks",
        type=int_at_least(1024),
        default=None,
        help="distinct allocation stacks the kernel can keep; more are counted and reported "
        f"(default {DEFAULT_CAPACITY['exact'][1]} exact, {DEFAULT_CAPACITY['sampled'][1]} sampled)",
    )
    h.add_argument(
        "--unwind",
        choices=("cfi", "fp"),
        default="cfi",
        help="walk stacks with .eh_frame tables (cfi, default) or frame pointers only (fp)",
    )
    h.add_argument("-q", "--quiet", action="store_true", help="print errors only")
    h.add_argument("-v", "--verbose", action="count", default=0,
                   help="more detail (Massif's -v): where each allocation function's probe sits and how")
    h.add_argument("--stats", type=yes_no, default=False, metavar="yes|no",
                   help="at the end, Massif's statistics from heapscope's own counts: allocations, frees, "
                   "reallocs, snapshots and cullings (Valgrind's --stats; default no)")


def build_parser() -> argparse.ArgumentParser:
    # @FILE reads arguments from FILE, one a line (a Kubernetes ConfigMap's selectors and limits, deploy/).
    parser = _Parser(
        prog=PROG,
        description="Heap profiling of running processes with eBPF, Massif-compatible.",
        fromfile_prefix_chars="@",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser(
        "run",
        help="launch a program and profile it from its first instruction",
        usage=f"{PROG} run [options] -- PROG [ARGS]",
    )
    _add_profile_options(run)
    _add_store_options(run, serve=False)
    attach = sub.add_parser("attach", help="profile a running process until Ctrl-C, SIGTERM or its exit")
    attach.add_argument("pid", type=int_at_least(1), help="the process to profile")
    _add_profile_options(attach, "sampled")
    _add_store_options(attach, serve=False)
    _add_http_options(run, serve=False)
    _add_http_options(attach, serve=False)
    serve = sub.add_parser(
        "serve",
        help="the daemon: profile processes attached over HTTP (POST /targets) or with --pid, until SIGTERM",
    )
    serve.add_argument(
        "--pid", type=int_at_least(1), action="append", default=[], dest="pids", help="attach to PID at start"
    )
    _add_profile_options(serve, "sampled")
    _add_store_options(serve, serve=True)
    _add_http_options(serve, serve=True)
    add_fleet_options(serve)
    offline_commands.register(sub)
    view.add_parser(sub)
    return parser


def _add_http_options(p: argparse.ArgumentParser, serve: bool) -> None:
    """The daemon's HTTP options. Left unset, they come from HEAPSCOPE_* variables (api.settings)."""
    g = p.add_argument_group("HTTP daemon (Massif's monitor commands, targets and Prometheus metrics over HTTP)")
    g.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=None,
        help="listen there (default 127.0.0.1:7411)" if serve else "serve the profile over HTTP while it runs",
    )
    g.add_argument(
        "--token",
        default=None,
        help="bearer token every endpoint but /healthz requires; needed to listen beyond loopback "
        "(or HEAPSCOPE_TOKEN, which keeps it out of the process list)",
    )
    g.add_argument(
        "--output-dir", default=None, metavar="DIR", help="where files are written (default: the current directory)"
    )
    g.add_argument(
        "--malt",
        choices=("yes", "no"),
        default="yes",
        help="keep MALT's statistics of every target, for GET /malt (default yes; they cost ~20-30%% more a call)",
    )
    g.add_argument(
        "--metrics-top-stacks",
        type=int_at_least(0),
        default=None,
        metavar="N",
        help="per-target allocation sites in /metrics, the rest summed into one series (default 10)",
    )


DEFAULT_STORE = "store"  # serve's store, under --output-dir


def _add_store_options(p: argparse.ArgumentParser, serve: bool) -> None:
    """The history store: every sample on disk, read back with `heapscope report` and `heapscope diff`."""
    g = p.add_argument_group("history store (every sample kept on disk, for heapscope report and diff)")
    if serve:
        g.add_argument("--store", metavar="DIR", default=None,
                       help=f"keep each target's history in DIR/<pid>/, DIR under --output-dir "
                            f"(default {DEFAULT_STORE})")
        g.add_argument("--no-store", action="store_true", help="keep no history on disk")
    else:
        g.add_argument("--store", metavar="DIR", default=None,
                       help="keep every sample of the profile in DIR/<pid>/ (off by default)")
    g.add_argument("--store-interval", type=positive_seconds, default=1.0, metavar="SECONDS",
                   help="seconds between stored samples (default 1)")
    g.add_argument("--store-quiet-interval", type=positive_seconds, default=60.0, metavar="SECONDS",
                   help="seconds between stored samples of a target whose heap, mappings and RSS do not move "
                        "(default 60); the history keeps it as a step")
    g.add_argument("--store-sync", choices=("interval", "always", "never"), default="interval",
                   help="when stored samples are forced to disk: at most --store-interval after they are written "
                        "(interval, the default: a power loss costs at most that much history), after each "
                        "(always), or when the kernel pleases (never). A crash of heapscope alone loses nothing")
    g.add_argument("--store-max-size", type=byte_size, default=Retention.max_bytes, metavar="SIZE",
                   help="history kept per process, oldest deleted first (default 4G)")
    g.add_argument("--store-max-age", default="7d", metavar="AGE",
                   help="history older than this is deleted (default 7d); `serve` also deletes it from the "
                        "histories of processes it no longer profiles")
    g.add_argument("--store-thin", default=None, metavar="AGE:EVERY,...",
                   help="thin older history: 1h:10s,1d:1m keeps one snapshot per 10 s of history older than an "
                        "hour, one a minute beyond a day (default: nothing is thinned)")


def store_settings(ns: argparse.Namespace, output_dir: Path | None = None) -> StoreSettings | None:
    """The store of `run` and `attach` (--store DIR, as given), or of `serve` (`output_dir`/store unless
    --no-store; a --store DIR that leaves the output directory is refused)."""
    from agent.session.storerec import StoreSettings

    if ns.command == "serve":
        assert output_dir is not None
        if ns.no_store:
            if ns.store is not None:
                raise UsageError("--store and --no-store contradict each other")
            return None
        root = _under_output_dir(output_dir, ns.store or DEFAULT_STORE)
    elif ns.store is None:
        return None
    else:
        root = Path(ns.store)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EnvironmentProblem(f"cannot create the store directory {root}: {exc.strerror}") from None
    if not os.access(root, os.W_OK | os.X_OK):
        raise EnvironmentProblem(f"the store directory {root} is not writable")
    thin = parse_thin_rules(ns.store_thin) if ns.store_thin else ()
    retention = Retention(max_bytes=ns.store_max_size, max_age_s=parse_duration(ns.store_max_age), thin=thin)
    sync = SyncPolicy(ns.store_sync, interval=max(ns.store_interval, 1.0) if ns.store_sync == "interval" else 1.0)
    return StoreSettings(root, interval=ns.store_interval, sync=sync, retention=retention,
                         quiet_interval=max(ns.store_quiet_interval, ns.store_interval))


def _under_output_dir(output_dir: Path, name: str) -> Path:
    """`name` (relative to `output_dir`, or absolute) as a path that stays under `output_dir` once symbolic links
    and `..` are resolved: the daemon writes nowhere else."""
    base = output_dir.resolve()
    path = (base / name).resolve()
    if path != base and base not in path.parents:
        raise UnsafePath(f"--store {name} is outside the output directory {output_dir}: the daemon writes only "
                         "under --output-dir (give a directory below it)")
    if path == base:
        raise UnsafePath(f"--store {name} is the output directory itself: give a directory below it")
    return path


def _split_program(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """`run`'s own options, and the program with its arguments (after `--`, or from the first non-option)."""
    if "--" in argv:
        i = list(argv).index("--")
        return list(argv[:i]), list(argv[i + 1 :])
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (i == 0 or not _takes_value(argv[i - 1])):
            return list(argv[:i]), list(argv[i:])
    return list(argv), []


def _value_options() -> frozenset[str]:
    """The options written as `--name VALUE` (rather than `--name=VALUE`), as the parser declares them."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(
        name
        for parser in sub.choices.values()
        for action in parser._actions
        if action.nargs != 0
        for name in action.option_strings
    )


_VALUE_OPTIONS: frozenset[str] | None = None


def _takes_value(arg: str) -> bool:
    global _VALUE_OPTIONS
    if _VALUE_OPTIONS is None:
        _VALUE_OPTIONS = _value_options()
    return arg in _VALUE_OPTIONS


def options_from(ns: argparse.Namespace) -> MassifOptions:
    opts = MassifOptions(
        heap=ns.heap,
        heap_admin=ns.heap_admin,
        alignment=ns.alignment,
        stacks=ns.stacks,
        pages_as_heap=ns.pages_as_heap,
        depth=ns.depth,
        alloc_fns=ns.alloc_fns,
        ignore_fns=ns.ignore_fns,
        threshold=ns.threshold,
        peak_inaccuracy=ns.peak_inaccuracy,
        time_unit=ns.time_unit,
        detailed_freq=ns.detailed_freq,
        max_snapshots=ns.max_snapshots,
        xtree_memory=ns.xtree_memory,
    )
    if opts.stacks and opts.pages_as_heap:
        raise UsageError("--stacks=yes cannot be combined with --pages-as-heap=yes (as in Massif)")
    if not opts.heap and not opts.pages_as_heap:
        # Stack depths are sampled at the allocator's probes: without them there is nothing to sample.
        raise UsageError("--heap=no needs --pages-as-heap=yes: heapscope samples stack depths at allocator calls")
    if opts.time_unit == "i":
        raise UsageError(
            "--time-unit=i needs hardware instruction counters, which heapscope does not read yet "
            "(and this machine may not have them: see `perf stat -e instructions true`); use ms or B"
        )
    if opts.alignment & (opts.alignment - 1):
        raise UsageError(f"--alignment must be a power of two, got {opts.alignment}")
    return opts


def massif_desc(argv: Sequence[str]) -> list[str]:
    """Massif's desc: the Massif options as the user wrote them."""
    out = []
    for i, arg in enumerate(argv):
        name = arg.split("=", 1)[0]
        if name in _MASSIF_NAMES:
            if "=" not in arg and _takes_value(arg) and i + 1 < len(argv):
                arg = f"{arg}={argv[i + 1]}"
            out.append(arg)
    return out


def expand_filename(template: str, pid: int, env: dict[str, str] | None = None) -> str:
    """Valgrind's %p (PID), %q{VAR} (an environment variable) and %% in output file names."""
    env = dict(os.environ) if env is None else env

    def one(m: re.Match[str]) -> str:
        token = m.group(0)
        if token == "%%":
            return "%"
        if token == "%p":
            return str(pid)
        var = m.group(1)
        if var is None:
            raise UsageError(f"bad output file name {template!r}: %q must be followed by {{VARIABLE}}")
        if var not in env:
            raise UsageError(f"output file name {template!r}: environment variable {var} is not set")
        return env[var]

    name = re.sub(r"%%|%p|%q(?:\{([^}]*)\})?", one, template)
    if re.search(r"%[^%pq]", name.replace("%%", "")) and "%" in template:
        raise UsageError(f"bad output file name {template!r}: only %p, %q{{VAR}} and %% are understood")
    return name


def mode_from(ns: argparse.Namespace) -> ProfileMode:
    if ns.sample_rate is not None and ns.mode != "sampled":
        raise UsageError("--sample-rate applies to --mode=sampled")
    if ns.mode == "sampled" and ns.pages_as_heap:
        raise UsageError("--pages-as-heap=yes profiles mapped pages, which sampled mode does not sample; "
                         "use --mode=exact")
    return ProfileMode(ns.mode, DEFAULT_SAMPLE_RATE if ns.sample_rate is None else ns.sample_rate)


def settings_from(ns: argparse.Namespace, desc: Sequence[str], daemon: bool) -> ProfileSettings:
    """The pipeline's settings from the command line. A daemon keeps MALT's statistics unless --malt=no (for
    GET /malt); `run` and `attach` keep them only for a MALT file."""
    from agent.session.pipeline import ProfileSettings

    opts = options_from(ns)
    files = {f.name: getattr(ns, f.dest) for f in FORMATS if getattr(ns, f.dest) is not None}
    variants = {f.name: getattr(ns, f.variant.dest) for f in FORMATS if f.variant is not None}
    return ProfileSettings(
        opts=opts,
        desc=tuple(desc),
        files=files,
        variants=variants,
        sample_interval=ns.sample_interval,
        unwind=ns.unwind,
        verbose=ns.verbose,
        max_blocks=ns.max_blocks,
        max_stacks=ns.max_stacks,
        malt=ns.malt == "yes" if daemon else "malt" in files,
        mode=mode_from(ns),
        store=store_settings(ns) if ns.command != "serve" else None,  # serve's is under --output-dir: cmd_daemon
    )


# ---- running a profile --------------------------------------------------------------------------------


@dataclass
class _Ctx:
    settings: ProfileSettings
    ns: argparse.Namespace

    def say(self, line: str) -> None:
        if not self.ns.quiet:
            LOG.say(line)  # a log that fails (a closed pipe) is counted, never the profile's end


def _stderr_of_our_own() -> None:
    """A daemon's lines go to a duplicate of fd 2, not to fd 2 itself: compiling a target's program points fd 2 at
    a file for seconds (agent.kernel.probes captures clang's messages there), and every line the other threads
    said meanwhile went into that file, not to the log."""
    sys.stderr.flush()
    sys.stderr = open(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")  # noqa: SIM115


def _require_environment() -> None:
    from agent.process.capability import check_environment

    problems = check_environment()
    if problems:
        raise EnvironmentProblem("; ".join(problems))


def _profile(ctx: _Ctx, process: TargetProcess, stop: threading.Event) -> Profile:
    """`run` and `attach` without --http: the pipeline in this thread, then the files and the summary."""
    from agent.session.pipeline import Profile

    profile = Profile(ctx.settings, process, ctx.say)
    profile.run(stop)
    profile.write_outputs(Path("."), expand_filename, strict=True)
    summary = profile.summary()
    for line in summary.lines():
        ctx.say(line)
    if ctx.ns.stats:
        for line in summary.massif_stats():
            ctx.say(line)
    _write_summary(ctx, summary, process.pid, Path("."))
    return profile


def _write_summary(ctx: _Ctx, summary: ProfileSummary, pid: int, output_dir: Path) -> None:
    if ctx.ns.summary_file is None:
        return
    path = output_dir / expand_filename(ctx.ns.summary_file, pid)
    try:
        path.write_text(json.dumps(summary.to_json(), indent=1) + "\n")
    except OSError as exc:
        raise HeapscopeError(f"cannot write the summary: {exc}") from exc


def _stop_on_signals(stop: threading.Event, forward: Callable[[int], None] | None = None) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        if forward is not None:
            forward(signum)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def _forward_sigterm(process: TargetProcess) -> Callable[[int], None]:
    """Ctrl-C reaches a launched child through the terminal already; SIGTERM to us is passed on."""

    def forward(signum: int) -> None:
        if process.child is not None and signum == signal.SIGTERM:
            process.child.forward(signum)

    return forward


def cmd_run(ctx: _Ctx, program: list[str]) -> int:
    from agent.process.launch import HeldChild

    if not program:
        raise UsageError("no program given: heapscope run [options] -- PROG [ARGS]")
    _require_environment()
    process = ctx.settings.launch(program)
    _stop_on_signals(threading.Event(), _forward_sigterm(process))  # the run ends when the child does
    _profile(ctx, process, threading.Event())
    assert process.child is not None
    return HeldChild.exit_code(process.child.wait())


def cmd_attach(ctx: _Ctx) -> int:
    from agent.process.discovery import read_process
    from agent.process.target import attach_to

    pid = ctx.ns.pid
    if pid == os.getpid():
        raise UsageError("heapscope cannot profile itself")
    read_process(pid)  # a missing PID is said before anything else
    _require_environment()
    process = attach_to(pid)
    ctx.settings.preflight(pid)
    stop = threading.Event()
    _stop_on_signals(stop)
    ctx.say(f"attaching to {pid} ({process.cmdline}); Ctrl-C or SIGTERM ends the profile")
    _profile(ctx, process, stop)
    if not process.alive():
        ctx.say(f"process {pid} exited; the profile holds its final state")
    return 0


# ---- the daemon: serve, and run/attach --http ----------------------------------------------------------


def _api_settings(ns: argparse.Namespace):  # type: ignore[no-untyped-def]
    from pydantic import ValidationError

    from api.server import parse_listen
    from api.settings import ApiSettings, check_exposure

    given: dict[str, object] = {}
    if ns.http is not None:
        given["host"], given["port"] = parse_listen(ns.http)
    if ns.token is not None:
        given["token"] = ns.token
    if ns.output_dir is not None:
        given["output_dir"] = ns.output_dir
    if ns.metrics_top_stacks is not None:
        given["metrics_top_stacks"] = ns.metrics_top_stacks
    try:
        settings = ApiSettings(**given)  # type: ignore[arg-type]
    except ValidationError as exc:
        err = exc.errors()[0]
        raise UsageError(f"bad setting {'.'.join(str(x) for x in err['loc'])}: {err['msg']}") from None
    check_exposure(settings)
    return settings


def _try_lines(host: str, port: int, token: bool, pid: int | None) -> list[str]:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    base = f"http://[{shown}]:{port}" if ":" in shown else f"http://{shown}:{port}"
    auth = ' -H "Authorization: Bearer $HEAPSCOPE_TOKEN"' if token else ""
    q = f"?pid={pid}" if pid is not None else ""
    return [
        f"  curl -s{auth} {base}/targets",
        f"  curl -s{auth} {base}/snapshot{q}",
        f"  curl -s{auth} '{base}/detailed_snapshot{q}' -o ds.out && ms_print ds.out",
        f"  curl -s{auth} '{base}/all_snapshots{q}' -o massif.out && ms_print massif.out",
        f"  curl -s{auth} '{base}/xtmemory{q}' -o xt.kcg && callgrind_annotate --inclusive=yes xt.kcg",
        f"  curl -s{auth} '{base}/detailed_snapshot{q}{'&' if q else '?'}format=json'",
        f"  curl -s{auth} {base}/monitor -H 'Content-Type: application/json' -d '{{\"command\": \"help\"}}'",
        f"  curl -s{auth} {base}/metrics",
    ]


def cmd_daemon(ctx: _Ctx, pids: Sequence[int] = (), program: Sequence[str] | None = None) -> int:
    """`serve` (until SIGTERM), or `run`/`attach` with --http (until the target ends, as without --http)."""
    from agent.daemon.fleet import FleetManager
    from agent.daemon.manager import DaemonConfig
    from agent.process.launch import HeldChild
    from api.app import create_app
    from api.server import bind, serve

    settings = _api_settings(ctx.ns)
    fleet = fleet_config_from(ctx.ns)  # a bad selector is said before anything starts
    _stderr_of_our_own()
    if ctx.ns.command == "serve":
        ctx.settings = replace(ctx.settings, store=store_settings(ctx.ns, settings.output_dir))
    _require_environment()
    sock = bind(settings.host, settings.port)  # first: a bad address fails before anything is attached
    host, port = sock.getsockname()[:2]
    config = DaemonConfig(
        profile=ctx.settings,
        output_dir=settings.output_dir,
        expand=expand_filename,
        say=ctx.say,
        summary_file=ctx.ns.summary_file,
    )
    manager = FleetManager(config, fleet)
    app = create_app(settings, manager)
    until = None
    child = None
    try:
        manager.start()
        if program is not None:
            target = manager.launch(program)
            child = target.process.child
            until = target.done
        for pid in pids:
            target = manager.attach(pid)
            if ctx.ns.command == "attach":
                until = target.done
    except BaseException:
        sock.close()
        manager.shutdown()
        raise
    shown_pid = child.pid if child is not None else (pids[0] if len(pids) == 1 else None)
    ctx.say(f"serving http://{host}:{port}" + ("" if until is None else " while the target runs"))
    ctx.say("try:")
    for line in _try_lines(host, port, settings.token is not None, shown_pid):
        ctx.say(line)

    def on_signal(signum: int) -> None:
        # As `run` without --http: SIGTERM is passed on (Ctrl-C reaches the child through the terminal).
        if child is not None and signum == signal.SIGTERM:
            child.forward(signum)

    serve(app, sock, until=until, on_signal=on_signal)  # the app's shutdown writes every target's files
    if child is not None:
        return HeldChild.exit_code(child.wait())
    return 0


def _command(ns: argparse.Namespace, own_args: Sequence[str], daemon: bool) -> _Ctx:
    return _Ctx(settings_from(ns, massif_desc(own_args), daemon=daemon), ns)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        if args and args[0] == "run":
            own, program = _split_program(args[1:])
            ns = parser.parse_args(["run", *own])
            ctx = _command(ns, own, daemon=ns.http is not None)
            if ns.http is not None:
                return cmd_daemon(ctx, program=program)
            return cmd_run(ctx, program)
        ns = parser.parse_args(args)
        if ns.command in offline_commands.COMMANDS:
            return offline_commands.run(ns)
        if ns.command == "view":
            return view.run(ns)
        if ns.command == "serve":
            return cmd_daemon(_command(ns, args[1:], daemon=True), pids=ns.pids)
        ctx = _command(ns, args[2:], daemon=ns.http is not None)
        if ns.http is not None:
            return cmd_daemon(ctx, pids=[ns.pid])
        return cmd_attach(ctx)
    except HeapscopeError as exc:
        LOG.say(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        LOG.say("interrupted")
        return 130
    except Exception as exc:  # a bug of ours: one line, and the probes were detached on the way out
        LOG.say(f"internal error: {type(exc).__name__}: {exc}")
        return 70


if __name__ == "__main__":
    sys.exit(main())
