#!/usr/bin/env python3
"""Writes the man page (heapscope.1) and the CLI reference (docs/cli.md) from heapscope's argument parser.

    .venv/bin/python scripts/gen_cli_docs.py            # rewrite both files
    .venv/bin/python scripts/gen_cli_docs.py --check    # exit 1 if either differs from what would be written

Every command, option, metavar and help text comes from agent.cli.build_parser(); the exit codes from the
error classes of agent.errors; the environment variables from the daemon's settings (api.settings). Nothing
here lists an option by hand: an option added to the parser appears in both files once this script is run
again, and tests/unit/test_cli_docs.py fails until it is.
"""

from __future__ import annotations

import argparse
import inspect
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from agent import __version__, errors  # noqa: E402
from agent.cli import build_parser  # noqa: E402
from api.settings import ApiSettings  # noqa: E402

MAN_PAGE = REPO / "heapscope.1"
CLI_REFERENCE = REPO / "docs" / "cli.md"
GENERATED_BY = "scripts/gen_cli_docs.py"


# ---- the parser, read into plain values ------------------------------------------------------------------


@dataclass(frozen=True)
class Option:
    names: tuple[str, ...]  # option strings, or () for a positional
    value: str  # what follows the option ("" for a flag), or the positional's name
    help: str  # the parser's help text, %-expanded as --help shows it ("" when it has none)


@dataclass(frozen=True)
class Group:
    title: str
    description: str
    options: tuple[Option, ...]


@dataclass(frozen=True)
class Command:
    name: str
    summary: str  # the help the command has in the command list
    usage: str
    description: str
    groups: tuple[Group, ...]
    epilog: str


def _value(action: argparse.Action) -> str:
    """The value an option takes, as its invocation shows it: METAVAR, a|b|c, or the destination in capitals."""
    if action.nargs == 0:
        return ""
    if action.metavar is not None:
        name = str(action.metavar)
    elif action.choices is not None:
        name = "|".join(str(c) for c in action.choices)
    else:
        name = action.dest.upper()
    if action.nargs == "?":
        return f"[{name}]"
    if action.nargs == "*":
        return f"[{name} ...]"
    if action.nargs == "+":
        return f"{name} [{name} ...]"
    return name


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    formatter = argparse.HelpFormatter(parser.prog)
    return " ".join(formatter._expand_help(action).split())  # the text --help prints, unwrapped


def _option(parser: argparse.ArgumentParser, action: argparse.Action) -> Option:
    if action.option_strings:
        return Option(tuple(action.option_strings), _value(action), _help(parser, action))
    return Option((), str(action.metavar or action.dest.upper()), _help(parser, action))


def _groups(parser: argparse.ArgumentParser) -> tuple[Group, ...]:
    groups = []
    for g in parser._action_groups:
        actions = [a for a in g._group_actions if not isinstance(a, argparse._HelpAction | argparse._SubParsersAction)]
        if actions:
            options = tuple(_option(parser, a) for a in actions)
            groups.append(Group(g.title or "", g.description or "", options))
    return tuple(groups)


def _usage(parser: argparse.ArgumentParser) -> str:
    """The parser's own usage when it has one, else PROG [options] and its positionals."""
    if parser.usage:
        return parser.usage.replace("%(prog)s", parser.prog)
    parts = [parser.prog]
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    if any(a.option_strings for a in actions):
        parts.append("[options]")
    parts += [_option(parser, a).value for a in actions if not a.option_strings]
    return " ".join(parts)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            return a
    raise SystemExit("the parser has no subcommands")


def commands(parser: argparse.ArgumentParser) -> list[Command]:
    sub = _subparsers(parser)
    out = []
    for choice in sub._choices_actions:  # the commands in the order the parser lists them
        p = sub.choices[choice.dest]
        out.append(Command(choice.dest, choice.help or "", _usage(p), p.description or "", _groups(p),
                           " ".join((p.epilog or "").split())))
    return out


def help_text(parser: argparse.ArgumentParser) -> str:
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            return _help(parser, a)
    return ""


def fromfile_note(parser: argparse.ArgumentParser) -> str:
    """What the parser says about arguments read from a file (@FILE), from its own line reader."""
    if not parser.fromfile_prefix_chars:
        return ""
    prefix = parser.fromfile_prefix_chars[0]
    doc = inspect.getdoc(type(parser).convert_arg_line_to_args) or ""
    if type(parser).convert_arg_line_to_args is argparse.ArgumentParser.convert_arg_line_to_args:
        doc = "Each line is one argument."
    return f"`{prefix}FILE` in place of arguments reads them from FILE. {' '.join(doc.split())}"


