"""The commands that profile: `run`, `attach` and `serve` (and `run`/`attach --http`, which serve their one profile).

They share the profile's options (agent.cli.settings) and the pipeline (agent.session.pipeline). The pipeline, the
daemon, the API and the process layer are imported inside the commands: `report`, `growth` and the other offline
commands start without them.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

from agent.argtypes import int_at_least, seconds_or_zero
from agent.cli.settings import (
    add_http_options,
    add_profile_options,
    add_store_options,
    expand_filename,
    massif_desc,
    settings_from,
    store_settings,
    total_samples_from,
)
from agent.daemon.fleetopts import add_fleet_options, fleet_config_from
from agent.errors import EnvironmentProblem, HeapscopeError, UsageError
from agent.export.registry import MASSIF, XTREE
from agent.log import LOG, PROG
from agent.model.sampling import DEFAULT_KEEP_PROGRAMS, DEFAULT_NODE_BLOCKS, Mode
from agent.model.summary import ProfileSummary

if TYPE_CHECKING:
    from agent.process.target import TargetProcess
    from agent.session.pipeline import Profile, ProfileSettings


@dataclass
class _Ctx:
    settings: ProfileSettings
    ns: argparse.Namespace
    total_samples: int = 0  # a daemon's total of samples a second (--total-samples)

    def say(self, line: str) -> None:
        if not self.ns.quiet:
            LOG.say(line)  # a log that fails (a closed pipe) is counted, never the profile's end


def _context(ns: argparse.Namespace, own_args: Sequence[str], daemon: bool) -> _Ctx:
    ctx = _Ctx(settings_from(ns, massif_desc(own_args), daemon=daemon), ns)
    ctx.total_samples = total_samples_from(ns, daemon)
    if ns.nice is not None:
        _set_nice(ns.nice)
    return ctx


def _set_nice(level: int) -> None:
    """heapscope's nice level (--nice), a thread's own on Linux: set on every thread there is (a library's pool
    started at import), before heapscope starts its own, which take it from the thread that starts them. The
    injecting thread still raises itself while it holds a target's thread stopped (agent.process.inject)."""
    for task in os.listdir("/proc/self/task"):
        try:
            os.setpriority(os.PRIO_PROCESS, int(task), level)
        except ProcessLookupError:  # a thread that ended meanwhile
            continue
        except OSError as exc:  # lowering it below the current level needs CAP_SYS_NICE
            raise EnvironmentProblem(f"cannot set heapscope's nice level to {level}: {exc.strerror}") from None


class Run:
    """`heapscope run [options] -- PROG [ARGS]`: launch PROG held until the probes are attached."""

    name = "run"

    def add_parser(self, sub: Any) -> None:
        p = sub.add_parser(
            self.name,
            help="launch a program and profile it from its first instruction",
            usage=f"{PROG} run [options] -- PROG [ARGS]",
        )
        _add_options(p, "exact", serve=False)
        p.set_defaults(program=[])  # main() puts the program there, unparsed (split_program)

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int:
        ctx = _context(ns, words, daemon=ns.http is not None)
        if ns.http is not None:
            return _serve(ctx, program=ns.program)
        return _run(ctx, ns.program)


class Attach:
    """`heapscope attach PID [options]`: profile a running process until Ctrl-C, SIGTERM or its exit."""

    name = "attach"

    def add_parser(self, sub: Any) -> None:
        p = sub.add_parser(self.name, help="profile a running process until Ctrl-C, SIGTERM or its exit")
        p.add_argument("pid", type=int_at_least(1), help="the process to profile")
        _add_options(p, "sampled", serve=False)

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int:
        ctx = _context(ns, words[1:], daemon=ns.http is not None)  # words[0]: the PID
        if ns.http is not None:
            return _serve(ctx, pids=[ns.pid])
        return _attach(ctx)


