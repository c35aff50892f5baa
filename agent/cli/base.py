"""What every command of the command line is: a parser that says errors in one line, and the Command protocol."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn, Protocol

from agent.errors import UsageError


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as a HeapscopeError (one line, exit 2), not a usage dump."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)

    def convert_arg_line_to_args(self, arg_line: str) -> list[str]:
        """An @FILE line is one argument; blank lines and lines starting with # are left out."""
        line = arg_line.strip()
        return [] if not line or line.startswith("#") else [line]


class Command(Protocol):
    """One subcommand: `add_parser` adds its parser and options to heapscope's; `run` runs it and returns the exit
    code. `words` are the words given after the command's name (`run`: its own, without the program)."""

    name: str

    def add_parser(self, sub: argparse._SubParsersAction[Parser]) -> None: ...

    def run(self, ns: argparse.Namespace, words: Sequence[str] = ()) -> int: ...