def exit_codes() -> list[tuple[int, str]]:
    """Each exit code agent.errors declares, with the first line of the class that declares it."""
    codes: dict[int, str] = {}
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if cls.__module__ == errors.__name__ and issubclass(cls, errors.HeapscopeError) and "exit_code" in vars(cls):
            codes.setdefault(cls.exit_code, (inspect.getdoc(cls) or "").split("\n\n")[0].replace("\n", " "))
    return sorted(codes.items())


def environment() -> list[str]:
    """The variables the daemon's HTTP settings are read from when their options are not given."""
    prefix = ApiSettings.model_config.get("env_prefix", "")
    return [f"{prefix}{name}".upper() for name in ApiSettings.model_fields]


def shared_groups(cmds: list[Command]) -> dict[tuple[str, Group], str]:
    """For each command's group, the earlier command that has the same group, options and texts."""
    first: dict[Group, str] = {}
    same: dict[tuple[str, Group], str] = {}
    for c in cmds:
        for g in c.groups:
            if len(g.options) < 3:  # a short group is shown again, not referred to
                continue
            if g in first:
                same[(c.name, g)] = first[g]
            else:
                first[g] = c.name
    return same


# ---- Markdown ----------------------------------------------------------------------------------------------


def _md(text: str) -> str:
    """Help text as Markdown: its `code` spans kept, what Markdown would take for markup escaped elsewhere."""
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        if i % 2:
            out.append(part)
        else:
            out.append(part.replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;"))
    return "".join(out)


def _md_invocation(o: Option) -> str:
    if not o.names:
        return f"`{o.value}`"
    return f"`{', '.join(o.names)}{' ' + o.value if o.value else ''}`"


def markdown(parser: argparse.ArgumentParser) -> str:
    cmds = commands(parser)
    same = shared_groups(cmds)
    prog = parser.prog
    lines = [
        f"# {prog}: the command line",
        "",
        f"<!-- Generated by {GENERATED_BY} from the argument parser (agent/cli, build_parser): do not edit. -->",
        "",
        f"Generated from the argument parser (`agent/cli`, `build_parser()`) by `{GENERATED_BY}`, as is the",
        f"man page `{MAN_PAGE.name}`. After changing an option, run `.venv/bin/python {GENERATED_BY}`;",
        "`tests/unit/test_cli_docs.py` fails while either file differs from what the script writes.",
        "",
        f"{_md(parser.description or '')}",
        "",
        "| command | what it does |",
        "|---|---|",
    ]
    lines += [f"| [`{prog} {c.name}`](#{prog}-{c.name}) | {_md(c.summary)} |" for c in cmds]
    lines.append("")
    for g in _groups(parser):
        for o in g.options:
            lines.append(f"- {_md_invocation(o)}: {_md(o.help)}" if o.help else f"- {_md_invocation(o)}")
    lines.append(f"- `-h, --help` (every command): {_md(help_text(parser))}")
    note = fromfile_note(parser)
    if note:
        lines += ["", _md(note)]
    for c in cmds:
        lines += ["", f"## {prog} {c.name}", "", f"{_md(c.summary[:1].upper() + c.summary[1:])}.", "", "```",
                  c.usage, "```"]
        if c.description:
            lines += ["", _md(c.description)]
        for g in c.groups:
            lines += ["", f"### {_md(g.title)}" if g.title else "### options"]
            if (c.name, g) in same:
                lines += ["", f"As for [`{prog} {same[(c.name, g)]}`](#{prog}-{same[(c.name, g)]})."]
                continue
            lines.append("")
            if g.description:
                lines += [_md(g.description), ""]
            for o in g.options:
                lines.append(f"- {_md_invocation(o)}: {_md(o.help)}" if o.help else f"- {_md_invocation(o)}")
        if c.epilog:
            lines += ["", _md(c.epilog)]
    lines += ["", "## Exit status", "", "- `0`: success; `run` exits with the status of the program it ran."]
    lines += [f"- `{code}`: {_md(doc)}" for code, doc in exit_codes()]
    lines += ["- `70`: an internal error (a bug), said in one line.", "- `130`: interrupted (Ctrl-C).", ""]
    lines += ["## Environment", "",
              "The daemon's HTTP settings (`serve`, and `run`/`attach --http`) are read from these variables when",
              "their options are not given (`api/settings.py`):", ""]
    lines += [f"- `{name}`" for name in environment()]
    return "\n".join(lines) + "\n"


# ---- roff (man(7)) -------------------------------------------------------------------------------------------


def _roff(text: str) -> str:
    """Text as roff: backslashes and hyphens escaped, `code` in bold, no line starting with a control character."""
    out = []
    for i, part in enumerate(re.split(r"(`[^`]*`)", text)):
        escaped = part.strip("`") if i % 2 else part
        escaped = escaped.replace("\\", "\\e").replace("-", "\\-")
        out.append(f"\\fB{escaped}\\fR" if i % 2 else escaped)
    line = "".join(out)
    return "\\&" + line if line.startswith((".", "'")) else line


def _arg(text: str) -> str:
    """A macro argument in double quotes."""
    return '"' + _roff(text).replace('"', "\\(dq") + '"'


def _man_option(o: Option) -> Iterator[str]:
    yield ".TP"
    if o.names:
        names = ", ".join(f"\\fB{_roff(n)}\\fR" for n in o.names)
        value = _roff(o.value).replace("|", "|\\:")  # a line may break after each choice
        yield names + (f" \\fI{value}\\fR" if o.value else "")
    else:
        yield f"\\fI{_roff(o.value)}\\fR"
    yield _roff(o.help) if o.help else "\\&"


def man(parser: argparse.ArgumentParser) -> str:
    cmds = commands(parser)
    same = shared_groups(cmds)
    prog = parser.prog
    description = (parser.description or "").rstrip(".")
    lines = [
        f'.\\" Generated by {GENERATED_BY} from the argument parser (agent/cli, build_parser): do not edit.',
        f'.TH {prog.upper()} 1 "" "{prog} {__version__}" "User Commands"',
        ".SH NAME",
        f"{prog} \\- {_roff(description[:1].lower() + description[1:])}",
        ".SH SYNOPSIS",
        ".nf",
    ]
    lines += [_roff(c.usage) for c in cmds]
    lines += [".fi", ".SH DESCRIPTION", _roff(parser.description or ""), ".PP", "The commands:"]
    for c in cmds:
        lines += [".TP", f"\\fB{c.name}\\fR", _roff(c.summary)]
    lines += [".PP", "Options of the command line itself:"]
    for g in _groups(parser):
        for o in g.options:
            lines += list(_man_option(o))
    lines += list(_man_option(Option(("-h", "--help"), "", help_text(parser) + " (every command)")))
    note = fromfile_note(parser)
    if note:
        lines += [".PP", _roff(note)]
    lines.append(".SH COMMANDS")
    for c in cmds:
        lines += [f".SS {_arg(f'{prog} {c.name}')}", _roff(c.summary[:1].upper() + c.summary[1:]) + ".", ".PP",
                  ".nf", _roff(c.usage), ".fi"]
        if c.description:
            lines += [".PP", _roff(c.description)]
        for g in c.groups:
            lines += [".PP", f"\\fI{_roff(g.title or 'options')}:\\fR"]
            if (c.name, g) in same:
                lines += [".RS", f"As for \\fB{prog} {same[(c.name, g)]}\\fR.", ".RE"]
                continue
            if g.description:
                lines += [".PP", _roff(g.description)]
            for o in g.options:
                lines += list(_man_option(o))
        if c.epilog:
            lines += [".PP", _roff(c.epilog)]
    lines += [".SH EXIT STATUS", ".TP", "0", f"Success; {_roff('`run`')} exits with the status of the program it ran."]
    for code, doc in exit_codes():
        lines += [".TP", str(code), _roff(doc)]
    lines += [".TP", "70", "An internal error (a bug), said in one line.", ".TP", "130", "Interrupted (Ctrl\\-C)."]
    lines += [".SH ENVIRONMENT",
              _roff("The daemon's HTTP settings (`serve`, and `run` or `attach` with `--http`) are read from these "
                    "variables when their options are not given:")]
    lines += [".PP", ".RS", ".nf", *(f"\\fB{_roff(name)}\\fR" for name in environment()), ".fi", ".RE"]
    lines += [".SH SEE ALSO", ".BR ms_print (1),", ".BR valgrind (1),", ".BR callgrind_annotate (1).",
              ".PP", _roff("The documentation in the source tree: README.md and docs/ (docs/cli.md is this page).")]
    return "\n".join(lines) + "\n"


# ---- the files ------------------------------------------------------------------------------------------------


def outputs() -> dict[Path, str]:
    """Each generated file and the text it should hold."""
    parser = build_parser()
    return {MAN_PAGE: man(parser), CLI_REFERENCE: markdown(parser)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file differs")
    ns = ap.parse_args(argv)
    stale = []
    for path, text in outputs().items():
        old = path.read_text() if path.exists() else None
        if old == text:
            continue
        stale.append(path.relative_to(REPO))
        if not ns.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    verb = "differs" if ns.check else "written"
    for p in stale:
        print(f"{p}: {verb}")
    return 1 if ns.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
