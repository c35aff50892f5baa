"""Massif's monitor commands (as gdbserver's `monitor` takes them), run by the daemon on a target; and writing a
file under the output directory, never outside it."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from agent.errors import HeapscopeError, UnsafePath, UsageError
from agent.model.target import MonitorResult

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


class MonitorTarget(Protocol):
    pid: int

    def snapshot_text(self, detailed: bool) -> str: ...

    def render(self, name: str, variant: str | None = None) -> str | bytes: ...

    def next_xtmemory_seq(self) -> int: ...


def _text(data: str | bytes) -> str:
    return data.decode() if isinstance(data, bytes) else data


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
        text = _text(t.render("xtree"))
    else:
        name = expand_monitor_name(cmd.filename or MONITOR_DEFAULT_FILE, t.pid, 0)
        if cmd.verb == "all_snapshots":
            text = _text(t.render("massif"))
        else:
            text = t.snapshot_text(detailed=cmd.verb == "detailed_snapshot")
    path = write_under(output_dir, name, text)
    return MonitorResult(
        command=command.strip(), pid=t.pid, file=str(path), bytes=len(text.encode()), output=f"wrote {path}\n"
    )