class Serve:
    """`heapscope serve [--pid PID]... [options]`: the daemon, until SIGTERM."""

    name = "serve"

    def add_parser(self, sub: Any) -> None:
        p = sub.add_parser(
            self.name,
            help="the daemon: profile processes attached over HTTP (POST /targets) or with --pid, until SIGTERM",
        )
        p.add_argument(
            "--pid", type=int_at_least(1), action="append", default=[], dest="pids", help="attach to PID at start"
        )
        _add_options(p, "sampled", serve=True)
        p.add_argument(
            "--node-blocks",
            type=int_at_least(1024),
            default=DEFAULT_NODE_BLOCKS,
            help="live blocks the kernel's block table holds for all exact-mode targets together (each target at "
            f"most --max-blocks); more are counted as dropped and reported (default {DEFAULT_NODE_BLOCKS})",
        )
        p.add_argument(
            "--keep-programs",
            type=seconds_or_zero,
            default=DEFAULT_KEEP_PROGRAMS,
            metavar="SECONDS",
            help="how long a compiled BPF program stays loaded once its last target is gone, for the next target "
            "of the same settings, which then attaches in milliseconds instead of seconds of compiling; 0 "
            f"unloads it with its last target (default {DEFAULT_KEEP_PROGRAMS:g})",
        )
        add_fleet_options(p)

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int:
        return _serve(_context(ns, words, daemon=True), pids=ns.pids)


def _add_options(p: argparse.ArgumentParser, mode: Mode, serve: bool) -> None:
    """The options every command that profiles takes, in the order --help lists them."""
    add_profile_options(p, mode)
    add_store_options(p, serve=serve)
    add_http_options(p, serve=serve)


def split_program(argv: Sequence[str], value_options: frozenset[str]) -> tuple[list[str], list[str]]:
    """`run`'s own options, and the program with its arguments (after `--`, or from the first non-option)."""
    if "--" in argv:
        i = list(argv).index("--")
        return list(argv[:i]), list(argv[i + 1 :])
    for i, arg in enumerate(argv):
        if not arg.startswith("-") and (i == 0 or argv[i - 1] not in value_options):
            return list(argv[:i]), list(argv[i:])
    return list(argv), []


def value_options(parser: argparse.ArgumentParser) -> frozenset[str]:
    """The options written as `--name VALUE` (rather than `--name=VALUE`), as the parser declares them."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(
        name
        for command in sub.choices.values()
        for action in command._actions
        if action.nargs != 0
        for name in action.option_strings
    )


# ---- running a profile --------------------------------------------------------------------------------


def _stderr_of_our_own() -> None:
    """A daemon's lines go to a duplicate of fd 2, not to fd 2 itself: compiling a target's program points fd 2 at
    a file for seconds (agent.kernel.loader captures clang's messages there), and every line the other threads
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


def _run(ctx: _Ctx, program: list[str]) -> int:
    from agent.process.launch import HeldChild

    if not program:
        raise UsageError("no program given: heapscope run [options] -- PROG [ARGS]")
    _require_environment()
    process = ctx.settings.launch(program)
    _stop_on_signals(threading.Event(), _forward_sigterm(process))  # the run ends when the child does
    _profile(ctx, process, threading.Event())
    assert process.child is not None
    return HeldChild.exit_code(process.child.wait())


def _attach(ctx: _Ctx) -> int:
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
        f"  curl -s{auth} '{base}{MASSIF.route}{q}' -o massif.out && ms_print massif.out",
        f"  curl -s{auth} '{base}{XTREE.route}{q}' -o xt.kcg && callgrind_annotate --inclusive=yes xt.kcg",
        f"  curl -s{auth} '{base}/detailed_snapshot{q}{'&' if q else '?'}format=json'",
        f"  curl -s{auth} {base}/monitor -H 'Content-Type: application/json' -d '{{\"command\": \"help\"}}'",
        f"  curl -s{auth} {base}/metrics",
    ]


def _serve(ctx: _Ctx, pids: Sequence[int] = (), program: Sequence[str] | None = None) -> int:
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
        total_samples=ctx.total_samples,
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


