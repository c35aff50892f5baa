"""Which processes the daemon profiles by itself: selectors by process name, command line and cgroup.

A selector has up to three conditions, all of which must hold:
- `comm`: a regular expression searched in the process name (/proc/PID/comm, 15 characters), as pgrep does;
- `cmdline`: a regular expression searched in the command line, its arguments joined by spaces;
- `cgroup`: the process's cgroup is PATH or below it (a systemd unit's or a pod's subtree); a PATH with shell
  wildcards (`*`, `?`, `[...]`; `*` also crosses `/`) matches when the cgroup or one of its ancestors matches;
  `pod:UID` and `container:ID` (a prefix of at least 12 hex digits) match what the path names
  (agent.model.cgroup).
The daemon takes several selectors: a process that matches any of them is profiled. Pure: the facts of a process
are read by agent.process.procinfo.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field

from agent.errors import UsageError
from agent.model.cgroup import normalize_path, placement_of

MAX_PATTERN = 1024
_GLOB = re.compile(r"[*?\[]")
_CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True)
class ProcessFacts:
    """What selectors look at. (pid, start_time) is the process's identity: a PID reused later is another
    process."""

    pid: int
    ppid: int
    start_time: int  # clock ticks after boot (/proc/PID/stat field 22)
    comm: str
    cmdline: str  # arguments joined by spaces; "" for a kernel thread
    cgroup: str  # agent.model.cgroup.normalize_path'd


def _regex(kind: str, text: str) -> re.Pattern[str]:
    if not text:
        raise UsageError(f"an empty {kind} pattern would select every process")
    if len(text) > MAX_PATTERN:
        raise UsageError(f"the {kind} pattern is longer than {MAX_PATTERN} characters")
    try:
        return re.compile(text)
    except re.error as exc:
        raise UsageError(f"bad {kind} regular expression {text!r}: {exc}") from None


def check_cgroup_pattern(text: str) -> str:
    """The cgroup condition, normalized; a bad one is a UsageError."""
    text = text.strip()
    if not text:
        raise UsageError("an empty cgroup path would select every process (give / for that)")
    if len(text) > MAX_PATTERN:
        raise UsageError(f"the cgroup path is longer than {MAX_PATTERN} characters")
    kind, sep, value = text.partition(":")
    if sep and kind == "pod":
        uid = value.lower().replace("_", "-")
        if not re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", uid):
            raise UsageError(f"pod:{value}: a pod UID looks like 0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0")
        return f"pod:{uid}"
    if sep and kind == "container":
        cid = value.lower().removeprefix("containerd://").removeprefix("docker://").removeprefix("cri-o://")
        if not re.fullmatch(r"[0-9a-f]{12,64}", cid):
            raise UsageError(f"container:{value}: give at least the first 12 hex digits of the container's ID")
        return f"container:{cid}"
    if not (text.startswith("/") or _GLOB.match(text)):
        raise UsageError(
            f"cgroup {text!r}: give a path from the cgroup root (/system.slice/nginx.service), a pattern "
            "(*/nginx.service), pod:UID or container:ID"
        )
    if text == _CGROUP_ROOT or text.startswith(_CGROUP_ROOT + "/"):
        text = text[len(_CGROUP_ROOT) :] or "/"
    if _GLOB.search(text):
        return text.rstrip("/") or "/"
    return normalize_path(text)


def cgroup_matches(pattern: str, path: str) -> bool:
    """Whether the cgroup `path` is selected by `pattern` (as check_cgroup_pattern returns it)."""
    if pattern.startswith("pod:"):
        return placement_of(path).pod == pattern[4:]
    if pattern.startswith("container:"):
        container = placement_of(path).container
        return bool(container) and container.startswith(pattern[10:])
    if not _GLOB.search(pattern):
        return pattern == "/" or path == pattern or path.startswith(pattern + "/")
    parts = [p for p in path.split("/") if p]
    # The cgroup itself, then each ancestor: a pattern selects a subtree.
    return any(fnmatch.fnmatchcase("/" + "/".join(parts[:n]), pattern) for n in range(len(parts), -1, -1))


@dataclass(frozen=True)
class Selector:
    comm: str | None = None
    cmdline: str | None = None
    cgroup: str | None = None
    follow_children: bool = True  # children forked by a selected process are profiled too (prefork workers)
    id: int = 0  # given by the daemon
    origin: str = "command line"  # or "api"
    _comm: re.Pattern[str] | None = field(default=None, compare=False, repr=False)
    _cmdline: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    @staticmethod
    def make(
        comm: str | None = None,
        cmdline: str | None = None,
        cgroup: str | None = None,
        follow_children: bool = True,
        id: int = 0,
        origin: str = "command line",
    ) -> Selector:
        """A checked selector: each pattern compiles, and at least one condition is given."""
        if comm is None and cmdline is None and cgroup is None:
            raise UsageError("a selector needs at least one of comm, cmdline, cgroup")
        return Selector(
            comm=comm,
            cmdline=cmdline,
            cgroup=None if cgroup is None else check_cgroup_pattern(cgroup),
            follow_children=follow_children,
            id=id,
            origin=origin,
            _comm=None if comm is None else _regex("comm", comm),
            _cmdline=None if cmdline is None else _regex("cmdline", cmdline),
        )

    def with_id(self, id: int) -> Selector:
        return Selector.make(self.comm, self.cmdline, self.cgroup, self.follow_children, id, self.origin)

    @property
    def needs_cmdline(self) -> bool:
        return self.cmdline is not None

    @property
    def needs_cgroup(self) -> bool:
        return self.cgroup is not None

    def matches(self, facts: ProcessFacts) -> bool:
        if not facts.cmdline:
            return False  # a kernel thread (or a zombie): nothing to profile
        if self._comm is not None and not self._comm.search(facts.comm):
            return False
        if self._cmdline is not None and not self._cmdline.search(facts.cmdline):
            return False
        return self.cgroup is None or cgroup_matches(self.cgroup, facts.cgroup)

    def describe(self) -> str:
        parts = [f"{k}={v}" for k, v in (("comm", self.comm), ("cmdline", self.cmdline), ("cgroup", self.cgroup)) if v]
        return f"selector {self.id} ({' '.join(parts)})"


def first_match(selectors: tuple[Selector, ...] | list[Selector], facts: ProcessFacts) -> Selector | None:
    return next((s for s in selectors if s.matches(facts)), None)
