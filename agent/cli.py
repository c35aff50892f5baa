"""heapscope's command line: wires discovery, the probes, the session and the exporters together.

    heapscope run [options] -- PROG [ARGS]    launch PROG held until the probes are attached
    heapscope attach PID [options]            profile a running process until Ctrl-C, SIGTERM or its exit
    heapscope serve [--pid PID]... [options]  the daemon: targets, monitor commands and metrics over HTTP
    (run and attach take --http HOST:PORT to serve their one profile over HTTP while it runs)

Every error the user can act on is a HeapscopeError: main() prints it as one line and exits with its code.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import NoReturn

import psutil

from agent import __version__
from agent.errors import EnvironmentProblem, HeapscopeError, TargetError, UsageError
from agent.model.options import MAX_WALKED_FRAMES, MassifOptions
from agent.process.capability import check_environment
from agent.process.discovery import Allocator, ProbePoint, allocator_of_process, allocator_of_program, read_process
from agent.process.launch import HeldChild
from agent.session.session import Session, SessionInfo

PROG = "heapscope"


class _Parser(argparse.ArgumentParser):
    """argparse that reports errors as a HeapscopeError (one line, exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def _yes_no(text: str) -> bool:
    if text in ("yes", "no"):
        return text == "yes"
    raise argparse.ArgumentTypeError(f"expected yes or no, got {text!r}")


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a percentage, got {text!r}") from None
    if not 0.0 <= value <= 100.0:
        raise argparse.ArgumentTypeError(f"must be between 0.0 and 100.0, got {value}")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {value}")
    return value


# Massif's options: (name, argparse keyword arguments). Their text as given goes into desc:.
_MASSIF_OPTIONS: list[tuple[str, dict]] = [  # type: ignore[type-arg]
    ("--heap", {"type": _yes_no, "default": True}),
    ("--heap-admin", {"type": _int_at_least(0), "default": 8}),
    ("--alignment", {"type": _int_at_least(8), "default": 16}),
    ("--stacks", {"type": _yes_no, "default": False}),
    ("--pages-as-heap", {"type": _yes_no, "default": False}),
    ("--depth", {"type": _int_at_least(1), "default": 30}),
    ("--alloc-fn", {"action": "append", "default": [], "dest": "alloc_fns"}),
    ("--ignore-fn", {"action": "append", "default": [], "dest": "ignore_fns"}),
    ("--threshold", {"type": _percent, "default": 1.0}),
    ("--peak-inaccuracy", {"type": _percent, "default": 1.0}),
    ("--time-unit", {"choices": ("i", "ms", "B"), "default": "ms"}),
    ("--detailed-freq", {"type": _int_at_least(1), "default": 10}),
    ("--max-snapshots", {"type": _int_at_least(10), "default": 100}),
    ("--massif-out-file", {"default": "massif.out.%p"}),
    ("--xtree-memory", {"choices": ("none", "allocs", "full"), "default": "none"}),
    ("--xtree-memory-file", {"default": "xtmemory.kcg.%p"}),
]
_MASSIF_NAMES = {name for name, _ in _MASSIF_OPTIONS}


def _add_profile_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("Massif options (Valgrind's names, defaults and meanings)")
    for name, kwargs in _MASSIF_OPTIONS:
        g.add_argument(name, **kwargs)
    m = p.add_argument_group("MALT profile (per-stack statistics, lifetimes, timelines, leaks)")
    m.add_argument(
        "--malt-out-file",
        default=None,
        metavar="FILE",
        help="write a MALT JSON profile there at the end (%%p: the PID); off by default",
    )
    m.add_argument(
        "--malt-format",
        choices=("1.1", "1.6"),
        default="1.1",
        help="1.1 (the documented format, default) or 1.6 (what current MALT's reader requires)",
    )
    h = p.add_argument_group("heapscope options")
    h.add_argument(
        "--sample-interval",
        type=_positive_seconds,
        default=0.05,
        metavar="SECONDS",
        help="how often the kernel's counters are sampled for snapshots (default 0.05)",
    )
    h.add_argument(
        "--max-blocks",
        type=_int_at_least(1024),
        default=1 << 20,
        help="live blocks the kernel can track; more are counted as dropped (default 1048576)",
    )
    h.add_argument(
        "--max-stacks",
        type=_int_at_least(1024),
        default=1 << 16,
        help="distinct allocation stacks the kernel can keep (default 65536)",
    )
    h.add_argument(
        "--unwind",
        choices=("cfi", "fp"),
        default="cfi",
        help="walk stacks with .eh_frame tables (cfi, default) or frame pointers only (fp)",
    )
    h.add_argument("-q", "--quiet", action="store_true", help="print errors only")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Heap profiling of running processes with eBPF, Massif-compatible.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    run = sub.add_parser(
        "run",
        help="launch a program and profile it from its first instruction",
        usage=f"{PROG} run [options] -- PROG [ARGS]",
    )
    _add_profile_options(run)
    attach = sub.add_parser("attach", help="profile a running process until Ctrl-C, SIGTERM or its exit")
    attach.add_argument("pid", type=_int_at_least(1), help="the process to profile")
    _add_profile_options(attach)
    _add_http_options(run, serve=False)
    _add_http_options(attach, serve=False)
    serve = sub.add_parser(
        "serve",
        help="the daemon: profile processes attached over HTTP (POST /targets) or with --pid, until SIGTERM",
    )
    serve.add_argument(
        "--pid", type=_int_at_least(1), action="append", default=[], dest="pids", help="attach to PID at start"
    )
    _add_profile_options(serve)
    _add_http_options(serve, serve=True)
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
        type=_int_at_least(0),
        default=None,
        metavar="N",
        help="per-target allocation sites in /metrics, the rest summed into one series (default 10)",
    )


