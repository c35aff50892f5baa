"""The output files of processes a fleet daemon no longer profiles, deleted once older than --output-max-age.

Each ended target leaves its files (massif.out.PID and the others) in the output directory. A daemon that sees
hundreds of processes an hour would fill its disk with them over weeks, as the store did before its sweep. Only
names that the daemon's own templates give for some PID are touched, so a sweep never deletes a file it did not
write (a template without %p names one file that every target overwrites: it is left alone). The names are
matched afresh at each sweep, so files left by an earlier daemon age out too."""

from __future__ import annotations

import os
import re
import stat
import time
from collections.abc import Callable, Container, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from agent.errors import HeapscopeError

# Expanded in place of a PID to find where a template puts it: above any PID Linux gives (pid_max <= 2^22).
_MARK = str(2**31 - 1)


@dataclass
class OutputSweep:
    files_deleted: int = 0
    errors: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class OutputName:
    """The files of one template: in `directory` (relative to the output directory), named by `pattern`, whose
    groups are the PID (a template may name it more than once)."""

    directory: str
    pattern: re.Pattern[str]


def output_names(templates: Iterable[str], expand: Callable[[str, int], str]) -> list[OutputName]:
    """The names the templates give, for those that put the PID in the file's own name (and only there)."""
    names = []
    for template in templates:
        try:
            directory, _, name = expand(template, int(_MARK)).rpartition("/")
        except HeapscopeError:  # a %q{VAR} not set: that template writes nothing either
            continue
        if _MARK in directory or _MARK not in name:
            continue
        pattern = r"(\d+)".join(re.escape(part) for part in name.split(_MARK))
        names.append(OutputName(directory, re.compile(pattern)))
    return names


def sweep_outputs(output_dir: Path, names: Iterable[OutputName], max_age_s: float, held: Container[int],
                  now: float | None = None) -> OutputSweep:
    """Delete the regular files named for a PID that `held` does not contain and last written more than
    `max_age_s` ago."""
    done = OutputSweep()
    now = time.time() if now is None else now
    base = Path(os.path.realpath(output_dir))  # realpath: never raises, even at a loop of links
    for name in names:
        directory = Path(os.path.realpath(base / name.directory))
        if directory != base and base not in directory.parents:
            continue  # a template that leaves the output directory is refused when given; never delete there
        try:
            entries = os.listdir(directory)
        except OSError:
            continue  # nothing written there yet
        for entry in entries:
            m = name.pattern.fullmatch(entry)
            if m is None or any(int(pid) in held for pid in m.groups()):
                continue
            path = directory / entry
            try:
                st = path.lstat()
                if stat.S_ISREG(st.st_mode) and now - st.st_mtime > max_age_s:
                    path.unlink()
                    done.files_deleted += 1
            except FileNotFoundError:
                continue
            except OSError as exc:
                done.errors.append(f"cannot delete {path}: {exc.strerror}")
    return done
