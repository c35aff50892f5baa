"""heapscope's command line: one class a command, listed in COMMANDS, each adding its own parser and running it.

    heapscope run [options] -- PROG [ARGS]    launch PROG held until the probes are attached
    heapscope attach PID [options]            profile a running process until Ctrl-C, SIGTERM or its exit
    heapscope serve [--pid PID]... [options]  the daemon: targets, monitor commands and metrics over HTTP
    heapscope report / diff / growth STORE    read a stored history (agent.offline.commands)
    heapscope view FILE|STORE                 a profile's web page as one HTML file (agent.offline.view)
    (run and attach take --http HOST:PORT to serve their one profile over HTTP while it runs)

The commands that profile are in agent.cli.profiling, their options in agent.cli.settings. Every error the user
can act on is a HeapscopeError: main() prints it as one line and exits with its code.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agent import __version__
from agent.cli.base import Command, Parser
from agent.cli.profiling import Attach, Run, Serve, split_program, value_options
from agent.cli.settings import expand_filename, options_from, settings_from, store_settings
from agent.errors import HeapscopeError
from agent.log import LOG, PROG
from agent.offline.commands import Diff, Growth, Report
from agent.offline.view import View

__all__ = ["COMMANDS", "build_parser", "expand_filename", "main", "options_from", "settings_from", "store_settings"]

# In the order --help lists them.
COMMANDS: dict[str, Command] = {c.name: c for c in (Run(), Attach(), Serve(), Report(), Diff(), Growth(), View())}


def build_parser() -> argparse.ArgumentParser:
    # @FILE reads arguments from FILE, one a line (a Kubernetes ConfigMap's selectors and limits, deploy/).
    parser = Parser(
        prog=PROG,
        description="Heap profiling of running processes with eBPF, Massif-compatible.",
        fromfile_prefix_chars="@",
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    for command in COMMANDS.values():
        command.add_parser(sub)
    return parser


def _parse(parser: argparse.ArgumentParser, args: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The namespace, and the words given after the command's name. `run`'s program is not parsed: its words,
    from the first that is not one of run's own, go to ns.program as they are."""
    if args and args[0] == Run.name:
        own, program = split_program(args[1:], value_options(parser))
        ns = parser.parse_args([Run.name, *own])
        ns.program = program
        return ns, own
    return parser.parse_args(args), args[1:]


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        ns, words = _parse(build_parser(), args)
        return COMMANDS[ns.command].run(ns, words)
    except HeapscopeError as exc:
        LOG.say(str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        LOG.say("interrupted")
        return 130
    except Exception as exc:  # a bug of ours: one line, and the probes were detached on the way out
        LOG.say(f"internal error: {type(exc).__name__}: {exc}")
        return 70