def _split_program(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """`run`'s own options, and the program with its arguments (after `--`, or from the first non-option)."""
    if "--" in argv:
        i = list(argv).index("--")
        return list(argv[:i]), list(argv[i + 1 :])
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (i == 0 or not _takes_value(argv[i - 1])):
            return list(argv[:i]), list(argv[i:])
    return list(argv), []


def _takes_value(arg: str) -> bool:
    """An option written as `--name VALUE` (rather than `--name=VALUE`)."""
    return arg in _MASSIF_NAMES - {"--heap", "--stacks", "--pages-as-heap"} or arg in (
        "--sample-interval",
        "--max-blocks",
        "--max-stacks",
        "--unwind",
        "--malt-out-file",
        "--malt-format",
        "--http",
        "--token",
        "--output-dir",
        "--metrics-top-stacks",
        "--malt",
    )


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
        massif_out_file=ns.massif_out_file,
        xtree_memory=ns.xtree_memory,
        xtree_memory_file=ns.xtree_memory_file,
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


# ---- running a session --------------------------------------------------------------------------------


@dataclass
class _Ctx:
    opts: MassifOptions
    ns: argparse.Namespace
    desc: list[str]

    def say(self, line: str) -> None:
        if not self.ns.quiet:
            print(f"{PROG}: {line}", file=sys.stderr, flush=True)


def _require_environment() -> None:
    problems = check_environment()
    if problems:
        raise EnvironmentProblem("; ".join(problems))


def _settings(ctx: _Ctx, pid: int, run: bool):  # type: ignore[no-untyped-def]
    from agent.kernel.probes import ProbeSettings  # the BPF layer is only loaded when probes are

    return ProbeSettings(
        target_tgid=pid,
        arm_on_exec=run,
        stop_events=run,
        unwind=ctx.ns.unwind == "cfi",
        free_stacks=ctx.opts.xtree_memory == "full",
        malt=bool(ctx.ns.malt_out_file),
        heap_admin=ctx.opts.heap_admin,
        alignment=ctx.opts.alignment,
        max_depth=ctx.opts.walked_frames,
        max_blocks=ctx.ns.max_blocks,
        max_stacks=ctx.ns.max_stacks,
        pages=True,  # page syscalls: the pages-as-heap tree, or the mapped total next to the heap
        stacks=ctx.opts.stacks,
        schedule_ns=ctx.opts.time_unit == "ms",  # the snapshot schedule's clock
    )


def _profile(
    ctx: _Ctx,
    pid: int,
    cmd: str,
    allocator: Allocator,
    run: bool,
    alive: Callable[[], bool],
    started: Callable[[], None],
    stop: threading.Event,
) -> Session:
    from agent.kernel.probes import HeapProbes

    for line in allocator.describe():
        ctx.say(line)
    if ctx.opts.depth + 12 > MAX_WALKED_FRAMES:
        ctx.say(f"stacks are walked to {MAX_WALKED_FRAMES} frames at most (the BPF verifier's limit)")
    points = allocator.points(run, heap=not ctx.opts.pages_as_heap)
    with HeapProbes(_settings(ctx, pid, run), points) as probes:
        tables = None
        if ctx.ns.unwind == "cfi":
            from agent.symbols.unwind import load_table

            tables = load_table
        session = Session(
            ctx.opts, probes, SessionInfo(pid, cmd, ctx.desc, allocator.family), tables=tables, exec_limit=int(run)
        )
        if ctx.ns.malt_out_file:
            from agent.session.maltrec import MaltRecorder

            session.recorder = MaltRecorder(probes, pid)
        if not run:
            session.prepare_attach()
        ctx.say(f"probes attached to {pid} ({probes.attached_through})")
        started()
        session.run(alive, stop, ctx.ns.sample_interval)
        probes.detach()  # the target runs on untouched from here
        if session.exec_ended():
            ctx.say(f"process {pid} exec'ed another program: the profile ends there")
        session.finish()
        _write_outputs(ctx, session, pid)
        if session.recorder is not None:
            _write_malt(ctx, session, points, allocator.path, pid)
    return session


def _write_malt(ctx: _Ctx, session: Session, points: Sequence[ProbePoint], allocator: str, pid: int) -> None:
    from agent.export.malt import check_consistency, symbolizer_resolver, write_malt

    assert session.recorder is not None and session.end_counters is not None
    profile = session.malt_profile(points, allocator)
    path = expand_filename(ctx.ns.malt_out_file, pid)
    try:
        with open(path, "w") as out:
            resolve = symbolizer_resolver(session.symbolizer, session.maps.mappings)
            write_malt(out, profile, format_version=ctx.ns.malt_format, resolve=resolve)
    except OSError as exc:
        raise HeapscopeError(f"cannot write the MALT profile: {exc}") from exc
    ctx.say(f"wrote {path}")
    for problem in check_consistency(profile):
        ctx.say(f"MALT profile inconsistent (concurrent updates in the kernel?): {problem}")


def _write_outputs(ctx: _Ctx, session: Session, pid: int) -> None:
    path = expand_filename(ctx.opts.massif_out_file, pid)
    try:
        _write_file(path, session.massif_text())
        ctx.say(f"wrote {path}")
        if ctx.opts.xtree_memory != "none":
            xpath = expand_filename(ctx.opts.xtree_memory_file, pid)
            _write_file(xpath, session.xtree_text())
            ctx.say(f"wrote {xpath}")
    except OSError as exc:
        raise HeapscopeError(f"cannot write the profile: {exc}") from exc
    for line in session.summary():
        ctx.say(line)


def _write_file(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _stop_on_signals(stop: threading.Event, forward: Callable[[int], None] | None = None) -> None:
    def handler(signum: int, frame: FrameType | None) -> None:
        if forward is not None:
            forward(signum)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def cmd_run(ctx: _Ctx, program: list[str]) -> int:
    if not program:
        raise UsageError("no program given: heapscope run [options] -- PROG [ARGS]")
    _require_environment()
    child = HeldChild(program)
    stop = threading.Event()
    try:
        allocator = allocator_of_program(child.path, child.env)
    except BaseException:
        child.abandon()
        raise

    def forward(signum: int) -> None:
        # Ctrl-C reaches the child through the terminal already; SIGTERM to us is passed on.
        if signum == signal.SIGTERM:
            child.forward(signum)

    _stop_on_signals(threading.Event(), forward)  # the run ends when the child does
    released = False

    def start() -> None:
        nonlocal released
        child.release()
        released = True

    try:
        _profile(ctx, child.pid, " ".join(program), allocator, True, lambda: child.poll() is None, start, stop)
    except BaseException:
        if not released:
            child.abandon()
        raise
    return HeldChild.exit_code(child.wait())


def cmd_attach(ctx: _Ctx) -> int:
    pid = ctx.ns.pid
    if pid == os.getpid():
        raise UsageError("heapscope cannot profile itself")
    info = read_process(pid)
    _require_environment()
    allocator = allocator_of_process(pid)
    try:
        proc = psutil.Process(pid)
    except psutil.Error as exc:
        raise TargetError(f"process {pid} went away: {exc}") from exc
    stop = threading.Event()
    _stop_on_signals(stop)

    def alive() -> bool:
        try:
            return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    ctx.say(f"attaching to {pid} ({' '.join(info.cmdline)}); Ctrl-C or SIGTERM ends the profile")
    _profile(ctx, pid, " ".join(info.cmdline), allocator, False, alive, lambda: None, stop)
    if not alive():
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
    from agent.daemon.manager import DaemonConfig, TargetManager
    from api.app import create_app
    from api.server import bind, serve

    settings = _api_settings(ctx.ns)
    _require_environment()
    sock = bind(settings.host, settings.port)  # first: a bad address fails before anything is attached
    host, port = sock.getsockname()[:2]
    config = DaemonConfig(
        opts=ctx.opts,
        desc=ctx.desc,
        output_dir=settings.output_dir,
        expand=expand_filename,
        sample_interval=ctx.ns.sample_interval,
        unwind=ctx.ns.unwind,
        max_blocks=ctx.ns.max_blocks,
        max_stacks=ctx.ns.max_stacks,
        malt=ctx.ns.malt == "yes",
        say=ctx.say,
    )
    manager = TargetManager(config)
    app = create_app(settings, manager)
    until = None
    child = None
    try:
        manager.start()
        if program is not None:
            target, child = manager.launch(program)
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


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser()
        if args and args[0] == "run":
            own, program = _split_program(args[1:])
            ns = parser.parse_args(["run", *own])
            ctx = _Ctx(options_from(ns), ns, massif_desc(own))
            if ns.http is not None:
                return cmd_daemon(ctx, program=program)
            return cmd_run(ctx, program)
        ns = parser.parse_args(args)
        if ns.command == "serve":
            ctx = _Ctx(options_from(ns), ns, massif_desc(args[1:]))
            return cmd_daemon(ctx, pids=ns.pids)
        ctx = _Ctx(options_from(ns), ns, massif_desc(args[2:]))
        if ns.http is not None:
            return cmd_daemon(ctx, pids=[ns.pid])
        return cmd_attach(ctx)
    except HeapscopeError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # a bug of ours: one line, and the probes were detached on the way out
        print(f"{PROG}: internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 70


if __name__ == "__main__":
    sys.exit(main())
